"""``paddle.reader``: decorators over *readers* (zero-argument callables returning a fresh iterator of samples).

Same behaviour as PaddlePaddle's ``paddle/reader/decorator.py``: ``shuffle`` uses Python's ``random`` module (seed
it with ``random.seed`` for a reproducible order), ``compose`` flattens tuple samples and raises
``ComposeNotAligned`` when the readers' lengths differ. One difference: an exception inside a ``buffered``
reader reaches the consumer (Paddle's reader thread died and the consumer waited forever).
"""

from __future__ import annotations

import itertools
import queue
import random
import threading
from typing import Any, Callable, Iterator, List, Tuple

from ..missing import module_getattr

Reader = Callable[[], Iterator[Any]]

__all__ = ["ComposeNotAligned", "buffered", "cache", "chain", "compose", "firstn", "map_readers", "shuffle"]
__getattr__ = module_getattr(__name__, "paddle.reader")


class ComposeNotAligned(ValueError):
    """``compose``: one reader ended before the others."""


def map_readers(func: Callable[..., Any], *readers: Reader) -> Reader:
    """Samples ``func(a, b, ...)`` with ``a, b, ...`` taken from each reader in step (stops at the shortest)."""
    return lambda: map(func, *(r() for r in readers))


def shuffle(reader: Reader, buf_size: int) -> Reader:
    """Shuffles within consecutive buffers of ``buf_size`` samples, with ``random.shuffle``."""

    def shuffled() -> Iterator[Any]:
        buf: List[Any] = []
        for sample in reader():
            buf.append(sample)
            if len(buf) >= buf_size:
                random.shuffle(buf)
                yield from buf
                buf = []
        random.shuffle(buf)
        yield from buf

    return shuffled


def chain(*readers: Reader) -> Reader:
    """Every sample of the first reader, then of the second, ..."""
    return lambda: itertools.chain.from_iterable(r() for r in readers)


def _as_tuple(x: Any) -> Tuple[Any, ...]:
    return x if isinstance(x, tuple) else (x,)


def compose(*readers: Reader, check_alignment: bool = True) -> Reader:
    """Samples ``(1, 2)``, ``3``, ``(4, 5)`` from three readers become ``(1, 2, 3, 4, 5)``.

    With ``check_alignment`` (default) readers of different lengths raise ``ComposeNotAligned``; without, the
    output stops at the shortest reader.
    """
    end = object()

    def composed() -> Iterator[Tuple[Any, ...]]:
        its = [r() for r in readers]
        rows = zip(*its) if not check_alignment else itertools.zip_longest(*its, fillvalue=end)
        for row in rows:
            if any(x is end for x in row):
                raise ComposeNotAligned("outputs of readers are not aligned (one reader ended before the others)")
            yield sum(map(_as_tuple, row), ())

    return composed


class _End:
    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error


def buffered(reader: Reader, size: int) -> Reader:
    """Reads ahead in a thread into a queue of at most ``size`` samples."""

    def read_ahead() -> Iterator[Any]:
        q: queue.Queue = queue.Queue(maxsize=max(1, int(size)))
        stop = threading.Event()

        def put(item: Any) -> bool:
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        def work() -> None:
            try:
                for sample in reader():
                    if not put(sample):
                        return
            except BaseException as e:  # noqa: B036 - handed to the consumer, which re-raises it
                put(_End(e))
                return
            put(_End())

        t = threading.Thread(target=work, name="paddle.reader.buffered", daemon=True)
        t.start()
        try:
            while True:
                item = q.get()
                if isinstance(item, _End):
                    if item.error is not None:
                        raise item.error
                    return
                yield item
        finally:
            stop.set()  # the consumer stopped early: let the thread end instead of blocking on a full queue

    return read_ahead


def firstn(reader: Reader, n: int) -> Reader:
    """At most the first ``n`` samples."""
    return lambda: itertools.islice(reader(), n)


def cache(reader: Reader) -> Reader:
    """Reads ``reader`` once, now, and replays its samples from memory on every call."""
    samples = tuple(reader())
    return lambda: iter(samples)
