"""Loading a checkpoint: one pserver's shard read and verified, the newest usable step, and the live shards
it describes.

Loading verifies the manifest and the checksum before touching any state, so a torn or corrupt checkpoint is
refused whole, never half-loaded. A checkpoint that is there but cannot be read is an error of its own
(``CheckpointUnreadable``), never taken for "no checkpoint".
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Dict, Mapping, Optional, Tuple

import numpy as np

from . import atomic
from .budget import Budget
from .checkpoint import (
    FORMAT,
    SHARD,
    BlockState,
    ShardState,
    TableState,
    file_problem,
    list_steps,
    read_manifest,
    shard_dir,
    shard_problem,
    step_dir,
    unreadable,
)
from .dense import DenseBlock, DenseShared
from .errors import CheckpointError, CheckpointUnreadable
from .optim import OptimizerSpec
from .shards import TableShard, dense_bytes

log = logging.getLogger("paddle_cluster.ps")


def _require(path: str, missing: str) -> None:
    """``CheckpointError(missing)`` when ``path`` does not exist, ``CheckpointUnreadable`` when it cannot be
    looked at (a checkpoint that may be there is never taken for an absent one)."""
    try:
        os.stat(path)
    except FileNotFoundError:
        raise CheckpointError(missing) from None
    except OSError as e:
        raise unreadable(path, e) from None


def load_shard(step_path: str, pserver_id: int, n_pservers: int) -> ShardState:
    """Load and verify this pserver's shard of the checkpoint in ``step_path``."""
    d = shard_dir(step_path, pserver_id)
    _require(d, f"checkpoint {step_path}: no shard directory for pserver {pserver_id} ({d})")
    body = read_manifest(d)
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
        why = file_problem(d, fname, info)
        if why is not None:
            corrupt = "" if why.endswith("missing") else ": corrupt"
            raise CheckpointError(f"checkpoint {d}: {why}{corrupt}; refusing it")
    try:
        arrays = atomic.load_npz(os.path.join(d, SHARD))
    except (FileNotFoundError, ValueError) as e:
        raise CheckpointError(f"checkpoint {d}: cannot read {SHARD}: {e}") from None
    except OSError as e:
        raise unreadable(os.path.join(d, SHARD), e) from None

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
    _require(path, f"checkpoint {path} does not exist")
    shard = load_shard(path, pserver_id, n_pservers)
    why = _siblings_complete(path, pserver_id)
    if why is not None:
        raise CheckpointError(f"checkpoint {path} is incomplete or corrupt ({why}); refusing it")
    return shard


def restore(shard: ShardState, dense: DenseShared, budget: Optional[Budget] = None, trainers: int = 1
            ) -> Tuple[Dict[int, DenseBlock], Dict[int, TableShard]]:
    """The live shards a loaded checkpoint describes (its dense blocks sharing ``dense``), charged to ``budget``;
    trainer 0 confirms each when it defines it again (``Shard.confirmed``)."""
    blocks: Dict[int, DenseBlock] = {}
    tables: Dict[int, TableShard] = {}
    for bs in shard.blocks:
        meta = {"name": bs.name, "lo": bs.lo, "hi": bs.hi, "shape": list(bs.param.shape), "dtype": bs.dtype}
        spec = OptimizerSpec.from_dict(bs.spec["current"])
        if budget is not None:
            budget.charge(dense_bytes(meta, spec, trainers), f"block {bs.name}[{bs.lo}:{bs.hi}] of the checkpoint")
        b = DenseBlock(bs.key, meta, spec, bs.spec["declared"], bs.step, dense)
        b.confirmed = False
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
                       shard.pserver_id, shard.n_pservers, budget)
        t.confirmed = False
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
