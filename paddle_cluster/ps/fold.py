"""Sync-mode SGD pushes, folded segment by segment as they arrive.

A dense push arrives as verified segments of ``stream.SEGMENT`` bytes (``Stream.chunks``). For each segment
of a block the first contribution of a step is received into an accumulator slot (copied there when no slot
was free as it arrived), later ones are added to it
in trainer order (the first two in either order: float addition commutes), and the last one is added,
averaged and applied to the parameter while the segment is in cache; the slot goes back to the pool, and
a pull waiting for the step sends the segment (``wait_segment``, ``handlers.pull_dense``). With
one trainer a segment is applied straight from the receive buffer. So a pserver holds its parameters plus
the segments some trainer has sent and another not yet -- bounded by ``AccPool``: a trainer that runs
ahead by more than the pool waits (TCP holds its bytes), which costs nothing in sync mode, where every
trainer waits for the slowest at the next pull anyway.

Rounding is that of the whole-block path (``shards.DenseBlock.apply_mean``): the same operations in the
same order on every element.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AbstractSet, Callable, FrozenSet, Iterable, List, Optional, Set, Tuple

import numpy as np

from . import optim
from .errors import ConnectionLost, PSError
from .shards import DenseBlock
from .stream import SEGMENT

if TYPE_CHECKING:
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

    def __init__(self, nbytes: int = POOL_BYTES) -> None:
        self.cv = threading.Condition()
        self.free: List[np.ndarray] = []
        self.left = max(1, nbytes // SEGMENT)  # slots that may still be allocated
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
            if unless():
                return None
            if self.free:
                return self.free.pop()
            self.left -= 1
            return np.empty(SEGMENT, dtype=np.uint8)

    def try_take(self) -> Optional[np.ndarray]:
        """A free slot if there is one now, else None (never waits)."""
        with self.cv:
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


def applies(sync: Sync, b: DenseBlock) -> bool:
    """Does a push to ``b`` take this path (sync mode, SGD, a non-empty block)?"""
    return sync.mode == "sync" and b.spec.name == "sgd" and b.nbytes > 0


_NOBODY: FrozenSet[int] = frozenset()


def _who(b: DenseBlock, i: int) -> AbstractSet[int]:
    """The trainers already in segment ``i``'s sum."""
    s = b.segs.get(i)
    return s.who if s is not None else _NOBODY


def _may_add(sync: Sync, b: DenseBlock, i: int, t: int) -> bool:
    """May trainer ``t`` add to segment ``i`` now (``Sync.in_order``)?"""
    return sync.in_order(t, _who(b, i))


def push(sync: Sync, pool: AccPool, b: DenseBlock, t: int, step: int,
         chunks: Callable[[Callable[[int], Optional[np.ndarray]]], Iterable[Tuple[int, memoryview]]],
         check: Optional[Callable[[np.ndarray], None]] = None) -> None:
    """Fold trainer ``t``'s gradient for ``step`` (``chunks``: its payload's ``Stream.chunks``) into ``b``.

    A segment that nobody started yet is received straight into a free pool slot when there is one (no
    copy: it becomes the sum); otherwise into the stream's scratch, then copied or added. The caller has
    checked ``step == b.step`` and marked ``t`` as receiving. A segment ``t`` is already in (a resent push)
    is skipped, so it never counts twice. ``check`` sees each segment before it is folded (while it is in
    cache) and may refuse it by raising: the segments before it stay folded, the step never completes."""
    item = b.dtype.itemsize
    pflat = b.param.reshape(-1)
    what = f"push {b.describe()}"
    held: List[np.ndarray] = []  # the slot the current segment is being received into

    def into(off: int) -> Optional[np.ndarray]:
        # Unlocked: a stale answer costs a copy (a slot taken for nothing goes back), never a wrong sum.
        first = off // SEGMENT not in b.segs and b.step == step and sync.first_two(t)
        slot = pool.try_take() if first else None
        if slot is not None:
            held.append(slot)
        return slot

    try:
        for off, view in chunks(into):
            if check is not None:
                check(np.frombuffer(view, dtype=b.dtype))
            _fold(sync, pool, b, t, step, off, view, held.pop() if held else None, pflat, item, what)
    finally:
        for slot in held:  # received into, never folded (the connection broke)
            pool.give(slot)


def _fold(sync: Sync, pool: AccPool, b: DenseBlock, t: int, step: int, off: int, view: memoryview,
          mine: Optional[np.ndarray], pflat: np.ndarray, item: int, what: str) -> None:
    """Fold one verified segment of trainer ``t`` (received into ``mine``, a pool slot, or not); ``mine`` ends
    as the segment's sum or back in the pool."""
    g = np.frombuffer(view, dtype=b.dtype)
    i = off // SEGMENT
    kept = False
    try:
        with b.cv:
            def turn() -> bool:
                return b.step != step or _may_add(sync, b, i, t)
            if not turn():  # checked first: the wait's message is built only when it waits
                sync.wait(b.seg_cv[i], turn, step, f"{what}: summing in trainer order",
                          lambda: {u for u in sync.active if u < t} - _who(b, i))
            s = b.segs.get(i)
            if s is None and b.step == step and not sync.active <= {t}:
                slot = mine if mine is not None else _take(b, pool, sync, step, what,
                                                           lambda: i in b.segs or b.step != step)
                s = b.segs.get(i)  # another trainer may have started the segment meanwhile
                if s is None and b.step == step and slot is not None:
                    s = b.segs[i] = Segment(slot, slot[:len(view)].view(b.dtype))
                    if slot is mine:
                        kept = True
                    else:
                        np.copyto(s.acc, g)
                    s.who.add(t)
                    pool.poke()
                    return
                if slot is not None and slot is not mine:
                    pool.give(slot)
            if b.step != step or (s is not None and t in s.who):
                return
            p = pflat[off // item:off // item + len(g)]
            with sync.rw.shared():
                sync.apply_hyper(b, step)
                if s is None:  # the only active trainer: straight from the receive buffer
                    _sgd(b, p, g, None, 1)
                elif sync.active <= s.who | {t}:  # the last one: add, average, apply
                    _sgd(b, p, s.acc, g, len(s.who) + 1)
                else:
                    np.add(s.acc, g, out=s.acc)
                    s.who.add(t)
                    b.seg_cv[i].notify_all()  # the next trainer in order may add now (else it sleeps out its poll)
                    return
            if s is not None:
                _free(b, pool, i)
            _segment_done(b, pool, i)
    finally:
        if mine is not None and not kept:  # its bytes were added (or not needed): the slot goes back
            pool.give(mine)


def _take(b: DenseBlock, pool: AccPool, sync: Sync, step: int, what: str, unless: Callable[[], bool]
          ) -> Optional[np.ndarray]:
    """(Holding ``b.cv``.) A pool slot, waited for without holding ``b.cv`` (others fold and free meanwhile)."""
    b.cv.release()
    try:
        return pool.take(sync, step, what, unless)
    finally:
        b.cv.acquire()


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


def _free(b: DenseBlock, pool: AccPool, i: int) -> None:
    pool.give(b.segs.pop(i).slot)


def _segment_done(b: DenseBlock, pool: AccPool, i: int) -> None:
    b.segs_done += 1
    b.applied.add(i)
    if b.segs_done == b.n_segs:
        b.segs_done = 0
        b.applied.clear()
        b.step += 1
        b.pending.clear()
        pool.poke()
        b.wake()
    else:
        b.seg_cv[i].notify_all()  # its pulls may send it


def wait_segment(sync: Sync, b: DenseBlock, step: int, end: int, gone: Callable[[], bool]) -> None:
    """Return once the segment of ``b`` ending at byte ``end`` holds its value of ``step`` (a sync pull sent
    as the segments are applied). Past the first segment the reply's header is out, so a failure can no
    longer be told in order: it ends the connection (``ConnectionLost``) and the trainer sees it break."""
    i = (end - 1) // SEGMENT
    with b.cv:
        if b.ready(i, step):
            return
        try:
            sync.wait(b.seg_cv[i], lambda: b.ready(i, step), step, f"pull {b.describe()} segment {i}",
                      lambda: set(sync.active) - _who(b, i), gone)
        except PSError as e:
            if i == 0:
                raise
            log.warning("%s", e)
            raise ConnectionLost(f"{e} (in the middle of a reply)") from None


def close(sync: Sync, pool: AccPool, b: DenseBlock) -> None:
    """(Holding ``b.cv``.) A trainer closed: apply every segment that now holds all the active trainers."""
    for i in sorted(b.segs):
        s = b.segs[i]
        if s.who and sync.active <= s.who:
            lo = i * SEGMENT // b.dtype.itemsize
            with sync.rw.shared():
                sync.apply_hyper(b, b.step)
                _sgd(b, b.param.reshape(-1)[lo:lo + len(s.acc)], s.acc, None, len(s.who))
            _free(b, pool, i)
            _segment_done(b, pool, i)
