"""The ops that set a job up on a pserver: DECLARE (mode, optimizer, staleness bound), DEF_DENSE and
DEF_SPARSE (what a block or table is, its size or id space, and which optimizer updates it), SET_HYPER (a
hyper-parameter change from a given step).

Trainer 0 is the one authority on the model: only its definitions create anything (charged to the pserver's
memory budget first); another trainer's definition waits for trainer 0's and must agree with it, else it is
that trainer's ``ConfigMismatch`` naming both sides -- never a denial for trainer 0.
"""

from __future__ import annotations

import dataclasses
import math
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, TypeVar, Union

import numpy as np

from ..errors import ConfigMismatch, LimitExceeded, NonFinite, ProtocolError
from ..optim import STRUCTURAL, OptimizerSpec
from ..wire import protocol as P
from .budget import SHARD_OVERHEAD
from .dense import DenseBlock, dense_bytes
from .net import Conn
from .state import State
from .table import TableShard

S = TypeVar("S", bound=Union[DenseBlock, TableShard])

MODES = ("sync", "async")
MAX_NAME = 1024  # characters of a block or table name
MAX_DEFINITION = 16 << 10  # bytes of a DECLARE, DEF_DENSE or DEF_SPARSE body (one is a few hundred)
MAX_DIMS = 32  # of a dense block's shape
MAX_WAITING = 64  # definitions of one trainer waiting for trainer 0's at once (one per connection is usual)
JSON_HELD = 24  # bytes of Python objects per byte of JSON at most while it is held ("[]," is 3 bytes, 64 held)
_HYPER_KEYS = frozenset(f.name for f in dataclasses.fields(OptimizerSpec)) - STRUCTURAL


def _spec_key(d: Dict[str, Any]) -> Dict[str, Any]:
    """``d`` in its normal form (defaults filled in), so two trainers' specs compare equal when they mean the same."""
    try:
        return OptimizerSpec.from_dict(d).to_dict()
    except (ValueError, TypeError) as e:
        raise ConfigMismatch(f"bad optimizer spec: {e}") from None


@contextmanager
def json_body(st: State, conn: Conn, h: P.Header, what: str, limit: int = MAX_DEFINITION) -> Iterator[Dict[str, Any]]:
    """The JSON body of a request: refused from its header past ``limit`` bytes, charged to the budget as
    ``JSON_HELD`` times its size while the request holds it (a definition waiting for trainer 0's, until then)."""
    if h.length > limit:
        raise LimitExceeded(f"trainer {conn.trainer}'s {what} of {h.length} bytes is over the {limit}-byte limit of "
                            f"one (names are at most {MAX_NAME} characters)")
    held = JSON_HELD * h.length
    st.budget.charge(held, f"trainer {conn.trainer}'s {what} ({h.length} bytes of JSON)")
    try:
        yield conn.stream.recv_json(h)
    finally:
        st.budget.release(held)


def _name(body: Dict[str, Any], what: str) -> str:
    name = body["name"]
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME:
        size = f"{len(name)} characters" if isinstance(name, str) else type(name).__name__
        raise LimitExceeded(f"{what} name of {size}: a name is a string of 1 to {MAX_NAME} characters")
    return name


def _check_declared(st: State) -> None:
    if st.sync.mode is None:
        raise ConfigMismatch("no DECLARE yet: the trainer must declare the mode first")


def _parse_spec(st: State, body: Dict[str, Any]) -> Dict[str, Any]:
    """The optimizer a definition names, else the job's declared one."""
    return _spec_key(body.get("optimizer") or st.optimizer or {})


def _define(st: State, conn: Conn, h: P.Header, shards: Dict[int, S], kind: str, meta: Dict[str, Any],
            spec: Dict[str, Any], make: Callable[[], S]) -> S:
    """The shard ``h.key`` of ``shards``: made by ``make`` at trainer 0's definition (or confirmed, restored
    from a checkpoint); another trainer's waits for that and must say the same, else ``ConfigMismatch``."""
    sync, t = st.sync, conn.trainer
    with sync.lock:
        shard = shards.get(h.key)
        if t != 0:
            waiting = st.waiting.get(t, 0)
            if waiting >= MAX_WAITING and not _confirmed(shards, h.key):
                raise LimitExceeded(f"{kind} {h.key}: trainer {t} already has {waiting} definitions waiting for "
                                    f"trainer 0's (at most {MAX_WAITING})")
            st.waiting[t] = waiting + 1
            try:
                sync.wait(sync.lock, lambda: _confirmed(shards, h.key) or 0 in sync.closed, st.base_step,
                          f"{kind} {h.key}: waiting for trainer 0 to define it", lambda: {0})
            finally:
                st.waiting[t] -= 1
            shard = shards.get(h.key)
            if shard is None or not shard.confirmed:
                raise ConfigMismatch(f"{kind} {h.key}: trainer {t} defines {meta['name']!r} but trainer 0 closed "
                                     "without defining it (do all trainers register the same parameters?)")
        elif shard is None:
            shard = make()
            shard.start_hyper(st.shards())
            shards[h.key] = shard
        mine = {k: v for k, v in shard.meta.items() if shard.confirmed or k in _RESTORED}
        if {k: v for k, v in meta.items() if k in mine} != mine:
            was = "trainer 0 defined" if shard.confirmed else "the checkpoint holds"
            raise ConfigMismatch(f"{kind} {h.key}: trainer {t} defines {meta} but {was} {shard.meta} (do all "
                                 "trainers register the same parameters?)")
        if shard.declared != spec:
            raise ConfigMismatch(f"{shard.label()}: trainer {t} uses optimizer {spec}, the job uses "
                                 f"{shard.declared}")
        if not shard.confirmed:  # restored, and trainer 0 says what it is: it may now bound it
            if isinstance(shard, TableShard):
                shard.bound(meta)
            shard.confirmed = True
        sync.lock.notify_all()
    return shard


# What a checkpoint records of a definition (a table's id space is trainer 0's to give again on resume).
_RESTORED = frozenset({"name", "lo", "hi", "shape", "dtype", "width", "init_scale", "seed"})


def _confirmed(shards: Dict[int, S], key: int) -> bool:
    shard = shards.get(key)
    return shard is not None and shard.confirmed


def declare(st: State, conn: Conn, h: P.Header) -> None:
    with json_body(st, conn, h, "DECLARE") as body:
        _declare(st, conn, body)


def _declare(st: State, conn: Conn, body: Dict[str, Any]) -> None:
    mode = body.get("mode")
    if mode not in MODES:
        raise ConfigMismatch(f"mode {mode!r}: expected one of {', '.join(MODES)}")
    opt = _spec_key(body.get("optimizer") or {})
    if body.get("trainers") != st.trainers or body.get("n_pservers") != st.n_pservers:
        raise ConfigMismatch(
            f"trainer {conn.trainer} thinks the job has {body.get('trainers')} trainers and "
            f"{body.get('n_pservers')} pservers; this pserver was started for {st.trainers} and "
            f"{st.n_pservers}")
    staleness = body.get("staleness")
    if staleness is not None and (not isinstance(staleness, int) or staleness < 0):
        raise ConfigMismatch(f"staleness {staleness!r}: expected a non-negative integer or null")
    sync = st.sync
    with sync.lock:
        if conn.trainer == 0 and sync.mode is None:
            sync.mode, st.optimizer, sync.staleness = mode, opt, staleness
            sync.lock.notify_all()
        sync.wait(sync.lock, lambda: sync.mode is not None, st.base_step, "waiting for trainer 0 to declare",
                  lambda: {0})
        if mode != sync.mode:
            raise ConfigMismatch(f"trainer {conn.trainer} asks for mode {mode!r} but the job runs in "
                                 f"{sync.mode!r} mode (declared by trainer 0)")
        if staleness != sync.staleness:
            raise ConfigMismatch(f"trainer {conn.trainer} asks for staleness bound {staleness} but trainer 0 "
                                 f"declared {sync.staleness}")
        if opt != st.optimizer:
            raise ConfigMismatch(f"trainer {conn.trainer} declares optimizer {opt} but trainer 0 declared "
                                 f"{st.optimizer}")
    conn.reply_ok({"pserver_id": st.pserver_id, "step": st.base_step, "mode": sync.mode,
                   "resumed_from": st.resumed_from, "lane": st.lanes.token if st.lanes is not None else None})


def def_dense(st: State, conn: Conn, h: P.Header) -> None:
    with json_body(st, conn, h, "dense block definition") as body:
        _def_dense(st, conn, h, body)


def _def_dense(st: State, conn: Conn, h: P.Header, body: Dict[str, Any]) -> None:
    _check_declared(st)
    try:
        meta = {"name": _name(body, "block"), "lo": int(body["lo"]), "hi": int(body["hi"]),
                "shape": [int(s) for s in body["shape"]], "dtype": np.dtype(body["dtype"]).name}
        P.dtype_code(meta["dtype"])
    except (KeyError, TypeError, ValueError) as e:
        raise ProtocolError(f"bad dense block definition: {e!r}") from None
    if any(s < 0 for s in meta["shape"]) or len(meta["shape"]) > MAX_DIMS:
        raise ProtocolError(f"bad dense block shape {meta['shape']}")
    spec = _parse_spec(st, body)

    def make() -> DenseBlock:
        nbytes = math.prod(meta["shape"]) * np.dtype(meta["dtype"]).itemsize  # Python integers: never wraps
        if nbytes > st.max_frame:
            raise LimitExceeded(f"block of {nbytes} bytes exceeds the {st.max_frame}-byte frame cap "
                                "(PADDLE_MAX_FRAME_BYTES): split it into smaller blocks (max_block_bytes)")
        opt = OptimizerSpec.from_dict(spec)
        held = dense_bytes(meta, opt, st.trainers) + h.length  # its arrays, and its definition (meta, names)
        st.budget.charge(held, f"block {meta['name']}[{meta['lo']}:{meta['hi']}] of {meta['shape']} {meta['dtype']}")
        try:
            return DenseBlock(h.key, meta, opt, spec, st.base_step, st.dense)
        except BaseException:
            st.budget.release(held)
            raise

    b = _define(st, conn, h, st.blocks, "dense block", meta, spec, make)
    conn.reply_ok({"step": b.step.n, "initialized": b.initialized}, key=h.key)


def def_sparse(st: State, conn: Conn, h: P.Header) -> None:
    with json_body(st, conn, h, "sparse table definition") as body:
        _def_sparse(st, conn, h, body)


def _def_sparse(st: State, conn: Conn, h: P.Header, body: Dict[str, Any]) -> None:
    _check_declared(st)
    try:
        meta = {"name": _name(body, "table"), "width": int(body["width"]), "dtype": np.dtype(body["dtype"]).name,
                "init_scale": float(body["init_scale"]), "seed": int(body["seed"]),
                "vocab_size": _count(body.get("vocab_size")), "max_rows": _count(body.get("max_rows"))}
        P.dtype_code(meta["dtype"])
    except (KeyError, TypeError, ValueError) as e:
        raise ProtocolError(f"bad sparse table definition: {e!r}") from None
    if meta["width"] < 1:
        raise ProtocolError(f"bad sparse table width {meta['width']}")
    scale = meta["init_scale"]
    if not (math.isfinite(scale) and abs(scale) <= np.finfo(meta["dtype"]).max):
        raise NonFinite(f"table {meta['name']!r}: init_scale={scale!r} would make rows of {meta['dtype']} that are "
                        "not finite; refused (an initial scale is a small finite number, e.g. 0.01)")
    if meta["vocab_size"] is None and meta["max_rows"] is None:
        raise ConfigMismatch(f"table {meta['name']!r}: declare its id space: vocab_size (ids in [0, vocab_size)) "
                             "or max_rows (a hashed id space: at most that many rows), e.g. "
                             f"register_sparse({meta['name']!r}, {meta['width']}, vocab_size=100000)")
    spec = _parse_spec(st, body)

    def make() -> TableShard:
        st.budget.charge(SHARD_OVERHEAD + h.length, f"table {meta['name']!r}")  # its bookkeeping and definition
        return TableShard(h.key, meta, OptimizerSpec.from_dict(spec), spec, st.base_step, st.sync, st.pserver_id,
                          st.n_pservers, st.budget, not st.allow_nonfinite)

    t = _define(st, conn, h, st.tables, "sparse table", meta, spec, make)
    conn.reply_ok({"step": t.step.n, "rows": t.n}, key=h.key)


def _count(v: Any) -> Any:
    """A declared size: None, or a positive integer (an int64 id space at most)."""
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 1 << 63:
        raise ValueError(f"a table size must be a positive integer, not {v!r}")
    return v


def set_hyper(st: State, conn: Conn, h: P.Header) -> None:
    with json_body(st, conn, h, "SET_HYPER", P.MAX_JSON_BYTES) as b:
        _set_hyper(st, conn, b)


def _set_hyper(st: State, conn: Conn, body: Dict[str, Any]) -> None:
    values = body.get("values")
    if not isinstance(values, dict) or not values:
        raise ConfigMismatch("SET_HYPER needs a non-empty 'values' object")
    bad = sorted(set(values) - _HYPER_KEYS)
    if bad:
        raise ConfigMismatch(f"cannot set {bad}: settable are {sorted(_HYPER_KEYS)}")
    try:
        base = dict(st.optimizer or OptimizerSpec().to_dict())
        OptimizerSpec.from_dict({**base, **values})
        values = {k: float(v) for k, v in values.items()}
        from_step = int(body.get("from_step", 0))
        names = body.get("names")
        if names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
            raise ValueError("'names' must be a list of parameter/table names")
        if names is not None and any(not 1 <= len(n) <= MAX_NAME for n in names):
            raise ValueError(f"a parameter or table name has 1 to {MAX_NAME} characters")
    except (ValueError, TypeError) as e:
        raise ConfigMismatch(f"bad hyper-parameters {values}: {e}") from None
    with st.sync.lock:
        st.sync.hyper.add(from_step, values, None if names is None else frozenset(names),
                          [s.hyper_seen for s in st.shards()], st.budget)
    conn.reply_ok()
