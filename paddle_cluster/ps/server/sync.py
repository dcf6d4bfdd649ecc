"""Who trains and in what order on one pserver (``Sync``): the mode and staleness bound trainer 0 declared, the
active and closed trainers, the order a step's sum follows, bounded waits, and the hyper-parameter history.
What a step is and who is in it is each shard's (``shard.Step``); it asks here.

Waits are bounded by ``barrier_timeout`` and fail with a ``BarrierTimeout`` naming the trainers that never
arrived (and when the pserver last heard from each). A closed trainer stops counting, so a barrier waiting only
for it completes.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Set, Tuple

from ..errors import BarrierTimeout, ConfigMismatch, ConnectionLost, MissingTrainer, RemoteError

log = logging.getLogger("paddle_cluster.ps")
MAX_PENDING_HYPER = 1024  # changes not yet applied by every shard
MAX_HYPER_NAMES = 4096  # distinct names hyper-parameter changes may name
HYPER_HELD = 1024  # bytes a waiting change is charged besides its names (its values, the record, the list entry)
NAME_HELD = 100  # bytes per name of a waiting change besides its characters (the str object, the set entry)
POLL = 1.0  # s between looks at the deadline and at shutdown while waiting; a notify wakes a waiter sooner


@dataclass(frozen=True)
class HyperChange:
    """One SET_HYPER: ``values`` from step ``from_step`` on, for the shards ``names`` (None: all)."""

    seq: int
    from_step: int
    values: Dict[str, float]
    names: Optional[frozenset]
    held: int = 0  # bytes charged to the pserver's budget while it waits


def hyper_bytes(names: Optional[Iterable[str]]) -> int:
    """What a waiting change holds, as charged to the budget."""
    return HYPER_HELD + sum(len(n) + NAME_HELD for n in names or ())


class HyperHistory:
    """The hyper-parameter changes in order, bounded: a change every shard has applied is folded into
    ``base`` (what a shard defined later starts from), and at most ``MAX_PENDING_HYPER`` may wait. A shard
    is known here by its cursor: the last change it applied (``Shard.hyper_seen``)."""

    def __init__(self) -> None:
        self.changes: List[HyperChange] = []  # replaced, never changed in place: readers hold no lock
        self.next_seq = 1
        self.base: Dict[Optional[str], Dict[str, Tuple[int, float]]] = {}
        self.base_seq = 0  # every change up to this one is in ``base``
        self._release: Callable[[int], None] = lambda n: None  # the budget a waiting change is charged to

    def add(self, from_step: int, values: Dict[str, float], names: Optional[frozenset],
            seen: Iterable[int], budget: Any = None) -> None:
        """(Holding ``Sync.lock``.) Record a change, charged to ``budget`` until every shard (``seen``: their
        cursors) has applied it; ConfigMismatch when too many are waiting, LimitExceeded when the budget has no
        room for it."""
        self._compact(seen)
        if len(self.changes) >= MAX_PENDING_HYPER:
            raise ConfigMismatch(f"{len(self.changes)} hyper-parameter changes are waiting for a step that has not "
                                 "been reached; set them once per step at most")
        if names is not None and len(set(self.base) | names) > MAX_HYPER_NAMES:
            raise ConfigMismatch(f"hyper-parameter changes may name at most {MAX_HYPER_NAMES} parameters")
        held = 0
        if budget is not None:
            held = hyper_bytes(names)
            budget.charge(held, f"a hyper-parameter change naming {len(names or ())} parameters, waiting for its step")
            self._release = budget.release
        self.changes = [*self.changes, HyperChange(self.next_seq, from_step, values, names, held)]
        self.next_seq += 1

    def _compact(self, seen: Iterable[int]) -> None:
        done = min(seen, default=self.next_seq - 1)
        for c in self.changes:
            if c.seq <= done:
                for who in [None] if c.names is None else sorted(c.names):
                    self.base.setdefault(who, {}).update({k: (c.seq, v) for k, v in c.values.items()})
                self._release(c.held)
        self.changes = [c for c in self.changes if c.seq > done]
        self.base_seq = max(self.base_seq, done)

    def start(self, name: str, seen: Iterable[int]) -> Tuple[Dict[str, float], int]:
        """(Holding ``Sync.lock``.) Where shard ``name``, defined now besides the shards at ``seen``, starts:
        the values of the changes they all applied, and its cursor (``Shard.start_hyper``)."""
        self._compact(seen)
        latest: Dict[str, Tuple[int, float]] = {}
        for who in (None, name):
            for k, (seq, v) in self.base.get(who, {}).items():
                if k not in latest or seq > latest[k][0]:
                    latest[k] = (seq, v)
        return {k: v for k, (_, v) in latest.items()}, self.base_seq

    def pending(self, seen: int) -> List[HyperChange]:
        """The changes a shard at cursor ``seen`` has not applied."""
        return [c for c in self.changes if c.seq > seen]


class RWLock:
    """Optimizer applies share it; a checkpoint snapshot takes it exclusively (a consistent cut).

    ``shared()`` is taken for every segment applied, so it is the lock itself (entered as a reader), not a
    generator, entered through the plain lock (a ``Condition``'s ``with`` is a Python call), and a reader
    leaving wakes no one unless a writer waits for the last one."""

    def __init__(self) -> None:
        self._mu = threading.Lock()
        self._cv = threading.Condition(self._mu)
        self._readers = 0
        self._writer = False

    def shared(self) -> RWLock:
        return self

    def __enter__(self) -> None:
        with self._mu:
            while self._writer:
                self._cv.wait()
            self._readers += 1

    def __exit__(self, *exc: Any) -> None:
        with self._mu:
            self._readers -= 1
            if self._writer and not self._readers:
                self._cv.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cv:
            while self._writer:
                self._cv.wait()
            self._writer = True
            while self._readers:
                self._cv.wait()
        try:
            yield
        finally:
            with self._cv:
                self._writer = False
                self._cv.notify_all()


class Sync:
    """Who is active, who closed and when each trainer was last heard from; the order a step's sum follows;
    the mode and staleness bound trainer 0 declared; the hyper-parameter history; bounded waits (a shard's step
    waits through ``wait``)."""

    def __init__(self, pserver_id: int, trainers: int, barrier_timeout: float, done: threading.Event) -> None:
        self.pserver_id = pserver_id
        self.trainers = trainers
        self.barrier_timeout = float(barrier_timeout)
        self.done = done
        self.lock = threading.Condition()
        self.mode: Optional[str] = None
        self.staleness: Optional[int] = None  # async: drop dense gradients computed on values this old
        self._set_active(range(trainers))
        self.closed: Set[int] = set()
        self.last_seen: Dict[int, float] = {}
        # trainer -> when a barrier here last timed out waiting for it: a later wait for it alone, with nothing
        # heard from it since, fails at once (``wait``)
        self.given_up: Dict[int, float] = {}
        self.hyper = HyperHistory()
        self.rw = RWLock()

    # -- trainers ------------------------------------------------------------------------------------------

    def _set_active(self, active: Iterable[int]) -> None:
        self.active = frozenset(active)
        order = sorted(self.active)
        # The trainer-order rule, worked out once per change of the active set (it is asked per segment).
        self._first_two = frozenset(order[:2])
        self._before = {t: frozenset(order[:k]) for k, t in enumerate(order)}

    def _rank(self, t: int) -> Tuple[frozenset, frozenset]:
        """(The trainers before ``t``, the first two) in trainer order; one not active (it closed) is ordered
        among the active as if it were."""
        before = self._before.get(t)
        if before is not None:
            return before, self._first_two
        order = sorted(self.active | {t})
        return frozenset(order[:order.index(t)]), frozenset(order[:2])

    def in_order(self, t: int, who: Any) -> bool:
        """May trainer ``t`` add its gradient to a sum that holds ``who`` (a set of trainers) now? After every
        active trainer before it, or as one of the first two in either order (float addition commutes), so
        the sum never depends on arrival order."""
        before, first_two = self._rank(t)
        return before <= who or (t in first_two and who <= first_two)

    def first_two(self, t: int) -> bool:
        """Is trainer ``t`` one of the first two in trainer order, with another trainer active besides it?"""
        return len(self.active) > (t in self.active) and t in self._rank(t)[1]

    def touch(self, trainer: int) -> None:
        if trainer >= 0:
            self.last_seen[trainer] = time.monotonic()

    def _missing(self, trainers: Iterable[int]) -> List[MissingTrainer]:
        now = time.monotonic()
        out = []
        for t in sorted(trainers):
            seen = self.last_seen.get(t)
            out.append(MissingTrainer(t, None if seen is None else round(now - seen, 1)))
        return out

    def close_trainer(self, t: int) -> bool:
        """Trainer ``t`` is done: its barriers stop counting it (the caller completes the steps that were waiting
        only for it). True once every trainer has closed."""
        with self.lock:
            self.closed.add(t)
            self._set_active(self.active - {t})
            all_closed = len(self.closed) >= self.trainers
            self.lock.notify_all()
        log.info("pserver %d: trainer %d closed (%d of %d closed)", self.pserver_id, t, len(self.closed),
                 self.trainers)
        return all_closed

    # -- waiting -------------------------------------------------------------------------------------------

    def wait(self, cv: threading.Condition, ready: Callable[[], bool], step: int, what: str,
             missing: Callable[[], Any], gone: Optional[Callable[[], bool]] = None) -> None:
        """Wait (holding ``cv``) until ``ready()``; on timeout raise a BarrierTimeout naming ``missing()``;
        ``gone()``: the trainer waiting has gone (ConnectionLost)."""
        if ready():
            return
        self._fail_if_given_up(step, what, missing)
        deadline = time.monotonic() + self.barrier_timeout
        while not ready():
            if self.done.is_set():
                raise RemoteError(f"pserver {self.pserver_id} is shutting down")
            if gone is not None and gone():
                raise ConnectionLost(f"pserver {self.pserver_id}: the trainer went away during {what}")
            left = deadline - time.monotonic()
            if left <= 0:
                missing_now = self._missing(missing())
                now = time.monotonic()
                self.given_up.update((m.trainer_id, now) for m in missing_now)
                waiting = ", ".join(m.label() for m in missing_now) or "no trainer (it should have completed)"
                raise BarrierTimeout(
                    f"barrier timeout at step {step} on pserver {self.pserver_id} ({what}): waiting for {waiting} "
                    f"for more than {self.barrier_timeout:g} s", step, self.pserver_id, missing_now)
            cv.wait(min(left, POLL))

    def _fail_if_given_up(self, step: int, what: str, missing: Callable[[], Any]) -> None:
        """Raise the BarrierTimeout at once when a trainer this wait is for was given up on by an earlier barrier
        of this pserver and has sent nothing since: the wait cannot end sooner than that trainer comes, and the
        requests behind the first one on a connection would otherwise each wait a barrier timeout more for it
        (N blocks: N times the timeout before the waiting trainer hears, by when the missing one may have been
        dropped as idle and meet a broken connection instead of this error)."""
        if not self.given_up:
            return
        who = set(missing())
        if not any(self.last_seen.get(t, -1.0) <= self.given_up.get(t, -math.inf) for t in who):
            return
        gone = self._missing(who)
        waiting = ", ".join(m.label() for m in gone)
        raise BarrierTimeout(f"barrier timeout at step {step} on pserver {self.pserver_id} ({what}): waiting for "
                             f"{waiting} for more than {self.barrier_timeout:g} s (nothing heard from it since an "
                             "earlier barrier timed out)", step, self.pserver_id, gone, again=True)
