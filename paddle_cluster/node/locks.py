"""``flock`` on lock files, for the caches of both sides: a node's trees (``trees``) and the launcher's archives
(``launch/cache.py``). Standard library only."""

from __future__ import annotations

import contextlib
import fcntl
import os
from typing import Iterator


@contextlib.contextmanager
def exclusive(path: str, wait: bool = True) -> Iterator[bool]:
    """``path`` (created 0600) locked exclusively for the ``with``: True. With ``wait`` False, False at once when
    another process holds it (shared or exclusive): its user still needs what it guards."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)
