"""Progress bars for copies to and from the nodes, on the launcher's stderr."""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Any, Callable, Iterator, List


@contextlib.contextmanager
def upload_progress(verb: str = "upload") -> Iterator[Callable[[str, int], Callable[[int, int], None]]]:
    """``bar(name, total)`` gives a copy's (``verb``: "upload", "fetch") progress callback; the bars (stderr)
    appear only once one is asked for, so a launch that sends nothing pays nothing for them, and only on a
    terminal (no stray line on a pipe)."""
    shown: List[Any] = []
    lock = threading.Lock()

    def bar(name: str, total: int) -> Callable[[int, int], None]:
        with lock:
            if not shown:
                from rich.console import Console
                from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

                shown.append(Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                                      TransferSpeedColumn(), disable=not sys.stderr.isatty(),
                                      console=Console(stderr=True)))
                shown[0].start()
            task = shown[0].add_task(f"{verb} {name}", total=total)
        return lambda done, _total: shown[0].update(task, completed=done)

    try:
        yield bar
    finally:
        if shown:
            shown[0].stop()
