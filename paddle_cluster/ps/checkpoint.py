"""Per-shard atomic checkpoints: the on-disk layout, writing a shard, and which steps are complete.

Layout: ``<root>/step-%08d/pserver-%d/{shard.npz,manifest.json}``. Each pserver writes only its own
shard: the arrays go to a temporary file that is fsynced and renamed; the manifest (step, block ranges,
shapes, dtypes, sha256 of the shard file) is written the same way and LAST, so a shard without a
manifest is by definition incomplete. ``State.snapshot`` makes the ``ShardState`` saved here; loading one
back is ``resume``'s; ``complete_steps`` and ``survey`` tell the launcher what a root holds.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import stat
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from . import atomic
from .errors import CheckpointError, CheckpointUnreadable

FORMAT = 1
MANIFEST = "manifest.json"
SHARD = "shard.npz"
MAX_MANIFEST = 16 << 20  # bytes of a manifest.json read at most (one says about 1.5 KiB per block or table)
_STEP_RE = re.compile(r"^step-(\d{8,})$")


@dataclass
class BlockState:
    key: int
    name: str
    lo: int
    hi: int
    dtype: str
    spec: Dict[str, Any]
    step: int
    param: np.ndarray
    opt_state: Dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class TableState:
    key: int
    name: str
    width: int
    dtype: str
    init_scale: float
    seed: int
    spec: Dict[str, Any]
    step: int
    ids: np.ndarray  # int64, sorted
    rows: np.ndarray  # (len(ids), width), row i belongs to ids[i]
    slots: Dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class ShardState:
    """Everything one pserver holds."""

    step: int
    pserver_id: int
    n_pservers: int
    mode: Optional[str]
    optimizer: Optional[Dict[str, Any]]
    blocks: List[BlockState] = field(default_factory=list)
    tables: List[TableState] = field(default_factory=list)
    path: str = ""


def valid_name(name: object) -> bool:
    """A checkpoint directory name a trainer may ask for: one path component, never a location."""
    return (isinstance(name, str) and 0 < len(name) <= 255 and name not in (".", "..") and "/" not in name
            and "\\" not in name and "\0" not in name)


def default_root(job_dir: str = "") -> str:
    return os.path.join(job_dir or os.getcwd(), "checkpoints")


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:08d}")


def shard_dir(step_path: str, pserver_id: int) -> str:
    return os.path.join(step_path, f"pserver-{pserver_id}")


def unreadable(path: str, e: OSError) -> CheckpointUnreadable:
    """The error for a checkpoint that exists but cannot be read (permissions, I/O error): never "no checkpoint"."""
    return CheckpointUnreadable(f"checkpoint {path} cannot be read: {e.strerror or e}; fix its permissions or "
                                "storage, or move it away to start without it (refusing to start over it)")


def _kind(mode: int) -> str:
    for test, what in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return what
    return "not a regular file"


def open_file(d: str, name: str, max_bytes: Optional[int] = None) -> BinaryIO:
    """File ``name`` of the shard directory ``d``, opened as input: a plain name (one path component, never a
    location), a regular file in ``d`` itself -- never followed through a symbolic link, never a device, FIFO or
    socket: looked at with ``lstat``, opened with ``O_NOFOLLOW | O_NONBLOCK`` and looked at again with ``fstat``
    (the same file) -- of at most ``max_bytes``. ``CheckpointError`` names the file and what it is instead;
    ``FileNotFoundError`` when it is absent; ``CheckpointUnreadable`` when it is there but cannot be read."""
    if not valid_name(name):
        raise CheckpointError(f"checkpoint {d}: the manifest names a file {name[:80]!r}, not a plain file name of "
                              "the shard's directory; refusing it")
    path = os.path.join(d, name)
    try:
        before = os.lstat(path)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise unreadable(path, e) from None
    _regular(path, before, max_bytes)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CheckpointError(f"checkpoint {path}: is a symbolic link, not a regular file; refusing it") from None
        raise unreadable(path, e) from None
    try:
        now = os.fstat(fd)
        _regular(path, now, max_bytes)
        if (now.st_dev, now.st_ino) != (before.st_dev, before.st_ino):
            raise CheckpointError(f"checkpoint {path}: replaced while it was opened; refusing it")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _regular(path: str, st: os.stat_result, max_bytes: Optional[int]) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"checkpoint {path}: is {_kind(st.st_mode)}, not a regular file; refusing it")
    if max_bytes is not None and st.st_size > max_bytes:
        raise CheckpointError(f"checkpoint {path}: {st.st_size} bytes, more than the {max_bytes} it may hold; "
                              "refusing it")


def file_digest(f: BinaryIO) -> str:
    """The sha256 of the open file ``f`` (from ``open_file``), read 1 MiB at a time up to its size when opened."""
    h = hashlib.sha256()
    left = os.fstat(f.fileno()).st_size
    while left > 0:
        chunk = f.read(min(left, 1 << 20))
        if not chunk:
            break
        h.update(chunk)
        left -= len(chunk)
    return h.hexdigest()


def files_problem(files: Any) -> Optional[str]:
    """Why a manifest's ``files`` is not what a save writes (``{"shard.npz": {"sha256": ..., "bytes": ...}}``)."""
    if not isinstance(files, dict) or set(files) != {SHARD} or not isinstance(files[SHARD], dict):
        names = sorted(map(str, files))[:3] if isinstance(files, dict) else type(files).__name__
        return f"manifest's files are {str(names)[:200]}, a save writes exactly {SHARD}"
    return None


def digest_problem(d: str, f: BinaryIO, info: Mapping[str, Any]) -> Optional[str]:
    """Why the open shard file ``f`` of ``d`` does not match its manifest entry ``info`` (None: it does)."""
    try:
        actual = file_digest(f)
    except OSError as e:
        raise unreadable(os.path.join(d, SHARD), e) from None
    if actual != info.get("sha256"):
        return (f"{SHARD} checksum mismatch (sha256 {actual[:12]}..., manifest says "
                f"{str(info.get('sha256'))[:12]}...)")
    return None


def file_problem(d: str, fname: str, info: Mapping[str, Any]) -> Optional[str]:
    """Why file ``fname`` of the shard in ``d`` does not match its manifest entry (None: it does); raises
    CheckpointUnreadable when it is there but cannot be read, CheckpointError when it is no regular file of
    ``d``."""
    try:
        with open_file(d, fname) as f:
            return digest_problem(d, f, info)
    except FileNotFoundError:
        return f"{fname} missing"


def read_manifest(d: str, max_bytes: int = MAX_MANIFEST) -> Optional[bytes]:
    """The manifest of the shard in ``d`` (a regular file of at most ``max_bytes``: ``open_file``); None when
    there is none (the save did not finish)."""
    try:
        with open_file(d, MANIFEST, max_bytes) as f:
            return f.read(max_bytes + 1)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise unreadable(os.path.join(d, MANIFEST), e) from None


def shard_problem(d: str) -> Optional[str]:
    """Why the shard in directory ``d`` is incomplete or corrupt (None: its manifest is there and every
    checksum matches); raises CheckpointUnreadable when a part of it exists but cannot be read."""
    try:
        body = read_manifest(d)
        if body is None:
            return f"{MANIFEST} missing (save did not finish)"
        files = json.loads(body.decode("utf-8"))["files"]
        why = files_problem(files)
        return why if why is not None else file_problem(d, SHARD, files[SHARD])
    except CheckpointUnreadable:
        raise
    except CheckpointError as e:
        return str(e)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        return f"corrupt manifest ({e})"


def _arr_meta(a: np.ndarray) -> Dict[str, Any]:
    return {"shape": list(a.shape), "dtype": a.dtype.str}


def save_shard(step_path: str, shard: ShardState) -> str:
    """Write ``shard`` under ``step_path/pserver-<id>/``; returns that directory."""
    d = shard_dir(step_path, shard.pserver_id)
    os.makedirs(d, exist_ok=True)
    manifest_path = os.path.join(d, MANIFEST)
    # Re-saving the same step: drop the old manifest first so a crash mid-write leaves "incomplete".
    if os.path.exists(manifest_path):
        os.unlink(manifest_path)
        atomic.fsync_dir(d)
    arrays: Dict[str, np.ndarray] = {}
    blocks_meta, tables_meta = [], []
    for b in shard.blocks:
        arrays[f"d{b.key}.param"] = b.param
        for name, a in b.opt_state.items():
            arrays[f"d{b.key}.opt.{name}"] = a
        blocks_meta.append({
            "key": b.key, "name": b.name, "lo": b.lo, "hi": b.hi, "dtype": b.dtype, "spec": b.spec,
            "step": b.step, "param": _arr_meta(b.param),
            "opt": {n: _arr_meta(a) for n, a in b.opt_state.items()},
        })
    for t in shard.tables:
        arrays[f"s{t.key}.ids"] = t.ids
        arrays[f"s{t.key}.rows"] = t.rows
        for name, a in t.slots.items():
            arrays[f"s{t.key}.slot.{name}"] = a
        tables_meta.append({
            "key": t.key, "name": t.name, "width": t.width, "dtype": t.dtype, "init_scale": t.init_scale,
            "seed": t.seed, "spec": t.spec, "step": t.step, "rows": len(t.ids),
            "slots": {n: _arr_meta(a) for n, a in t.slots.items()},
        })
    sha = atomic.save_npz_atomic(os.path.join(d, SHARD), arrays)
    manifest = {
        "format": FORMAT, "step": shard.step, "pserver_id": shard.pserver_id, "n_pservers": shard.n_pservers,
        "mode": shard.mode, "optimizer": shard.optimizer, "blocks": blocks_meta, "tables": tables_meta,
        "files": {SHARD: {"sha256": sha, "bytes": os.path.getsize(os.path.join(d, SHARD))}},
    }
    body = json.dumps(manifest, indent=1, sort_keys=True).encode("utf-8")
    atomic.write_atomic(manifest_path, lambda f: f.write(body))
    return d


def _steps(root: str) -> List[Tuple[int, str]]:
    """(step, directory) of the step directories under ``root``, ascending; none when ``root`` does not exist,
    CheckpointUnreadable when it exists but cannot be listed."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    except OSError as e:
        raise unreadable(root, e) from None
    return sorted((int(mt.group(1)), os.path.join(root, n)) for n in names if (mt := _STEP_RE.match(n)))


def list_steps(root: str) -> List[str]:
    """Step directories under ``root``, newest first."""
    return [d for _, d in reversed(_steps(root))]


def complete_steps(root: str, pserver_ids: Sequence[int]) -> List[int]:
    """The steps under ``root``, ascending, whose shards of every pserver in ``pserver_ids`` are complete
    (manifest present, every sha256 matches). What a node can offer when the launcher picks a common step."""
    return [s for s, d in _steps(root) if all(shard_problem(shard_dir(d, k)) is None for k in pserver_ids)]


def survey(root: str, pserver_ids: Sequence[int]) -> Dict[str, Any]:
    """What ``root`` holds for these pservers, for the launcher's ``--resume_from`` check before a job starts:
    ``root`` ("" when it is a directory, else what it is instead), the ``complete`` steps, ascending, and the
    newest ``incomplete`` ones: ``[step, {pserver id: why its shard is unusable}]``. CheckpointUnreadable when
    a part of it exists but cannot be read."""
    if not os.path.isdir(root):
        return {"root": "is not a directory" if os.path.exists(root) else "does not exist", "complete": [],
                "incomplete": []}
    complete: List[int] = []
    incomplete: List[Any] = []
    for s, d in _steps(root):
        problems = {}
        for k in pserver_ids:
            shard = shard_dir(d, k)
            why = shard_problem(shard) if os.path.isdir(shard) else f"no pserver-{k} shard (directory missing)"
            if why is not None:
                problems[str(k)] = why
        if problems:
            incomplete.append([s, problems])
        else:
            complete.append(s)
    return {"root": "", "complete": complete, "incomplete": incomplete[-3:]}
