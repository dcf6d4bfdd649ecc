"""The ops that set a job up on a pserver: DECLARE (mode, optimizer, staleness bound), DEF_DENSE and
DEF_SPARSE (what a block or table is and which optimizer updates it), SET_HYPER (a hyper-parameter change
from a given step). Every trainer must agree with trainer 0's declaration; a disagreement is a
``ConfigMismatch`` naming both sides.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Dict, TypeVar, Union

import numpy as np

from . import protocol as P
from .errors import ConfigMismatch, ProtocolError
from .net import Conn
from .optim import OptimizerSpec
from .shards import DenseBlock, TableShard

if TYPE_CHECKING:
    from .server import PServer

S = TypeVar("S", bound=Union[DenseBlock, TableShard])

MODES = ("sync", "async")
_HYPER_KEYS = frozenset(f.name for f in dataclasses.fields(OptimizerSpec)) - {"name"}


def _spec_key(d: Dict[str, Any]) -> Dict[str, Any]:
    """``d`` in its normal form (defaults filled in), so two trainers' specs compare equal when they mean the same."""
    try:
        return OptimizerSpec.from_dict(d).to_dict()
    except (ValueError, TypeError) as e:
        raise ConfigMismatch(f"bad optimizer spec: {e}") from None


def _check_declared(ps: PServer) -> None:
    if ps.sync.mode is None:
        raise ConfigMismatch("no DECLARE yet: the trainer must declare the mode first")


def _parse_spec(ps: PServer, body: Dict[str, Any]) -> Dict[str, Any]:
    """The optimizer a definition names, else the job's declared one."""
    return _spec_key(body.get("optimizer") or ps.optimizer or {})


def _define(ps: PServer, conn: Conn, h: P.Header, shards: Dict[int, S], kind: str, meta: Dict[str, Any],
            spec: Dict[str, Any], make: Callable[[], S]) -> S:
    """The shard ``h.key`` of ``shards``: made by ``make`` at its first definition; a later definition must
    say the same (what it is, which optimizer), else ``ConfigMismatch`` naming both."""
    with ps.sync.lock:
        shard = shards.get(h.key)
        if shard is None:
            shard = make()
            ps.sync.hyper.start(shard, [*ps.blocks.values(), *ps.tables.values()])
            shards[h.key] = shard
        elif shard.meta != meta:
            raise ConfigMismatch(f"{kind} {h.key}: trainer {conn.trainer} defines {meta} but it is {shard.meta} "
                                 "(do all trainers register the same parameters?)")
        elif shard.declared != spec:
            raise ConfigMismatch(f"{shard.describe()}: trainer {conn.trainer} uses optimizer {spec}, the job uses "
                                 f"{shard.declared}")
    return shard


def declare(ps: PServer, conn: Conn, h: P.Header) -> None:
    body = conn.read_json(h)
    mode = body.get("mode")
    if mode not in MODES:
        raise ConfigMismatch(f"mode {mode!r}: expected one of {', '.join(MODES)}")
    opt = _spec_key(body.get("optimizer") or {})
    if body.get("trainers") != ps.env.trainers or body.get("n_pservers") != ps.n_pservers:
        raise ConfigMismatch(
            f"trainer {conn.trainer} thinks the job has {body.get('trainers')} trainers and "
            f"{body.get('n_pservers')} pservers; this pserver was started for {ps.env.trainers} and "
            f"{ps.n_pservers}")
    staleness = body.get("staleness")
    if staleness is not None and (not isinstance(staleness, int) or staleness < 0):
        raise ConfigMismatch(f"staleness {staleness!r}: expected a non-negative integer or null")
    sync = ps.sync
    with sync.lock:
        if conn.trainer == 0 and sync.mode is None:
            sync.mode, ps.optimizer, ps.staleness = mode, opt, staleness
            sync.lock.notify_all()
        sync.wait(sync.lock, lambda: sync.mode is not None, ps.base_step, "waiting for trainer 0 to declare",
                  lambda: {0})
        if mode != sync.mode:
            raise ConfigMismatch(f"trainer {conn.trainer} asks for mode {mode!r} but the job runs in "
                                 f"{sync.mode!r} mode (declared by trainer 0)")
        if staleness != ps.staleness:
            raise ConfigMismatch(f"trainer {conn.trainer} asks for staleness bound {staleness} but trainer 0 "
                                 f"declared {ps.staleness}")
        if opt != ps.optimizer:
            raise ConfigMismatch(f"trainer {conn.trainer} declares optimizer {opt} but trainer 0 declared "
                                 f"{ps.optimizer}")
    conn.reply_ok({"pserver_id": ps.pserver_id, "step": ps.base_step, "mode": sync.mode,
                   "resumed_from": ps.resumed_from})


def def_dense(ps: PServer, conn: Conn, h: P.Header) -> None:
    body = conn.read_json(h)
    _check_declared(ps)
    try:
        meta = {"name": str(body["name"]), "lo": int(body["lo"]), "hi": int(body["hi"]),
                "shape": [int(s) for s in body["shape"]], "dtype": np.dtype(body["dtype"]).name}
        P.dtype_code(meta["dtype"])
    except (KeyError, TypeError, ValueError) as e:
        raise ProtocolError(f"bad dense block definition: {e!r}") from None
    if any(s < 0 for s in meta["shape"]):
        raise ProtocolError(f"bad dense block shape {meta['shape']}")
    spec = _parse_spec(ps, body)

    def make() -> DenseBlock:
        nbytes = int(np.prod(meta["shape"], dtype=np.int64)) * np.dtype(meta["dtype"]).itemsize
        if nbytes > ps.max_frame:
            raise ProtocolError(f"block of {nbytes} bytes exceeds the {ps.max_frame}-byte frame cap")
        return DenseBlock(h.key, meta, OptimizerSpec.from_dict(spec), spec, ps.base_step)

    b = _define(ps, conn, h, ps.blocks, "dense block", meta, spec, make)
    conn.reply_ok({"step": b.step, "initialized": b.initialized}, key=h.key)


def def_sparse(ps: PServer, conn: Conn, h: P.Header) -> None:
    body = conn.read_json(h)
    _check_declared(ps)
    try:
        meta = {"name": str(body["name"]), "width": int(body["width"]), "dtype": np.dtype(body["dtype"]).name,
                "init_scale": float(body["init_scale"]), "seed": int(body["seed"])}
        P.dtype_code(meta["dtype"])
    except (KeyError, TypeError, ValueError) as e:
        raise ProtocolError(f"bad sparse table definition: {e!r}") from None
    if meta["width"] < 1:
        raise ProtocolError(f"bad sparse table width {meta['width']}")
    spec = _parse_spec(ps, body)

    def make() -> TableShard:
        try:
            return TableShard(h.key, meta, OptimizerSpec.from_dict(spec), spec, ps.base_step, ps.pserver_id,
                              ps.n_pservers)
        except ValueError as e:
            raise ConfigMismatch(str(e)) from None

    t = _define(ps, conn, h, ps.tables, "sparse table", meta, spec, make)
    conn.reply_ok({"step": t.step, "rows": t.n}, key=h.key)


def set_hyper(ps: PServer, conn: Conn, h: P.Header) -> None:
    body = conn.read_json(h)
    values = body.get("values")
    if not isinstance(values, dict) or not values:
        raise ConfigMismatch("SET_HYPER needs a non-empty 'values' object")
    bad = sorted(set(values) - _HYPER_KEYS)
    if bad:
        raise ConfigMismatch(f"cannot set {bad}: settable are {sorted(_HYPER_KEYS)}")
    try:
        base = dict(ps.optimizer or OptimizerSpec().to_dict())
        OptimizerSpec.from_dict({**base, **values})
        values = {k: float(v) for k, v in values.items()}
        from_step = int(body.get("from_step", 0))
        names = body.get("names")
        if names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
            raise ValueError("'names' must be a list of parameter/table names")
    except (ValueError, TypeError) as e:
        raise ConfigMismatch(f"bad hyper-parameters {values}: {e}") from None
    with ps.sync.lock:
        ps.sync.hyper.add(from_step, values, None if names is None else frozenset(names),
                          [*ps.blocks.values(), *ps.tables.values()])
    conn.reply_ok()
