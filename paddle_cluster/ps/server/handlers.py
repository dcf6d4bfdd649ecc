"""The op table ``OPS``, one function per request op that moves data (dense and sparse pushes and pulls,
CLOSE, STATUS, SAVE; the ops that set a job up are ``declare``'s), and ``route``: a frame to its op, and what
a request costs when it fails.

A handler reads its payload (``conn.stream``), does its work and replies. A request-level failure
(a barrier timeout, a mismatch) is reported to the trainer and the connection stays; malformed input drops
the connection; a bug costs one connection, never the pserver.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Dict, Mapping, Optional, Tuple, TypeVar

import numpy as np

from .. import checkpoint as ckpt
from ..errors import (
    AuthError,
    BarrierTimeout,
    CheckpointError,
    ConnectionLost,
    Forbidden,
    LimitExceeded,
    NonFinite,
    ProtocolError,
    PSError,
    RemoteError,
    UnknownKey,
)
from ..wire import lane as lane_util
from ..wire import protocol as P
from ..wire.lane import MAX_LANES, NONCE_SIZE, LaneRefused
from .declare import declare, def_dense, def_sparse, json_body, set_hyper
from .net import Conn
from .reduce import reduce_op
from .shard import Shard
from .state import State

log = logging.getLogger("paddle_cluster.ps")
STATUS_CHUNK = 64 << 10  # the STATUS reply is charged to the budget in steps of this many bytes


# -- data: what a request does to a block or a table is the shard's (``shard.Shard``), its frame checks too ---------

S = TypeVar("S", bound=Shard)
# The shards a data op names (its key is a block's or a table's), and what they are called when none has it.
SHARDS: Dict[int, Tuple[str, str]] = {
    **dict.fromkeys((P.Op.PUSH_DENSE, P.Op.PULL_DENSE), ("blocks", "dense block")),
    **dict.fromkeys((P.Op.PUSH_SPARSE, P.Op.PULL_SPARSE), ("tables", "sparse table")),
}


def _find(shards: Mapping[int, S], h: P.Header, kind: str) -> S:
    s = shards.get(h.key)
    if s is None:
        raise UnknownKey(f"no {kind} with key {h.key}")
    return s


def _shard(st: State, h: P.Header) -> Shard:
    """The block or table shard a PUSH or PULL names."""
    field, kind = SHARDS[h.op]
    return _find(getattr(st, field), h, kind)


def init_dense(st: State, conn: Conn, h: P.Header) -> None:
    b = _find(st.blocks, h, "dense block")
    b.init(conn, h)
    conn.reply_ok(key=h.key, step=b.step.n)


def push(st: State, conn: Conn, h: P.Header) -> None:
    """PUSH_DENSE and PUSH_SPARSE: the shard takes the push through its step; the reply names the step it is at."""
    s = _shard(st, h)
    if not s.push(conn, h):
        st.dropped_stale += 1  # async: computed on values older than the staleness bound allows
    conn.reply_ok(key=h.key, step=s.step.n)


def pull(st: State, conn: Conn, h: P.Header) -> None:
    """PULL_DENSE and PULL_SPARSE: the shard replies once its step is there."""
    _shard(st, h).pull(conn, h)


def rows_sparse(st: State, conn: Conn, h: P.Header) -> None:
    _find(st.tables, h, "sparse table").rows(conn, h)


# -- control ---------------------------------------------------------------------------------------------------


def close(st: State, conn: Conn, h: P.Header) -> None:
    if h.length:
        conn.stream.discard()
    # Answered once the state says so: a trainer told "closed" is no longer counted by any barrier.
    all_closed = st.sync.close_trainer(conn.trainer)
    for shard in st.shards():  # a step that was waiting only for this trainer completes now
        with shard.cv:
            try:
                shard.trainer_closed()
            except NonFinite as e:  # that update was refused (the shard says why to whoever asks next)
                log.warning("pserver %d: %s", st.pserver_id, e)
            shard.wake()
    conn.reply_ok()
    if all_closed:
        log.info("pserver %d: all %d trainers closed; exiting", st.pserver_id, st.trainers)
        st.done.set()


def status(st: State, conn: Conn, h: P.Header) -> None:
    """The pserver's state as JSON, built piece by piece: charged to the budget as it grows, and at most a
    JSON frame (``protocol.MAX_JSON_BYTES``, what a trainer reads), else refused naming its size."""
    if h.length:
        raise ProtocolError("STATUS takes no payload")
    sync = st.sync
    out, held = bytearray(), 0
    try:
        def put(piece: bytes) -> None:
            nonlocal held
            if len(out) + len(piece) > P.MAX_JSON_BYTES:
                raise LimitExceeded(f"the STATUS reply of {len(st.blocks)} blocks and {len(st.tables)} tables would "
                                    f"exceed {P.MAX_JSON_BYTES} bytes (the cap of a JSON frame)")
            while len(out) + len(piece) > held:  # bytearray over-allocates by at most 1/8
                st.budget.charge(STATUS_CHUNK, "the STATUS reply")
                held += STATUS_CHUNK
            out.extend(piece)

        with sync.lock:
            head = {
                "pserver_id": st.pserver_id, "mode": sync.mode, "base_step": st.base_step,
                "staleness": sync.staleness, "dropped_stale": st.dropped_stale,
                "hyper_pending": len(sync.hyper.changes), "active": sorted(sync.active),
                "closed": sorted(sync.closed), "resumed_from": st.resumed_from,
            }
            put(P.encode_json(head)[:-1])
            for field, shards in (("blocks", st.blocks), ("tables", st.tables)):
                put(b',"%s":{' % field.encode())
                for i, (k, s) in enumerate(shards.items()):
                    entry = {"name": s.name, "step": s.step.n, "lr": s.spec.lr}
                    if field == "tables":
                        entry = {"name": s.name, "step": s.step.n, "rows": s.n, "lr": s.spec.lr}
                    put(b"%s\"%d\":%s" % (b"," if i else b"", k, P.encode_json(entry)))
                put(b"}")
            put(b"}")
        conn.stream.send(P.pack_header(P.Op.OK, P.DTYPE_JSON, length=len(out)), out)
    finally:
        st.budget.release(held)


def save(st: State, conn: Conn, h: P.Header) -> None:
    with json_body(st, conn, h, "SAVE") as b:
        step, name = int(b.get("step", h.step)), b.get("path")
    if name is None:
        path = ckpt.step_dir(st.checkpoint_root, step)
    elif not ckpt.valid_name(name):
        raise Forbidden(f"SAVE {name!r}: a checkpoint is named, not placed: a plain name (no '/', not '.' or "
                        f"'..', at most 255 characters) under the job's checkpoint directory {st.checkpoint_root}")
    else:
        path = os.path.join(st.checkpoint_root, name)
    if st.sync.mode == "sync":
        for shard in st.shards():
            with shard.cv:
                shard.step.wait(step, "checkpoint")
    broken = [s.error for s in st.shards() if s.error]
    if broken:  # its values are not to be trusted (async mode saves without waiting for a step)
        raise CheckpointError(f"cannot write checkpoint {path}: {broken[0]}")
    try:
        d = ckpt.save_shard(path, st.snapshot(step))
    except OSError as e:
        raise CheckpointError(f"cannot write checkpoint {path}: {e}") from None
    log.info("pserver %d: saved checkpoint of step %d to %s", st.pserver_id, step, d)
    conn.reply_ok({"path": d, "step": step})


def lane(st: State, conn: Conn, h: P.Header) -> None:
    """Bind the same-host lane this trainer offered under the frame's nonce to this connection, with the place of
    each of its blocks (docs/architecture.md): one lane per registration, up to ``MAX_LANES``, of exactly the size
    its layout needs (``lane_size``), its memory charged to the budget since the desk kept it; a refusal is an
    answer, not an error: those blocks stay on TCP."""
    if not NONCE_SIZE <= h.length <= P.MAX_JSON_BYTES or (h.length - NONCE_SIZE) % 16:
        raise ProtocolError(f"LANE of {h.length} bytes: a nonce and (key, offset) pairs expected")
    body = bytearray(h.length)
    conn.stream.recv_into(body)
    nonce, layout = bytes(body[:NONCE_SIZE]), np.frombuffer(body, "<i8", offset=NONCE_SIZE).reshape(-1, 2)
    keys = layout[:, 0].tolist()
    if len(set(keys)) != len(keys) or not conn.lane_at.keys().isdisjoint(keys):  # a block has one place
        raise ProtocolError(f"trainer {conn.trainer}: LANE names a block twice or one already in a lane of this "
                            "connection")
    try:
        if st.lanes is None:
            raise LaneRefused(f"pserver {st.pserver_id} takes no lanes")
        if len(conn.lanes) >= MAX_LANES:
            raise LaneRefused(f"trainer {conn.trainer}: this connection has its {MAX_LANES} lanes already")
        places = {}
        for key, off in layout.tolist():
            b = st.blocks.get(key)
            if b is None or off < 0 or off % b.dtype.itemsize:
                raise LaneRefused(f"trainer {conn.trainer}: block {key} at offset {off}: no such block here, or "
                                  "misplaced")
            places[key] = (b, off)
        lane = st.lanes.claim(conn.trainer, nonce, lane_size(conn.trainer, places), set(places))
    except LaneRefused as e:
        if st.lanes is not None:
            st.lanes.drop(conn.trainer, nonce)  # refused whatever it holds: the desk lets it go now
        conn.reply_ok({"lane": False, "reason": str(e)})
        return
    conn.lanes.append(lane)
    half = lane.size // 2
    for key, (b, off) in places.items():
        n = b.nbytes // b.dtype.itemsize
        conn.lane_at[key] = (np.frombuffer(lane.mem, b.dtype, n, off), np.frombuffer(lane.mem, b.dtype, n, half + off))
    conn.reply_ok({"lane": True})


def lane_size(trainer: int, places: Dict[int, Tuple[Any, int]]) -> int:
    """The bytes of a lane holding these blocks at these places (a gradient area and a value area of the same
    size, each ending with its last block, aligned): no empty layout, and no room past its blocks' own bytes
    (each aligned), so what a lane maps is what its blocks need."""
    half = lane_util.aligned(max((off + b.nbytes for b, off in places.values()), default=0))
    if not half:
        raise LaneRefused(f"trainer {trainer}: an empty lane layout")
    need = sum(lane_util.aligned(b.nbytes) for b, _ in places.values())
    if half > need:
        raise LaneRefused(f"trainer {trainer}: a layout of {len(places)} blocks ({need} bytes) spread over {half} "
                          "bytes: a lane holds its blocks and nothing else")
    return 2 * half


OPS: Dict[int, Callable[[State, Conn, P.Header], None]] = {
    P.Op.DECLARE: declare,
    P.Op.DEF_DENSE: def_dense,
    P.Op.INIT_DENSE: init_dense,
    P.Op.DEF_SPARSE: def_sparse,
    P.Op.PUSH_DENSE: push,
    P.Op.PULL_DENSE: pull,
    P.Op.PUSH_SPARSE: push,
    P.Op.PULL_SPARSE: pull,
    P.Op.ROWS_SPARSE: rows_sparse,
    P.Op.SET_HYPER: set_hyper,
    P.Op.SAVE: save,
    P.Op.CLOSE: close,
    P.Op.STATUS: status,
    P.Op.LANE: lane,
    P.Op.REDUCE: reduce_op,
}


# What trainer 0 alone may do: it initialises the parameters and runs the job (learning rate, checkpoints).
CHIEF_OPS = frozenset({P.Op.INIT_DENSE, P.Op.SET_HYPER, P.Op.SAVE})


def route(st: State, conn: Conn, h: P.Header) -> bool:
    """Serve one request; False when the connection must be dropped."""
    st.sync.touch(conn.trainer)
    handler: Optional[Callable[[State, Conn, P.Header], None]] = OPS.get(h.op)
    try:
        if handler is None:
            raise ProtocolError(f"unknown or unexpected {h.op_name()}")
        if h.op in CHIEF_OPS and conn.trainer != 0:
            raise Forbidden(f"trainer {conn.trainer} may not {h.op_name()}: only trainer 0 initialises parameters, "
                            "sets hyper-parameters and saves checkpoints")
        handler(st, conn, h)
        return True
    except (ProtocolError, UnknownKey, AuthError) as e:
        conn.drop(f"{h.op_name()} key={h.key}: {e}", e)
        return False
    except ConnectionLost as e:
        log.info("pserver %d: trainer %d (%s) went away during %s: %s", st.pserver_id, conn.trainer,
                 conn.peer, h.op_name(), e)
        return False
    except PSError as e:
        # A request-level failure (barrier timeout, mismatch): report it and keep the connection.
        if isinstance(e, BarrierTimeout) and not e.again:
            log.warning("%s", e)
        if conn.stream.left:  # the payload not read yet
            conn.stream.discard()
        conn.reply_error(e)
        return True
    except OSError:
        raise
    except Exception as e:  # a bug must cost one connection, not the pserver
        log.exception("pserver %d: internal error serving %s from trainer %d", st.pserver_id, h.op_name(),
                      conn.trainer)
        conn.drop(f"internal error: {e!r}", RemoteError(f"pserver {st.pserver_id}: {e!r}"))
        return False
