"""A dense block (``DenseBlock``): its value and optimizer, and everything a request does to it -- its initial
value, receiving a gradient and folding it into this step's sum, applying the step, and answering pulls (its
``synchronize()`` average is ``average.Average``'s).

Sync mode sums the trainers' gradients of a step in trainer order (the first two in either order: float
addition commutes), so the result never depends on arrival order. SGD folds a push a segment at a time into
slots of the pserver's ``pool.AccPool``; another optimizer sums whole gradients into one buffer per block and
applies the step on the apply threads. Async mode applies each gradient as it lands.

A push arrives as verified segments of ``stream.SEGMENT`` bytes (``Stream.chunks``). A segment's first
contribution of a step is received into a pool slot (copied there when none was free), later ones are added
in trainer order, and the last is added, averaged and applied while the segment is in cache; the slot goes
back to the pool and a pull waiting for the step sends the segment. With one trainer a segment is applied
straight from the receive buffer. So a pserver holds its parameters plus the segments some trainer has sent
and another not yet, bounded by ``AccPool``: a trainer further ahead waits (TCP holds its bytes), which costs
nothing in sync mode, where every trainer waits for the slowest at the next pull anyway. Rounding is that of
``DenseBlock.apply_mean``: the same operations in the same order on every element.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import AbstractSet, Any, Callable, Dict, FrozenSet, Iterable, List, Optional, Set, Tuple, Union

import numpy as np

from .. import optim
from ..errors import ConnectionLost, NonFinite, ProtocolError, PSError, RemoteError
from ..optim import OptimizerSpec
from ..wire import protocol as P
from ..wire.lane import Payload
from ..wire.stream import SEGMENT
from . import finite
from .average import Average
from .budget import SHARD_OVERHEAD, Budget
from .net import Conn
from .pool import AccPool
from .shard import Shard
from .sync import Sync

log = logging.getLogger("paddle_cluster.ps")
POOL_BYTES = 2 << 20  # per pserver: how far one trainer may run ahead of another, summed over its blocks


@dataclass
class Segment:
    """One segment's sum for the block's current step (in ``slot``, a pool slot) and who is in it."""

    slot: np.ndarray
    acc: np.ndarray
    who: Set[int] = field(default_factory=set)


_NOBODY: FrozenSet[int] = frozenset()


@dataclass(frozen=True)
class DenseShared:
    """What the dense blocks of one pserver share: its barriers, the slots segments are summed in, and the
    threads that apply a whole block's step."""

    sync: Sync
    pool: AccPool
    applier: ThreadPoolExecutor
    finite: bool = True  # refuse a value, gradient or update holding NaN or Inf (not PADDLE_ALLOW_NONFINITE)
    budget: Optional[Budget] = None  # what ``synchronize()``'s averages are charged to

    @classmethod
    def make(cls, sync: Sync, finite: bool = True, budget: Optional[Budget] = None) -> DenseShared:
        return cls(sync, AccPool(POOL_BYTES),
                   ThreadPoolExecutor(max_workers=max(2, min(8, os.cpu_count() or 2)),
                                      thread_name_prefix=f"pserver{sync.pserver_id}-apply"), finite, budget)


def dense_bytes(meta: Dict[str, Any], spec: OptimizerSpec, trainers: int) -> int:
    """What a block of ``meta`` holds, in Python integers (never wraps): its value, its optimizer's state and
    scratch, and with several trainers the sum of their gradients."""
    n = math.prod(int(s) for s in meta["shape"]) * np.dtype(meta["dtype"]).itemsize
    copies = 2 + len(optim.slots(spec)[0]) + int(optim.coupled_decay(spec)) + int(trainers > 1)
    return n * copies + SHARD_OVERHEAD


class DenseBlock(Shard):
    """Pserver-side rows ``meta['lo']:meta['hi']`` of a dense parameter."""

    def __init__(self, key: int, meta: Dict[str, Any], spec: OptimizerSpec, declared: Dict[str, Any],
                 step: int, shared: DenseShared) -> None:
        super().__init__(key, meta["name"], spec, declared, step, shared.sync)
        self.pool, self.applier, self.finite, self.budget = shared.pool, shared.applier, shared.finite, shared.budget
        self.meta = meta
        self.dtype = np.dtype(meta["dtype"])
        self.shape = tuple(meta["shape"])
        self.param = np.zeros(self.shape, dtype=self.dtype)
        self.nbytes = self.param.nbytes
        self.opt = optim.DenseOptimizer(spec, self.param)
        self.initialized = False
        self.initializing = False
        # Sync mode with several trainers, not folded by segment: their gradients of the current step, summed
        # in trainer order. One buffer per block, allocated on first use.
        self._acc: Optional[np.ndarray] = None
        self.acc_busy = False  # a push is being received straight into acc
        # The last sync step some trainer gave a gradient (a push without ``NOGRAD_FLAG``), and the last one whose
        # gradient came averaged already (``AVERAGED_FLAG``): per step number, so nothing is reset between steps.
        self.graded_at = -1
        self.averaged_at = -1
        self.average: Optional[Average] = None  # its synchronize(), made on the first one (most never have one)
        self._start_segments(self.lock)

    def label(self) -> str:
        return f"block {self.name}[{self.meta['lo']}:{self.meta['hi']}]"

    def wake(self) -> None:
        self.cv.notify_all()
        for c in self.seg_cv:
            c.notify_all()

    @property
    def acc(self) -> np.ndarray:
        if self._acc is None:
            self._acc = np.empty(self.shape, dtype=self.dtype)
        return self._acc

    @property
    def plain_sgd(self) -> bool:
        return self.spec.name == "sgd" and self.spec.weight_decay == 0

    def touched(self, step: int) -> bool:
        """(Holding ``cv``.) Did some trainer give the block a gradient for sync step ``step``? One that none did is
        not updated at all (no decay, no momentum, no step count), as torch skips a parameter whose grad is None."""
        return self.graded_at == step

    def divisor(self, n: int, step: int) -> int:
        """(Holding ``cv``.) What the sum of ``n`` trainers' gradients for ``step`` is divided by: ``n`` (the
        trainers without a gradient count as zero, DDP's rule), 1 when it came averaged already."""
        return 1 if self.averaged_at == step else n

    def apply_mean(self, g: np.ndarray, n: int, by: str) -> None:
        """Apply the mean gradient ``g / n`` of ``by`` ("trainer 1"); ``g`` is scratch (it may be overwritten)."""
        if self.plain_sgd:
            # No buffer of the block's size is touched besides param and g (same rounding as the optimizer's).
            optim.sgd(self.param, g, self.spec.lr, n=n)
        else:
            if n > 1:
                g /= self.dtype.type(n)
            self.opt.apply(self.param, g)
            self.check_state(by, self.step.n)
        self.check_update(self.param, by, self.step.n)

    def check_state(self, by: str, step: int) -> None:
        """(Holding ``cv``.) After an update of ``step`` from ``by``'s gradients: refuse one that made the optimizer's
        state NaN or Inf (``NonFinite``), as ``check_update`` refuses values -- the block serves nothing more."""
        slot = finite.bad_state(self.opt.state) if self.finite else None
        if slot is not None:
            e = finite.state_refused(self.label(), slot, self.spec.name, by, step)
            self.error = str(e)
            self.wake()
            raise e

    def check_update(self, values: np.ndarray, by: Union[str, AbstractSet[int]], step: int) -> None:
        """(Holding ``cv``.) After an update of step ``step`` from ``by``'s gradients ("trainer 1", or the set of
        trainers) wrote ``values`` (the block or a segment): refuse one that made them NaN or Inf (``NonFinite``).
        The values it wrote are lost, so the block serves nothing more (``error``): its pulls and the job's
        checkpoints fail naming it. The message is built only then (this runs for every segment)."""
        if self.finite and not finite.all_finite(values):
            e = finite.update_refused(self.label(), by if isinstance(by, str) else finite.trainers(by), step)
            self.error = str(e)
            self.wake()  # its waiting pulls fail with the same message (``Step.wait``)
            raise e

    # -- requests --------------------------------------------------------------------------------------------

    def _frame(self, h: P.Header, payload: bool) -> None:
        """Refuse a frame not of the block's dtype, or whose payload is not the block's bytes (``payload``) or
        not empty."""
        if h.dtype != P.dtype_code(self.dtype):
            raise ProtocolError(f"{self.label()} is {self.dtype}, frame says dtype code {h.dtype}")
        P.expect_length(h, self.nbytes if payload else 0, self.label())

    def _lane(self, conn: Conn, h: P.Header) -> Optional[Tuple[np.ndarray, np.ndarray]]:
        """The block's (gradient, values) place in the connection's same-host lane, if the frame says it is there
        (a ``synchronize()`` frame never is)."""
        if not h.status & P.LANE_FLAG or h.status & P.REDUCE_FLAG:
            return None
        at = conn.lane_at.get(h.key)
        if at is None:
            raise ProtocolError(f"block {h.key} is not in this connection's lane")
        return at

    def _widened(self, conn: Conn, h: P.Header) -> Optional[Payload]:
        """A float32 block's gradient sent as float16 (a frontend's ``compression="fp16"``: half the bytes on the
        wire), read whole and widened to float32, which the step then folds as any push; None for any other
        frame (``synchronize()``'s are never compressed)."""
        if h.dtype != P.dtype_code(np.float16) or np.dtype(self.dtype) != np.float32 or h.status & P.REDUCE_FLAG:
            return None
        P.expect_length(h, self.nbytes // 2, self.label())
        half = np.empty(self.nbytes // 4, np.float16)
        conn.stream.recv_into(half)
        return Payload(half.astype(np.float32))

    def _empty(self, h: P.Header) -> Optional[Payload]:
        """The zeros a step's push without gradient stands for when it carries no payload (``EMPTY_FLAG``); None
        for any other frame. Only with ``NOGRAD_FLAG`` (an empty push is no gradient), never a ``synchronize()``
        or lane frame, in the block's dtype. Fresh zeros (calloc'd: no memory until written), as the push path
        may use a received gradient as scratch."""
        if not h.status & P.EMPTY_FLAG:
            return None
        if h.status & (P.REDUCE_FLAG | P.LANE_FLAG) or not h.status & P.NOGRAD_FLAG:
            raise ProtocolError(f"push {self.label()}: EMPTY_FLAG goes with NOGRAD_FLAG only, on a step's push over "
                                f"TCP (status {h.status})")
        if h.length:
            raise ProtocolError(f"push {self.label()}: EMPTY_FLAG with a payload of {h.length} bytes")
        self._frame(h, payload=False)
        return Payload(np.zeros(self.shape, self.dtype))

    def _average(self) -> Average:
        with self.cv:
            if self.average is None:
                self.average = Average(self, self.shape, self.dtype, self.budget)
            return self.average

    def init(self, conn: Conn, h: P.Header) -> None:
        """Trainer 0's initial value: the first one received counts, a repeat is read and dropped; one holding
        NaN or Inf is refused (unless the pserver accepts them: not ``finite``)."""
        self._frame(h, payload=True)
        with self.cv:
            mine = not (self.initialized or self.initializing)
            self.initializing = self.initializing or mine
        if not mine:
            conn.stream.discard()
            return
        try:
            conn.stream.recv_into(self.param)
            if self.finite and not finite.all_finite(self.param):
                self.param[...] = 0
                raise NonFinite(f"trainer {conn.trainer}'s initial value of {self.label()} holds NaN or Inf; "
                                "refused (PADDLE_ALLOW_NONFINITE=1 accepts it)")
        except BaseException:
            with self.cv:
                self.initializing = False
                self.wake()
            raise
        with self.cv:
            self.initialized, self.initializing = True, False
            self.wake()

    def pull(self, conn: Conn, h: P.Header) -> None:
        """Reply with the value for ``h.step`` (``REDUCE_FLAG``: the average of a ``synchronize()`` step instead,
        ``Average.pull``). In sync mode one not applied yet is waited for here: the
        trainer's requests behind it (its next gradients) wait in the socket's buffer, where the kernel keeps
        taking them in; a writer thread to read them meanwhile cost more CPU than it saved
        (docs/benchmarks.md). Where the step is folded segment by segment, the reply is sent segment by segment
        as they are applied, so a block's values flow back while its later segments' gradients still arrive
        (the same frame: only when its bytes are written changes). A block in the connection's same-host lane
        has its values copied there (segment by segment likewise) before a header without payload says they
        are there."""
        self._frame(h, payload=False)
        if h.status & P.REDUCE_FLAG:
            self._average().pull(conn, h)
            return
        lane, sync = self._lane(conn, h), self.sync
        if lane is not None:
            conn.stream.tally[0] += self.nbytes  # what ``top`` shows as sent: the lane's bytes too
        with self.cv:
            streams = self.folds() and self.initialized and not self.error and self.step.n < h.step
            if not streams:
                self.step.wait(h.step, "pull", gone=lambda: conn.gone)
            step = h.step if streams else self.step.n
        # Sent outside the lock: in sync mode nothing can update this block (segment) until this trainer
        # pushes again (after it has read this reply), and a stalled reader must never block the other
        # trainers. Async pulls may see a concurrent update.
        if lane is not None:
            self._pull_into(lane[1], step, (lambda end: self.wait_segment(step, end, lambda: conn.gone)) if streams
                            else None)
            conn.stream.send(P.pack_header(P.Op.DATA, P.dtype_code(self.dtype), P.LANE_FLAG, key=h.key, step=step))
            return
        conn.stream.send(P.pack_header(P.Op.DATA, P.dtype_code(self.dtype), key=h.key, step=step,
                                       length=self.nbytes),
                         self.param, volatile=sync.mode != "sync",
                         ready=(lambda end: self.wait_segment(step, end, lambda: conn.gone)) if streams else None)

    def _pull_into(self, into: np.ndarray, step: int, ready: Optional[Callable[[int], None]]) -> None:
        """Copy the values into a lane (``pull``), a segment at a time once ``ready`` says it is applied."""
        src, dst = self.param.reshape(-1).view(np.uint8), into.view(np.uint8)
        for lo in range(0, self.nbytes, SEGMENT):
            hi = min(lo + SEGMENT, self.nbytes)
            if ready is not None:
                ready(hi)
            np.copyto(dst[lo:hi], src[lo:hi])

    def push(self, conn: Conn, h: P.Header) -> bool:
        """Receive trainer ``conn.trainer``'s gradient for step ``h.step`` and fold it in; False when async mode
        dropped it as staler than the declared bound (``h.aux``: the block version it was computed on). A repeat
        of a push already counted is read and dropped. ``REDUCE_FLAG``: a ``synchronize()`` gradient, summed
        and not applied (``Average.push``).

        Sync SGD folds the push segment by segment as it arrives (``push_segments``); another sync optimizer
        receives it whole and adds it to the block's sum (``_push_sum``); async mode applies it as it lands.
        Received whole, a frame cut short changes nothing. The payload is read from the connection's stream, or
        from its same-host lane (``lane.Payload``) when the frame says the block is there, or widened from the
        float16 a frontend's ``compression="fp16"`` sent (``_widened``)."""
        empty = self._empty(h)
        lane = None if empty is not None else self._lane(conn, h)
        wide = empty if empty is not None or lane is not None else self._widened(conn, h)
        if wide is None:
            self._frame(h, payload=lane is None)
        if h.status & P.REDUCE_FLAG:
            self._average().push(conn, h, self._checker(conn.trainer, h.step))
            return True
        if lane is not None:
            conn.stream.tally[1] += self.nbytes  # what ``top`` shows as received: the lane's bytes too
        src = wide if wide is not None else conn.stream if lane is None else Payload(lane[0])
        t, at = conn.trainer, self.step
        with self.cv:
            new = at.begin(t, h.step)
            if new and not h.status & P.NOGRAD_FLAG:
                self.graded_at = h.step
            if new and h.status & P.AVERAGED_FLAG:
                self.averaged_at = h.step
        if not new:
            src.discard()
            return True
        check = self._checker(t, h.step)
        try:
            if self.folds():
                self.push_segments(t, h.step, src.chunks, check)
                with self.cv:
                    at.take(t, h.step)
            elif self.sync.mode == "sync":
                self._push_sum(conn, src, t, h.step, check)
            else:
                g = conn.buffer(self.shape, self.dtype)
                src.recv_into(g)
                if check is not None:
                    check(g)  # before it is applied: refused, it changes nothing
                with self.cv:
                    bound = self.sync.staleness
                    if bound is not None and at.n - h.aux > bound:
                        return False  # computed on values older than allowed
                    if h.status & P.NOGRAD_FLAG:
                        return True  # no gradient: nothing to apply (torch's rule)
                    with at.advancing(None):
                        self.apply_mean(g, 1, f"trainer {t}")
            return True
        finally:
            with self.cv:
                at.end(t)
                # Those waiting on the block (its step, its sum's order) look again; a segment's waiters were woken
                # as their segment landed and wait for nothing this changes.
                self.cv.notify_all()

    def _checker(self, t: int, step: int) -> Optional[Callable[[np.ndarray], None]]:
        """What refuses trainer ``t``'s gradient for ``step`` if it holds NaN or Inf (None: the pserver accepts
        them); called for every segment, so the message is built only on a refusal."""
        if not self.finite:
            return None

        def check(g: np.ndarray) -> None:
            if not finite.all_finite(g):
                raise finite.push_refused(self.label(), t, step)
        return check

    def trainer_closed(self) -> None:
        """(Holding ``cv``.) A trainer closed: a step that was waiting only for it completes now (not in a block
        whose update was refused: its values are lost)."""
        if self.average is not None:
            self.average.trainer_closed()
        if self.sync.mode == "sync" and not self.error:
            if self.folds():
                self._close_segments()
            else:
                self._complete()
        self.wake()

    # -- sync SGD: a push folded segment by segment -------------------------------------------------------------

    def _start_segments(self, lock: threading.RLock) -> None:
        self.segs: Dict[int, Segment] = {}  # this step's segments some trainers have sent
        self.segs_done = 0
        self.n_segs = max(1, -(-self.nbytes // SEGMENT))
        self.applied: Set[int] = set()  # segments already at ``step + 1`` (a pull of it may send them)
        # One condition per segment on ``cv``'s lock, for those waiting on one segment (its trainers in order,
        # its pulls): with 4 trainers, waking every waiter of the block at each fold put the pserver's threads
        # on a core 3x as often as the fold needs.
        self.seg_cv = tuple(threading.Condition(lock) for _ in range(self.n_segs))

    def folds(self) -> bool:
        """Does a push to this block take this path (sync mode, SGD, a non-empty block)?"""
        return self.sync.mode == "sync" and self.spec.name == "sgd" and self.nbytes > 0

    def ready(self, i: int, step: int) -> bool:
        """(Holding ``cv``.) Does segment ``i`` hold its value of ``step``?"""
        return self.step.n >= step or (self.step.n == step - 1 and i in self.applied)

    def _who(self, i: int) -> AbstractSet[int]:
        """The trainers already in segment ``i``'s sum."""
        s = self.segs.get(i)
        return s.who if s is not None else _NOBODY

    def push_segments(self, t: int, step: int,
                      chunks: Callable[[Callable[[int], Optional[np.ndarray]]], Iterable[Tuple[int, memoryview]]],
                      check: Optional[Callable[[np.ndarray], None]] = None) -> None:
        """Fold trainer ``t``'s gradient for ``step`` (``chunks``: its payload's ``Stream.chunks``) in.

        A segment that nobody started yet is received straight into a free pool slot when there is one (no
        copy: it becomes the sum); otherwise into the stream's scratch, then copied or added. The caller has
        marked ``t`` as receiving (``Step.begin``). A segment ``t`` is already in (a resent
        push) is skipped, so it never counts twice. ``check`` sees each segment before it is folded (while it
        is in cache) and may refuse it by raising: the segments before it stay folded, the step never
        completes."""
        sync, pool = self.sync, self.pool
        item = self.dtype.itemsize
        pflat = self.param.reshape(-1)
        what = f"push {self.label()}"
        held: List[np.ndarray] = []  # the slot the current segment is being received into
        may_start = sync.first_two(t)  # asked once per push: the active set changes only when a trainer closes

        def into(off: int) -> Optional[np.ndarray]:
            # Unlocked: a stale answer costs a copy (a slot taken for nothing goes back), never a wrong sum.
            first = may_start and off // SEGMENT not in self.segs and self.step.n == step
            slot = pool.try_take() if first else None
            if slot is not None:
                held.append(slot)
            return slot

        try:
            for off, view in chunks(into):
                if check is not None:
                    check(np.frombuffer(view, dtype=self.dtype))
                self._fold(t, step, off, view, held.pop() if held else None, pflat, item, what)
        finally:
            for slot in held:  # received into, never folded (the connection broke)
                pool.give(slot)

    def _fold(self, t: int, step: int, off: int, view: memoryview, mine: Optional[np.ndarray], pflat: np.ndarray,
              item: int, what: str) -> None:
        """Fold one verified segment of trainer ``t`` (received into ``mine``, a pool slot, or not); ``mine`` ends
        as the segment's sum or back in the pool."""
        sync, pool = self.sync, self.pool
        g = np.frombuffer(view, dtype=self.dtype)
        i = off // SEGMENT
        kept = False
        try:
            with self.lock:  # ``cv``'s lock: a Condition's ``with`` is one more Python call per segment
                s = self.segs.get(i)
                if self.step.n == step and not sync.in_order(t, _NOBODY if s is None else s.who):
                    def turn() -> bool:  # made only when it waits
                        return self.step.n != step or sync.in_order(t, self._who(i))
                    sync.wait(self.seg_cv[i], turn, step, f"{what}: summing in trainer order",
                              lambda: {u for u in sync.active if u < t} - self._who(i))
                s = self.segs.get(i)
                if s is None and self.step.n == step and not sync.active <= {t}:
                    slot = mine if mine is not None else self._take(t, step, what,
                                                                    lambda: i in self.segs or self.step.n != step)
                    s = self.segs.get(i)  # another trainer may have started the segment meanwhile
                    if s is None and self.step.n == step and slot is not None:
                        s = self.segs[i] = Segment(slot, slot[:len(view)].view(self.dtype))
                        if slot is mine:
                            kept = True
                        else:
                            np.copyto(s.acc, g)
                        s.who.add(t)
                        pool.poke()
                        return
                    if slot is not None and slot is not mine:
                        pool.give(slot)
                if self.step.n != step or (s is not None and t in s.who):
                    return
                p = pflat[off // item:off // item + len(g)]
                with sync.rw.shared():
                    self.apply_hyper(step)
                    if s is None:  # the only active trainer: straight from the receive buffer
                        if self.touched(step):
                            _sgd(self, p, g, None, 1)
                    elif sync.active <= s.who | {t}:  # the last one: add, average, apply
                        if self.touched(step):
                            _sgd(self, p, s.acc, g, self.divisor(len(s.who) + 1, step))
                    else:
                        np.add(s.acc, g, out=s.acc)
                        s.who.add(t)
                        # The next trainer in order may add now (else it sleeps out its poll).
                        self.seg_cv[i].notify_all()
                        return
                # One pass over the segment while it is in cache; refused, the step never completes.
                self.check_update(p, f"trainer {t}" if s is None else s.who | {t}, step)
                if s is not None:
                    self._free(i)
                self._segment_done(i)
        finally:
            if mine is not None and not kept:  # its bytes were added (or not needed): the slot goes back
                pool.give(mine)

    def _take(self, t: int, step: int, what: str, unless: Callable[[], bool]) -> Optional[np.ndarray]:
        """(Holding ``cv``.) A pool slot for trainer ``t``, waited for without holding ``cv`` (others fold and free
        meanwhile)."""
        self.cv.release()
        try:
            return self.pool.take(self.sync, t, step, what, unless)
        finally:
            self.cv.acquire()

    def _free(self, i: int) -> None:
        self.pool.give(self.segs.pop(i).slot)

    def _segment_done(self, i: int) -> None:
        self.segs_done += 1
        self.applied.add(i)
        if self.segs_done == self.n_segs:
            self.segs_done = 0
            self.applied.clear()
            self.step.next()
            self.pool.poke()
            self.wake()
        else:
            self.seg_cv[i].notify_all()  # its pulls may send it

    def wait_segment(self, step: int, end: int, gone: Callable[[], bool]) -> None:
        """Return once the segment ending at byte ``end`` holds its value of ``step`` (a sync pull sent as the
        segments are applied). Past the first segment the reply's header is out, so a failure can no longer
        be told in order: it ends the connection (``ConnectionLost``) and the trainer sees it break."""
        i = (end - 1) // SEGMENT
        with self.cv:
            if self.ready(i, step):
                return
            try:
                self.sync.wait(self.seg_cv[i], lambda: self.ready(i, step) or self.error is not None, step,
                               f"pull {self.label()} segment {i}",
                               lambda: set(self.sync.active) - self._who(i), gone)
                if not self.ready(i, step):  # an update of the step was refused (``check_update``)
                    raise RemoteError(f"pserver {self.sync.pserver_id}: {self.error}")
            except PSError as e:
                if i == 0:
                    raise
                log.warning("%s", e)
                raise ConnectionLost(f"{e} (in the middle of a reply)") from None

    def _close_segments(self) -> None:
        """(Holding ``cv``.) A trainer closed: apply every segment that now holds all the active trainers."""
        sync = self.sync
        for i in sorted(self.segs):
            s = self.segs[i]
            if s.who and sync.active <= s.who:
                lo = i * SEGMENT // self.dtype.itemsize
                p = self.param.reshape(-1)[lo:lo + len(s.acc)]
                with sync.rw.shared():
                    self.apply_hyper(self.step.n)
                    if self.touched(self.step.n):
                        _sgd(self, p, s.acc, None, self.divisor(len(s.who), self.step.n))
                self.check_update(p, s.who, self.step.n)
                self._free(i)
                self._segment_done(i)

    # -- a whole block's sum (an optimizer other than SGD) ---------------------------------------------------

    def _push_sum(self, conn: Conn, src: Any, t: int, step: int, check: Optional[Callable[[np.ndarray], None]]) -> None:
        """Receive trainer ``t``'s whole gradient and add it to the block's sum in trainer order. One of the
        first two trainers finding the sum empty receives straight into it (no copy); the others into their
        connection's buffer. ``check`` sees it before it is added to anything."""
        at, sync = self.step, self.sync
        with self.cv:
            direct = not at.started() and not self.acc_busy and t in sync.active and sync.first_two(t)
            self.acc_busy = self.acc_busy or direct
        try:
            g = self.acc if direct else conn.buffer(self.shape, self.dtype)
            src.recv_into(g)
            if check is not None:
                check(g)
            with self.cv:
                if direct:
                    self.acc_busy = False
                    if at.take(t, step):
                        self._complete()
                    return
                def turn() -> bool:
                    return at.n != step or self._may_add(t)
                if not turn():  # checked first: the wait's message is built only when it waits
                    sync.wait(self.cv, turn, step, f"push {self.label()}: summing in trainer order",
                              lambda: {u for u in sync.active if u < t} - set(at.contributors()))
                if at.take(t, step):
                    self._add(t, g)
        except BaseException:
            if direct:
                with self.cv:
                    self.acc_busy = False
            raise

    def _may_add(self, t: int) -> bool:
        """(Holding ``cv``.) May trainer ``t`` add its gradient to the block's sum now?"""
        return not self.acc_busy and self.step.in_turn(t)

    def _add(self, t: int, g: np.ndarray) -> None:
        """(Holding ``cv``.) Add trainer ``t``'s gradient ``g`` (a connection buffer, counted in the step) to its
        sum."""
        at = self.step
        first = len(at.contributors()) == 1
        last = at.full()
        if first and last:  # the only contributor: apply straight from the receive buffer
            with at.advancing(at.n):
                if self.touched(at.n):
                    self.apply_mean(g, 1, f"trainer {t}")
            return
        if not last or not self.plain_sgd or not self.touched(at.n):
            if first:
                np.copyto(self.acc, g)
            else:
                np.add(self.acc, g, out=self.acc)  # acc is a read-only property: `self.acc += g` would assign to it
            self._complete()
            return
        # Last of several with plain SGD: add, average and apply in one pass per cache-sized chunk.
        n = self.divisor(len(at.contributors()), at.n)
        by = finite.trainers(at.contributors())
        with at.advancing(at.n):
            optim.sgd(self.param, self.acc, self.spec.lr, plus=g, n=n)
            self.check_update(self.param, by, at.n)

    def _complete(self) -> None:
        """(Holding ``cv``.) Once every active trainer pushed, apply the averaged gradient.

        The apply runs on the apply threads, not on the connection thread, so the connection can already
        receive the next block while this one is being updated (the pull for the next step waits for it)."""
        if self.step.hand_off():
            self.applier.submit(self._apply)

    def _apply(self) -> None:
        at = self.step
        with self.cv:
            try:
                # acc holds the contributors' gradients, summed in trainer order by _add.
                with at.advancing(at.n):
                    if self.touched(at.n):
                        who = at.contributors()
                        self.apply_mean(self.acc, self.divisor(len(who), at.n), finite.trainers(who))
            except NonFinite as e:  # check_update set ``error``: the waiting pulls report it
                log.warning("pserver %d: %s", self.sync.pserver_id, e)
            except Exception as e:  # keep serving; the waiting pulls report it
                log.exception("pserver %d: optimizer failed on %s", self.sync.pserver_id, self.label())
                self.error = f"optimizer failed on {self.label()} at step {at.n}: {e!r}"
            finally:
                self.wake()


def _sgd(b: DenseBlock, p: np.ndarray, g: np.ndarray, plus: Optional[np.ndarray], n: int) -> None:
    """``p -= lr * ((g + plus) / n + wd * p)`` rounded as the whole-block path rounds it; ``g`` is scratch."""
    if not b.spec.weight_decay:
        optim.sgd(p, g, b.spec.lr, plus=plus, n=n)
        return
    if plus is not None:
        np.add(g, plus, out=g)
    if n > 1:
        g /= b.dtype.type(n)
    d = np.multiply(p, b.dtype.type(b.spec.weight_decay))
    d += g
    optim.sgd(p, d, b.spec.lr, out=g)
