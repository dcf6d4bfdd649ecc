"""A node's cache of unpacked workspaces: one tree per archive hash, copied into each job directory.

A job gets its own copy, never links into the cache: a job that writes into its workspace (a file opened
for writing, not replaced) would otherwise change the cache and every other job made from it. The copy is
a reflink (shared blocks, copy-on-write) where the filesystem has them (btrfs, XFS), else an in-kernel copy.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
from typing import List

from .unpack import UnsafeArchive, fresh_dir, safe_extract

KEEP = 4  # unpacked trees kept per ROOT_DIR, least recently used dropped first
FICLONE = 0x40049409  # linux/fs.h: _IOW(0x94, 9, int)


def tree_dir(root: str, sha: str) -> str:
    return os.path.join(root, ".paddle_cluster", "trees", sha)


def materialize(root: str, sha: str, dest: str) -> bool:
    """Copy the tree of archive ``sha`` into a fresh ``dest`` (via a temporary sibling, renamed at the end);
    False, with nothing done, when this node holds no such tree."""
    src = tree_dir(root, sha)
    if not os.path.isdir(src):
        return False
    fresh_dir(dest, lambda tmp: _copy_tree(src, tmp), "copying")
    os.utime(src)  # most recently used
    return True


def store(root: str, archive: str, sha: str, max_members: int) -> None:
    """Unpack a verified archive into the cache (refusing what ``safe_extract`` refuses); drop old trees."""
    dst = tree_dir(root, sha)
    os.makedirs(os.path.dirname(dst), mode=0o700, exist_ok=True)
    try:
        safe_extract(archive, dst, max_members=max_members)
    except (UnsafeArchive, OSError):
        if not os.path.isdir(dst) or not os.listdir(dst):
            raise
        # another launcher unpacked the same archive at the same moment: its tree is as good as ours
    _prune(os.path.dirname(dst), keep=KEEP)


def _prune(parent: str, keep: int) -> None:
    trees: List[str] = [os.path.join(parent, n) for n in os.listdir(parent) if "." not in n]
    trees.sort(key=lambda p: os.stat(p).st_mtime, reverse=True)
    for old in trees[keep:]:
        shutil.rmtree(old, ignore_errors=True)


def _copy_tree(src: str, dst: str) -> None:
    for dirpath, dirnames, filenames in os.walk(src):
        rel = os.path.relpath(dirpath, src)
        out = dst if rel == "." else os.path.join(dst, rel)
        for name in dirnames + filenames:
            s, d = os.path.join(dirpath, name), os.path.join(out, name)
            st = os.lstat(s)
            if os.path.islink(s):  # os.walk lists a link to a directory among dirnames and does not enter it
                os.symlink(os.readlink(s), d)
            elif name in dirnames:
                os.mkdir(d, st.st_mode & 0o777)
            else:
                _copy_file(s, d, st.st_mode & 0o777)
        dirnames[:] = [n for n in dirnames if not os.path.islink(os.path.join(dirpath, n))]


def _copy_file(src: str, dst: str, mode: int) -> None:
    with open(src, "rb") as fi, open(os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode), "wb") as fo:
        try:
            fcntl.ioctl(fo.fileno(), FICLONE, fi.fileno())
            return
        except OSError:
            pass
        left = os.fstat(fi.fileno()).st_size
        try:
            while left > 0:
                n = os.copy_file_range(fi.fileno(), fo.fileno(), left)
                if n == 0:
                    break
                left -= n
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                raise
            shutil.copyfileobj(fi, fo, 1 << 20)  # no in-kernel copy here; fi and fo are at the same offset
