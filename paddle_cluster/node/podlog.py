"""A Kubernetes pod's log, written by its entry point alone (``node/pod.py``).

The launcher reads the entry point's own lines from the log -- ``paddle-cluster pod: figures {...}`` for
``top``, ``ready:``/``error:`` events, a trainer's ``metrics`` records -- so the job's process must not be able
to write one. Its stdout and stderr are pipes to the entry point, which relays them into the log with every
``paddle-cluster pod: `` in them made inert (``paddle-cluster pod (from the process): ``), across reads too;
the entry point writes its own lines whole, starting a line. The entry point is also made non-dumpable, so the
process (same user) cannot open ``/proc/1/fd/1`` and write into the log past the relay, nor read
``/proc/1/environ``.
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Dict, List

PREFIX = b"paddle-cluster pod: "
INERT = b"paddle-cluster pod (from the process): "  # holds no PREFIX, nor makes one with what is around it
_PR_SET_DUMPABLE = 4
READ = 64 << 10


def not_dumpable() -> bool:
    """Make this process non-dumpable (its ``/proc/<pid>`` files then belong to root: another process of the same
    user cannot open its descriptors or read its environment); whether it could."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _held(data: bytes) -> int:
    """How many bytes at the end of ``data`` could be the start of a PREFIX still to come."""
    for k in range(min(len(PREFIX) - 1, len(data)), 0, -1):
        if PREFIX.startswith(data[-k:]):
            return k
    return 0


class Inert:
    """One stream's bytes with every PREFIX made inert: ``feed`` returns what may be written now (a possible
    start of a PREFIX is held until the next bytes say), ``end`` the rest."""

    def __init__(self) -> None:
        self._hold = b""

    def feed(self, data: bytes) -> bytes:
        out = (self._hold + data).replace(PREFIX, INERT)
        k = _held(out)
        self._hold = out[len(out) - k:] if k else b""
        return out[:len(out) - k] if k else out

    def end(self) -> bytes:
        out, self._hold = self._hold, b""
        return out


class PodLog:
    """The pod's stdout (1) and stderr (2): the entry point's lines and the relayed output of its process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._mid: Dict[int, bool] = {1: False, 2: False}  # a relayed line not ended yet on that descriptor
        self._relays: List[threading.Thread] = []

    def line(self, text: str, fd: int = 2) -> None:
        """One line of the entry point's own, starting a line (after a newline if relayed output is mid-line)."""
        data = ("\n" if self._mid[fd] else "") + text.replace("\n", " ") + "\n"
        with self._lock:
            self._write(fd, data.encode(errors="replace"))
            self._mid[fd] = False

    def _write(self, fd: int, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                n = os.write(fd, view)
            except InterruptedError:
                continue
            except OSError:
                return  # the log is gone (the pod ends): nothing to write to
            view = view[n:]

    def relay(self, src: int, fd: int) -> None:
        """Copy the pipe ``src`` (the process's output) into descriptor ``fd`` until its end, on a thread."""
        t = threading.Thread(target=self._relay, args=(src, fd), daemon=True, name=f"relay-{fd}")
        t.start()
        self._relays.append(t)

    def _relay(self, src: int, fd: int) -> None:
        inert = Inert()
        try:
            while True:
                try:
                    data = os.read(src, READ)
                except InterruptedError:
                    continue
                except OSError:
                    data = b""
                out = inert.feed(data) if data else inert.end()
                if out:
                    with self._lock:
                        self._write(fd, out)
                        self._mid[fd] = not out.endswith(b"\n")
                if not data:
                    return
        finally:
            os.close(src)

    def drain(self, timeout: float = 2.0) -> None:
        """Wait up to ``timeout`` s for the relays to reach the end of the process's output (a descendant that
        keeps the pipe open does not hold the pod)."""
        for t in self._relays:
            t.join(timeout)


LOG = PodLog()  # the pod's log: one per entry point
