"""``paddle-cluster fetch``: a job's files (each node's ``output/`` by default) copied to this machine, one folder
per node (``DEST/node0/output/...``).

A backend gives the job's nodes as ``NodeFiles`` (``Backend.outputs``): over each node's connection (``node
files`` lists what is there with sizes and SHA-256, ``node send`` streams one file from an offset; ssh, mpi) or a
directory this machine reads (Slurm's shared ROOT_DIR). A file already here with the node's hash is skipped; one
half-fetched (``.NAME.fetch-part``) resumes where it stopped; every file is checked against the node's hash before
it takes its name. Whatever a node says, nothing is written outside ``DEST/nodeN``: its paths are relative with
no ``..``, and every directory here is entered without following a symbolic link.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import sys
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Callable, Dict, List, Optional, Protocol, Sequence

from paddle_cluster.node import files

from . import nodecmd
from .each_node import NodeResults, each_node
from .errors import ClusterError, HostError
from .hosts import Node
from .shown import printable as shown

DEFAULT_PATHS = ("output",)
LARGE = 16 << 20  # a file at least this big gets a progress bar
PART = ".fetch-part"
SHOWN = 20  # files left alone named per node
_SHA = re.compile("[0-9a-f]{64}")


class NodeFiles(Protocol):
    """One node's job directory, as ``fetch`` reads it."""

    index: int  # its node id
    name: str  # node0: its folder here
    label: str  # for messages

    def listing(self, paths: Sequence[str]) -> Dict[str, Any]: ...

    def send(self, rel: str, offset: int, sink: BinaryIO) -> None: ...


class AgentFiles:
    """A node of HOSTS, over its connection (the node library installed)."""

    def __init__(self, node: Node, lib: Any, job_dir: str) -> None:
        self.node, self.lib, self.job_dir = node, lib, job_dir
        self.index, self.name, self.label = node.index, node.name, node.label

    def listing(self, paths: Sequence[str]) -> Dict[str, Any]:
        return nodecmd.agent_json(self.node, self.lib, "files", "--job-dir", self.job_dir, "--", *paths,
                                  what="listing the job's files", timeout=600)

    def send(self, rel: str, offset: int, sink: BinaryIO) -> None:
        argv = nodecmd.agent_argv(self.node, self.lib, "send", "--job-dir", self.job_dir, "--path", rel,
                                  "--offset", str(offset))
        res = self.node.run_into(argv, sink, timeout=120)
        if res.exit_code:
            raise HostError(self.label, f"reading {rel} failed: {res.stderr.strip() or f'exit {res.exit_code}'}")


class DirFiles:
    """A node's job directory that this machine reads itself (Slurm: on the shared filesystem)."""

    def __init__(self, index: int, job_dir: str, name: str = "") -> None:
        self.index, self.name, self.job_dir = index, name or f"node{index}", job_dir
        self.label = f"{self.name} ({job_dir})"

    def listing(self, paths: Sequence[str]) -> Dict[str, Any]:
        return files.listing(self.job_dir, list(paths))

    def send(self, rel: str, offset: int, sink: BinaryIO) -> None:
        try:
            files.copy(self.job_dir, rel, offset, sink)
        except (OSError, files.UnsafePath) as e:
            raise ClusterError(f"{self.label}: reading {rel} failed: {getattr(e, 'strerror', None) or e}") from None


class Outputs:
    """The nodes of one job whose files ``fetch`` copies; ``each`` runs a function on every one (the nodes of
    HOSTS at once, through ``each_node``), keeping every value and every exception."""

    def __init__(self, sources: Sequence[NodeFiles], nodes: Sequence[Node] = ()) -> None:
        self.sources, self.nodes = list(sources), list(nodes)

    def each(self, fn: Callable[[NodeFiles], Any]) -> NodeResults:
        if self.nodes:
            by = {s.index: s for s in self.sources}
            return each_node(self.nodes, lambda n: fn(by[n.index]))
        values: Dict[int, Any] = {}
        errors: Dict[int, BaseException] = {}
        for s in self.sources:
            try:
                values[s.index] = fn(s)
            except Exception as e:  # noqa: BLE001 - every node's failure is reported, none dropped
                errors[s.index] = e
        return NodeResults(values, errors, {s.index: s.label for s in self.sources})

    def keep(self, names: Sequence[str]) -> None:
        """Only the nodes ``names`` (node0): the others are closed."""
        gone = [n for n in self.nodes if n.name not in names]
        each_node(gone, lambda n: n.close())
        self.nodes = [n for n in self.nodes if n.name in names]
        self.sources = [s for s in self.sources if s.name in names]

    def close(self) -> None:
        if self.nodes:
            each_node(self.nodes, lambda n: n.close())


@dataclass
class Fetched:
    """What one node gave: files copied, files already here, paths it does not have, files left alone."""

    node: str
    dest: str
    copied: List[str] = field(default_factory=list)
    copied_bytes: int = 0
    same: List[str] = field(default_factory=list)
    missing: List[str] = field(default_factory=list)
    skipped: List[str] = field(default_factory=list)  # "path: why"

    def line(self) -> str:
        got = [f"{len(self.copied)} file(s) copied ({_size(self.copied_bytes)})"] if self.copied else []
        got += [f"{len(self.same)} already here (same SHA-256)"] if self.same else []
        return f"{self.node}: " + (f"{', '.join(got)} -> {self.dest}" if got else "nothing to copy (no files there)")


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def _entry(doc: Any) -> files.UnsafePath | Dict[str, Any]:
    """A listing entry checked: a relative path inside the job directory, a size, a SHA-256."""
    if not isinstance(doc, dict) or not isinstance(doc.get("path"), str):
        return files.UnsafePath(f"a listing entry that is not a file: {str(doc)[:80]!r}")
    size, sha = doc.get("size"), doc.get("sha256")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0 or not isinstance(sha, str) \
            or not _SHA.fullmatch(sha):
        return files.UnsafePath(f"{doc['path']!r}: no valid size and SHA-256 in the listing")
    try:
        return {"path": "/".join(files.parts(doc["path"])), "size": size, "sha256": sha}
    except files.UnsafePath as e:
        return e


def listings(outputs: Outputs, job: str, paths: Sequence[str]) -> NodeResults:
    """Every node's listing of ``paths``; a ``ClusterError`` naming what exists when the job is on no node or a
    path is on none."""
    res = outputs.each(lambda s: s.listing(paths))
    docs = [d for d in res.values.values() if isinstance(d, dict)]
    if res.errors and not docs:
        res.ok(f"listing job {job}'s files")
    found = [d for d in docs if d.get("found")]
    if not found and docs:
        jobs = sorted({j for d in docs for j in d.get("jobs") or () if isinstance(j, str)})
        raise ClusterError(f"job {job} is on no node ({shown(str(docs[0].get('error')))}); jobs there: "
                           f"{', '.join(map(shown, jobs)) or 'none'}")
    for d in found:
        if not d.get("ok"):
            raise ClusterError(f"fetch: {shown(str(d.get('error')))}")
    nowhere = [p for p in paths if all("/".join(files.parts(p)) in (d.get("missing") or ()) for d in found)]
    if nowhere:
        present = sorted({n for d in found for n in d.get("present") or () if isinstance(n, str)})
        raise ClusterError(f"{', '.join(nowhere)}: on no node of job {job}; its job directory holds: "
                           f"{', '.join(map(shown, present)) or 'nothing'}")
    return res


def fetch(outputs: Outputs, job: str, dest: str, paths: Sequence[str], say: Callable[[str], None],
          bar: Callable[[str, int], Callable[[int, int], None]]) -> List[Fetched]:
    """Copy ``paths`` of every node of ``job`` into ``dest/<node>``; what each gave (said as it ends). A node
    that failed is raised after the others (``HostsFailed``), none dropped."""
    for p in paths:  # the user's own paths: relative, inside the job directory
        try:
            files.parts(p)
        except files.UnsafePath as e:
            raise ClusterError(f"fetch: {e}; give paths relative to the job directory, such as output or "
                               "log") from None
    found = listings(outputs, job, paths)

    def one(src: NodeFiles) -> Optional[Fetched]:
        doc = found.values.get(src.index)
        if not isinstance(doc, dict) or not doc.get("found"):
            return None
        return copy_node(src, doc, os.path.join(dest, src.name), bar)

    res = outputs.each(one)
    for i in sorted(res.values):
        got = res.values[i]
        if got is None and i in found.values:  # the job's directory is not on this node (the others have it)
            say(f"{res.labels[i]}: no directory of job {job} there ({shown(str(found.values[i].get('error')))})")
        if got is None:  # that, or its listing failed (raised below)
            continue
        say(got.line())
        for p in got.missing:
            say(f"{got.node}: no {shown(p)} there")
        for s in got.skipped[:SHOWN]:
            say(f"{got.node}: left alone {s}")
        if len(got.skipped) > SHOWN:
            say(f"{got.node}: and {len(got.skipped) - SHOWN} more left alone")
    failed = {**found.errors, **res.errors}
    NodeResults({}, failed, {**found.labels, **res.labels}).ok(f"fetching job {job}'s files")
    return [res.values[i] for i in sorted(res.values) if res.values[i] is not None]


def copy_node(src: NodeFiles, doc: Dict[str, Any], dest: str, bar: Callable[[str, int], Callable[[int, int], None]]
              ) -> Fetched:
    """Copy every file of ``doc`` (``src``'s listing) into ``dest``."""
    got = Fetched(src.name, dest, missing=[m for m in doc.get("missing") or () if isinstance(m, str)],
                  skipped=[f"{shown(str(s.get('path')))}: {s.get('why')}" for s in doc.get("skipped") or ()
                           if isinstance(s, dict)])
    os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)
    try:
        os.mkdir(dest)
    except FileExistsError:
        pass
    try:
        top = os.open(dest, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as e:
        raise ClusterError(f"{dest}: {e.strerror} (it must be a directory, not a symbolic link)") from None
    try:
        for entry in doc.get("files") or ():
            f = _entry(entry)
            if isinstance(f, files.UnsafePath):
                got.skipped.append(f"{shown(str(f))} (refused: not written)")
                continue
            try:
                n = _copy_file(src, f, top, dest, bar)
            except LocalRefused as e:
                got.skipped.append(f"{shown(f['path'])}: {e} (not written)")
                continue
            (got.copied if n is not None else got.same).append(f["path"])
            got.copied_bytes += n or 0
    finally:
        os.close(top)
    return got


class LocalRefused(Exception):
    """A file that cannot be put where it belongs here (a link or a file in the way)."""


class _Sink:
    """Where a file's bytes go: appended to the part file, hashed, counted; no more than the listed size."""

    def __init__(self, fd: int, h: Any, done: int, size: int, progress: Optional[Callable[[int, int], None]]) -> None:
        self.fd, self.h, self.done, self.size, self.progress = fd, h, done, size, progress

    def write(self, b: bytes) -> int:
        if self.done + len(b) > self.size:
            raise ClusterError(f"sent more than the {self.size} bytes listed")
        os.write(self.fd, b)
        self.h.update(b)
        self.done += len(b)
        if self.progress:
            self.progress(self.done, self.size)
        return len(b)

    def flush(self) -> None:
        pass


def _dir_below(top: int, comps: List[str], dest: str) -> int:
    """The directory ``comps`` under ``top``, made where missing, entered without following a link."""
    fd = os.dup(top)
    for k, c in enumerate(comps):
        try:
            os.mkdir(c, 0o755, dir_fd=fd)
        except FileExistsError:
            pass
        try:
            nxt = os.open(c, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
        except OSError:
            try:
                link = stat.S_ISLNK(os.stat(c, dir_fd=fd, follow_symlinks=False).st_mode)
            except OSError:
                link = False
            os.close(fd)
            where = os.path.join(dest, *comps[:k + 1])
            raise LocalRefused(f"{where} is {'a symbolic link' if link else 'not a directory'}") from None
        os.close(fd)
        fd = nxt
    return fd


def _hash_fd(fd: int, h: Any) -> int:
    n = 0
    for b in iter(lambda: os.read(fd, files.CHUNK), b""):
        h.update(b)
        n += len(b)
    return n


def _copy_file(src: NodeFiles, f: Dict[str, Any], top: int, dest: str,
               bar: Callable[[str, int], Callable[[int, int], None]]) -> Optional[int]:
    """Bytes copied, or None when the file here already has the node's hash."""
    comps = f["path"].split("/")
    name, size = comps[-1], f["size"]
    d = _dir_below(top, comps[:-1], dest)
    try:
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=d)
        except OSError:
            fd = -1  # not there, or a link (replaced, never followed)
        if fd >= 0:
            try:
                h = hashlib.sha256()
                if _hash_fd(fd, h) == size and h.hexdigest() == f["sha256"]:
                    return None
            except OSError:
                pass
            finally:
                os.close(fd)
        part = f".{name}{PART}"
        progress = bar(f"{src.name}/{f['path']}", size) if size >= LARGE else None
        for _ in range(2):  # a part left by an earlier fetch of a file that changed since: once more from 0
            pfd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644, dir_fd=d)
            try:
                h = hashlib.sha256()
                have = _hash_fd(pfd, h)
                if have > size:
                    os.ftruncate(pfd, 0)
                    h, have = hashlib.sha256(), 0
                sink = _Sink(pfd, h, have, size, progress)
                if have < size:
                    src.send(f["path"], have, sink)  # type: ignore[arg-type]
                if sink.done == size and h.hexdigest() == f["sha256"]:
                    break
                os.ftruncate(pfd, 0)
            finally:
                os.close(pfd)
        else:
            raise ClusterError(f"{src.label}: {f['path']} arrived as {sink.done} bytes not matching the listed "
                               f"SHA-256 (changed while it was read?); fetch again")
        try:
            os.replace(part, name, src_dir_fd=d, dst_dir_fd=d)
        except IsADirectoryError:
            raise LocalRefused(f"{os.path.join(dest, f['path'])} is a directory") from None
        return size - have if have < size else 0
    finally:
        os.close(d)


def fetch_job(outputs_of: Callable[[], Outputs], job: str, dest: Optional[str], paths: Sequence[str],
              say: Callable[[str], None]) -> List[Fetched]:
    """``paddle-cluster fetch``: ``paths`` (default ``output``) of every node of ``job`` into ``dest`` (default
    ``./<job>``), with progress bars for large files on a terminal."""
    from .progress import upload_progress

    outputs = outputs_of()
    try:
        with upload_progress("fetch") as bars:
            def bar(name: str, total: int) -> Callable[[int, int], None]:
                if not sys.stderr.isatty():  # no bar on a pipe: a line as each large file starts
                    say(f"fetching {name} ({_size(total)})")
                return bars(name, total)

            return fetch(outputs, job, dest or job, list(paths) or list(DEFAULT_PATHS), say, bar)
    except KeyboardInterrupt:
        say("interrupted: the same fetch resumes where it stopped (what arrived is kept as .NAME.fetch-part)")
        raise
    finally:
        outputs.close()


def hint(job: str, where: str) -> str:
    """The line ``run`` ends with: where the outputs are, and the command that brings them here."""
    return f"outputs: {where}; `paddle-cluster fetch --job_name {job}` copies them to ./{job}/node<N>/"
