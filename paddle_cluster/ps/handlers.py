"""One function per request op, the op table ``OPS``, and ``dispatch``: what a request costs when it fails.

A handler reads its payload (``conn.stream``), does its work and replies. A request-level failure
(a barrier timeout, a mismatch) is reported to the trainer and the connection stays; malformed input drops
the connection; a bug costs one connection, never the pserver.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional

import numpy as np

from . import checkpoint as ckpt
from . import fold
from . import protocol as P
from .errors import (
    AuthError,
    BarrierTimeout,
    CheckpointError,
    ConfigMismatch,
    ConnectionLost,
    Forbidden,
    ProtocolError,
    PSError,
    RemoteError,
    UnknownKey,
)
from .net import Conn
from .optim import OptimizerSpec
from .shards import DenseBlock, TableShard

if TYPE_CHECKING:
    from .server import PServer

log = logging.getLogger("paddle_cluster.ps")
MODES = ("sync", "async")
_HYPER_KEYS = frozenset(f.name for f in dataclasses.fields(OptimizerSpec)) - {"name"}


def _spec_key(d: Dict[str, Any]) -> Dict[str, Any]:
    return OptimizerSpec.from_dict(d).to_dict()


def _check_declared(ps: PServer) -> None:
    if ps.sync.mode is None:
        raise ConfigMismatch("no DECLARE yet: the trainer must declare the mode first")


def _parse_spec(ps: PServer, body: Dict[str, Any]) -> Dict[str, Any]:
    """The optimizer a definition names, else the job's declared one."""
    try:
        return _spec_key(body.get("optimizer") or ps.optimizer or {})
    except (ValueError, TypeError) as e:
        raise ConfigMismatch(f"bad optimizer spec: {e}") from None


# -- declaring -----------------------------------------------------------------------------------------------


def declare(ps: PServer, conn: Conn, h: P.Header) -> None:
    body = conn.read_json(h)
    mode = body.get("mode")
    if mode not in MODES:
        raise ConfigMismatch(f"mode {mode!r}: expected one of {', '.join(MODES)}")
    try:
        opt = _spec_key(body.get("optimizer") or {})
    except (ValueError, TypeError) as e:
        raise ConfigMismatch(f"bad optimizer spec: {e}") from None
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
    with ps.sync.lock:
        b = ps.blocks.get(h.key)
        if b is None:
            nbytes = int(np.prod(meta["shape"], dtype=np.int64)) * np.dtype(meta["dtype"]).itemsize
            if nbytes > ps.max_frame:
                raise ProtocolError(f"block of {nbytes} bytes exceeds the {ps.max_frame}-byte frame cap")
            b = DenseBlock(h.key, meta, OptimizerSpec.from_dict(spec), spec, ps.base_step)
            ps.sync.hyper.start(b, [*ps.blocks.values(), *ps.tables.values()])
            ps.blocks[h.key] = b
        elif b.meta != meta:
            raise ConfigMismatch(f"dense block {h.key}: trainer {conn.trainer} defines {meta} but it is "
                                 f"{b.meta} (do all trainers register the same parameters?)")
        elif b.declared != spec:
            raise ConfigMismatch(f"dense block {b.describe()}: trainer {conn.trainer} uses optimizer {spec}, "
                                 f"the job uses {b.declared}")
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
    with ps.sync.lock:
        t = ps.tables.get(h.key)
        if t is None:
            try:
                t = TableShard(h.key, meta, OptimizerSpec.from_dict(spec), spec, ps.base_step, ps.pserver_id,
                               ps.n_pservers)
            except ValueError as e:
                raise ConfigMismatch(str(e)) from None
            ps.sync.hyper.start(t, [*ps.blocks.values(), *ps.tables.values()])
            ps.tables[h.key] = t
        elif t.meta != meta:
            raise ConfigMismatch(f"sparse table {h.key}: trainer {conn.trainer} defines {meta} but it is {t.meta}")
        elif t.declared != spec:
            raise ConfigMismatch(f"{t.describe()}: trainer {conn.trainer} uses optimizer {spec}, the job uses "
                                 f"{t.declared}")
    conn.reply_ok({"step": t.step, "rows": t.n}, key=h.key)


# -- dense blocks ----------------------------------------------------------------------------------------------


def _block(ps: PServer, h: P.Header, payload: bool) -> DenseBlock:
    """The block a request names; ``payload``: the request carries the block's bytes."""
    b = ps.blocks.get(h.key)
    if b is None:
        raise UnknownKey(f"no dense block with key {h.key}")
    if h.dtype != P.dtype_code(b.dtype):
        raise ProtocolError(f"{b.describe()} is {b.dtype}, frame says dtype code {h.dtype}")
    P.expect_length(h, b.nbytes if payload else 0, b.describe())
    return b


def init_dense(ps: PServer, conn: Conn, h: P.Header) -> None:
    b = _block(ps, h, payload=True)
    with b.cv:
        mine = not (b.initialized or b.initializing)
        b.initializing = b.initializing or mine
    if not mine:
        conn.discard()
    else:
        try:
            conn.stream.recv_into(b.param)
        except BaseException:
            with b.cv:
                b.initializing = False
                b.cv.notify_all()
            raise
        with b.cv:
            b.initialized, b.initializing = True, False
            b.cv.notify_all()
    conn.reply_ok(key=h.key, step=b.step)


def pull_dense(ps: PServer, conn: Conn, h: P.Header) -> None:
    b = _block(ps, h, payload=False)
    with b.cv:
        ps.sync.wait_step(b, h.step, "pull")
        step = b.step
    # Sent outside the lock: in sync mode nothing can update this block until this trainer pushes again,
    # and a stalled reader must never block the other trainers. Async pulls may see a concurrent update.
    conn.stream.send(P.pack_header(P.Op.DATA, P.dtype_code(b.dtype), key=h.key, step=step, length=b.nbytes),
                     b.param, volatile=ps.sync.mode != "sync")


def push_dense(ps: PServer, conn: Conn, h: P.Header) -> None:
    """Receive one block's gradient and fold it in.

    Memory: a gradient is received whole into this connection's buffer (or, for the first of several
    sync trainers, straight into the block's sum), so a frame cut short changes nothing. Sync mode
    with several trainers keeps one sum per block, added in trainer order (the first two in either
    order: float addition commutes), so the result never depends on arrival order. The last
    contribution of a step is folded and, for plain SGD, applied in one cache-sized pass.
    """
    b = _block(ps, h, payload=True)
    t, sync = conn.trainer, ps.sync
    in_sync = sync.mode == "sync"
    with b.cv:
        sync.wait_step(b, h.step, "push")
        if in_sync:
            dup = h.step < b.step or t in b.pending or t in b.receiving or b.applying
        else:
            dup = t in b.receiving
        segments = not dup and fold.applies(sync, b)
        if segments:
            b.receiving.add(t)
    if segments:
        try:
            fold.push(sync, sync.pool, b, t, h.step, conn.stream.chunks())
        except BaseException:
            with b.cv:
                b.receiving.discard(t)
                b.cv.notify_all()
            raise
        with b.cv:
            b.receiving.discard(t)
            if b.step == h.step:
                b.pending[t] = True
            b.cv.notify_all()
        conn.reply_ok(key=h.key, step=b.step)
        return
    with b.cv:
        direct = (in_sync and not dup and not b.pending and not b.acc_busy and sync.active != {t}
                  and t in sorted(sync.active)[:2])
        if not dup:
            b.receiving.add(t)
            b.acc_busy = b.acc_busy or direct
    if dup:
        conn.discard()  # an idempotent repeat of a push already counted
        conn.reply_ok(key=h.key, step=b.step)
        return
    dest = b.acc if direct else conn.buffer(b.shape, b.dtype)
    try:
        conn.stream.recv_into(dest)
    except BaseException:
        with b.cv:
            b.receiving.discard(t)
            b.acc_busy = b.acc_busy and not direct
            b.cv.notify_all()
        raise
    with b.cv:
        try:
            if not in_sync:
                if ps.staleness is not None and b.step - h.aux > ps.staleness:
                    # Bounded staleness: the trainer computed this on values older than allowed (aux
                    # carries the block version it pulled).
                    ps.dropped_stale += 1
                else:
                    sync.advance(b, None, lambda: b.apply_mean(dest, 1))
            elif b.step == h.step:
                if direct:
                    b.acc_busy = False
                    b.pending[t] = True
                    sync.complete_dense(b)
                else:
                    sync.wait(b.cv, lambda: b.step != h.step or sync.may_fold(b, t), h.step,
                              f"push {b.describe()}: summing in trainer order",
                              lambda: {u for u in sync.active if u < t} - set(b.pending))
                    if b.step == h.step:
                        sync.fold(b, t, dest)
        finally:
            b.receiving.discard(t)
            if direct:
                b.acc_busy = False
            b.cv.notify_all()
    conn.reply_ok(key=h.key, step=b.step)


# -- sparse tables ---------------------------------------------------------------------------------------------


def _table(ps: PServer, h: P.Header) -> TableShard:
    t = ps.tables.get(h.key)
    if t is None:
        raise UnknownKey(f"no sparse table with key {h.key}")
    return t


def pull_sparse(ps: PServer, conn: Conn, h: P.Header) -> None:
    t = _table(ps, h)
    n = h.aux
    if h.dtype != P.dtype_code(np.int64):
        raise ProtocolError(f"{t.describe()}: a pull carries int64 ids, frame says dtype code {h.dtype}")
    P.expect_length(h, 8 * n, f"{t.describe()}: pull of {n} ids")
    ids = np.empty(n, dtype=np.int64)
    conn.stream.recv_into(ids)
    t.check_ids(ids)
    with t.cv:
        ps.sync.wait_step(t, h.step, "pull")
        with ps.sync.rw.shared():
            pos = t.lookup(ids)  # may grow (reallocate) the table: look up before reading t.table
            rows = t.table[pos]
        step = t.step
    conn.stream.send(P.pack_header(P.Op.DATA, P.dtype_code(t.dtype), key=h.key, step=step, length=rows.nbytes,
                                   aux=n), rows)


def push_sparse(ps: PServer, conn: Conn, h: P.Header) -> None:
    t = _table(ps, h)
    n, tr, sync = h.aux, conn.trainer, ps.sync
    if h.dtype != P.dtype_code(t.dtype):
        raise ProtocolError(f"{t.describe()} is {t.dtype}, frame says dtype code {h.dtype}")
    P.expect_length(h, n * (8 + t.width * t.dtype.itemsize), f"{t.describe()}: push of {n} rows")
    with t.cv:
        sync.wait_step(t, h.step, "push")
        dup = sync.mode == "sync" and (h.step < t.step or tr in t.pending or tr in t.receiving)
        if not dup:
            t.receiving.add(tr)
    if dup:
        conn.discard()
    else:
        try:
            ids = np.empty(n, dtype=np.int64)
            grads = np.empty((n, t.width), dtype=t.dtype)
            conn.stream.recv_into(ids, grads)
            t.check_ids(ids)
        finally:
            with t.cv:
                t.receiving.discard(tr)
        with t.cv:
            if sync.mode == "async":
                sync.advance(t, None, lambda: t.apply_rows(ids, grads))
            elif t.step == h.step:
                t.pending[tr] = (ids, grads)
                sync.complete_table(t)
            t.cv.notify_all()
    conn.reply_ok(key=h.key, step=t.step)


# -- control ---------------------------------------------------------------------------------------------------


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


def close(ps: PServer, conn: Conn, h: P.Header) -> None:
    if h.length:
        conn.discard()
    # Answered once the state says so: a trainer told "closed" is no longer counted by any barrier.
    all_closed = ps.sync.close_trainer(conn.trainer, [*ps.blocks.values(), *ps.tables.values()])
    conn.reply_ok()
    if all_closed:
        log.info("pserver %d: all %d trainers closed; exiting", ps.pserver_id, ps.env.trainers)
        ps.done.set()


def status(ps: PServer, conn: Conn, h: P.Header) -> None:
    if h.length:
        raise ProtocolError("STATUS takes no payload")
    sync = ps.sync
    with sync.lock:
        body = {
            "pserver_id": ps.pserver_id, "mode": sync.mode, "base_step": ps.base_step,
            "staleness": ps.staleness, "dropped_stale": ps.dropped_stale, "hyper_pending": len(sync.hyper.changes),
            "active": sorted(sync.active), "closed": sorted(sync.closed), "resumed_from": ps.resumed_from,
            "blocks": {str(k): {"name": b.name, "step": b.step, "lr": b.spec.lr} for k, b in ps.blocks.items()},
            "tables": {str(k): {"name": t.name, "step": t.step, "rows": t.n, "lr": t.spec.lr}
                       for k, t in ps.tables.items()},
        }
    conn.reply_ok(body)


def save(ps: PServer, conn: Conn, h: P.Header) -> None:
    body = conn.read_json(h)
    step = int(body.get("step", h.step))
    name = body.get("path")
    if name is None:
        path = ckpt.step_dir(ps.checkpoint_root, step)
    elif not ckpt.valid_name(name):
        raise Forbidden(f"SAVE {name!r}: a checkpoint is named, not placed: a plain name (no '/', not '.' or "
                        f"'..', at most 255 characters) under the job's checkpoint directory {ps.checkpoint_root}")
    else:
        path = os.path.join(ps.checkpoint_root, name)
    if ps.sync.mode == "sync":
        for shard in [*ps.blocks.values(), *ps.tables.values()]:
            with shard.cv:
                ps.sync.wait_step(shard, step, "checkpoint")
    try:
        d = ckpt.save_shard(path, ps.snapshot(step))
    except OSError as e:
        raise CheckpointError(f"cannot write checkpoint {path}: {e}") from None
    log.info("pserver %d: saved checkpoint of step %d to %s", ps.pserver_id, step, d)
    conn.reply_ok({"path": d, "step": step})


OPS: Dict[int, Callable[[PServer, Conn, P.Header], None]] = {
    P.Op.DECLARE: declare,
    P.Op.DEF_DENSE: def_dense,
    P.Op.INIT_DENSE: init_dense,
    P.Op.DEF_SPARSE: def_sparse,
    P.Op.PUSH_DENSE: push_dense,
    P.Op.PULL_DENSE: pull_dense,
    P.Op.PUSH_SPARSE: push_sparse,
    P.Op.PULL_SPARSE: pull_sparse,
    P.Op.SET_HYPER: set_hyper,
    P.Op.SAVE: save,
    P.Op.CLOSE: close,
    P.Op.STATUS: status,
}


# What trainer 0 alone may do: it initialises the parameters and runs the job (learning rate, checkpoints).
CHIEF_OPS = frozenset({P.Op.INIT_DENSE, P.Op.SET_HYPER, P.Op.SAVE})


def dispatch(ps: PServer, conn: Conn, h: P.Header) -> bool:
    """Serve one request; False when the connection must be dropped."""
    ps.sync.touch(conn.trainer)
    handler: Optional[Callable[[PServer, Conn, P.Header], None]] = OPS.get(h.op)
    try:
        if handler is None:
            raise ProtocolError(f"unknown or unexpected {h.op_name()}")
        if h.op in CHIEF_OPS and conn.trainer != 0:
            raise Forbidden(f"trainer {conn.trainer} may not {h.op_name()}: only trainer 0 initialises parameters, "
                            "sets hyper-parameters and saves checkpoints")
        handler(ps, conn, h)
        return True
    except (ProtocolError, UnknownKey, AuthError) as e:
        conn.drop(f"{h.op_name()} key={h.key}: {e}", e)
        return False
    except ConnectionLost as e:
        log.info("pserver %d: trainer %d (%s) went away during %s: %s", ps.pserver_id, conn.trainer,
                 conn.peer, h.op_name(), e)
        return False
    except PSError as e:
        # A request-level failure (barrier timeout, mismatch): report it and keep the connection.
        if isinstance(e, BarrierTimeout):
            log.warning("%s", e)
        if not conn.consumed:
            conn.discard()
        conn.reply_error(e)
        return True
    except OSError:
        raise
    except Exception as e:  # a bug must cost one connection, not the pserver
        log.exception("pserver %d: internal error serving %s from trainer %d", ps.pserver_id, h.op_name(),
                      conn.trainer)
        conn.drop(f"internal error: {e!r}", RemoteError(f"pserver {ps.pserver_id}: {e!r}"))
        return False
