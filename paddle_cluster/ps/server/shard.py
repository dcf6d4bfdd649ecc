"""What every shard of a pserver is (``Shard``: a dense block, ``dense.DenseBlock``, or a table's shard,
``table.TableShard``) and its step (``Step``): the step's number, the trainers whose contribution to it is in
and those whose push is being received, the sync-mode barrier on it, telling a repeated push from a new one,
the trainer order contributions are added in, and moving the shard on to its next step.

A shard answers what ``Shard`` declares -- ``push``, ``pull``, ``trainer_closed`` -- through its step; what a
contribution is, how the step's sum is applied and which frames it takes is the shard's own. Each shard has
its own condition variable (``cv``), its step and how far into the server's hyper-parameter history it is.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterable, Iterator, KeysView, List, Optional, Set

from ..counters import PROCESS
from ..errors import RemoteError
from ..optim import OptimizerSpec
from ..wire import protocol as P
from .net import Conn
from .sync import Sync


class Shard(ABC):
    """What dense blocks and table shards answer and share: a step (``Step``, with its barrier) and a
    hyper-parameter cursor. Each checks its own frames (dtype, length) and answers through its step:
    ``Step.begin`` takes a push or tells a repeat, ``Step.wait`` holds a pull until its step is there."""

    def __init__(self, key: int, name: str, spec: OptimizerSpec, declared: Dict[str, Any], step: int,
                 sync: Sync) -> None:
        self.key = key
        self.name = name
        self.spec = spec
        self.declared = declared  # spec as first defined; later definitions must match it
        self.sync = sync
        self.lock = threading.RLock()
        self.cv = threading.Condition(self.lock)
        self.step = Step(self, step)
        self.hyper_seen = 0  # the last hyper-parameter change (``HyperChange.seq``) applied to ``spec``
        # Defined by trainer 0 (the one authority on the model); False for a shard restored from a checkpoint
        # until trainer 0 defines it again. Other trainers' definitions wait for it and must agree.
        self.confirmed = True
        self.initialized = True  # a dense block is not until trainer 0 sends its value
        self.error: Optional[str] = None  # a failed optimizer apply: its pulls report it

    @abstractmethod
    def push(self, conn: Conn, h: P.Header) -> bool:
        """Take trainer ``conn.trainer``'s push for step ``h.step`` (its payload read from ``conn``); a repeat of
        one already counted is read and dropped. False: async mode dropped it as staler than its bound."""

    @abstractmethod
    def pull(self, conn: Conn, h: P.Header) -> None:
        """Reply to trainer ``conn.trainer`` with the values of step ``h.step`` (waited for in sync mode)."""

    @abstractmethod
    def trainer_closed(self) -> None:
        """(Holding ``cv``.) A trainer closed: a step that was waiting only for it completes now."""

    @abstractmethod
    def label(self) -> str:
        """The shard in a message: ``block w[0:64]``, ``table 'emb'``."""

    def wake(self) -> None:
        """(Holding ``cv``.) Something any waiter may be waiting for changed: wake every one."""
        self.cv.notify_all()

    # -- hyper-parameters ----------------------------------------------------------------------------------

    def start_hyper(self, others: Iterable[Shard]) -> None:
        """(Holding ``Sync.lock``.) A shard defined now, besides ``others``, starts from the hyper-parameter
        changes they all applied; later ones reach it as they reach every shard."""
        values, self.hyper_seen = self.sync.hyper.start(self.name, [s.hyper_seen for s in others])
        for k, v in values.items():
            setattr(self.spec, k, v)

    def apply_hyper(self, step: Optional[int]) -> None:
        """Catch ``spec`` up with the hyper-parameter changes effective at ``step`` (None: all)."""
        changes = self.sync.hyper.changes
        if not changes or changes[-1].seq <= self.hyper_seen:  # the common case, once per segment applied
            return
        for c in self.sync.hyper.pending(self.hyper_seen):
            if step is not None and c.from_step > step:
                break
            if c.names is None or self.name in c.names:
                for k, v in c.values.items():
                    setattr(self.spec, k, v)
            self.hyper_seen = c.seq

    def spec_at(self, step: int) -> Dict[str, Any]:
        """The spec the update of ``step`` will use: includes hyper-parameter changes not yet applied."""
        spec = self.spec.to_dict()
        for c in self.sync.hyper.pending(self.hyper_seen):
            if self.sync.mode == "sync" and c.from_step > step:
                break
            if c.names is None or self.name in c.names:
                spec.update(c.values)
        return spec


class Step:
    """A shard's step: who is in it, its barrier, the order its contributions are added in, and moving on.
    (Every method but ``missing`` is called holding the shard's ``cv``.)"""

    def __init__(self, shard: Shard, n: int) -> None:
        self.shard = shard
        self.sync = shard.sync
        self._n = n
        self._pending: Dict[int, Any] = {}  # trainer -> its contribution to step ``n``
        self._receiving: Set[int] = set()
        self._busy = False  # the step's sum is being applied (a push of it now is a repeat)

    @property
    def n(self) -> int:
        """The step the shard is at: its values are those after step ``n - 1``."""
        return self._n

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
            if self._n < step:  # checked first: the wait's message is built only when it waits
                sync.wait(shard.cv, lambda: self._n >= step or shard.error is not None, step,
                          f"{what} {shard.label()}", self.missing, gone)
            PROCESS.add_wait(time.monotonic() - t0)  # ``top``'s barrier wait p50/p99 (a step not waited for: 0)
            if self._n < step and shard.error:  # the update of the step waited for was refused
                raise RemoteError(f"pserver {sync.pserver_id}: {shard.error}")

    def missing(self) -> Set[int]:
        """The active trainers neither in the step's sum nor being received."""
        return set(self.sync.active) - set(self._pending) - self._receiving

    def begin(self, t: int, step: int) -> bool:
        """Trainer ``t`` pushes for ``step``: wait until the shard may take it (``wait``). True, with ``t`` now
        receiving, for a new push; False for a repeat of one already counted or still being received (a resend:
        the caller reads it and drops it)."""
        self.wait(step, "push")
        repeat = t in self._receiving
        if self.sync.mode == "sync":
            repeat = repeat or step < self._n or t in self._pending or self._busy
        if not repeat:
            self._receiving.add(t)
        return not repeat

    def end(self, t: int) -> None:
        """Trainer ``t``'s push has been taken or has failed: it no longer counts as receiving (the caller wakes
        the shard's waiters)."""
        self._receiving.discard(t)

    def take(self, t: int, step: int, contribution: Any = True) -> bool:
        """Count trainer ``t``'s ``contribution`` to ``step`` if the shard is still at it (else the step moved on
        without it: a trainer closed, or it came too late); True if it was counted."""
        if self._n != step:
            return False
        self._pending[t] = contribution
        return True

    def started(self) -> bool:
        """Is some trainer's contribution to this step in?"""
        return bool(self._pending)

    def contributors(self) -> KeysView[int]:
        """The trainers whose contribution to this step is in."""
        return self._pending.keys()

    def contributions(self) -> List[Any]:
        """Their contributions, in trainer order."""
        return [self._pending[t] for t in sorted(self._pending)]

    def in_turn(self, t: int) -> bool:
        """May trainer ``t`` add its contribution to this step's sum now? Not while the sum is being applied;
        then in trainer order (``Sync.in_order``)."""
        return not self._busy and self.sync.in_order(t, self._pending.keys())

    def full(self) -> bool:
        """Has every active trainer contributed to this step?"""
        return bool(self._pending) and self.sync.active.issubset(self._pending.keys())

    def hand_off(self) -> bool:
        """The step is full: True once, for the caller that is to apply it (elsewhere: ``advancing`` ends it);
        until then a push of it is a repeat."""
        if self._busy or not self.full():
            return False
        self._busy = True
        return True

    def next(self) -> None:
        """The step's update is in: move to the next step."""
        self._n += 1
        self._pending.clear()

    @contextmanager
    def advancing(self, at: Optional[int]) -> Iterator[None]:
        """``with step.advancing(at): <the update>``: the update runs with the hyper-parameters effective at step
        ``at`` (None: every change so far), outside any snapshot, and the shard moves to its next step once it
        is done. The contributions are dropped whether or not it succeeds (one that failed leaves the shard's
        ``error`` set: it serves nothing more), and a step handed off (``hand_off``) is no longer."""
        try:
            with self.sync.rw.shared():
                self.shard.apply_hyper(at)
                yield
                self._n += 1
        finally:
            self._pending.clear()
            self._busy = False
