"""Training metrics as JSON lines, one file per trainer, plus the job's final metric.

Each trainer appends to ``<log dir>/metrics.trainer<i>.jsonl`` (log dir: ``$PADDLE_JOB_DIR/log`` when set,
else ``./log``); every record is written with one ``write`` and flushed, so a launcher tailing the file
sees whole lines. Non-finite floats are written as ``NaN``/``Infinity`` (Python's json reads them back),
because a diverged loss must stay visible.
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, TextIO

from ..contract import ProcessEnv

RESERVED = ("pass", "step", "loss", "samples_per_s", "time", "trainer")
_FILE_RE = re.compile(r"metrics\.trainer(\d+)\.jsonl$")


def default_log_dir(environ: Optional[Mapping[str, str]] = None) -> str:
    job_dir = ProcessEnv.from_environ(environ).job_dir
    return os.path.join(job_dir, "log") if job_dir else "log"


def metrics_path(log_dir: str, trainer_id: int) -> str:
    return os.path.join(log_dir, f"metrics.trainer{trainer_id}.jsonl")


def _jsonable(o: Any) -> Any:
    # numpy scalars and arrays without importing numpy (``item``/``tolist`` are duck-typed).
    if hasattr(o, "tolist"):
        return o.tolist()
    if hasattr(o, "item"):
        return o.item()
    raise TypeError(f"metric value of type {type(o).__name__} is not JSON serialisable")


class RunningMean:
    """A sample-weighted running mean (e.g. of a loss over a pass): ``add(value, n)`` counts ``value`` n times."""

    def __init__(self) -> None:
        self.total = 0.0
        self.count = 0

    def add(self, value: float, n: int = 1) -> None:
        self.total += float(value) * n
        self.count += n

    @property
    def mean(self) -> float:
        """The mean so far; 0.0 before anything was added."""
        return self.total / max(1, self.count)


class MetricsWriter:
    """Appends one JSON object per ``log`` call to this trainer's metrics file."""

    def __init__(
        self,
        trainer_id: Optional[int] = None,
        log_dir: Optional[str] = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if trainer_id is None:
            trainer_id = ProcessEnv.from_environ().trainer_id or 0
        self.trainer_id = int(trainer_id)
        self.path = metrics_path(log_dir or default_log_dir(), self.trainer_id)
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        self._clock = clock
        self._last = clock()
        # A trainer killed mid-write leaves a torn line; end it so the next record starts on its own line.
        with open(self.path, "ab+") as f:
            if f.seek(0, os.SEEK_END) > 0:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    f.write(b"\n")
        self._f: Optional[TextIO] = open(self.path, "a", encoding="utf-8")

    def log(
        self,
        pass_id: int,
        step: int,
        loss: float,
        samples_per_s: Optional[float] = None,
        samples: Optional[int] = None,
        **extra: Any,
    ) -> Dict[str, Any]:
        """Write and return one record. Give ``samples`` (processed since the previous call) instead of
        ``samples_per_s`` to have the rate computed from the wall time between calls."""
        if self._f is None:
            raise ValueError("MetricsWriter is closed")
        clash = sorted(set(extra) & set(RESERVED))
        if clash:
            raise ValueError(f"extra metric names {clash} clash with the standard keys")
        now = self._clock()
        if samples_per_s is None and samples is not None:
            elapsed = now - self._last
            samples_per_s = samples / elapsed if elapsed > 0 else None
        self._last = now
        rec: Dict[str, Any] = {
            "pass": int(pass_id),
            "step": int(step),
            "loss": float(loss),
            "samples_per_s": None if samples_per_s is None else float(samples_per_s),
            "time": now,
            "trainer": self.trainer_id,
        }
        rec.update(extra)
        self._f.write(json.dumps(rec, default=_jsonable) + "\n")
        self._f.flush()
        return rec

    def record(self, step: int, metrics: Mapping[str, float]) -> Dict[str, Any]:
        """Write and return one record of ``metrics`` (name -> number) at ``step``: a framework script's
        ``report`` (``train.report``), with the bookkeeping keys of ``log`` but no pass or rate of its own."""
        if self._f is None:
            raise ValueError("MetricsWriter is closed")
        self._last = now = self._clock()
        rec: Dict[str, Any] = {"step": int(step), **metrics, "time": now, "trainer": self.trainer_id}
        self._f.write(json.dumps(rec, default=_jsonable) + "\n")
        self._f.flush()
        return rec

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# -- reading -------------------------------------------------------------------------------------------


def _parse(line: str) -> Optional[Dict[str, Any]]:
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    return rec if isinstance(rec, dict) else None


def read_metrics(path_or_dir: str) -> List[Dict[str, Any]]:
    """All records of one metrics file, or of every ``metrics.trainer<i>.jsonl`` in a directory (by
    trainer, then file order). Lines that do not parse, such as a torn last line, are skipped."""
    if os.path.isdir(path_or_dir):
        found = glob.glob(os.path.join(path_or_dir, "metrics.trainer*.jsonl"))
        keyed = [(int(m.group(1)), p) for p in found if (m := _FILE_RE.search(os.path.basename(p)))]
        paths = [p for _, p in sorted(keyed)]
    else:
        paths = [path_or_dir]
    out: List[Dict[str, Any]] = []
    for p in paths:
        with open(p, encoding="utf-8", errors="replace") as f:
            for line in f:
                rec = _parse(line)
                if rec is not None:
                    out.append(rec)
    return out


# -- final metric --------------------------------------------------------------------------------------


def write_final(metric_name: str, value: Any, output_dir: str = "output") -> str:
    """Print ``final <metric>=<value>`` on its own line and merge it into ``<output_dir>/metrics.json``.

    The JSON file is replaced atomically (temporary file in the same directory, fsync, rename), so a
    reader sees the old or the new content, never a mix. Returns the file's path.
    """
    if not metric_name or re.search(r"[\s=]", metric_name):
        raise ValueError(f"metric name {metric_name!r} must be non-empty without spaces or '='")
    if getattr(getattr(value, "dtype", None), "kind", "") == "f":
        # Shortest text of a numpy float at its own precision: float32 0.1 reports as 0.1, not 0.10000000149.
        value = float(str(value))
    elif hasattr(value, "item"):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"final metric {metric_name} must be a number, got {value!r}")
    if isinstance(value, float):  # 7 significant digits (float32's): 0.91234568, not 0.9123456789012345
        value = float(f"{value:.7g}")
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, "metrics.json")
    current: Dict[str, Any] = {}
    try:
        with open(path, encoding="utf-8") as f:
            loaded = json.load(f)
        if isinstance(loaded, dict):
            current = loaded
    except (OSError, ValueError):
        pass
    current[metric_name] = value
    fd, tmp = tempfile.mkstemp(prefix=".metrics.", suffix=".tmp", dir=output_dir)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(current, f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    sys.stdout.write(f"final {metric_name}={value}\n")
    sys.stdout.flush()
    return path
