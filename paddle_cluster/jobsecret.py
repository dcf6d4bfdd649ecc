"""The job secret: what a good one is (``contract.check_secret`` refuses a bad one where a process starts), and
the trainer keys derived from it. Standard library only: it runs on every node; imports nothing of the package."""

from __future__ import annotations

import collections
import hashlib
import hmac
import math
import os
from typing import Mapping, Optional

# The variable carrying the job secret: a backend that must keep it apart from the rest (a Kubernetes Secret)
# asks for it by this name.
SECRET_VAR = "PADDLE_JOB_SECRET"
# The launcher makes 64 hex digits; anything under 32 characters is refused where a runtime process starts.
MIN_SECRET_CHARS = 32
# What a secret's character frequencies must estimate at least: far below a generated one's 128 bits (the
# estimate undercounts short random strings), far above a typed word or a repeated character.
MIN_SECRET_BITS = 64


def derive_trainer_key(secret: str, job_id: str, trainer: int) -> str:
    """Trainer ``trainer``'s own key (64 hex digits) from the job secret: a trainer gets this, never the
    secret, so it can prove its own id and no other (pservers derive every trainer's key)."""
    msg = b"paddle-cluster trainer key|" + job_id.encode("utf-8") + b"|" + str(int(trainer)).encode("ascii")
    return hmac.new(secret.encode("utf-8"), msg, hashlib.sha256).hexdigest()


def secret_problem(value: str, var: str) -> Optional[str]:
    """What is wrong with ``value`` as a secret (``var`` names its variable): empty, short or obviously
    low-entropy, with how to make a good one; None when it is fine. Never shows the secret."""
    if not value or len(value) < MIN_SECRET_CHARS:
        state = "is not set" if not value else f"has {len(value)} characters, fewer than {MIN_SECRET_CHARS}"
    else:
        weak = weakness(value)
        if weak is None:
            return None
        state = f"is too easy to guess ({weak}); a generated one carries at least 128 bits"
    return (f"{var} {state}: `paddle-cluster run` sets it for every process it starts; to start pservers and "
            "trainers by hand, give them all the same PADDLE_JOB_SECRET, e.g. "
            "export PADDLE_JOB_SECRET=$(python3 -c 'import secrets; print(secrets.token_hex(32))')")


def weakness(value: str) -> Optional[str]:
    """Why ``value`` is obviously low-entropy, or None: few distinct characters (under ``MIN_SECRET_BITS`` by
    its character frequencies: 32 random hex digits estimate about 110), a repeated pattern, or mostly a run
    (``abcdef...``, ``012345...``). A heuristic against typed secrets; a generated one passes."""
    n = len(value)
    counts = collections.Counter(value)
    bits = max(0.0, -sum(c * math.log2(c / n) for c in counts.values()))
    if bits < MIN_SECRET_BITS:
        return f"{len(counts)} distinct characters, about {bits:.0f} bits by their frequencies"
    period = _period(value)
    if period <= n // 2:
        return f"a {period}-character pattern repeated"
    steps = collections.Counter(ord(b) - ord(a) for a, b in zip(value, value[1:]))
    if steps.most_common(1)[0][1] * 2 > n - 1:
        return "mostly a run of consecutive characters"
    return None


def _period(s: str) -> int:
    """The shortest ``p`` with ``s[i] == s[i + p]`` everywhere (the prefix function: linear time)."""
    pi = [0] * len(s)
    for i in range(1, len(s)):
        k = pi[i - 1]
        while k and s[i] != s[k]:
            k = pi[k - 1]
        pi[i] = k + (s[i] == s[k])
    return len(s) - pi[-1]


def job_secret(environ: Optional[Mapping[str, str]] = None) -> str:
    """``PADDLE_JOB_SECRET`` alone, for a job described by arguments rather than the launcher's contract (a
    hand-started seed script names its pservers itself); "" when unset."""
    return (os.environ if environ is None else environ).get(SECRET_VAR, "")

