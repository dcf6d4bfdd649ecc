"""A process's own figures for ``paddle-cluster top``: bytes it sent and received on its pserver connections,
its step, the barrier waits of a pserver, written once a second to ``<job dir>/log/figures.<name>.json``.

One set per process (``PROCESS``): a process is one trainer or one pserver, and its streams and barriers add
to it without each constructor on the way being handed a counter. A frame costs one addition to its
connection's tally; the file is written by one thread, whole (temporary file, rename), so a reader never sees
half of one.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, Callable, Dict, List, Optional

PERIOD_S = 1.0  # how often the figures file is rewritten (``top`` refreshes about as often)


def percentile(xs: List[float], q: float) -> Optional[float]:
    """The ``q`` quantile (0..1) of ``xs`` by the nearest rank; None when empty."""
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(round(q * len(s) + 0.5)) - 1))]


class Counters:
    """Totals since the process began, and the barrier waits since the last ``interval``.

    Bytes are counted per connection (``tally``: a stream has one reader and one writer, so its two counts need
    no lock) and summed when read; a wait is one list append (atomic under the GIL)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tallies: List[List[int]] = []  # [sent, received] of every connection made (two ints each)
        self._waits: List[float] = []

    def tally(self) -> List[int]:
        """A new connection's ``[sent, received]`` byte counts, for it alone to add to."""
        t = [0, 0]
        with self._lock:
            self._tallies.append(t)
        return t

    def add_wait(self, seconds: float) -> None:
        if len(self._waits) < 100_000:  # bounded: a pserver with thousands of blocks waits often
            self._waits.append(seconds)

    def interval(self) -> Dict[str, Any]:
        """The totals and the waits since the previous call (which it forgets)."""
        with self._lock:
            tallies = list(self._tallies)
        waits, self._waits = self._waits, []
        return {"sent": sum(t[0] for t in tallies), "received": sum(t[1] for t in tallies), "waits": waits}


PROCESS = Counters()


class FiguresWriter:
    """Writes ``figures()`` (the process's own, e.g. its step) plus the counters' rates to ``path`` every
    ``PERIOD_S`` from a daemon thread, until ``stop``."""

    def __init__(self, path: str, figures: Callable[[], Dict[str, Any]], counters: Counters = PROCESS) -> None:
        self.path, self.figures, self.counters = path, figures, counters
        self._stop = threading.Event()
        self._last: Optional[Dict[str, Any]] = None
        self._step: Any = None
        self._advanced = time.time()
        self._thread = threading.Thread(target=self._run, name="figures", daemon=True)

    def start(self) -> FiguresWriter:
        self.write()  # the first one at once: ``top`` shows the process from its start
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.write()  # the last word: its final step

    def _run(self) -> None:
        while not self._stop.wait(PERIOD_S):
            self.write()

    def write(self) -> None:
        try:
            doc = self.sample()
            tmp = f"{self.path}.tmp-{os.getpid()}-{threading.get_ident()}"
            with open(tmp, "w") as f:
                json.dump(doc, f)
            os.replace(tmp, self.path)
        except (OSError, ValueError, TypeError):
            pass  # a full disk or a gone job directory: ``top`` shows the figures as old, the process goes on

    def sample(self) -> Dict[str, Any]:
        now, mono = time.time(), time.monotonic()
        c = self.counters.interval()
        doc: Dict[str, Any] = dict(self.figures())
        if doc.get("step") != self._step:
            self._step, self._advanced = doc.get("step"), now
        doc.update(time=now, advanced_at=self._advanced, sent=c["sent"], received=c["received"],
                   wait_p50=percentile(c["waits"], 0.5), wait_p99=percentile(c["waits"], 0.99), waits=len(c["waits"]))
        last = self._last
        if last is not None and mono > last["mono"]:
            dt = mono - last["mono"]
            doc["sent_per_s"] = (c["sent"] - last["sent"]) / dt
            doc["received_per_s"] = (c["received"] - last["received"]) / dt
            if isinstance(doc.get("step"), int) and isinstance(last["step"], int):
                doc["steps_per_s"] = (doc["step"] - last["step"]) / dt
            if "ps_seconds" in doc and last["ps_seconds"] is not None:  # a trainer's time in pserver calls
                doc["ps_share"] = min(1.0, (doc["ps_seconds"] - last["ps_seconds"]) / dt)
        self._last = {"mono": mono, "sent": c["sent"], "received": c["received"], "step": doc.get("step"),
                      "ps_seconds": doc.get("ps_seconds")}
        return doc
