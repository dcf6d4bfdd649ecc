"""A node's cache of unpacked workspaces: one tree per archive hash, hard-linked into each job directory.

``trees/<sha>/tree/`` holds the files, made read-only, and ``trees/<sha>/manifest.json`` what each file was
when it was unpacked (inode, size, mtime, mode). A job directory is made of real directories whose files are
hard links to the cached ones: no byte is copied. Before a tree is linked again, every file is checked against
its record (one ``stat`` each); a tree something wrote into -- root ignores the read-only mode -- is dropped
and the archive is sent again. So a job that writes into a workspace file in place can change what it reads
itself (and another job linked to the same tree while both run), never what the next job is given. The rule
for jobs: the workspace is read-only input; outputs go to new files (a file replaced by rename is the job's own).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import stat
from typing import Any, BinaryIO, Callable, Dict, Iterator, List, Optional, Union

from .locks import exclusive
from .unpack import UnsafeArchive, fresh_dir, safe_extract

KEEP = 4  # unpacked trees kept per ROOT_DIR, least recently used dropped first
DELTA_NAME = ".paddle-delta.json"  # a delta archive's listing of the files kept from its base (launch/delta.py)
READ_ONLY = ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH)


_PINS: List[int] = []  # this process's pins (``pin``): descriptors holding a shared flock


def tree_dir(root: str, sha: str) -> str:
    return os.path.join(root, ".paddle_cluster", "trees", sha)


def _pins(root: str) -> str:
    """Where the pins are (``<sha>`` files and ``.lock``): beside the trees, never among them."""
    return os.path.join(root, ".paddle_cluster", "pins")


@contextlib.contextmanager
def _locked(root: str) -> Iterator[str]:
    """The pins directory, its lock held exclusively: pinning and pruning never interleave."""
    pins = _pins(root)
    os.makedirs(pins, mode=0o700, exist_ok=True)
    with exclusive(os.path.join(pins, ".lock")):
        yield pins


def pin(root: str, sha: str) -> None:
    """Keep the tree of ``sha`` (there, or still to come) from being pruned by another session (a concurrent
    launch) until ``unpin`` or this process ends: a session that found it, or links from it, still has it."""
    with _locked(root) as pins:
        fd = os.open(os.path.join(pins, sha), os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_SH)  # never waits: prune takes it exclusively only under the same lock
        _PINS.append(fd)


def unpin() -> None:
    """Release every tree this process pinned."""
    while _PINS:
        os.close(_PINS.pop())


def _record(st: os.stat_result) -> List[int]:
    return [st.st_ino, st.st_size, st.st_mtime_ns, st.st_mode]


def materialize(root: str, sha: str, dest: str) -> bool:
    """Make a fresh ``dest`` of the tree of archive ``sha`` (via a temporary sibling, renamed at the end);
    False, with nothing done, when this node holds no such tree or the one it holds was written into."""
    manifest = _intact(root, sha)
    if manifest is None:
        return False
    files = os.path.join(tree_dir(root, sha), "tree")
    fresh_dir(dest, lambda tmp: _link_tree(files, manifest, tmp), "linking")
    os.utime(tree_dir(root, sha))  # most recently used
    return True


def holds(root: str, sha: str) -> bool:
    """Whether this node holds the intact tree of archive ``sha`` (a damaged one is dropped)."""
    return _intact(root, sha) is not None


def _intact(root: str, sha: str) -> Optional[Dict[str, Any]]:
    """The tree's manifest when every file is as it was unpacked; else None, and a damaged tree is dropped."""
    top = tree_dir(root, sha)
    try:
        with open(os.path.join(top, "manifest.json")) as f:
            manifest = json.load(f)
        files = os.path.join(top, "tree")
        if all(_record(os.lstat(os.path.join(files, rel))) == rec for rel, rec in manifest["files"].items()):
            return manifest
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    if os.path.lexists(top):
        drop(root, sha)
    return None


def drop(root: str, sha: str) -> None:
    """Remove a cached tree (renamed away first, so no one links from it half-removed)."""
    top = tree_dir(root, sha)
    gone = f"{top}.drop-{os.getpid()}"
    try:
        os.rename(top, gone)
    except OSError:
        return
    shutil.rmtree(gone, ignore_errors=True)


def newest(root: str) -> str:
    """The hash of the most recently used intact tree here (""  if none): what a changed workspace can be sent
    against."""
    recent = _by_recency(os.path.dirname(tree_dir(root, "x")))
    return next((n for n in map(os.path.basename, recent) if _intact(root, n) is not None), "")


def _by_recency(parent: str) -> List[str]:
    """The cached trees under ``parent``, most recently used first (one being dropped meanwhile is left out)."""
    try:
        names = [n for n in os.listdir(parent) if "." not in n]  # not "<sha>.drop-<pid>" nor a temporary
    except OSError:
        return []
    used: Dict[str, float] = {}
    for n in names:
        try:
            used[os.path.join(parent, n)] = os.stat(os.path.join(parent, n)).st_mtime
        except OSError:
            pass
    return sorted(used, key=used.__getitem__, reverse=True)


def store(root: str, archive: Union[str, BinaryIO], sha: Union[str, Callable[[], str]], max_members: int,
          max_bytes: Optional[int] = None, verified: Callable[[], bool] = lambda: True, base: str = "") -> None:
    """Unpack an archive (a path, or a stream as it arrives) into the cache (refusing what ``safe_extract``
    refuses), its files made read-only and recorded; drop old trees. The tree is put in place only if
    ``verified()`` (asked once all is unpacked: is the archive's hash the expected one?), under ``sha`` (or
    ``sha()``, asked then: the hash of an archive sent while it was made is known only at its end). With
    ``base``, the archive is a delta (``launch/delta.py``): the files it lists are linked from that tree, the
    rest is in it."""
    parent = os.path.dirname(tree_dir(root, "x"))
    os.makedirs(parent, mode=0o700, exist_ok=True)
    tmp = os.path.join(parent, f"{sha if isinstance(sha, str) else 'new'}.unpacking-{os.getpid()}")
    try:
        os.makedirs(tmp, mode=0o700)
        _unpack_sealed(archive, tmp, max_members, max_bytes, root, base)
        if not verified():
            raise UnsafeArchive("checksum mismatch: the archive is not the one the launcher packed")
        name = sha if isinstance(sha, str) else sha()
        top = tree_dir(root, name)
        try:
            if os.path.isdir(top) and not os.listdir(top):
                os.rmdir(top)
            os.rename(tmp, top)
        except OSError:  # it was put in place meanwhile: another launcher stored the same archive at the same moment
            if _intact(root, name) is None:
                raise
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    _prune(root, keep=KEEP)


def _unpack_sealed(archive: Union[str, BinaryIO], top: str, max_members: int, max_bytes: Optional[int],
                   root: str = "", base: str = "") -> None:
    files = os.path.join(top, "tree")
    safe_extract(archive, files, max_bytes, max_members=max_members)
    if base:
        _apply_delta(root, base, files)
    manifest: Dict[str, Any] = {"dirs": {}, "files": {}, "links": {}}
    for dirpath, dirnames, filenames in os.walk(files):
        for name in dirnames + filenames:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, files)
            st = os.lstat(full)
            if stat.S_ISLNK(st.st_mode):
                manifest["links"][rel] = os.readlink(full)
            elif stat.S_ISDIR(st.st_mode):
                manifest["dirs"][rel] = st.st_mode & 0o777
            else:
                os.chmod(full, st.st_mode & 0o777 & READ_ONLY)
                manifest["files"][rel] = _record(os.lstat(full))
        dirnames[:] = [d for d in dirnames if not os.path.islink(os.path.join(dirpath, d))]
    with open(os.path.join(top, "manifest.json"), "w") as f:
        json.dump(manifest, f)


def _apply_delta(root: str, base: str, files: str) -> None:
    """Link into ``files`` (a delta just unpacked) the unchanged files its listing names, from tree ``base``."""
    listing = os.path.join(files, DELTA_NAME)
    try:
        with open(listing) as f:
            doc = json.load(f)
        keep = doc["keep"]
        assert doc["base"] == base and isinstance(keep, list)
    except (OSError, ValueError, KeyError, TypeError, AssertionError):
        raise UnsafeArchive(f"a delta archive without a valid {DELTA_NAME}") from None
    os.unlink(listing)
    manifest = _intact(root, base)
    if manifest is None:
        raise UnsafeArchive(f"the tree {base[:12]} a delta is based on is gone or was written into")
    src = os.path.join(tree_dir(root, base), "tree")
    for rel in keep:
        if not isinstance(rel, str) or (rel not in manifest["files"] and rel not in manifest["links"]):
            raise UnsafeArchive(f"a delta keeps {rel!r}, which the tree {base[:12]} does not have")
        dst = os.path.join(files, rel)
        os.makedirs(os.path.dirname(dst), mode=0o755, exist_ok=True)
        if rel in manifest["links"]:
            os.symlink(manifest["links"][rel], dst)
        else:
            os.link(os.path.join(src, rel), dst)


def _prune(root: str, keep: int) -> None:
    """Drop the trees beyond the ``keep`` most recently used that no session pinned (and the pins of trees
    that never came, no session holding them)."""
    with _locked(root) as pins:
        trees = _by_recency(os.path.dirname(tree_dir(root, "x")))
        gone = [n for n in os.listdir(pins) if n != ".lock" and not os.path.isdir(tree_dir(root, n))]
        for sha in [os.path.basename(t) for t in trees[keep:]] + gone:
            with exclusive(os.path.join(pins, sha), wait=False) as free:
                if free:  # else a session is using it
                    drop(root, sha)  # nothing to do for a tree that never came
                    os.unlink(os.path.join(pins, sha))


def _link_tree(src: str, manifest: Dict[str, Any], dst: str) -> None:
    for rel in sorted(manifest["dirs"]):  # parents sort before their children
        os.mkdir(os.path.join(dst, rel), manifest["dirs"][rel])
    for rel, target in manifest["links"].items():
        os.symlink(target, os.path.join(dst, rel))
    for rel in manifest["files"]:
        s, d = os.path.join(src, rel), os.path.join(dst, rel)
        try:
            os.link(s, d)
        except OSError as e:  # the job directory is on another filesystem than the cache: copy that file
            if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
                raise
            shutil.copy2(s, d)

