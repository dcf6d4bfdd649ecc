"""Unpacking a workspace archive on a node, refusing anything that could write outside the job directory."""

from __future__ import annotations

import os
import shutil
import tarfile
from typing import Any, Dict


class UnsafeArchive(Exception):
    """The archive has a member that could escape the job directory, or is too big."""


def check_member(m: tarfile.TarInfo, dest: str, max_bytes: int) -> None:
    """Refuse anything that could write outside ``dest``: absolute paths, ``..``, links out, devices."""
    name = m.name
    if name.startswith(("/", "\\")) or os.path.isabs(name) or (len(name) > 1 and name[1] == ":"):
        raise UnsafeArchive(f"absolute path {name!r}")
    parts = name.replace("\\", "/").split("/")
    if ".." in parts:
        raise UnsafeArchive(f"path with '..': {name!r}")
    target = os.path.realpath(os.path.join(dest, name))
    if not (target == dest or target.startswith(dest + os.sep)):
        raise UnsafeArchive(f"{name!r} resolves outside the job directory")
    if m.issym() or m.islnk():
        link = m.linkname
        if not link.strip("/.") or link.endswith("/"):
            raise UnsafeArchive(f"link {name!r} -> {link!r} has no real target")
        if os.path.isabs(link) or ".." in link.replace("\\", "/").split("/"):
            raise UnsafeArchive(f"link {name!r} -> {link!r} points outside the job directory")
        base = os.path.dirname(target) if m.issym() else dest
        if not os.path.realpath(os.path.join(base, link)).startswith(dest + os.sep):
            raise UnsafeArchive(f"link {name!r} -> {link!r} points outside the job directory")
    elif not (m.isfile() or m.isdir()):
        raise UnsafeArchive(f"{name!r} is a device, fifo or other special file")
    if m.size > max_bytes:
        raise UnsafeArchive(f"{name!r} is {m.size} bytes, over the {max_bytes}-byte limit")


# Our own checks ran; Python 3.12+ would otherwise warn that no extraction filter was chosen.
_TRUSTED = {"filter": "fully_trusted"} if hasattr(tarfile, "fully_trusted_filter") else {}


def safe_extract(archive: str, dest: str, max_bytes: int = 1 << 36) -> int:
    """Extract into a fresh ``dest`` (via a temporary sibling, renamed at the end); returns member count."""
    dest = os.path.realpath(dest)
    if os.path.exists(dest) and os.listdir(dest):
        raise UnsafeArchive(f"{dest} already exists and is not empty; choose another --job_name")
    tmp = f"{dest}.unpacking-{os.getpid()}"
    n = 0
    try:
        os.makedirs(tmp)
        real_tmp = os.path.realpath(tmp)
        with tarfile.open(archive, "r:*") as tar:
            total = 0
            files = set()
            for m in tar:
                check_member(m, real_tmp, max_bytes)
                if m.islnk() and m.linkname not in files:
                    raise UnsafeArchive(f"hard link {m.name!r} -> {m.linkname!r}: no such file earlier in the archive")
                total += m.size
                if total > max_bytes:
                    raise UnsafeArchive(f"archive expands to more than {max_bytes} bytes")
                # No setuid/setgid; the owner can always read and write (and enter directories).
                m.mode = (m.mode | (0o700 if m.isdir() else 0o600)) & 0o777
                m.uid = m.gid = os.getuid()
                m.uname = m.gname = ""
                tar.extract(m, real_tmp, set_attrs=not m.issym(), **_TRUSTED)  # checked above
                if m.isfile():
                    files.add(m.name)
                n += 1
        if os.path.isdir(dest):
            os.rmdir(dest)
        os.rename(tmp, dest)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return n


def unpack_report(archive: str, dest: str) -> Dict[str, Any]:
    """``safe_extract`` answered as a document: ``{"ok": True, "members": n}`` or ``{"ok": False, "error": ...}``."""
    try:
        return {"ok": True, "members": safe_extract(archive, dest)}
    except (UnsafeArchive, tarfile.TarError, OSError) as e:
        return {"ok": False, "error": str(e)}
    except Exception as e:  # noqa: BLE001 - whatever a hostile archive provokes, answer in JSON, not a traceback
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
