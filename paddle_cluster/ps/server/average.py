"""A dense block's ``synchronize()`` (``Average``): the trainers' gradients of a sync step summed in trainer order
and sent back averaged instead of applied (``REDUCE_FLAG`` on a dense push and pull, ``dense.DenseBlock``)."""

from __future__ import annotations

import math
from typing import Callable, Dict, Optional, Set, Tuple

import numpy as np

from ..errors import ProtocolError
from ..wire import protocol as P
from .budget import Budget
from .net import Conn
from .shard import Shard


class Average:
    """Shard ``shard``'s average of sync step ``step``: the trainers' gradients summed in trainer order (``who``:
    each one in the sum, and whether it had a gradient), their average once ``done``. Its buffer is made, and
    charged to ``budget``, on the first ``synchronize()``."""

    def __init__(self, shard: Shard, shape: Tuple[int, ...], dtype: np.dtype, budget: Optional[Budget]) -> None:
        self.shard, self.shape, self.dtype, self.budget = shard, shape, dtype, budget
        self.sum: Optional[np.ndarray] = None
        self.step = -1
        self.who: Dict[int, bool] = {}
        self.receiving: Set[int] = set()
        self.done = False

    def push(self, conn: Conn, h: P.Header, check: Optional[Callable[[np.ndarray], None]]) -> None:
        """Trainer ``conn.trainer``'s gradient for sync step ``h.step`` (``NOGRAD_FLAG``: it has none), summed in
        trainer order into the average of that step (``check`` sees it first); nothing is applied. A repeat of a
        push already counted is read and dropped."""
        t, shard = conn.trainer, self.shard
        sync = shard.sync
        with shard.cv:
            shard.step.wait(h.step, "synchronize")  # every earlier step applied: its average is no longer read
            if self.sum is None:
                nbytes = math.prod(self.shape) * self.dtype.itemsize
                if self.budget is not None:
                    self.budget.charge(nbytes, f"the averaged gradient of {shard.label()} (synchronize())")
                self.sum = np.empty(self.shape, dtype=self.dtype)
            total = self.sum
            if self.step != h.step:
                self.step, self.who, self.done = h.step, {}, False
            repeat = t in self.who or t in self.receiving
            self.receiving.add(t)
        if repeat:
            conn.stream.discard()
            return
        try:
            g = conn.buffer(self.shape, self.dtype)
            conn.stream.recv_into(g)
            if check is not None:
                check(g)
            with shard.cv:
                def turn() -> bool:
                    return sync.in_order(t, self.who.keys())
                if not turn():
                    sync.wait(shard.cv, turn, h.step, f"synchronize {shard.label()}: summing in trainer order",
                              lambda: {u for u in sync.active if u < t} - set(self.who))
                if self.who:
                    np.add(total, g, out=total)
                else:
                    np.copyto(total, g)
                self.who[t] = not h.status & P.NOGRAD_FLAG
                self.trainer_closed()
        finally:
            with shard.cv:
                self.receiving.discard(t)
                shard.cv.notify_all()

    def trainer_closed(self) -> None:
        """(Holding the shard's ``cv``.) Once every active trainer is in the sum, it becomes their average."""
        if self.sum is None or self.done or not self.who or not self.shard.sync.active <= self.who.keys():
            return
        if len(self.who) > 1:
            self.sum /= self.dtype.type(len(self.who))
        self.done = True
        self.shard.cv.notify_all()

    def pull(self, conn: Conn, h: P.Header) -> None:
        """Reply with the average of sync step ``h.step`` once every active trainer is in it; with
        ``NOGRAD_FLAG`` when no trainer had a gradient."""
        shard = self.shard
        with shard.cv:
            total = self.sum
            if total is None or self.step != h.step:
                raise ProtocolError(f"{shard.label()}: trainer {conn.trainer} pulls the average of step {h.step}, "
                                    "which it did not push (synchronize())")
            shard.sync.wait(shard.cv, lambda: self.done or self.step != h.step, h.step,
                            f"synchronize {shard.label()}", lambda: set(shard.sync.active) - set(self.who),
                            lambda: conn.gone)
            flag = 0 if any(self.who.values()) else P.NOGRAD_FLAG
        # Sent outside the lock: nothing changes it until this trainer pushes again, after reading it.
        conn.stream.send(P.pack_header(P.Op.DATA, P.dtype_code(self.dtype), flag, key=h.key, step=h.step,
                                       length=total.nbytes), total)
