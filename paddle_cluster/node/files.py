"""A job's files as ``paddle-cluster fetch`` takes them from a node: ``listing`` (what is there under the paths
asked for, each regular file with its size and SHA-256) and ``send`` (one file's bytes from an offset).

Both stay inside the job directory: a path is relative, with no ``..``; every component is opened without
following a symbolic link (a link is listed as skipped, never read), and only regular files are sent (a FIFO or
a device could block or never end)."""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import sys
from typing import Any, BinaryIO, Dict, List

MAX_FILES = 100_000  # a listing's bound: one JSON answer, read whole by the launcher
CHUNK = 1 << 20
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafePath(ValueError):
    """A path that would leave the job directory (absolute, ``..``, empty)."""


def parts(rel: str) -> List[str]:
    """The components of a path relative to a job directory; ``UnsafePath`` when it could leave it."""
    if not isinstance(rel, str) or not rel or rel.startswith("/") or "\0" in rel:
        raise UnsafePath(f"{rel!r} is not a path relative to the job directory")
    out = [p for p in rel.split("/") if p not in ("", ".")]
    if not out or ".." in out:
        raise UnsafePath(f"{rel!r} leaves the job directory (..) or names nothing")
    return out


def open_below(top_fd: int, comps: List[str], flags: int = os.O_RDONLY) -> int:
    """``comps`` opened from the directory ``top_fd`` one component at a time, no symbolic link followed
    (OSError ELOOP/ENOTDIR when one is met)."""
    fd = os.dup(top_fd)
    try:
        for c in comps[:-1]:
            nxt = os.open(c, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = nxt
        return os.open(comps[-1], flags | _NOFOLLOW, dir_fd=fd)
    finally:
        os.close(fd)


def _sha256(fd: int) -> str:
    h = hashlib.sha256()
    while True:
        b = os.read(fd, CHUNK)
        if not b:
            return h.hexdigest()
        h.update(b)


def listing(job_dir: str, paths: List[str]) -> Dict[str, Any]:
    """Every regular file under ``paths`` (relative to ``job_dir``): ``files`` [{path, size, sha256}],
    ``missing`` (paths not there), ``skipped`` [{path, why}] (links, FIFOs, devices, unreadable ones) and
    ``present`` (the names in ``job_dir``, for a message about a path that is nowhere)."""
    try:
        top = os.open(job_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        try:
            jobs = sorted(e.name for e in os.scandir(os.path.dirname(job_dir)) if e.is_dir() and e.name[:1] != ".")
        except OSError:
            jobs = []
        return {"ok": False, "found": False, "error": f"{job_dir}: {e.strerror or e}", "jobs": jobs}
    files: List[Dict[str, Any]] = []
    missing: List[str] = []
    skipped: List[Dict[str, str]] = []
    try:
        for rel in paths:
            try:
                comps = parts(rel)
            except UnsafePath as e:
                return {"ok": False, "found": True, "error": str(e)}
            _walk(top, comps, files, missing, skipped)
        present = sorted(e.name for e in os.scandir(top))
    finally:
        os.close(top)
    return {"ok": True, "found": True, "files": files, "missing": missing, "skipped": skipped, "present": present,
            "truncated": len(files) >= MAX_FILES}


def _walk(top: int, comps: List[str], files: list, missing: list, skipped: list) -> None:
    rel = "/".join(comps)
    if len(files) >= MAX_FILES:
        return
    try:
        fd = open_below(top, comps, os.O_RDONLY | os.O_NONBLOCK)  # NONBLOCK: a FIFO opens without a writer
    except FileNotFoundError:
        missing.append(rel)
        return
    except OSError as e:
        link = e.errno in (errno.ELOOP, errno.ENOTDIR)
        skipped.append({"path": rel, "why": "a symbolic link (not followed)" if link else e.strerror or str(e)})
        return
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            for name in sorted(os.listdir(fd)):
                _walk(top, [*comps, name], files, missing, skipped)
        elif stat.S_ISREG(st.st_mode):
            files.append({"path": rel, "size": st.st_size, "sha256": _sha256(fd)})
        else:
            skipped.append({"path": rel, "why": "not a regular file"})
    except OSError as e:
        skipped.append({"path": rel, "why": e.strerror or str(e)})
    finally:
        os.close(fd)


def copy(job_dir: str, rel: str, offset: int, out: BinaryIO) -> None:
    """Write the bytes of regular file ``rel`` of ``job_dir`` from ``offset`` to ``out``; OSError or
    ``UnsafePath`` when it cannot."""
    top = os.open(job_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd = open_below(top, parts(rel), os.O_RDONLY | os.O_NONBLOCK)
    finally:
        os.close(top)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        os.lseek(fd, offset, os.SEEK_SET)
        for b in iter(lambda: os.read(fd, CHUNK), b""):
            out.write(b)
        out.flush()
    finally:
        os.close(fd)


def send(job_dir: str, rel: str, offset: int) -> int:
    """``node send``: ``copy`` to stdout; 0, or 1 with one line on stderr."""
    try:
        copy(job_dir, rel, offset, sys.stdout.buffer)
        return 0
    except (OSError, UnsafePath) as e:
        print(f"{rel}: {getattr(e, 'strerror', None) or e}", file=sys.stderr)
        return 1
