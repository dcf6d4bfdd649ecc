"""Sync-mode SGD pushes, folded segment by segment as they arrive: ``SegmentFold``, the segment half of
``dense.DenseBlock``, and ``AccPool``, the accumulator slots every block of a pserver shares.

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
import threading
from dataclasses import dataclass, field
from typing import AbstractSet, Any, Callable, Dict, FrozenSet, Iterable, List, Optional, Set, Tuple

import numpy as np

from . import finite, optim
from .errors import ConnectionLost, PSError, RemoteError
from .optim import OptimizerSpec
from .stream import SEGMENT
from .sync import Sync

log = logging.getLogger("paddle_cluster.ps")
POOL_BYTES = 2 << 20  # per pserver: how far one trainer may run ahead of another, summed over its blocks


@dataclass
class Segment:
    """One segment's sum for the block's current step (in ``slot``, a pool slot) and who is in it."""

    slot: np.ndarray
    acc: np.ndarray
    who: Set[int] = field(default_factory=set)


class AccPool:
    """Accumulator slots of one segment each, at most ``POOL_BYTES`` of them."""

    def __init__(self, nbytes: Optional[int] = None) -> None:
        self.cv = threading.Condition()
        self.free: List[np.ndarray] = []
        self.left = max(1, (POOL_BYTES if nbytes is None else nbytes) // SEGMENT)  # slots that may still be allocated
        self.waiting = 0  # threads in ``take``: give and poke wake no one when there are none

    def take(self, sync: Sync, step: int, what: str, unless: Callable[[], bool]) -> Optional[np.ndarray]:
        """A free slot; None as soon as ``unless()`` (the slot is no longer needed: another trainer started
        the segment, or the step completed)."""
        with self.cv:
            self.waiting += 1
            try:
                sync.wait(self.cv, lambda: bool(self.free) or self.left > 0 or unless(), step,
                          f"{what}: waiting for the other trainers to catch up", lambda: set(sync.active))
            finally:
                self.waiting -= 1
            return None if unless() else self._pop()

    def try_take(self) -> Optional[np.ndarray]:
        """A free slot if there is one now, else None (never waits)."""
        with self.cv:
            return self._pop()

    def _pop(self) -> Optional[np.ndarray]:
        if self.free:
            return self.free.pop()
        if self.left > 0:
            self.left -= 1
            return np.empty(SEGMENT, dtype=np.uint8)
        return None

    def give(self, slot: np.ndarray) -> None:
        with self.cv:
            self.free.append(slot)
            if self.waiting:
                self.cv.notify_all()

    def poke(self) -> None:
        """A segment was started or a step completed: a waiting ``take`` may no longer need its slot."""
        if self.waiting:  # read unlocked: a take that starts waiting after this checks ``unless`` first
            with self.cv:
                self.cv.notify_all()


_NOBODY: FrozenSet[int] = frozenset()


class SegmentFold:
    """The segment half of a dense block (``dense.DenseBlock``, which supplies the attributes annotated here):
    this step's segment sums, folding a push into them in trainer order, applying each segment as its last
    gradient lands, and a pull's wait for one segment."""

    sync: Sync
    pool: AccPool
    cv: threading.Condition
    step: int
    pending: Dict[int, Any]
    param: np.ndarray
    dtype: np.dtype
    spec: OptimizerSpec
    nbytes: int
    describe: Callable[[], str]
    wake: Callable[[], None]
    check_update: Callable[[np.ndarray, str, int], None]
    error: Optional[str]

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
        return self.step >= step or (self.step == step - 1 and i in self.applied)

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
        checked ``step == self.step`` and marked ``t`` as receiving. A segment ``t`` is already in (a resent
        push) is skipped, so it never counts twice. ``check`` sees each segment before it is folded (while it
        is in cache) and may refuse it by raising: the segments before it stay folded, the step never
        completes."""
        sync, pool = self.sync, self.pool
        item = self.dtype.itemsize
        pflat = self.param.reshape(-1)
        what = f"push {self.describe()}"
        held: List[np.ndarray] = []  # the slot the current segment is being received into

        def into(off: int) -> Optional[np.ndarray]:
            # Unlocked: a stale answer costs a copy (a slot taken for nothing goes back), never a wrong sum.
            first = off // SEGMENT not in self.segs and self.step == step and sync.first_two(t)
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
            with self.cv:
                def turn() -> bool:
                    return self.step != step or sync.in_order(t, self._who(i))
                if not turn():  # checked first: the wait's message is built only when it waits
                    sync.wait(self.seg_cv[i], turn, step, f"{what}: summing in trainer order",
                              lambda: {u for u in sync.active if u < t} - self._who(i))
                s = self.segs.get(i)
                if s is None and self.step == step and not sync.active <= {t}:
                    slot = mine if mine is not None else self._take(step, what,
                                                                    lambda: i in self.segs or self.step != step)
                    s = self.segs.get(i)  # another trainer may have started the segment meanwhile
                    if s is None and self.step == step and slot is not None:
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
                if self.step != step or (s is not None and t in s.who):
                    return
                p = pflat[off // item:off // item + len(g)]
                with sync.rw.shared():
                    sync.apply_hyper(self, step)
                    if s is None:  # the only active trainer: straight from the receive buffer
                        _sgd(self, p, g, None, 1)
                    elif sync.active <= s.who | {t}:  # the last one: add, average, apply
                        _sgd(self, p, s.acc, g, len(s.who) + 1)
                    else:
                        np.add(s.acc, g, out=s.acc)
                        s.who.add(t)
                        # The next trainer in order may add now (else it sleeps out its poll).
                        self.seg_cv[i].notify_all()
                        return
                # One pass over the segment while it is in cache; refused, the step never completes.
                self.check_update(p, f"trainer {t}" if s is None else finite.trainers(s.who | {t}), step)
                if s is not None:
                    self._free(i)
                self._segment_done(i)
        finally:
            if mine is not None and not kept:  # its bytes were added (or not needed): the slot goes back
                pool.give(mine)

    def _take(self, step: int, what: str, unless: Callable[[], bool]) -> Optional[np.ndarray]:
        """(Holding ``cv``.) A pool slot, waited for without holding ``cv`` (others fold and free meanwhile)."""
        self.cv.release()
        try:
            return self.pool.take(self.sync, step, what, unless)
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
            self.step += 1
            self.pending.clear()
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
                               f"pull {self.describe()} segment {i}",
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
                    sync.apply_hyper(self, self.step)
                    _sgd(self, p, s.acc, None, len(s.who))
                self.check_update(p, finite.trainers(s.who), self.step)
                self._free(i)
                self._segment_done(i)


def _sgd(b: SegmentFold, p: np.ndarray, g: np.ndarray, plus: Optional[np.ndarray], n: int) -> None:
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
