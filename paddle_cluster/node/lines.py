"""Bounded line splitting of raw descriptors: a process's output pipe and the agent's stdin.

Buffered readers (``readline``) grow without bound on output without newlines (a progress bar's ``\\r``) and
hide what they have buffered from ``select``; these read the descriptor itself and never hold more than one
line's bound plus one read.
"""

from __future__ import annotations

import os
import select
import subprocess
from typing import Callable, Iterator, List

OUTPUT_LINE_MAX = 32 << 10  # a longer output line reaches the launcher as several
EVENT_LINE_MAX = 1 << 20  # an agent's event carries at most one escaped output line; longer is not an event
READ_SIZE = 64 << 10
PIPE_MAX = 1 << 20  # a pipe holds at most this much (Linux's default limit for /proc/sys/fs/pipe-max-size)


class LineSplitter:
    """Bytes in, complete lines out (without the newline); a line longer than ``limit`` comes out in pieces."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._buf = bytearray()

    def feed(self, data: bytes) -> List[bytes]:
        self._buf += data
        out = []
        start = 0
        while True:
            end = self._buf.find(b"\n", start, start + self.limit + 1)
            if end >= 0:
                out.append(bytes(self._buf[start:end]))
                start = end + 1
            elif len(self._buf) - start >= self.limit:
                out.append(bytes(self._buf[start:start + self.limit]))
                start += self.limit
            else:
                break
        del self._buf[:start]
        return out

    def rest(self) -> bytes:
        """What is left after the last newline (a final line without one); empties the buffer."""
        rest = bytes(self._buf)
        self._buf.clear()
        return rest


def follow(proc: subprocess.Popen, on_data: Callable[[bytes], None], on_line: Callable[[str], None],
           on_exit: Callable[[int], None]) -> None:
    """Read ``proc``'s output pipe until its end: every chunk to ``on_data``, every line to ``on_line``, and
    ``on_exit(returncode)`` once the process has exited and the output it wrote is read -- also when something
    it started (a ``setsid`` child) still holds the pipe open; that output keeps coming after the exit."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    lines = LineSplitter(OUTPUT_LINE_MAX)
    exited = False

    def read(timeout_ms: int) -> bool:
        """One read if something is there within the timeout; False at the end of the pipe."""
        if not poller.poll(timeout_ms):
            return True
        data = os.read(fd, READ_SIZE)
        if not data:
            return False
        on_data(data)
        for line in lines.feed(data):
            on_line(line.decode(errors="replace"))
        return True

    def finish_lines() -> None:
        rest = lines.rest()
        if rest:
            on_line(rest.decode(errors="replace"))

    open_ = True
    while open_:
        open_ = read(200)
        if open_ and not exited and proc.poll() is not None:
            for _ in range(PIPE_MAX // READ_SIZE):  # what it wrote before it exited comes before its exit
                if not (open_ and poller.poll(0)):
                    break
                open_ = read(0)
            finish_lines()
            on_exit(proc.returncode)
            exited = True
    finish_lines()
    if not exited:
        on_exit(proc.wait())


def bounded_lines(readline: Callable[[int], bytes], limit: int = EVENT_LINE_MAX) -> Iterator[str]:
    """The lines ``readline(size)`` returns, decoded, without the newline; a line over ``limit`` bytes is read
    and dropped in pieces, and a one-line note says so in its place."""
    while True:
        raw = readline(limit + 1)
        if not raw:
            return
        if raw.endswith(b"\n") or len(raw) <= limit:
            yield raw.decode(errors="replace").rstrip("\n")
            continue
        dropped = len(raw)
        while not raw.endswith(b"\n"):
            raw = readline(limit)
            if not raw:
                break
            dropped += len(raw)
        yield f"(a line of {dropped} bytes was dropped: over the {limit}-byte limit for an agent's line)"
