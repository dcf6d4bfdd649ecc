"""Files written atomically (temporary file, fsync, rename, fsync of the directory) and file digests.

Checkpoint shards and the trainers' saved models (``save_dense``, ``fluid.io``) go through here, so a crash
leaves the old file or the new one, never half of one. Arrays are stored with ``np.savez`` and loaded with
``allow_pickle=False``.
"""

from __future__ import annotations

import hashlib
import os
import threading
from typing import Any, Dict, Mapping

import numpy as np


def file_digest(path: str, algorithm: str = "sha256") -> str:
    """The hex digest of the file at ``path``, read 1 MiB at a time."""
    h = hashlib.new(algorithm)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: str, write: Any) -> str:
    """Call ``write(fileobj)`` on a temporary file, fsync it, rename it to ``path``; returns sha256."""
    tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"  # unique per writer: concurrent saves never share one
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        digest = file_digest(tmp)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(os.path.dirname(path) or ".")
    return digest


def save_npz_atomic(path: str, arrays: Mapping[str, np.ndarray]) -> str:
    """``np.savez`` to ``path`` atomically; returns the file's sha256."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    return write_atomic(path, lambda f: np.savez(f, **arrays))


def load_npz(path: str) -> Dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}
