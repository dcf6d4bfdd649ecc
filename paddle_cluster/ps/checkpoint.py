"""Per-shard atomic checkpoints.

Layout: ``<root>/step-%08d/pserver-%d/{shard.npz,manifest.json}``. Each pserver writes only its own
shard: the arrays go to a temporary file that is fsynced and renamed; the manifest (step, block ranges,
shapes, dtypes, sha256 of the shard file) is written the same way and LAST, so a shard without a
manifest is by definition incomplete. Loading verifies the manifest and the checksum before touching
any state, so a torn or corrupt checkpoint is refused whole, never half-loaded.

Arrays are stored with ``np.savez`` and loaded with ``allow_pickle=False``. ``snapshot`` and ``restore``
convert between a pserver's live shards and a ``ShardState``; ``complete_steps`` answers, for the launcher,
which steps a node holds complete.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from .errors import CheckpointError, CheckpointUnreadable
from .optim import OptimizerSpec
from .shards import DenseBlock, Shard, TableShard

FORMAT = 1
MANIFEST = "manifest.json"
SHARD = "shard.npz"
_STEP_RE = re.compile(r"^step-(\d{8,})$")
log = logging.getLogger("paddle_cluster.ps")


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


def snapshot(step: int, pserver_id: int, n_pservers: int, mode: Optional[str], optimizer: Optional[Dict[str, Any]],
             blocks: Iterable[DenseBlock], tables: Iterable[TableShard],
             spec_at: Callable[[Shard, int], Dict[str, Any]]) -> ShardState:
    """A copy of the live shards of one pserver, for ``step`` (the caller keeps optimizer applies out)."""
    block_states = [
        BlockState(b.key, b.name, b.meta["lo"], b.meta["hi"], b.dtype.name,
                   {"declared": b.declared, "current": spec_at(b, step)}, b.step, b.param.copy(),
                   {k: v.copy() for k, v in b.opt.state.items()})
        for b in blocks
    ]
    table_states = [
        TableState(t.key, t.name, t.width, t.dtype.name, t.init_scale, t.seed,
                   {"declared": t.declared, "current": spec_at(t, step)}, t.step, t.keys.copy(), t.table[t.pos],
                   {k: v[t.pos] for k, v in t.state.items()})
        for t in tables
    ]
    return ShardState(step, pserver_id, n_pservers, mode, optimizer, block_states, table_states)


def restore(shard: ShardState) -> Tuple[Dict[int, DenseBlock], Dict[int, TableShard]]:
    """The live shards a loaded checkpoint describes."""
    blocks: Dict[int, DenseBlock] = {}
    tables: Dict[int, TableShard] = {}
    for bs in shard.blocks:
        meta = {"name": bs.name, "lo": bs.lo, "hi": bs.hi, "shape": list(bs.param.shape), "dtype": bs.dtype}
        b = DenseBlock(bs.key, meta, OptimizerSpec.from_dict(bs.spec["current"]), bs.spec["declared"], bs.step)
        b.param[...] = bs.param
        try:
            b.opt.load_state(bs.opt_state)
        except ValueError as e:
            raise CheckpointError(f"checkpoint {shard.path}: {b.describe()}: {e}") from None
        b.initialized = True
        blocks[bs.key] = b
    for ts in shard.tables:
        meta = {"name": ts.name, "width": ts.width, "dtype": ts.dtype, "init_scale": ts.init_scale, "seed": ts.seed}
        t = TableShard(ts.key, meta, OptimizerSpec.from_dict(ts.spec["current"]), ts.spec["declared"], ts.step,
                       shard.pserver_id, shard.n_pservers)
        n = len(ts.ids)
        t.grow(n)
        t.table[:n] = ts.rows
        if set(ts.slots) != set(t.state):
            raise CheckpointError(f"checkpoint {shard.path}: {t.describe()} has optimizer slots "
                                  f"{sorted(ts.slots)}, expected {sorted(t.state)}")
        for k, v in ts.slots.items():
            t.state[k][:n] = v
        t.keys = np.asarray(ts.ids, dtype=np.int64).copy()
        t.pos = np.arange(n, dtype=np.int64)
        t.n = n
        tables[ts.key] = t
    return blocks, tables


def default_root(job_dir: str = "") -> str:
    return os.path.join(job_dir or os.getcwd(), "checkpoints")


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:08d}")


def shard_dir(step_path: str, pserver_id: int) -> str:
    return os.path.join(step_path, f"pserver-{pserver_id}")


def _fsync_dir(path: str) -> None:
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
    h = hashlib.sha256()
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        with open(tmp, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(os.path.dirname(path) or ".")
    return h.hexdigest()


def save_npz_atomic(path: str, arrays: Mapping[str, np.ndarray]) -> str:
    """``np.savez`` to ``path`` atomically; returns the file's sha256."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    return write_atomic(path, lambda f: np.savez(f, **arrays))


def load_npz(path: str) -> Dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def unreadable(path: str, e: OSError) -> CheckpointUnreadable:
    """The error for a checkpoint that exists but cannot be read (permissions, I/O error): never "no checkpoint"."""
    return CheckpointUnreadable(f"checkpoint {path} cannot be read: {e.strerror or e}; fix its permissions or "
                                "storage, or move it away to start without it (refusing to start over it)")


def _file_problem(d: str, fname: str, info: Mapping[str, Any]) -> Optional[str]:
    """Why file ``fname`` of the shard in ``d`` does not match its manifest entry (None: it does); raises
    CheckpointUnreadable when it is there but cannot be read."""
    path = os.path.join(d, fname)
    try:
        actual = _sha256(path)
    except FileNotFoundError:
        return f"{fname} missing"
    except OSError as e:
        raise unreadable(path, e) from None
    if actual != info.get("sha256"):
        return (f"{fname} checksum mismatch (sha256 {actual[:12]}..., manifest says "
                f"{str(info.get('sha256'))[:12]}...)")
    return None


def _read_manifest(d: str) -> Optional[bytes]:
    """The manifest of the shard in ``d``; None when there is none (the save did not finish)."""
    path = os.path.join(d, MANIFEST)
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise unreadable(path, e) from None


def shard_problem(d: str) -> Optional[str]:
    """Why the shard in directory ``d`` is incomplete or corrupt (None: its manifest is there and every
    checksum matches); raises CheckpointUnreadable when a part of it exists but cannot be read."""
    body = _read_manifest(d)
    if body is None:
        return f"{MANIFEST} missing (save did not finish)"
    try:
        files = json.loads(body.decode("utf-8"))["files"]
        for fname, info in files.items():
            why = _file_problem(d, fname, info)
            if why is not None:
                return why
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        return f"corrupt manifest ({e})"
    return None


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
        _fsync_dir(d)
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
    sha = save_npz_atomic(os.path.join(d, SHARD), arrays)
    manifest = {
        "format": FORMAT, "step": shard.step, "pserver_id": shard.pserver_id, "n_pservers": shard.n_pservers,
        "mode": shard.mode, "optimizer": shard.optimizer, "blocks": blocks_meta, "tables": tables_meta,
        "files": {SHARD: {"sha256": sha, "bytes": os.path.getsize(os.path.join(d, SHARD))}},
    }
    body = json.dumps(manifest, indent=1, sort_keys=True).encode("utf-8")
    write_atomic(manifest_path, lambda f: f.write(body))
    return d


def load_shard(step_path: str, pserver_id: int, n_pservers: int) -> ShardState:
    """Load and verify this pserver's shard of the checkpoint in ``step_path``."""
    d = shard_dir(step_path, pserver_id)
    try:
        os.stat(d)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {step_path}: no shard directory for pserver {pserver_id} ({d})") from None
    except OSError as e:
        raise unreadable(d, e) from None
    body = _read_manifest(d)
    if body is None:
        raise CheckpointError(f"checkpoint {d}: manifest.json missing (the save did not finish); refusing it")
    try:
        m = json.loads(body.decode("utf-8"))
        files = m["files"]
        step = int(m["step"])
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint {d}: corrupt manifest ({e}); refusing it") from None
    if m.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {d}: format {m.get('format')!r}, this runtime reads {FORMAT}")
    if m.get("pserver_id") != pserver_id or m.get("n_pservers") != n_pservers:
        raise CheckpointError(
            f"checkpoint {d}: written by pserver {m.get('pserver_id')} of {m.get('n_pservers')}, "
            f"but this is pserver {pserver_id} of {n_pservers}")
    for fname, info in files.items():
        why = _file_problem(d, fname, info)
        if why is not None:
            corrupt = "" if why.endswith("missing") else ": corrupt"
            raise CheckpointError(f"checkpoint {d}: {why}{corrupt}; refusing it")
    try:
        arrays = load_npz(os.path.join(d, SHARD))
    except FileNotFoundError as e:
        raise CheckpointError(f"checkpoint {d}: cannot read {SHARD}: {e}") from None
    except OSError as e:
        raise unreadable(os.path.join(d, SHARD), e) from None
    except ValueError as e:
        raise CheckpointError(f"checkpoint {d}: cannot read {SHARD}: {e}") from None

    def get(name: str, meta: Mapping[str, Any]) -> np.ndarray:
        a = arrays.get(name)
        if a is None:
            raise CheckpointError(f"checkpoint {d}: array {name} missing")
        if list(a.shape) != list(meta["shape"]) or a.dtype.str != meta["dtype"]:
            raise CheckpointError(f"checkpoint {d}: array {name} is {a.dtype}{a.shape}, manifest says "
                                  f"{meta['dtype']}{tuple(meta['shape'])}")
        return a

    try:
        blocks = [
            BlockState(int(b["key"]), b["name"], int(b["lo"]), int(b["hi"]), b["dtype"], b["spec"], int(b["step"]),
                       get(f"d{b['key']}.param", b["param"]),
                       {n: get(f"d{b['key']}.opt.{n}", am) for n, am in b["opt"].items()})
            for b in m["blocks"]
        ]
        tables = []
        for t in m["tables"]:
            ids = arrays.get(f"s{t['key']}.ids")
            rows = arrays.get(f"s{t['key']}.rows")
            if ids is None or rows is None or len(ids) != t["rows"] or rows.shape != (t["rows"], t["width"]):
                raise CheckpointError(f"checkpoint {d}: table {t['name']!r} rows do not match the manifest")
            tables.append(TableState(int(t["key"]), t["name"], int(t["width"]), t["dtype"], float(t["init_scale"]),
                                     int(t["seed"]), t["spec"], int(t["step"]), ids, rows,
                                     {n: get(f"s{t['key']}.slot.{n}", am) for n, am in t["slots"].items()}))
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint {d}: manifest does not describe the shard ({e!r})") from None
    return ShardState(step, pserver_id, n_pservers, m.get("mode"), m.get("optimizer"), blocks, tables, path=d)


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


def _siblings_complete(step_path: str, pserver_id: int) -> Optional[str]:
    """Why the other pservers' shards visible in ``step_path`` are unusable (None: all fine).

    With a shared file system every pserver sees every shard, and all of them must agree on which step
    is the latest complete one, so each verifies its siblings too (manifest present, checksums match).
    With per-host directories a pserver sees only its own; the trainers then check at connect time that
    every pserver resumed from the same step.
    """
    try:
        names = os.listdir(step_path)
    except OSError as e:
        raise unreadable(step_path, e) from None
    for n in sorted(names):
        if not n.startswith("pserver-") or n == f"pserver-{pserver_id}":
            continue
        why = shard_problem(os.path.join(step_path, n))
        if why is not None:
            return f"{n}: {why}"
    return None


def load_latest(root: str, pserver_id: int, n_pservers: int) -> Optional[ShardState]:
    """The newest complete, verified checkpoint under ``root``; None if there is none at all.

    Incomplete or corrupt ones are skipped with a log line; if checkpoints exist but none is usable,
    that is an error rather than a silent fresh start.
    """
    steps = list_steps(root)
    reasons = []
    for sp in steps:
        try:
            shard = load_shard(sp, pserver_id, n_pservers)
            why = _siblings_complete(sp, pserver_id)
            if why is None:
                return shard
        except CheckpointUnreadable:
            raise  # an older step is no substitute for one that is there but cannot be read
        except CheckpointError as e:
            why = str(e)
        log.warning("pserver %d: skipping checkpoint %s: %s", pserver_id, sp, why)
        reasons.append(f"{os.path.basename(sp)}: {why}")
    if steps:
        raise CheckpointError(f"no usable checkpoint under {root}: " + "; ".join(reasons))
    return None


def resolve_resume(resume: str, root: str, pserver_id: int, n_pservers: int) -> Optional[ShardState]:
    """``resume`` is "" (fresh start), "latest", a step number, or a step directory path."""
    resume = resume.strip()
    if not resume:
        return None
    if resume == "latest":
        return load_latest(root, pserver_id, n_pservers)
    path = step_dir(root, int(resume)) if resume.isdigit() else resume
    try:
        os.stat(path)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} does not exist") from None
    except OSError as e:
        raise unreadable(path, e) from None
    shard = load_shard(path, pserver_id, n_pservers)
    why = _siblings_complete(path, pserver_id)
    if why is not None:
        raise CheckpointError(f"checkpoint {path} is incomplete or corrupt ({why}); refusing it")
    return shard
