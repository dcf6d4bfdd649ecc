"""The slots sync SGD sums a pserver's dense pushes in (``AccPool``): one segment (``stream.SEGMENT``) each, a
bounded number of them, so a trainer further ahead than the pool allows waits for the others
(``dense.DenseBlock.push_segments``)."""

from __future__ import annotations

import threading
from typing import Callable, List, Optional

import numpy as np

from ..wire.stream import SEGMENT
from .sync import Sync


class AccPool:
    """Accumulator slots of one segment each, at most ``nbytes`` of them (at least one)."""

    def __init__(self, nbytes: int) -> None:
        self.cv = threading.Condition()
        self.free: List[np.ndarray] = []
        self.left = max(1, nbytes // SEGMENT)  # slots that may still be allocated
        self.waiting = 0  # threads in ``take``: give and poke wake no one when there are none

    def take(self, sync: Sync, t: int, step: int, what: str, unless: Callable[[], bool]) -> Optional[np.ndarray]:
        """A free slot for trainer ``t``; None as soon as ``unless()`` (the slot is no longer needed: another
        trainer started the segment, or the step completed)."""
        with self.cv:
            self.waiting += 1
            try:
                sync.wait(self.cv, lambda: bool(self.free) or self.left > 0 or unless(), step,
                          f"{what}: waiting for the other trainers to catch up", lambda: set(sync.active) - {t})
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
