"""The launcher's archive caches (workspaces, the node library), shared by every launch from this machine.

A directory holds ``<key>.tar`` (the archive), ``<key>.json`` (what it is: written last, so a listed entry is
complete) and ``<key>.lock``. Every step that looks up, publishes or evicts an entry holds the directory's
``.lock`` (an exclusive ``flock``); a launch that uses an archive holds a shared ``flock`` on its ``<key>.lock``
until it is done with it, and eviction skips such an entry. Temporaries are named by pid and a random token
and renamed into place whole (``os.replace``), so concurrent launches never share one nor see one half-written.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
from pathlib import Path
from typing import Any, ContextManager, Dict, Optional

from paddle_cluster.node.locks import exclusive

PART = ".part"  # a temporary's suffix: ``.<pid>-<random>...part``, never matched by ``*.tar`` / ``*.json``


def temp_name(directory: str, what: str) -> str:
    """A temporary's path in ``directory`` that no other launch (process) or thread uses."""
    return os.path.join(directory, f".{os.getpid()}-{secrets.token_hex(6)}-{what}{PART}")


def locked(directory: str) -> ContextManager[bool]:
    """The directory's lock, held exclusively for the ``with``."""
    return exclusive(os.path.join(directory, ".lock"))


def lookup(directory: str, key: str, hold: Optional[contextlib.ExitStack]) -> Optional[Dict[str, Any]]:
    """The entry's description when it is complete (marked most recently used, and with ``hold``, held until that
    stack closes); None when there is none. Call inside ``locked``."""
    meta_path = os.path.join(directory, f"{key}.json")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
        if not isinstance(meta, dict) or os.path.getsize(os.path.join(directory, f"{key}.tar")) != meta["size"]:
            return None
        os.utime(meta_path)
    except (OSError, ValueError, KeyError):
        return None
    if hold is not None:
        fd = os.open(os.path.join(directory, f"{key}.lock"), os.O_RDWR | os.O_CREAT, 0o600)
        hold.callback(os.close, fd)
        fcntl.flock(fd, fcntl.LOCK_SH)  # never blocks: only eviction takes it exclusively, under ``locked``
    return meta


def publish(directory: str, key: str, tar_tmp: str, meta: Dict[str, Any]) -> None:
    """Put a complete archive and then its description in place. Call inside ``locked``."""
    os.replace(tar_tmp, os.path.join(directory, f"{key}.tar"))
    tmp = temp_name(directory, "json")
    try:
        with open(tmp, "w") as f:
            json.dump(meta, f)
        os.replace(tmp, os.path.join(directory, f"{key}.json"))
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def evict(directory: str, keep: int) -> None:
    """Drop the entries beyond the ``keep`` most recently used that no launch holds, and the temporaries of
    launches that are gone. Call inside ``locked``."""
    metas = []
    for p in Path(directory).glob("*.json"):
        with contextlib.suppress(OSError):
            metas.append((p.stat().st_mtime, p))
    for _, meta in sorted(metas, reverse=True)[keep:]:
        lock = meta.with_suffix(".lock")
        with exclusive(str(lock), wait=False) as free:
            if free:  # else a launch is sending it
                for stale in (meta, meta.with_suffix(".tar"), lock):  # the description first: never listed half-gone
                    stale.unlink(missing_ok=True)
    for part in Path(directory).glob(f".*{PART}"):
        pid = part.name[1:].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            part.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
