"""Data helpers for trainers: file lists, sharding by trainer, and paddle.reader-style generator readers.

A *reader* is a zero-argument callable returning a fresh iterator over samples (``for s in reader():``),
so one reader can be read once per pass. Decorators here take a reader and return a reader.
"""

from __future__ import annotations

import glob
import itertools
import os
from typing import Any, Callable, Iterable, Iterator, List, Optional, Sequence, TypeVar

import numpy as np

T = TypeVar("T")
Reader = Callable[[], Iterator[Any]]

_GLOB_CHARS = set("*?[")


# -- file lists ----------------------------------------------------------------------------------------


def file_list(spec: str) -> List[str]:
    """The data files ``spec`` names: a glob pattern (sorted matches), a directory (its sorted files), or a
    list file such as ``train.list`` (one path per line, relative paths resolved against the list's
    directory; blank lines and ``#`` comments ignored)."""
    if _GLOB_CHARS & set(spec):
        paths = sorted(p for p in glob.glob(spec) if os.path.isfile(p))
        if not paths:
            raise FileNotFoundError(f"no files match {spec!r}")
        return paths
    if os.path.isdir(spec):
        paths = (os.path.join(spec, n) for n in os.listdir(spec))
        return sorted(p for p in paths if os.path.isfile(p))
    base = os.path.dirname(os.path.abspath(spec))
    out = []
    with open(spec) as f:
        for line in f:
            line = line.strip()
            if line and not line.startswith("#"):
                out.append(line if os.path.isabs(line) else os.path.join(base, line))
    return out


def shard(items: Sequence[T], trainer_id: int, trainers: int) -> List[T]:
    """Trainer ``trainer_id`` of ``trainers`` gets items trainer_id, trainer_id + trainers, ..."""
    if trainers < 1 or not 0 <= trainer_id < trainers:
        raise ValueError(f"trainer_id={trainer_id} must be in [0, trainers={trainers})")
    return list(items[trainer_id::trainers])


# -- readers -------------------------------------------------------------------------------------------


def lines_reader(paths: Iterable[str], strip: bool = True) -> Reader:
    """Reads every line of the files in order (without the newline when ``strip``)."""
    paths = list(paths)

    def reader() -> Iterator[str]:
        for p in paths:
            with open(p) as f:
                for line in f:
                    yield line.rstrip("\n") if strip else line

    return reader


def from_list(items: Sequence[Any]) -> Reader:
    """A reader over an in-memory sequence."""
    return lambda: iter(items)


def shard_reader(reader: Reader, trainer_id: int, trainers: int) -> Reader:
    """Sample-level sharding, the same rule as ``shard``: samples trainer_id, trainer_id + trainers, ..."""
    shard(range(trainers), trainer_id, trainers)  # validates the arguments
    return lambda: itertools.islice(reader(), trainer_id, None, trainers)


def map_reader(fn: Callable[[Any], Any], reader: Reader) -> Reader:
    return lambda: map(fn, reader())


def shuffle(reader: Reader, buf_size: int, seed: int = 0) -> Reader:
    """Shuffles within consecutive buffers of ``buf_size`` samples (like paddle.reader.shuffle).

    Pass ``k`` (the k-th call of the returned reader) uses the seed ``(seed, k)``: passes differ from each
    other, yet a run is reproducible, and ``pass_index`` restarts a given pass (e.g. after a restore).
    """
    if buf_size < 1:
        raise ValueError("shuffle buf_size must be >= 1")
    counter = itertools.count()

    def shuffled(pass_index: Optional[int] = None) -> Iterator[Any]:
        k = next(counter) if pass_index is None else pass_index
        rng = np.random.default_rng([seed, k])
        buf: List[Any] = []
        for sample in reader():
            buf.append(sample)
            if len(buf) >= buf_size:
                yield from _permuted(buf, rng)
                buf = []
        yield from _permuted(buf, rng)

    return shuffled


def _permuted(buf: List[Any], rng: np.random.Generator) -> Iterator[Any]:
    for i in rng.permutation(len(buf)):
        yield buf[i]


def batch(reader: Reader, batch_size: int, drop_last: bool = False) -> Reader:
    """Groups samples into lists of ``batch_size``; the last, shorter batch is kept unless ``drop_last``."""
    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")

    def batched() -> Iterator[List[Any]]:
        it = reader()
        while True:
            b = list(itertools.islice(it, batch_size))
            if not b or (drop_last and len(b) < batch_size):
                return
            yield b

    return batched


def firstn(reader: Reader, n: int) -> Reader:
    return lambda: itertools.islice(reader(), n)


# -- splitting -----------------------------------------------------------------------------------------


def split_file(path: str, split_count: int, out_prefix: str, mode: str = "round_robin") -> List[str]:
    """Split a line-oriented file into ``<out_prefix>-00000`` ... ``<out_prefix>-<split_count-1>``.

    ``mode="round_robin"`` (default) sends line i to part ``i % split_count``, so parts differ in size by at
    most one line and each is a sample of the whole file; ``mode="contiguous"`` keeps the order, giving
    part k the k-th run of lines (sizes again within one line). All ``split_count`` parts are always
    written, possibly empty, and every line in them ends with a newline. Each part is written to a
    temporary name and renamed, so a reader never sees a half-written part. Returns the part paths.
    """
    if split_count < 1:
        raise ValueError("split_count must be >= 1")
    if mode not in ("round_robin", "contiguous"):
        raise ValueError(f"split mode {mode!r}: expected 'round_robin' or 'contiguous'")
    names = [f"{out_prefix}-{k:05d}" for k in range(split_count)]
    d = os.path.dirname(out_prefix)
    if d:
        os.makedirs(d, exist_ok=True)
    tmps = [f"{n}.tmp{os.getpid()}" for n in names]
    if mode == "contiguous":
        with open(path, "rb") as f:
            total = sum(1 for _ in f)
        base, extra = divmod(total, split_count)
        # Part k holds base lines, plus one for the first ``extra`` parts.
        bounds = np.cumsum([base + (k < extra) for k in range(split_count)])
    outs = [open(t, "wb") for t in tmps]
    try:
        with open(path, "rb") as f:
            part = 0
            for i, line in enumerate(f):
                if not line.endswith(b"\n"):
                    line += b"\n"
                if mode == "round_robin":
                    part = i % split_count
                else:
                    while i >= bounds[part]:
                        part += 1
                outs[part].write(line)
    except BaseException:
        for o, t in zip(outs, tmps):
            o.close()
            os.unlink(t)
        raise
    for o, t, n in zip(outs, tmps, names):
        o.close()
        os.replace(t, n)
    return names
