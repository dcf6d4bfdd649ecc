"""The job secret: how it is checked where a process starts, and the trainer keys derived from it. Standard
library only: it runs on every node."""

from __future__ import annotations

import hashlib
import hmac

# The launcher makes 64 hex digits; anything under 32 characters is refused where a runtime process starts.
MIN_SECRET_CHARS = 32


def derive_trainer_key(secret: str, job_id: str, trainer: int) -> str:
    """Trainer ``trainer``'s own key (64 hex digits) from the job secret: a trainer gets this, never the
    secret, so it can prove its own id and no other (pservers derive every trainer's key)."""
    msg = b"paddle-cluster trainer key|" + job_id.encode("utf-8") + b"|" + str(int(trainer)).encode("ascii")
    return hmac.new(secret.encode("utf-8"), msg, hashlib.sha256).hexdigest()


def check_secret(value: str, var: str) -> None:
    """Refuse an empty or short secret (``var`` names the variable) with how to provide one."""
    if len(value) >= MIN_SECRET_CHARS:
        return
    state = "is not set" if not value else f"has {len(value)} characters, fewer than {MIN_SECRET_CHARS}"
    raise _error(
        f"{var} {state}: `paddle-cluster run` sets it for every process it starts; to start pservers and "
        "trainers by hand, give them all the same PADDLE_JOB_SECRET, e.g. "
        "export PADDLE_JOB_SECRET=$(python3 -c 'import secrets; print(secrets.token_hex(32))')")


def _error(message: str) -> ValueError:
    from .contract import ContractError  # contract re-exports this module's names

    return ContractError(message)
