"""A dense block (``DenseBlock``): its value and optimizer, and everything a request does to it -- its initial
value, receiving a gradient and folding it into this step's sum, applying the step, and answering pulls.

Sync mode sums the trainers' gradients of a step in trainer order (the first two in either order: float
addition commutes), so the result never depends on arrival order. SGD folds a push a segment at a time into
slots of the pserver's ``AccPool`` (``fold.SegmentFold``, the block's segment half); another optimizer sums
whole gradients into one buffer per block and applies the step on the apply threads. Async mode applies each
gradient as it lands.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Dict, Optional

import numpy as np

from . import finite, fold, optim
from . import protocol as P
from .errors import NonFinite
from .fold import AccPool, SegmentFold
from .net import Conn
from .optim import OptimizerSpec
from .shards import Shard
from .sync import Sync

log = logging.getLogger("paddle_cluster.ps")


@dataclass(frozen=True)
class DenseShared:
    """What the dense blocks of one pserver share: its barriers, the slots segments are summed in, and the
    threads that apply a whole block's step."""

    sync: Sync
    pool: AccPool
    applier: ThreadPoolExecutor
    finite: bool = True  # refuse an update that would make a value NaN or Inf (not PADDLE_ALLOW_NONFINITE)

    @classmethod
    def make(cls, sync: Sync, finite: bool = True) -> DenseShared:
        return cls(sync, AccPool(fold.POOL_BYTES),
                   ThreadPoolExecutor(max_workers=max(2, min(8, os.cpu_count() or 2)),
                                      thread_name_prefix=f"pserver{sync.pserver_id}-apply"), finite)


class DenseBlock(SegmentFold, Shard):
    """Pserver-side rows ``meta['lo']:meta['hi']`` of a dense parameter."""

    def __init__(self, key: int, meta: Dict[str, Any], spec: OptimizerSpec, declared: Dict[str, Any],
                 step: int, shared: DenseShared) -> None:
        super().__init__(key, meta["name"], spec, declared, step)
        self.sync, self.pool, self.applier, self.finite = shared.sync, shared.pool, shared.applier, shared.finite
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
        self.applying = False
        self._start_segments(self.lock)

    def describe(self) -> str:
        return f"block {self.name}[{self.meta['lo']}:{self.meta['hi']}]"

    def wake(self) -> None:
        super().wake()
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

    def apply_mean(self, g: np.ndarray, n: int, by: str) -> None:
        """Apply the mean gradient ``g / n`` of ``by`` ("trainer 1"); ``g`` is scratch (it may be overwritten)."""
        if self.plain_sgd:
            # No buffer of the block's size is touched besides param and g (same rounding as the optimizer's).
            optim.sgd(self.param, g, self.spec.lr, n=n)
        else:
            if n > 1:
                g /= self.dtype.type(n)
            self.opt.apply(self.param, g)
        self.check_update(self.param, by, self.step)

    def check_update(self, values: np.ndarray, by: str, step: int) -> None:
        """(Holding ``cv``.) After an update of step ``step`` from ``by``'s gradients wrote ``values`` (the block or
        a segment): refuse one that made them NaN or Inf (``NonFinite``). The values it wrote are lost, so the
        block serves nothing more (``error``): its pulls and the job's checkpoints fail naming it."""
        if self.finite:
            try:
                finite.updated(values, self.describe(), by, step)
            except NonFinite as e:
                self.error = str(e)
                self.wake()  # its waiting pulls fail with the same message (``Sync.wait_step``)
                raise

    # -- requests --------------------------------------------------------------------------------------------

    def init(self, conn: Conn, allow_nonfinite: bool = False) -> None:
        """Trainer 0's initial value: the first one received counts, a repeat is read and dropped; one holding
        NaN or Inf is refused (unless ``allow_nonfinite``)."""
        with self.cv:
            mine = not (self.initialized or self.initializing)
            self.initializing = self.initializing or mine
        if not mine:
            conn.stream.discard()
            return
        try:
            conn.stream.recv_into(self.param)
            if not allow_nonfinite and not finite.all_finite(self.param):
                self.param[...] = 0
                raise NonFinite(f"trainer {conn.trainer}'s initial value of {self.describe()} holds NaN or Inf; "
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
        """Reply with the value for ``h.step``. In sync mode one not applied yet is waited for here: the
        trainer's requests behind it (its next gradients) wait in the socket's buffer, where the kernel keeps
        taking them in; a writer thread to read them meanwhile cost more CPU than it saved
        (docs/benchmarks.md). Where the step is folded segment by segment, the reply is sent segment by segment
        as they are applied, so a block's values flow back while its later segments' gradients still arrive
        (the same frame: only when its bytes are written changes)."""
        sync = self.sync
        with self.cv:
            streams = self.folds() and self.initialized and not self.error and self.step < h.step
            if not streams:
                sync.wait_step(self, h.step, "pull", gone=lambda: conn.gone)
            step = h.step if streams else self.step
        # Sent outside the lock: in sync mode nothing can update this block (segment) until this trainer
        # pushes again (after it has read this reply), and a stalled reader must never block the other
        # trainers. Async pulls may see a concurrent update.
        conn.stream.send(P.pack_header(P.Op.DATA, P.dtype_code(self.dtype), key=h.key, step=step,
                                       length=self.nbytes),
                         self.param, volatile=sync.mode != "sync",
                         ready=(lambda end: self.wait_segment(step, end, lambda: conn.gone)) if streams else None)

    def push(self, conn: Conn, h: P.Header, allow_nonfinite: bool, staleness: Optional[int]) -> bool:
        """Receive trainer ``conn.trainer``'s gradient for step ``h.step`` and fold it in; False when async mode
        dropped it as staler than ``staleness`` (``h.aux``: the block version it was computed on).

        A gradient is received whole into this connection's buffer (or, for the first of several sync
        trainers, straight into the block's sum), so a frame cut short changes nothing. The last contribution
        of a step is folded and, for plain SGD, applied in one cache-sized pass."""
        t, sync = conn.trainer, self.sync
        in_sync = sync.mode == "sync"
        with self.cv:
            sync.wait_step(self, h.step, "push")
            if in_sync:
                dup = h.step < self.step or t in self.pending or t in self.receiving or self.applying
            else:
                dup = t in self.receiving
            segments = not dup and self.folds()
            if segments:
                self.receiving.add(t)
        check = None if allow_nonfinite else (lambda g: finite.check(g, self.describe(), t, h.step))
        if segments:
            try:
                self.push_segments(t, h.step, conn.stream.chunks, check)
            except BaseException:
                with self.cv:
                    self.receiving.discard(t)
                    self.wake()
                raise
            with self.cv:
                self.receiving.discard(t)
                if self.step == h.step:
                    self.pending[t] = True
                # No segment's waiter waits on these: its folds and pulls were woken as they landed.
                self.cv.notify_all()
            return True
        with self.cv:
            direct = (in_sync and not dup and not self.pending and not self.acc_busy and t in sync.active
                      and sync.first_two(t))
            if not dup:
                self.receiving.add(t)
                self.acc_busy = self.acc_busy or direct
        if dup:
            conn.stream.discard()  # an idempotent repeat of a push already counted
            return True
        try:
            dest = self.acc if direct else conn.buffer(self.shape, self.dtype)
            conn.stream.recv_into(dest)
            if check is not None:
                check(dest)  # before it is added to anything: refused, it changes nothing
        except BaseException:
            with self.cv:
                self.receiving.discard(t)
                self.acc_busy = self.acc_busy and not direct
                self.wake()
            raise
        kept = True
        with self.cv:
            try:
                if not in_sync:
                    if staleness is not None and self.step - h.aux > staleness:
                        kept = False  # computed on values older than allowed
                    else:
                        sync.advance(self, None, lambda: self.apply_mean(dest, 1, f"trainer {t}"))
                elif self.step == h.step:
                    if direct:
                        self.acc_busy = False
                        self.pending[t] = True
                        self._complete()
                    else:
                        sync.wait(self.cv, lambda: self.step != h.step or self._may_add(t), h.step,
                                  f"push {self.describe()}: summing in trainer order",
                                  lambda: {u for u in sync.active if u < t} - set(self.pending))
                        if self.step == h.step:
                            self._add(t, dest)
            finally:
                self.receiving.discard(t)
                if direct:
                    self.acc_busy = False
                self.wake()
        return kept

    def trainer_closed(self) -> None:
        """(Holding ``cv``.) A trainer closed: a step that was waiting only for it completes now (not in a block
        whose update was refused: its values are lost)."""
        if self.sync.mode == "sync" and not self.error:
            if self.folds():
                self._close_segments()
            else:
                self._complete()
        self.wake()

    # -- a whole block's sum (an optimizer other than SGD) ---------------------------------------------------

    def _may_add(self, t: int) -> bool:
        """(Holding ``cv``.) May trainer ``t`` add its gradient to the block's sum now?"""
        if self.acc_busy or self.applying:
            return False
        return self.sync.in_order(t, self.pending.keys())

    def _add(self, t: int, g: np.ndarray) -> None:
        """(Holding ``cv``.) Add trainer ``t``'s gradient ``g`` (a connection buffer) to step ``self.step``."""
        sync = self.sync
        first = not self.pending
        self.pending[t] = True
        last = sync.ready_to_apply(self)
        if first and last:  # the only contributor: apply straight from the receive buffer
            sync.advance(self, self.step, lambda: self.apply_mean(g, 1, f"trainer {t}"))
            self.pending.clear()
            return
        if not last or not self.plain_sgd:
            if first:
                np.copyto(self.acc, g)
            else:
                np.add(self.acc, g, out=self.acc)  # acc is a read-only property: `self.acc += g` would assign to it
            self._complete()
            return
        # Last of several with plain SGD: add, average and apply in one pass per cache-sized chunk.
        n = len(self.pending)
        by = finite.trainers(self.pending)

        def update() -> None:
            optim.sgd(self.param, self.acc, self.spec.lr, plus=g, n=n)
            self.check_update(self.param, by, self.step)

        sync.advance(self, self.step, update)
        self.pending.clear()

    def _complete(self) -> None:
        """(Holding ``cv``.) Once every active trainer pushed, apply the averaged gradient.

        The apply runs on the apply threads, not on the connection thread, so the connection can already
        receive the next block while this one is being updated (the pull for the next step waits for it)."""
        if self.applying or not self.sync.ready_to_apply(self):
            return
        self.applying = True
        self.applier.submit(self._apply)

    def _apply(self) -> None:
        with self.cv:
            try:
                # acc holds the contributors' gradients, summed in trainer order by _add.
                self.sync.advance(self, self.step, lambda: self.apply_mean(self.acc, len(self.pending),
                                                                           finite.trainers(self.pending)))
            except NonFinite as e:  # check_update set ``error``: the waiting pulls report it
                log.warning("pserver %d: %s", self.sync.pserver_id, e)
            except Exception as e:  # keep serving; the waiting pulls report it
                log.exception("pserver %d: optimizer failed on %s", self.sync.pserver_id, self.describe())
                self.error = f"optimizer failed on {self.describe()} at step {self.step}: {e!r}"
            finally:
                self.pending.clear()
                self.applying = False
                self.wake()

