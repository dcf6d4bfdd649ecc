"""The trainer's side of the parameters it keeps on the pservers: dense parameters (placed in blocks over
the pservers' dense channels) and sparse tables (sharded by ``id % n_pservers``), and the wire work of
defining, pulling and pushing them. ``PSClient`` drives both with its step and its checks.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import numpy as np

from .channel import Channel, Frame, exchange, expect_ok, fan_out, gather, json_request, pipeline
from .errors import ConnectionLost
from .placement import Block, place_dense, shard_of, sparse_conn
from .wire import lane as L
from .wire import protocol as P

log = logging.getLogger("paddle_cluster.ps")


class DenseParams:
    """Dense parameters: their blocks, this trainer's receive buffers, and the block versions it last pulled."""

    def __init__(self, channels: List[List[Channel]], conns_per_pserver: int, max_block_bytes: int,
                 lanes: bool = False) -> None:
        self.channels = channels  # [pserver][dense port]
        self.lanes = lanes  # try a same-host lane on each channel at each registration of blocks on it
        self.lane_at: Dict[int, Tuple[np.ndarray, np.ndarray]] = {}  # block key -> its gradient, values in a lane
        self._lanes: List[L.Lane] = []  # the memfds this trainer made, one per registration that got a lane
        self._in_lane: Set[str] = set()  # parameters whose receive buffer is their place in a lane's value area
        self._lanes_on: Dict[Channel, int] = {}  # lanes each channel holds (at most ``L.MAX_LANES``)
        self._lane_refused: Set[Channel] = set()  # channels a lane was refused on: they stay on TCP
        self._lane_said = False
        # Gradient compression (a frontend's compression="fp16"): a float32 block's step gradient goes as float16
        # over TCP (half the bytes; the pserver widens it back and updates in float32). Not in a lane: no wire.
        self.fp16 = False
        self.conns_per_pserver = conns_per_pserver
        self.max_block_bytes = max_block_bytes
        self.values: Dict[str, np.ndarray] = {}
        self.blocks: Dict[str, List[Block]] = {}
        self.versions: Dict[int, int] = {}  # block key -> pserver's update count at our last pull
        self._next_key = 0
        self._loads: Optional[Tuple[int, ...]] = None

    def _by_channel(self, blocks: Sequence[Block]) -> Dict[Channel, List[Block]]:
        out: Dict[Channel, List[Block]] = {}
        for b in blocks:
            out.setdefault(self.channels[b.pserver][b.conn], []).append(b)
        return out

    def register(self, params: Mapping[str, Any], spec: Dict[str, Any], init: bool, step: int) -> List[str]:
        """Define ``params`` on the pservers (``init``: send their values to blocks nobody initialised yet);
        returns their names. Their values are the pservers' from the next ``pull`` on."""
        dup = sorted(set(params) & set(self.values))
        if dup:
            raise ValueError(f"dense parameters {dup} are already registered")
        arrays = {}
        for name, value in params.items():
            a = np.asarray(value)
            P.dtype_code(a.dtype)
            arrays[name] = np.ascontiguousarray(a)
        placement = place_dense({n: (a.shape, a.dtype) for n, a in arrays.items()}, len(self.channels),
                                self.conns_per_pserver, max_block_bytes=self.max_block_bytes,
                                first_key=self._next_key, loads=self._loads)
        self._next_key += len(placement.blocks)
        self._loads = placement.loads
        initialized: Dict[int, bool] = {}

        def define(ch: Channel, blocks: List[Block]) -> None:
            frames = [json_request(P.Op.DEF_DENSE, {**b.meta(), "optimizer": spec}, key=b.key) for b in blocks]

            def got(b: Block) -> Callable[[Channel, P.Header], None]:
                def cb(ch: Channel, h: P.Header) -> None:
                    initialized[b.key] = bool(ch.stream.recv_json(h)["initialized"])
                return cb
            pipeline(ch, frames, [got(b) for b in blocks])
            if init:
                mine = [b for b in blocks if not initialized[b.key]]
                frames = [(P.pack_header(P.Op.INIT_DENSE, P.dtype_code(b.dtype), key=b.key, step=step,
                                         length=b.nbytes), (arrays[b.name][b.lo:b.hi],)) for b in mine]
                pipeline(ch, frames, [expect_ok] * len(mine))

        gather([ch.submit(define, bl) for ch, bl in self._by_channel(placement.blocks).items()])
        by_name = placement.by_name()
        for name in arrays:
            self.blocks[name] = by_name[name]
        in_lane = self._open_lanes(arrays) if self.lanes else {}
        for name, a in arrays.items():
            self.values[name] = in_lane[name] if name in in_lane else np.empty(a.shape, dtype=a.dtype)
        self._in_lane.update(in_lane)
        return list(arrays)

    def _open_lanes(self, arrays: Mapping[str, np.ndarray]) -> Dict[str, np.ndarray]:
        """One memfd per channel the blocks of ``arrays`` are on, holding exactly that channel's blocks (a pserver
        maps no more than what it registered), offered to its pserver, but on channels that refused one before
        (the reason is the node's or the pserver's: it stays) or hold ``L.MAX_LANES`` already; where one cannot
        be had, the first reason is logged once. Returns the parameters whose blocks are all in one lane, in
        order: their receive buffers, views of its value area (others are copied out of their lanes by ``pull``).

        A view is the caller's array as the TCP receive buffer is (``PSClient.pull``: overwritten by the next
        pull): the pserver writes a block's place only while it answers this trainer's pull of that block, before
        the reply's header, and never reads it."""
        todo = {ch: bl for ch, bl in self._by_channel([b for n in arrays for b in self.blocks[n]]).items()
                if ch not in self._lane_refused}
        for ch in [ch for ch in todo if self._lanes_on.get(ch, 0) >= L.MAX_LANES]:
            self._say_tcp(ch.where, f"its connection holds {L.MAX_LANES} lanes already, one per registration")
            del todo[ch]
        made: Dict[Channel, Tuple[L.Lane, Dict[int, int]]] = {}  # channel -> its lane, block key -> place
        try:
            for ch, bl in todo.items():
                place, half = lane_layout(arrays, bl)
                if half:  # nothing to share (empty parameters): no memfd of 0 bytes
                    made[ch] = (L.create(2 * half), place)
        except L.LaneRefused as e:
            for lane, _ in made.values():
                lane.close()
            self._lane_refused.update(todo)
            self._say_tcp("this node", str(e))
            return {}
        try:
            why = gather([ch.submit(Channel.open_lane, lane, list(place.items()))
                          for ch, (lane, place) in made.items()])
        except BaseException:
            for lane, _ in made.values():
                lane.close()
            raise
        whole: Dict[str, np.ndarray] = {}
        for (ch, (lane, place)), no in zip(made.items(), why):
            lane.offered()
            if no is not None:
                self._lane_refused.add(ch)
                self._say_tcp(ch.where, no)
                lane.close()
                continue
            self._lanes.append(lane)
            self._lanes_on[ch] = self._lanes_on.get(ch, 0) + 1
            half = lane.size // 2
            for b in todo[ch]:
                n, dt = b.nbytes // np.dtype(b.dtype).itemsize, np.dtype(b.dtype)
                self.lane_at[b.key] = (np.frombuffer(lane.mem, dt, n, place[b.key]),
                                       np.frombuffer(lane.mem, dt, n, half + place[b.key]))
            for name, a in arrays.items():
                blocks = self.blocks[name]
                if all(b.key in place for b in blocks):  # laid out one after another, as in the array
                    whole[name] = np.frombuffer(lane.mem, a.dtype, a.size, half + place[blocks[0].key]).reshape(a.shape)
        return whole

    def _say_tcp(self, where: str, why: str) -> None:
        if not self._lane_said:
            # DEBUG: TCP is a correct path, not a fault; at INFO (Paddle sets the root logger so) it read as an error.
            log.debug("dense data to %s over TCP, not a same-host lane: %s", where, why)
            self._lane_said = True

    def close(self) -> None:
        """Unmap the lanes; a receive buffer the caller still holds keeps its mapping (and its values) alive."""
        self.lane_at.clear()
        self.values.clear()
        for lane in self._lanes:
            lane.close()
        self._lanes.clear()

    def pull(self, names: Sequence[str], step: int) -> Dict[str, np.ndarray]:
        unknown = [n for n in names if n not in self.values]
        if unknown:
            raise KeyError(f"dense parameters {unknown} are not registered")

        def fetch(ch: Channel, blocks: List[Block]) -> None:
            pipeline(ch, [self._pull_frame(b, step) for b in blocks], [self._into(b) for b in blocks])

        blocks = [b for n in dict.fromkeys(names) for b in self.blocks[n]]  # a block once: one reply per place
        gather(fan_out([(ch, fetch, (bl,)) for ch, bl in self._by_channel(blocks).items()]))
        return {n: self.values[n] for n in names}

    def push(self, grads: Mapping[str, Any], step: int, flags: Optional[Mapping[str, int]] = None) -> List[Future]:
        """Send a gradient of every registered parameter for ``step`` (without copying: the caller keeps
        the arrays unchanged until the push is waited for). ``flags``: a parameter's push status bits
        (``protocol.NOGRAD_FLAG``, ``AVERAGED_FLAG``), 0 when not named."""
        send = self.gradients(grads)
        flags = flags or {}

        def push_blocks(ch: Channel, blocks: List[Block]) -> None:
            pipeline(ch, [self._push_frame(ch, b, send, step, flags.get(b.name, 0)) for b in blocks],
                     [expect_ok] * len(blocks))

        return [ch.submit(push_blocks, bl) for ch, bl in self._by_channel(self._blocks_of(send)).items()]

    def push_pull(self, send: Mapping[str, np.ndarray], step: int, flags: Optional[Mapping[str, int]] = None,
                  here: bool = True, copy_split: bool = True) -> List[Future]:
        """Push ``send`` (from ``gradients``) for ``step`` and pull its parameters' values for ``step + 1``, block
        by block: on each channel a block's pull follows its push, so the pserver answers it as soon as that
        block's step is applied while later blocks' gradients are still on their way. ``flags``: as ``push``'s.
        ``here``: one channel's share runs on the calling thread (which waits anyway); else every share goes to
        its channel's thread and the caller goes on (a bucket sent while backward runs). ``copy_split`` False: a
        parameter split over lanes keeps its values there (``parts`` reads them) rather than copied into its
        receive buffer, for a caller that copies each part into its own place anyway."""
        flags = flags or {}

        def blocks_both_ways(ch: Channel, blocks: List[Block]) -> None:
            frames, replies = [], []
            for b in blocks:
                frames += [self._push_frame(ch, b, send, step, flags.get(b.name, 0)), self._pull_frame(b, step + 1)]
                replies += [expect_ok, self._into(b, copy_split)]
            exchange(ch, frames, replies, sum(b.nbytes for b in blocks))

        jobs = [(ch, blocks_both_ways, (bl,)) for ch, bl in self._by_channel(self._blocks_of(send)).items()]
        # The caller waits for them all (``PSClient.push_pull``): one channel's share runs on its thread.
        return fan_out(jobs) if here else [ch.submit(fn, *args) for ch, fn, args in jobs]

    def reduce(self, send: Mapping[str, np.ndarray], step: int, flags: Mapping[str, int]
               ) -> Tuple[List[Future], Dict[str, np.ndarray], Set[str]]:
        """Push ``send`` (from ``gradients``) for ``step`` to be averaged, not applied (``REDUCE_FLAG``), and pull
        the average, block by block, over TCP (a lane holds values, not averages): the futures, the averages'
        arrays (filled once the futures are done) and the parameters some block of which no trainer had a
        gradient for."""
        out = {n: np.empty_like(self.values[n]) for n in send}
        none: Set[str] = set()

        def into(b: Block) -> Callable[[Channel, P.Header], None]:
            def cb(ch: Channel, h: P.Header) -> None:
                if h.op != P.Op.DATA or h.key != b.key or h.length != b.nbytes:
                    raise ConnectionLost(f"bad reply to synchronize of key {b.key}: {h}")
                ch.stream.recv_into(out[b.name][b.lo:b.hi])
                if h.status & P.NOGRAD_FLAG:
                    none.add(b.name)
            return cb

        def both_ways(ch: Channel, blocks: List[Block]) -> None:
            frames, replies = [], []
            for b in blocks:
                status = P.REDUCE_FLAG | flags.get(b.name, 0)
                frames += [(P.pack_header(P.Op.PUSH_DENSE, P.dtype_code(b.dtype), status, key=b.key, step=step,
                                          length=b.nbytes), (send[b.name][b.lo:b.hi],)),
                           (P.pack_header(P.Op.PULL_DENSE, P.dtype_code(b.dtype), P.REDUCE_FLAG, key=b.key,
                                          step=step), ())]
                replies += [expect_ok, into(b)]
            exchange(ch, frames, replies, sum(b.nbytes for b in blocks))

        jobs = [(ch, both_ways, (bl,)) for ch, bl in self._by_channel(self._blocks_of(send)).items()]
        return fan_out(jobs), out, none

    def gradients(self, grads: Mapping[str, Any], whole: bool = True) -> Dict[str, np.ndarray]:
        """``grads`` checked against the registered parameters (``whole``: every one of them), as contiguous
        arrays of their dtypes."""
        missing = sorted(set(self.values) - set(grads)) if whole else []
        extra = sorted(set(grads) - set(self.values))
        if missing or extra:
            raise KeyError(f"push needs gradients for exactly the registered dense parameters: "
                           f"missing {missing}, unknown {extra}")
        send: Dict[str, np.ndarray] = {}
        for name, g in grads.items():
            want = self.values[name]
            g = np.ascontiguousarray(g, dtype=want.dtype)
            if g.shape != want.shape:
                raise ValueError(f"gradient of {name!r} has shape {g.shape}, the parameter has {want.shape}")
            send[name] = g
        return send

    def _blocks_of(self, send: Mapping[str, np.ndarray]) -> List[Block]:
        return [b for n in sorted(send) for b in self.blocks[n]]

    def _push_frame(self, ch: Channel, b: Block, send: Mapping[str, np.ndarray], step: int, flags: int = 0
                    ) -> Frame:
        """A push's frame; a block in a lane is copied there now (on the channel's thread: every earlier push on
        the channel is answered, so the pserver no longer reads the place) and its frame is a header."""
        if flags & P.NOGRAD_FLAG:  # zeros: the pserver has them, a header says so
            return (P.pack_header(P.Op.PUSH_DENSE, P.dtype_code(b.dtype), flags | P.EMPTY_FLAG, key=b.key, step=step,
                                  aux=self.versions.get(b.key, 0)), ())
        at = self.lane_at.get(b.key)
        if at is not None:
            np.copyto(at[0], send[b.name][b.lo:b.hi].reshape(-1))
            ch.stream.tally[0] += b.nbytes  # what ``top`` shows as sent: the lane's bytes too
            return (P.pack_header(P.Op.PUSH_DENSE, P.dtype_code(b.dtype), P.LANE_FLAG | flags, key=b.key, step=step,
                                  aux=self.versions.get(b.key, 0)), ())
        g = send[b.name][b.lo:b.hi]
        if self.fp16 and g.dtype == np.float32 and not flags & P.AVERAGED_FLAG:  # an averaged one goes exact
            g = g.astype(np.float16)
        return (P.pack_header(P.Op.PUSH_DENSE, P.dtype_code(g.dtype), flags, key=b.key, step=step, length=g.nbytes,
                              aux=self.versions.get(b.key, 0)), (g,))

    def _pull_frame(self, b: Block, step: int) -> Frame:
        flag = P.LANE_FLAG if b.key in self.lane_at else 0
        return P.pack_header(P.Op.PULL_DENSE, P.dtype_code(b.dtype), flag, key=b.key, step=step), ()

    def parts(self, name: str) -> List[Tuple[int, int, np.ndarray]]:
        """Where ``name``'s values of the last pull are, flat: ``(lo, hi, values)`` places, the lane's value area
        for a block in a lane (a parameter split over lanes, pulled with ``copy_split`` False), else its receive
        buffer."""
        v = self.values[name]
        whole = v.reshape(-1)
        if name in self._in_lane or v.ndim == 0 or not any(b.key in self.lane_at for b in self.blocks[name]):
            return [(0, whole.size, whole)]
        per = whole.size // v.shape[0] if v.shape[0] else 0  # elements per row: blocks are row ranges
        out = []
        for b in self.blocks[name]:
            lo, hi = b.lo * per, b.hi * per
            at = self.lane_at.get(b.key)
            out.append((lo, hi, at[1] if at is not None else whole[lo:hi]))
        return out

    def _into(self, b: Block, copy_split: bool = True) -> Callable[[Channel, P.Header], None]:
        """Reads a pull's reply into ``b``'s place in the receive buffers."""
        def cb(ch: Channel, h: P.Header) -> None:
            lane = h.status & P.LANE_FLAG and b.key in self.lane_at
            if h.op != P.Op.DATA or h.key != b.key or h.length != (0 if lane else b.nbytes):
                raise ConnectionLost(f"bad reply to pull of key {b.key}: {h}")
            if lane:  # the pserver copied the values into the lane before it sent the header
                if b.name not in self._in_lane and copy_split:  # else in the receive buffer already, or read there
                    np.copyto(self.values[b.name][b.lo:b.hi].reshape(-1), self.lane_at[b.key][1])
                ch.stream.tally[1] += b.nbytes
            else:
                ch.stream.recv_into(self.values[b.name][b.lo:b.hi])
            self.versions[b.key] = h.step
        return cb


@dataclass(frozen=True)
class Table:
    key: int
    name: str
    width: int
    dtype: np.dtype


class SparseTables:
    """Sparse tables: each row lives on pserver ``id % n``, on one of its sparse channels per table."""

    def __init__(self, channels: List[List[Channel]], control: Callable[[int], Channel]) -> None:
        self.channels = channels  # [pserver][sparse port]
        self.control = control
        self.tables: Dict[str, Table] = {}
        self.pushed: Set[str] = set()  # tables pushed for the current step
        self._next_key = 0

    def get(self, name: str) -> Table:
        try:
            return self.tables[name]
        except KeyError:
            raise KeyError(f"sparse table {name!r} is not registered") from None

    def register(self, name: str, width: int, init_scale: float, seed: int, dtype: Any,
                 spec: Dict[str, Any], vocab_size: Optional[int], max_rows: Optional[int]) -> None:
        if name in self.tables:
            raise ValueError(f"sparse table {name!r} is already registered")
        dt = np.dtype(dtype)
        P.dtype_code(dt)
        t = Table(self._next_key, name, int(width), dt)
        body = {"name": name, "width": t.width, "dtype": dt.name, "init_scale": float(init_scale), "seed": int(seed),
                "vocab_size": vocab_size, "max_rows": max_rows, "optimizer": spec}
        gather([self.control(k).submit(Channel.call_json, P.Op.DEF_SPARSE, body, t.key)
                for k in range(len(self.channels))])
        self._next_key += 1
        self.tables[name] = t

    def _channel(self, t: Table, k: int) -> Channel:
        chans = self.channels[k]
        return chans[sparse_conn(t.key, len(chans))]

    def pull(self, name: str, ids: Any, step: int) -> np.ndarray:
        t = self.get(name)
        ids = np.asarray(ids, dtype=np.int64)
        uniq, inv = np.unique(ids.reshape(-1), return_inverse=True)
        out = np.empty((len(uniq), t.width), dtype=t.dtype)
        owner = shard_of(uniq, len(self.channels))

        def fetch(ch: Channel, sel: np.ndarray) -> None:
            sub = np.ascontiguousarray(uniq[sel])
            rows = np.empty((len(sub), t.width), dtype=t.dtype)

            def cb(ch: Channel, h: P.Header) -> None:
                if h.op != P.Op.DATA or h.length != rows.nbytes:
                    raise ConnectionLost(f"bad reply to sparse pull of {name!r}: {h}")
                ch.stream.recv_into(rows)
            pipeline(ch, [(P.pack_header(P.Op.PULL_SPARSE, P.dtype_code(np.int64), key=t.key, step=step,
                                         length=sub.nbytes, aux=len(sub)), (sub,))], [cb])
            out[sel] = rows

        futures = []
        for k in range(len(self.channels)):
            sel = np.flatnonzero(owner == k)
            if len(sel):
                futures.append(self._channel(t, k).submit(fetch, sel))
        gather(futures)
        return out[inv].reshape(ids.shape + (t.width,))

    def rows(self, name: str, step: int, page_rows: int = 1 << 16) -> Tuple[np.ndarray, np.ndarray]:
        """Every row of table ``name`` that exists, for ``step``: (sorted ids, their rows), read page by page
        from every pserver at once (``ROWS_SPARSE``)."""
        t = self.get(name)

        def read(ch: Channel) -> Tuple[np.ndarray, np.ndarray]:
            ids_parts, row_parts = [], []
            first = np.array([np.iinfo(np.int64).min], dtype=np.int64)
            while True:
                ids, rows = _rows_page(ch, t, step, first, page_rows)
                ids_parts.append(ids)
                row_parts.append(rows)
                if not len(ids) or ids[-1] == np.iinfo(np.int64).max:
                    break
                first = ids[-1:] + 1
            return np.concatenate(ids_parts), np.concatenate(row_parts)

        parts = gather([self._channel(t, k).submit(read) for k in range(len(self.channels))])
        ids = np.concatenate([i for i, _ in parts])
        rows = np.concatenate([r for _, r in parts]).reshape(-1, t.width)
        order = np.argsort(ids, kind="stable")
        return ids[order], rows[order]

    def push(self, name: str, ids: Any, grads: Any, step: int, all_ps: bool) -> List[Future]:
        """Row gradients (duplicate ids summed here), at most once per table per step."""
        t = self.get(name)
        if name in self.pushed:
            raise ValueError(f"sparse table {name!r} was already pushed for step {step}")
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        grads = np.asarray(grads, dtype=t.dtype).reshape(-1, t.width)
        if len(grads) != len(ids):
            raise ValueError(f"push_sparse({name!r}): {len(ids)} ids but {len(grads)} gradient rows")
        uniq, inv = np.unique(ids, return_inverse=True)
        if len(uniq) == len(ids):
            summed = np.empty_like(grads)
            summed[inv] = grads
        else:
            summed = np.zeros((len(uniq), t.width), dtype=t.dtype)
            np.add.at(summed, inv, grads)
        self.pushed.add(name)
        return self._push_rows(t, step, uniq, summed, all_ps)

    def end_step(self, step: int, sync: bool) -> List[Future]:
        """The step is over: in sync mode, an empty push for every table not pushed (barriers count every
        trainer on every step)."""
        futures: List[Future] = []
        if sync:
            empty = np.empty(0, dtype=np.int64)
            for name, t in self.tables.items():
                if name not in self.pushed:
                    futures += self._push_rows(t, step, empty, np.empty((0, t.width), dtype=t.dtype), all_ps=True)
        self.pushed.clear()
        return futures

    def _push_rows(self, t: Table, step: int, ids: np.ndarray, grads: np.ndarray, all_ps: bool) -> List[Future]:
        owner = shard_of(ids, len(self.channels))
        futures = []
        for k in range(len(self.channels)):
            sel = np.flatnonzero(owner == k)
            if not len(sel) and not all_ps:
                continue
            sub_ids = np.ascontiguousarray(ids[sel])
            sub_g = np.ascontiguousarray(grads[sel])
            header = P.pack_header(P.Op.PUSH_SPARSE, P.dtype_code(t.dtype), key=t.key, step=step,
                                   length=sub_ids.nbytes + sub_g.nbytes, aux=len(sub_ids))
            futures.append(self._channel(t, k).submit(
                lambda ch, hd=header, a=sub_ids, g=sub_g: pipeline(ch, [(hd, (a, g))], [expect_ok])))
        return futures


def _rows_page(ch: Channel, t: Table, step: int, first: np.ndarray, page_rows: int) -> Tuple[np.ndarray, np.ndarray]:
    """One ``ROWS_SPARSE`` page of table ``t`` from ``ch``'s pserver: its rows with ids from ``first[0]`` on."""
    got: List[np.ndarray] = []

    def cb(ch: Channel, h: P.Header) -> None:
        n = h.aux
        if h.op != P.Op.DATA or h.length != n * (8 + t.width * t.dtype.itemsize):
            raise ConnectionLost(f"bad reply to a rows request of {t.name!r}: {h}")
        ids, rows = np.empty(n, dtype=np.int64), np.empty((n, t.width), dtype=t.dtype)
        ch.stream.recv_into(ids, rows)
        got.extend((ids, rows))
    pipeline(ch, [(P.pack_header(P.Op.ROWS_SPARSE, P.dtype_code(np.int64), key=t.key, step=step, length=8,
                                 aux=page_rows), (first,))], [cb])
    return got[0], got[1]


def lane_layout(arrays: Mapping[str, np.ndarray], blocks: Sequence[Block]) -> Tuple[Dict[int, int], int]:
    """The places of ``blocks`` (one channel's) in its lane's gradient area, and that area's size: each
    parameter's blocks one after another in row order, each parameter at an aligned place (``L.ALIGN``); so the
    area is no bigger than the blocks' own bytes, which is what a pserver takes (``handlers.lane_size``)."""
    place: Dict[int, int] = {}
    off = 0
    for name in arrays:
        for b in sorted((b for b in blocks if b.name == name), key=lambda b: b.lo):
            place[b.key] = off
            off += b.nbytes
        off = L.aligned(off)
    return place, off
