"""Getting code onto the nodes: the node-side library, and a job's workspace.

Both travel as tar archives named by their SHA-256 under ``ROOT_DIR/.paddle_cluster/``; a node that
already holds an archive with that hash is not sent it again. The workspace archive is unpacked on the
node by the agent, which refuses absolute paths, ``..`` and links that leave the job directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import posixpath
import secrets
import sys
import tarfile
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import paddle_cluster
from paddle_cluster.node import MAIN

from . import cache
from .errors import ClusterError, HostConfigError, HostError
from .fanout import fanout
from .hosts import Node
from .plan import JobSpec

SKIP_ANYWHERE = {".git", "__pycache__", ".hypothesis", ".pytest_cache"}
SKIP_TOP = {"log", "output"}
# The parts of paddle_cluster a node needs; the launcher (launch/, cli.py) stays behind.
NODE_SIDE = ("__init__.py", "contract.py", "jobsecret.py", "node", "ps", "train", "compat", "torch", "paddle")


@dataclass(frozen=True)
class Package:
    path: str
    sha256: str
    size: int
    files: int


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


class _Hashing:
    """A file read through ``read`` while its SHA-256 is taken."""

    def __init__(self, f: Any) -> None:
        self.f, self.h = f, hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        b = self.f.read(n)
        self.h.update(b)
        return b


def _tar(entries: List[Tuple[Path, str]], out_dir: str, prefix: str,
         manifest: Optional[Dict[str, str]] = None, tmp: Optional[str] = None) -> Package:
    """A deterministic tar (sorted, no owner names), so an unchanged tree has an unchanged hash; ``manifest``
    gets what each entry is (``delta.py``: the content's SHA-256 and whether it is executable, or a link).
    Written to ``tmp`` when given, else to a new file in ``out_dir``."""
    if tmp is None:
        fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=".tar", dir=out_dir)
        os.close(fd)
    files = {} if manifest is None else manifest
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT, copybufsize=1 << 20) as tar:
        for full, arc in entries:
            info = tar.gettarinfo(str(full), arcname=arc)
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            if info.isfile():
                with open(full, "rb") as f:
                    hashing = _Hashing(f)
                    tar.addfile(info, hashing)
                files[arc] = hashing.h.hexdigest() + ("x" if info.mode & 0o111 else "")
            elif info.issym():
                tar.addfile(info)
                files[arc] = "link:" + info.linkname
    h = hashlib.sha256()
    with open(tmp, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return Package(tmp, h.hexdigest(), os.path.getsize(tmp), len(entries))


def pack_workspace(directory: str, cache_dir: str, keep: int = 4,
                   hold: Optional[contextlib.ExitStack] = None) -> Package:
    """The workspace as a tar in ``cache_dir``, rebuilt only when a file's path, size, times or mode changed.

    An unchanged workspace then costs one directory walk instead of re-reading (tar + SHA-256) every byte;
    the ``keep`` most recently used archives stay in the cache, and any a launch holds (``hold``: until that
    stack closes, no concurrent launch evicts the archive).
    """
    root = Path(directory)
    if not root.is_dir():
        raise ClusterError(f"--job_dispatch_package {directory}: no such directory")
    entries = list(_walk(root, SKIP_TOP))
    if not entries:
        raise ClusterError(f"--job_dispatch_package {directory}: the directory is empty")
    return _cached_tar(entries, str(root.resolve()), cache_dir, "workspace-", keep, hold)


def _cached_tar(entries: List[Tuple[Path, str]], origin: str, cache_dir: str, prefix: str, keep: int,
                hold: Optional[contextlib.ExitStack] = None) -> Package:
    """``_tar(entries)`` from ``cache_dir`` when no entry's path, size, times or mode changed since it was made;
    safe with other launches doing the same at the same moment (``cache.py``)."""
    stats = []
    for full, arc in entries:
        st = full.lstat()
        stats.append([arc, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_mode])  # ctime: even `touch -d`
    key = hashlib.sha256(json.dumps([origin, stats]).encode()).hexdigest()
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
                    meta = {"sha256": pkg.sha256, "size": pkg.size, "files": pkg.files, "manifest": manifest}
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


def agent_argv(node: Node, lib: Package, *args: str) -> List[str]:
    """The command line that runs ``python -m paddle_cluster.node ARGS`` from the installed library."""
    return [node.cfg.python, "-c", MAIN, f"{node.cfg.root_dir}/.paddle_cluster/lib/{lib.sha256}", *args]


def agent_json(node: Node, lib: Package, *args: str, what: str, timeout: float = 120,
               stdin: str = "") -> Dict[str, Any]:
    """A node sub-command's JSON answer (``stdin``: what it reads)."""
    return node.run_json(agent_argv(node, lib, *args), what, timeout, stdin)


@contextlib.contextmanager
def upload_progress() -> Iterator[Callable[[str, int], Callable[[int, int], None]]]:
    """``bar(name, total)`` gives an upload's progress callback; the bars (stderr) appear only once one is asked
    for, so a launch that sends nothing pays nothing for them, and only on a terminal (no stray line on a pipe)."""
    shown: List[Any] = []
    lock = threading.Lock()

    def bar(name: str, total: int) -> Callable[[int, int], None]:
        with lock:
            if not shown:
                from rich.console import Console
                from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

                shown.append(Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                                      TransferSpeedColumn(), disable=not sys.stderr.isatty(),
                                      console=Console(stderr=True)))
                shown[0].start()
            task = shown[0].add_task(f"upload {name}", total=total)
        return lambda done, _total: shown[0].update(task, completed=done)

    try:
        yield bar
    finally:
        if shown:
            shown[0].stop()


def deliver_workspace(nodes: Sequence[Node], lib: Package, spec: JobSpec, say: Callable[[str], None]) -> None:
    """Dispatch the workspace (``--job_dispatch_package``) or check it exists (``--job_workspace``), one step
    per command: for a backend without node sessions (Slurm's shared directory; SSH uses ``session``)."""
    if spec.workspace:
        def has(n: Node) -> None:
            if n.run(["test", "-d", spec.workspace], timeout=60).exit_code != 0:
                raise HostConfigError(n.label, f"--job_workspace {spec.workspace}: no such directory there; copy "
                                      "the workspace to every node first, or use --job_dispatch_package")
        fanout(nodes, has).ok(f"checking --job_workspace {spec.workspace}")
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

            fanout(nodes, send).ok("dispatching the workspace")
    skipped = [nodes[i].name for i, s in sorted(sent.items()) if not s]
    if skipped:
        say(f"{', '.join(skipped)} already held this package: not sent again")
