"""Unpacking a workspace archive on a node, refusing anything that could write outside the job directory."""

from __future__ import annotations

import os
import re
import shutil
import tarfile
from typing import Any, BinaryIO, Callable, Dict, List, Optional, Sequence, TypeVar, Union

# Bounds on what an archive may make the unpacker hold or write; the byte cap defaults to the archive's own
# size, which a plain tar's contents can never exceed.
MAX_HEADER_BYTES = 1 << 20  # one pax / GNU long-name header (a path is at most a few KiB)
MAX_MEMBERS = 100_000
T = TypeVar("T")


class UnsafeArchive(Exception):
    """The archive has a member that could escape the job directory, or is too big."""


_HEADER_TYPES = (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK, tarfile.XHDTYPE, tarfile.XGLTYPE,
                 tarfile.SOLARIS_XHDTYPE)


class _BoundedTarInfo(tarfile.TarInfo):
    """Refuses, before reading them, extended headers over MAX_HEADER_BYTES (tarfile reads one whole into
    memory) and GNU sparse members (an unbounded chain of map blocks, and contents bigger than the archive)."""

    def _proc_member(self, tar: tarfile.TarFile) -> Any:
        if self.type == tarfile.GNUTYPE_SPARSE:
            raise UnsafeArchive(f"{self.name!r} is a sparse file")
        if self.type in _HEADER_TYPES and self.size > MAX_HEADER_BYTES:
            raise UnsafeArchive(f"a {self.size}-byte extended header, over the {MAX_HEADER_BYTES}-byte limit")
        return super()._proc_member(tar)


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


def _normal_mode(m: tarfile.TarInfo) -> int:
    """rwxr-xr-x for directories and executables, rw-r--r-- for the rest: no one else may write, no set-id."""
    return 0o755 if m.isdir() or m.mode & 0o111 else 0o644


# Our own checks ran; Python 3.12+ would otherwise warn that no extraction filter was chosen.
_TRUSTED = {"filter": "fully_trusted"} if hasattr(tarfile, "fully_trusted_filter") else {}


def fresh_dir(dest: str, fill: Callable[[str], T], what: str = "unpacking") -> T:
    """``fill(tmp)`` an owner-only temporary sibling of ``dest`` and rename it to ``dest``, which must not exist
    or be empty; ``fill``'s value. Nothing is left behind when ``fill`` fails."""
    dest = os.path.realpath(dest)
    if os.path.exists(dest) and os.listdir(dest):
        raise UnsafeArchive(f"{dest} already exists and is not empty; choose another --job_name")
    tmp = f"{dest}.{what}-{os.getpid()}"
    try:
        os.makedirs(tmp, mode=0o700)
        os.chmod(tmp, 0o700)  # owner-only from the start: logs, checkpoints and the secret's processes live here
        out = fill(os.path.realpath(tmp))
        if os.path.isdir(dest):
            os.rmdir(dest)
        os.rename(tmp, dest)
        return out
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


def sweep_stale(parent: str, kinds: Sequence[str], named: Callable[[str], bool] = lambda name: True) -> List[str]:
    """Remove the entries ``<name>.<kind>-<pid>`` of ``parent`` (what ``fresh_dir``, the chain's receiver and a
    dropped tree leave while they work) whose process is gone: a node process killed mid-dispatch cannot clean
    up after itself. One whose pid runs (its owner, or a reuse) stays for a later sweep; ``named(name)`` must
    hold too. Returns the paths removed."""
    alt = "|".join(map(re.escape, kinds))
    pat = re.compile(rf"^(.+)\.(?:{alt})-(\d+)$")
    try:
        entries = os.listdir(parent)
    except OSError:
        return []
    removed = []
    for entry in entries:
        mt = pat.match(entry)
        if mt is None or _running(int(mt.group(2))) or not named(mt.group(1)):
            continue
        path = os.path.join(parent, entry)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.unlink(path)
            except OSError:
                pass
        removed.append(path)
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # not ours to signal: it runs
        pass
    return True


def safe_extract(archive: Union[str, BinaryIO], dest: str, max_bytes: Optional[int] = None,
                 max_members: int = MAX_MEMBERS) -> int:
    """Extract a plain tar (a path, or a stream read as it comes) into a fresh ``dest`` (via a temporary
    sibling, renamed at the end); returns the member count. ``max_bytes`` (default: the archive's size, which a
    stream must give) caps every member and their sum."""
    cap = os.path.getsize(archive) if max_bytes is None else max_bytes  # type: ignore[arg-type]
    how: Dict[str, Any] = ({"name": archive, "mode": "r:"} if isinstance(archive, str) else
                           {"fileobj": archive, "mode": "r|", "bufsize": 1 << 20})
    how["copybufsize"] = 1 << 20  # tarfile's default of 16 KiB costs ~4x the CPU per byte unpacked

    def extract(real_tmp: str) -> int:
        n = total = 0
        files = set()
        with tarfile.open(tarinfo=_BoundedTarInfo, **how) as tar:
            for m in tar:
                n += 1
                if n > max_members:
                    raise UnsafeArchive(f"archive has more than {max_members} members")
                check_member(m, real_tmp, cap)
                if m.islnk() and m.linkname not in files:
                    raise UnsafeArchive(f"hard link {m.name!r} -> {m.linkname!r}: no such file earlier in the archive")
                total += m.size
                if total > cap:
                    raise UnsafeArchive(f"archive expands to more than {cap} bytes")
                if os.path.realpath(os.path.join(real_tmp, m.name)) == real_tmp:
                    continue  # a '.' member: the job directory keeps its own owner-only mode
                m.mode = _normal_mode(m)
                m.uid = m.gid = os.getuid()
                m.uname = m.gname = ""
                tar.extract(m, real_tmp, set_attrs=not m.issym(), **_TRUSTED)  # checked above
                if m.isfile():
                    files.add(m.name)
        return n

    return fresh_dir(dest, extract)


def unpack_report(archive: str, dest: str, max_members: int = MAX_MEMBERS) -> Dict[str, Any]:
    """``safe_extract`` answered as a document: ``{"ok": True, "members": n}`` or ``{"ok": False, "error": ...}``."""
    try:
        return {"ok": True, "members": safe_extract(archive, dest, max_members=max_members)}
    except (UnsafeArchive, tarfile.TarError, OSError) as e:
        return {"ok": False, "error": str(e)}
    except Exception as e:  # noqa: BLE001 - whatever a hostile archive provokes, answer in JSON, not a traceback
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
