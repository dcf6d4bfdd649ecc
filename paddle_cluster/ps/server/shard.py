"""What every shard of a pserver is (``Shard``: a dense block, ``dense.DenseBlock``, or a table's shard,
``table.TableShard``) and its step (``Step``): the step's number, the trainers whose contribution to it is in
(``pending``) and those whose push is being received (``receiving``), the sync-mode barrier on it, telling a
repeated push from a new one, and moving the shard on to its next step. Each shard answers push and pull
through its step; what a contribution is and how the step's sum is applied is the shard's.

Each shard has its own condition variable (``cv``), its step and how far into the server's hyper-parameter
history it is.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, Optional, Set

from ..counters import PROCESS
from ..errors import RemoteError
from ..optim import OptimizerSpec

if TYPE_CHECKING:
    from .sync import Sync


class Shard:
    """What dense blocks and table shards share: a step (``Step``, with its barrier) and a hyper-parameter
    cursor. Each answers push and pull through its step: ``Step.begin`` takes a push or tells a repeat,
    ``Step.wait`` holds a pull until its step is there."""

    def __init__(self, key: int, name: str, spec: OptimizerSpec, declared: Dict[str, Any], step: int,
                 sync: Sync) -> None:
        self.key = key
        self.name = name
        self.spec = spec
        self.declared = declared  # spec as first defined; later definitions must match it
        self.sync = sync
        self.lock = threading.RLock()
        self.cv = threading.Condition(self.lock)
        self.step = Step(self, sync, step)
        self.hyper_seen = 0  # the last hyper-parameter change (``HyperChange.seq``) applied to ``spec``
        # Defined by trainer 0 (the one authority on the model); False for a shard restored from a checkpoint
        # until trainer 0 defines it again. Other trainers' definitions wait for it and must agree.
        self.confirmed = True
        self.initialized = True  # a dense block is not until trainer 0 sends its value
        self.error: Optional[str] = None  # a failed optimizer apply: its pulls report it

    def label(self) -> str:
        raise NotImplementedError

    def wake(self) -> None:
        """(Holding ``cv``.) Something any waiter may be waiting for changed: wake every one."""
        self.cv.notify_all()


class Step:
    """A shard's step: who is in it, its barrier, and moving on. (Every method but ``missing`` is called holding
    the shard's ``cv``.)"""

    def __init__(self, shard: Shard, sync: Sync, n: int) -> None:
        self.shard = shard
        self.sync = sync
        self.n = n  # the step the shard is at: its values are those after step ``n - 1``
        self.pending: Dict[int, Any] = {}  # trainer -> its contribution to step ``n``
        self.receiving: Set[int] = set()
        self.busy = False  # the step's sum is being applied (a push of it now is a repeat)

    def wait(self, step: int, what: str, gone: Optional[Callable[[], bool]] = None) -> None:
        """Wait until the shard may serve ``step``: initialised, and in sync mode at it (``gone``: the trainer
        waiting went away, see ``Sync.wait``). A shard whose update was refused fails the wait with its message."""
        shard, sync = self.shard, self.sync
        if shard.error:
            raise RemoteError(f"pserver {sync.pserver_id}: {shard.error}")
        if not shard.initialized:
            sync.wait(shard.cv, lambda: shard.initialized, step, f"{what} {shard.label()}: initial value",
                      lambda: {0} - sync.closed)
        if sync.mode == "sync":
            t0 = time.monotonic()
            if self.n < step:  # checked first: the wait's message is built only when it waits
                sync.wait(shard.cv, lambda: self.n >= step or shard.error is not None, step,
                          f"{what} {shard.label()}", self.missing, gone)
            PROCESS.add_wait(time.monotonic() - t0)  # ``top``'s barrier wait p50/p99 (a step not waited for: 0)
            if self.n < step and shard.error:  # the update of the step waited for was refused
                raise RemoteError(f"pserver {sync.pserver_id}: {shard.error}")

    def missing(self) -> Set[int]:
        """The active trainers neither in the step's sum nor being received."""
        return set(self.sync.active) - set(self.pending) - self.receiving

    def begin(self, t: int, step: int) -> bool:
        """Trainer ``t`` pushes for ``step``: wait until the shard may take it (``wait``). True, with ``t`` now
        receiving, for a new push; False for a repeat of one already counted or still being received (a resend:
        the caller reads it and drops it)."""
        self.wait(step, "push")
        repeat = t in self.receiving
        if self.sync.mode == "sync":
            repeat = repeat or step < self.n or t in self.pending or self.busy
        if not repeat:
            self.receiving.add(t)
        return not repeat

    def end(self, t: int) -> None:
        """Trainer ``t``'s push has been taken or has failed: it no longer counts as receiving (the caller wakes
        the shard's waiters)."""
        self.receiving.discard(t)

    def full(self) -> bool:
        """Has every active trainer contributed to this step?"""
        return bool(self.pending) and self.sync.active.issubset(self.pending.keys())

    def next(self) -> None:
        """The step's update is in: move to the next step."""
        self.n += 1
        self.pending.clear()

    @contextmanager
    def advancing(self, at: Optional[int]) -> Iterator[None]:
        """``with step.advancing(at): <the update>``: the update runs with the hyper-parameters effective at step
        ``at`` (None: every change so far), outside any snapshot, and the shard moves to its next step once it
        is done. The contributions are dropped whether or not it succeeds (one that failed leaves the shard's
        ``error`` set: it serves nothing more)."""
        try:
            with self.sync.rw.shared():
                self.sync.apply_hyper(self.shard, at)
                yield
                self.n += 1
        finally:
            self.pending.clear()
