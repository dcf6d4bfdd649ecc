"""The one rule for every long-running command (``run``, ``logs -f``): Ctrl+C, SIGTERM and SIGHUP all end it.

Inside ``stoppable()`` the first of those signals raises ``KeyboardInterrupt`` in the main thread, so the
command's own ``finally`` stops whatever it started on the nodes; a repeated signal calls ``on_repeat``
(``run``: skip the grace period). SIGHUP is there because a closed terminal or a dropped SSH session to the
launching machine must end a command exactly as Ctrl+C does, not leave its node-side processes running.
"""

from __future__ import annotations

import contextlib
import signal
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass
class Interrupts:
    """How many stop signals arrived, and the callback for the second and later ones."""

    count: int = 0
    on_repeat: Optional[Callable[[], None]] = None


@contextlib.contextmanager
def stoppable(on_repeat: Optional[Callable[[], None]] = None) -> Iterator[Interrupts]:
    """Turn SIGINT, SIGTERM and SIGHUP into ``KeyboardInterrupt`` (the first) and ``on_repeat`` (the next)."""
    state = Interrupts(0, on_repeat)

    def handler(_signum: int, _frame: object) -> None:
        state.count += 1
        if state.count == 1:
            raise KeyboardInterrupt
        if state.on_repeat is not None:
            state.on_repeat()

    old = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield state
    finally:
        for s, h in old.items():
            signal.signal(s, h)
