"""Getting code onto the nodes: the node-side library, and a job's workspace.

Both travel as tar archives named by their SHA-256 under ``ROOT_DIR/.paddle_cluster/``; a node that
already holds an archive with that hash is not sent it again. The workspace archive is unpacked on the
node by the agent, which refuses absolute paths, ``..`` and links that leave the job directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import posixpath
import secrets
import stat
import tarfile
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import paddle_cluster

from . import cache
from .each_node import each_node
from .errors import ClusterError, HostConfigError, HostError
from .hosts import Node
from .nodecmd import agent_json
from .package import Package
from .plan import JobSpec
from .progress import upload_progress

SKIP_ANYWHERE = {".git", "__pycache__", ".hypothesis", ".pytest_cache"}
SKIP_TOP = {"log", "output"}
# The parts of paddle_cluster a node needs; the launcher (launch/, cli.py) stays behind.
NODE_SIDE = ("__init__.py", "contract.py", "jobsecret.py", "node", "ps", "train", "compat", "torch", "paddle")


def _walk(root: Path, top_skip: set) -> Iterator[Tuple[Path, str]]:
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_ANYWHERE
                             and not (rel_dir == "." and d in top_skip))
        for name in sorted(filenames):
            if name.endswith((".pyc", ".pyo")):
                continue
            full = Path(dirpath) / name
            yield full, posixpath.normpath(posixpath.join(rel_dir.replace(os.sep, "/"), name))


CHUNK = 1 << 20
# A delta (delta.py, which imports this module) is sent only when it is at most this fraction of the whole
# archive; so a workspace of which at most this much changed is packed first (a delta may go) rather than sent
# while it is packed.
WORTH_DELTA = 0.5


class WorkspaceChanged(ClusterError):
    """A file of the workspace changed (or came, or went) while it was packed: the archive would hold part of
    one version and part of another, so it is never used (nothing of it is kept on any node)."""

    def __init__(self, what: str) -> None:
        super().__init__(f"{what}: nothing of it was kept on any node; run again once the workspace holds still "
                         "(a job writing into it? write outputs elsewhere)")


@dataclass(frozen=True)
class _Member:
    full: Path
    info: tarfile.TarInfo
    stat: list  # [arcname, size, mtime_ns, ctime_ns, mode]: what it was when listed


def _stat_row(full: Path, arc: str) -> list:
    st = full.lstat()
    return [arc, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_mode]  # ctime: even `touch -d`


def _layout(entries: List[Tuple[Path, str]]) -> Tuple[List[_Member], int]:
    """Every entry's tar header (sorted, no owner names: an unchanged tree has an unchanged hash) and the
    archive's exact size, from the entries' metadata alone: nothing is read yet. A hard link is sent as the
    file it names."""
    tar = tarfile.TarFile(fileobj=io.BytesIO(), mode="w", format=tarfile.PAX_FORMAT)
    members, offset = [], 0
    for full, arc in entries:
        row = _stat_row(full, arc)
        tar.inodes = {}  # never a hard-link member: each name carries its own contents
        info = tar.gettarinfo(str(full), arcname=arc)
        if info is None or not (info.isfile() or info.issym()):
            continue  # a socket, FIFO or device: never sent
        if info.isfile() and info.size != row[1]:
            raise WorkspaceChanged(f"{full} changed while the workspace was read")
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        members.append(_Member(full, info, row))
        offset += len(info.tobuf(tarfile.PAX_FORMAT, tar.encoding, tar.errors))
        offset += -(-info.size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE if info.isfile() else 0
    offset += 2 * tarfile.BLOCKSIZE
    return members, -(-offset // tarfile.RECORDSIZE) * tarfile.RECORDSIZE


def _write_tar(members: List[_Member], size: int, emit: Callable[[bytes], None],
               manifest: Optional[Dict[str, str]]) -> str:
    """The tar of ``members`` (``_layout``) passed to ``emit`` piece by piece as each file is read, once: its
    SHA-256, and into ``manifest`` (unless None: a second SHA-256 pass) what each entry is (``entry_id``). A file
    that is not as it was listed, before or after it is read, raises ``WorkspaceChanged``; the caller checks the
    whole listing once more at the end (``_unchanged``)."""
    h = hashlib.sha256()
    done = 0

    def out(b: bytes) -> None:
        nonlocal done
        h.update(b)
        emit(b)
        done += len(b)

    enc, errors = tarfile.ENCODING, "surrogateescape"
    for mb in members:
        info = mb.info
        out(info.tobuf(tarfile.PAX_FORMAT, enc, errors))
        if info.issym():
            if manifest is not None:
                manifest[info.name] = entry_id(info, None)
            continue
        content = hashlib.sha256() if manifest is not None else None
        with open(mb.full, "rb") as f:
            before = os.fstat(f.fileno())
            if [before.st_size, before.st_mtime_ns, before.st_ctime_ns] != mb.stat[1:4]:
                raise WorkspaceChanged(f"{mb.full} changed while the workspace was read")
            left = info.size
            while left:
                b = f.read(min(CHUNK, left))
                if not b:
                    raise WorkspaceChanged(f"{mb.full} shrank while the workspace was read")
                if content is not None:
                    content.update(b)
                out(b)
                left -= len(b)
            after = os.fstat(f.fileno())
            if [after.st_size, after.st_mtime_ns, after.st_ctime_ns] != mb.stat[1:4]:
                raise WorkspaceChanged(f"{mb.full} changed while the workspace was read")
        pad = -info.size % tarfile.BLOCKSIZE
        if pad:
            out(tarfile.NUL * pad)
        if manifest is not None:
            manifest[info.name] = entry_id(info, content)
    out(tarfile.NUL * (size - done))  # the end blocks and the record's padding
    assert done == size, f"the tar came to {done} bytes, laid out as {size}"
    return h.hexdigest()


def entry_id(info: tarfile.TarInfo, content: Optional[Any]) -> str:
    """What an archive's entry is, for ``delta.py``: its contents' SHA-256 (``content``, a hash of them) and
    whether it is executable, or a link's target."""
    if info.issym():
        return "link:" + info.linkname
    assert content is not None
    return content.hexdigest() + ("x" if info.mode & 0o111 else "")


def _unchanged(members: List[_Member], entries: List[Tuple[Path, str]]) -> None:
    """Raise ``WorkspaceChanged`` unless the files listed now (``entries``) are those ``members`` were listed as:
    with each file's own check as it was read, the archive is one version of the workspace."""
    now: Dict[str, list] = {}
    for full, arc in entries:
        with contextlib.suppress(FileNotFoundError):
            now[arc] = _stat_row(full, arc)
    listed = set()
    for mb in members:
        listed.add(mb.stat[0])
        if now.get(mb.stat[0]) != mb.stat:
            raise WorkspaceChanged(f"{mb.full} changed (or went away) while the workspace was read")
    came = [arc for arc, row in now.items() if arc not in listed and (stat.S_ISREG(row[4]) or stat.S_ISLNK(row[4]))]
    if came:
        raise WorkspaceChanged(f"{came[0]} appeared while the workspace was read")


def _tar(entries: List[Tuple[Path, str]], out_dir: str, prefix: str,
         manifest: Optional[Dict[str, str]] = None, tmp: Optional[str] = None) -> Package:
    """A deterministic tar of ``entries``, made and hashed in one read of each file (``_write_tar``); ``manifest``
    gets what each entry is. Written to ``tmp`` when given, else to a new file in ``out_dir``."""
    if tmp is None:
        fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=".tar", dir=out_dir)
        os.close(fd)
    members, size = _layout(entries)
    with open(tmp, "wb") as f:
        sha = _write_tar(members, size, f.write, manifest)
    _unchanged(members, entries)
    return Package(tmp, sha, size, len(members))


class Packing:
    """A new workspace's archive made while it is sent: ``start()`` reads every file once, in a thread, hashing
    it and appending it to a temporary in the cache, which ``reader()``s follow as it grows (the first byte can
    leave as soon as it is read). ``size`` and ``files`` are known at once (``_layout``), ``sha256`` once the
    last byte is read and the workspace was found unchanged throughout (``wait``); only then does the archive
    enter the cache (so the next launch of the same workspace sends nothing it need not)."""

    def __init__(self, directory: str, entries: List[Tuple[Path, str]], members: List[_Member], size: int,
                 cache_dir: str, key: str, meta: Dict[str, Any], hold: Optional[contextlib.ExitStack]) -> None:
        self.directory, self.size, self.files = directory, size, len(members)
        self.sha256 = ""
        self.error: Optional[BaseException] = None
        self._entries, self._members, self._meta = entries, members, meta
        self._cache_dir, self._key, self._hold = cache_dir, key, hold
        self._tmp = cache.temp_name(cache_dir, "workspace-tar")
        self._out = open(self._tmp, "wb", buffering=0)
        self._fd = os.open(self._tmp, os.O_RDONLY)  # readers keep it whatever the temporary's name becomes
        self._written = 0
        self._cond = threading.Condition()
        self._done = self._stop = False
        self._thread = threading.Thread(target=self._run, name="pack", daemon=True)

    @property
    def path(self) -> str:
        return self._tmp

    def start(self) -> Packing:
        self._thread.start()
        return self

    def _emit(self, b: bytes) -> None:
        if self._stop:
            raise ClusterError(f"packing the workspace {self.directory} was stopped: the launch failed")
        view = memoryview(b)
        while view:
            view = view[self._out.write(view):]
        with self._cond:
            self._written += len(b)
            self._cond.notify_all()

    def _run(self) -> None:
        try:
            # One SHA-256 pass (the archive's): what each file is, which only a later delta against this archive
            # needs, is read from the cached archive then (delta.manifest).
            sha = _write_tar(self._members, self.size, self._emit, None)
            self._out.close()
            _unchanged(self._members, _workspace_entries(self.directory))  # listed again: a file that came too
            self._publish(sha)
            with self._cond:
                self.sha256 = sha
        except BaseException as e:  # noqa: BLE001 - said by every reader and by wait()
            with self._cond:
                self.error = e if isinstance(e, ClusterError) else ClusterError(
                    f"packing the workspace {self.directory} failed: {e}")
        finally:
            with self._cond:
                self._done = True
                self._cond.notify_all()
            self._out.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._tmp)  # published, or failed: readers keep their descriptor

    def _publish(self, sha: str) -> None:
        meta = {**self._meta, "sha256": sha, "size": self.size, "files": self.files}
        with cache.locked(self._cache_dir):
            if cache.lookup(self._cache_dir, self._key, self._hold) is None:
                cache.publish(self._cache_dir, self._key, self._tmp, meta)
                cache.lookup(self._cache_dir, self._key, self._hold)

    def wait(self) -> Package:
        """The archive once whole and found unchanged, as a cached Package; its ``WorkspaceChanged`` (or other
        ``ClusterError``) otherwise."""
        with self._cond:
            while not self._done:
                self._cond.wait()
        if self.error is not None:
            raise self.error
        return Package(os.path.join(self._cache_dir, f"{self._key}.tar"), self.sha256, self.size, self.files)

    def failed(self) -> Optional[BaseException]:
        with self._cond:
            return self.error

    def reader(self) -> _Follower:
        return _Follower(self)

    def _ready(self, pos: int, n: int) -> int:
        """How many of the ``n`` bytes from ``pos`` are written, once some are (0: the archive ends before)."""
        with self._cond:
            while self._written <= pos and not self._done:
                self._cond.wait()
            if self.error is not None:
                raise self.error
            return max(min(n, self._written - pos), 0)

    def _read(self, pos: int, n: int) -> bytes:
        n = self._ready(pos, n)
        return os.pread(self._fd, n, pos) if n else b""

    def _send(self, fd: int, pos: int, n: int) -> int:
        n = self._ready(pos, n)
        return os.sendfile(fd, self._fd, pos, n) if n else 0

    def close(self) -> None:
        """Stop using the archive (after ``wait``, or to give up: the thread ends at its next piece)."""
        self._stop = True
        self._thread.join()
        with contextlib.suppress(OSError):
            os.close(self._fd)


class _Follower(io.RawIOBase):
    """The archive read from its start as it is written: ``read`` waits for more, b"" once it is whole."""

    def __init__(self, packing: Packing) -> None:
        super().__init__()
        self._p, self._pos = packing, 0
        self.name = os.path.basename(packing.directory.rstrip("/")) + ".tar"

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        b = self._p._read(self._pos, CHUNK if n is None or n < 0 else n)
        self._pos += len(b)
        return b

    def readinto(self, buf: Any) -> int:
        b = self.read(len(buf))
        buf[:len(b)] = b
        return len(b)

    def sendinto(self, fd: int, n: int) -> int:
        """Up to ``n`` more bytes into ``fd`` straight from the archive's file (``os.sendfile``, never through
        Python); 0 at its end."""
        k = self._p._send(fd, self._pos, n)
        self._pos += k
        return k


def pack_workspace(directory: str, cache_dir: str, keep: int = 4,
                   hold: Optional[contextlib.ExitStack] = None) -> Package:
    """The workspace as a tar in ``cache_dir``, rebuilt only when a file's path, size, times or mode changed.

    An unchanged workspace then costs one directory walk instead of re-reading (tar + SHA-256) every byte;
    the ``keep`` most recently used archives stay in the cache, and any a launch holds (``hold``: until that
    stack closes, no concurrent launch evicts the archive).
    """
    return _cached_tar(_workspace_entries(directory), str(Path(directory).resolve()), cache_dir, "workspace-",
                       keep, hold)


def _workspace_entries(directory: str) -> List[Tuple[Path, str]]:
    root = Path(directory)
    if not root.is_dir():
        raise ClusterError(f"--job_dispatch_package {directory}: no such directory")
    entries = list(_walk(root, SKIP_TOP))
    if not entries:
        raise ClusterError(f"--job_dispatch_package {directory}: the directory is empty")
    return entries


def workspace_archive(directory: str, cache_dir: str, keep: int = 4,
                      hold: Optional[contextlib.ExitStack] = None) -> Union[Package, Packing]:
    """The workspace's cached archive (``pack_workspace``) when nothing changed, or when little did (then it is
    packed first: a node holding the previous version is sent only the changed files, ``delta.py``); else a
    ``Packing``, started, to send while it is made. ``hold`` as for ``pack_workspace``."""
    entries = _workspace_entries(directory)
    origin = str(Path(directory).resolve())
    key, stats = _key(entries, origin)
    os.makedirs(cache_dir, mode=0o700, exist_ok=True)
    with cache.locked(cache_dir):
        meta = cache.lookup(cache_dir, key, hold)
        cache.evict(cache_dir, keep)
    if meta is not None:
        return Package(os.path.join(cache_dir, f"{key}.tar"), meta["sha256"], meta["size"], meta["files"])
    previous = _previous(cache_dir, origin)
    if previous is not None:
        total = sum(s[1] for s in stats)
        changed = sum(s[1] for s in stats if tuple(s) not in previous)
        if changed <= WORTH_DELTA * total:
            return pack_workspace(directory, cache_dir, keep, hold)
    members, size = _layout(entries)
    return Packing(directory, entries, members, size, cache_dir, key, {"origin": origin, "stats": stats},
                   hold).start()


def _previous(cache_dir: str, origin: str) -> Optional[set]:
    """The listing (``_stat_row``s) of the most recent archive of ``origin`` in the cache; None without one."""
    best: Tuple[float, Optional[set]] = (-1.0, None)
    for meta in Path(cache_dir).glob("*.json"):
        try:
            doc = json.loads(meta.read_text())
            if isinstance(doc, dict) and doc.get("origin") == origin and meta.stat().st_mtime > best[0]:
                best = (meta.stat().st_mtime, {tuple(s) for s in doc["stats"]})
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return best[1]


def _key(entries: List[Tuple[Path, str]], origin: str) -> Tuple[str, List[list]]:
    stats = [_stat_row(full, arc) for full, arc in entries]
    return hashlib.sha256(json.dumps([origin, stats]).encode()).hexdigest(), stats


def _cached_tar(entries: List[Tuple[Path, str]], origin: str, cache_dir: str, prefix: str, keep: int,
                hold: Optional[contextlib.ExitStack] = None) -> Package:
    """``_tar(entries)`` from ``cache_dir`` when no entry's path, size, times or mode changed since it was made;
    safe with other launches doing the same at the same moment (``cache.py``)."""
    key, stats = _key(entries, origin)
    os.makedirs(cache_dir, mode=0o700, exist_ok=True)
    tar_path = os.path.join(cache_dir, f"{key}.tar")
    with cache.locked(cache_dir):
        meta = cache.lookup(cache_dir, key, hold)
        cache.evict(cache_dir, keep)  # also what was held when it was last asked
    if meta is None:  # made outside the lock: launches of other workspaces do not wait for this one
        manifest: Dict[str, str] = {}
        tmp = cache.temp_name(cache_dir, prefix + "tar")
        try:
            pkg = _tar(entries, cache_dir, prefix, manifest, tmp)
            with cache.locked(cache_dir):
                meta = cache.lookup(cache_dir, key, hold)  # another launch may have made it meanwhile
                if meta is None:
                    meta = {"sha256": pkg.sha256, "size": pkg.size, "files": pkg.files, "manifest": manifest,
                            "origin": origin, "stats": stats}
                    cache.publish(cache_dir, key, tmp, meta)
                    meta = cache.lookup(cache_dir, key, hold)
                cache.evict(cache_dir, keep)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        assert meta is not None, f"{tar_path} vanished while the cache was locked"
    return Package(tar_path, meta["sha256"], meta["size"], meta["files"])


def workspace_cache_dir() -> str:
    return os.path.join(_cache_home(), "workspaces")


def _cache_home() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "paddle-cluster")


def library_package(hold: Optional[contextlib.ExitStack] = None) -> Package:
    """The node library as a tar, cached like a workspace (made again only when one of its files changed), in a
    directory of this installation's own: launchers of other versions prune theirs, never ours."""
    here = str(Path(paddle_cluster.__file__).resolve().parent)
    directory = os.path.join(_cache_home(), "lib", hashlib.sha256(here.encode()).hexdigest()[:16])
    return _cached_tar(_library_entries(), here, directory, "lib-", keep=2, hold=hold)


@contextlib.contextmanager
def library_archive() -> Iterator[Package]:
    """The node library's cached tar, which no concurrent launcher evicts inside the ``with`` (the sha256 stays
    valid after)."""
    with contextlib.ExitStack() as hold:
        yield library_package(hold)


def pack_library(out_dir: str) -> Package:
    return _tar(_library_entries(), out_dir, "lib-")


def _library_entries() -> List[Tuple[Path, str]]:
    pkg = Path(paddle_cluster.__file__).parent
    entries: List[Tuple[Path, str]] = []
    for part in NODE_SIDE:
        p = pkg / part
        if p.is_file():
            entries.append((p, f"paddle_cluster/{part}"))
        else:
            entries.extend((full, f"paddle_cluster/{part}/{arc}") for full, arc in _walk(p, set()))
    return entries


# Runs on the node with nothing but Python: is the archive there, and if asked, verify and keep it. (The node
# library is installed by the node session, launch/session.py.)
_REMOTE = r"""
import hashlib, json, os, sys
op, root, sha = sys.argv[1], sys.argv[2], sys.argv[3]
cache = os.path.join(root, ".paddle_cluster")
os.makedirs(os.path.join(cache, "packages"), mode=0o700, exist_ok=True)
final = os.path.join(cache, "packages", sha + ".tar")
if op == "has":
    print(json.dumps({"has": os.path.exists(final), "part": final + ".part"}))
    sys.exit(0)
part = sys.argv[4]
h = hashlib.sha256()
with open(part, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
        h.update(chunk)
if h.hexdigest() != sha:
    os.unlink(part)
    print(json.dumps({"ok": False, "error": "checksum mismatch after upload"}))
    sys.exit(1)
os.replace(part, final)
print(json.dumps({"ok": True}))
"""


def ensure_package(node: Node, pkg: Package, kind: str,
                   progress: Optional[Callable[[int, int], None]] = None) -> Tuple[str, bool]:
    """Make ``pkg`` present on ``node``; returns (its path there, whether it had to be sent)."""
    root = node.cfg.root_dir
    remote = [node.cfg.python, "-c", _REMOTE]
    state = node.run_json([*remote, "has", root, pkg.sha256], f"looking for the {kind} archive under {root}", 300)
    final = f"{root}/.paddle_cluster/packages/{pkg.sha256}.tar"
    if state["has"]:
        return final, False  # no progress reported: nothing was sent
    part = f"{state['part']}-{secrets.token_hex(4)}"
    node.put(pkg.path, part, progress)
    res = node.run_json([*remote, kind, root, pkg.sha256, part], f"installing the {kind} archive", 300)
    if not res.get("ok"):
        raise HostError(node.label, f"{kind} archive: {res.get('error')}")
    return final, True


def deliver_workspace(nodes: Sequence[Node], lib: Package, spec: JobSpec, say: Callable[[str], None]) -> None:
    """Dispatch the workspace (``--job_dispatch_package``) or check it exists (``--job_workspace``), one step
    per command: for a backend without node sessions (Slurm's shared directory; SSH uses ``session``)."""
    if spec.workspace:
        def has(n: Node) -> None:
            if n.run(["test", "-d", spec.workspace], timeout=60).exit_code != 0:
                raise HostConfigError(n.label, f"--job_workspace {spec.workspace}: no such directory there; copy "
                                      "the workspace to every node first, or use --job_dispatch_package")
        each_node(nodes, has).ok(f"checking --job_workspace {spec.workspace}")
        return
    assert spec.dispatch_dir is not None
    with contextlib.ExitStack() as hold:  # the cached archive, which no concurrent launch evicts meanwhile
        pkg = pack_workspace(spec.dispatch_dir, workspace_cache_dir(), hold=hold)
        say(f"workspace {spec.dispatch_dir}: {pkg.files} files, {pkg.size / 1e6:.1f} MB, sha256 {pkg.sha256[:12]}")
        sent: Dict[int, bool] = {}
        with upload_progress() as bar:
            def send(n: Node) -> None:
                archive, sent[n.index] = ensure_package(n, pkg, "workspace", bar(n.name, pkg.size))
                # The archive is ours: exactly pkg.files members, contents no bigger than the archive (the default).
                doc = agent_json(n, lib, "unpack", "--archive", archive, "--dest", spec.job_dir,
                                 "--max-members", str(max(pkg.files, 1)),
                                 what=f"unpacking the workspace into {spec.job_dir}", timeout=600)
                if not doc.get("ok"):
                    raise HostError(n.label, f"unpacking the workspace into {spec.job_dir} refused: {doc.get('error')}")

            each_node(nodes, send).ok("dispatching the workspace")
    skipped = [nodes[i].name for i, s in sorted(sent.items()) if not s]
    if skipped:
        say(f"{', '.join(skipped)} already held this package: not sent again")
