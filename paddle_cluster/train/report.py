"""A framework script's metrics (``report``, Ray Train's convention) and numbers averaged over every trainer
(``average``), for ``paddle_cluster.torch`` and ``paddle_cluster.paddle``: numbers in, numbers out.

``report({"loss": 0.4, "acc": 0.9})`` appends one record to this trainer's metrics file
(``train.metrics``: what ``paddle-cluster top`` and ``plot`` read), at the step the process's
``DistributedOptimizer`` has reached. ``average([...])`` is the mean of the same numbers over every trainer of
the job (through pserver 0: ``PSClient.sum_over_trainers``), the same bits on every trainer: what a
``ReduceLROnPlateau``, an early stop or a validation score must follow instead of one trainer's shard.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Sequence

import numpy as np

from . import bridge
from .metrics import MetricsWriter

_BOOKKEEPING = ("step", "time", "trainer")  # what every record has; a metric may not take these names
_writer: Optional[MetricsWriter] = None
_reports = 0


def _short(v: Any) -> str:
    """``v``'s repr on one line, at most 60 characters (a tensor's spans several)."""
    return (repr(v).splitlines() or [""])[0][:60]


def _number(key: str, v: Any) -> float:
    try:
        x = v.item() if hasattr(v, "item") else v  # a one-element tensor or a numpy scalar
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            raise TypeError
        return float(x)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"report: metric {key!r} is {type(v).__name__} {_short(v)}; a metric is a number (a "
                         "float, an int or a one-element tensor)") from None


def report(metrics: Mapping[str, Any], step: Optional[int] = None) -> Dict[str, Any]:
    """Append ``metrics`` (name -> number) to this trainer's metrics records at ``step`` (default: the steps
    the process's DistributedOptimizer has taken, else the count of reports so far); the record written."""
    global _writer, _reports
    if not isinstance(metrics, Mapping) or not metrics:
        raise ValueError(f"report({_short(metrics)}): give a dict of metric name -> number, e.g. {{'loss': 0.5}}")
    clash = sorted(repr(k) for k in metrics if k in _BOOKKEEPING or not isinstance(k, str) or not k)
    if clash:
        raise ValueError(f"report: metric name(s) {', '.join(clash)} not allowed: every record has its own "
                         f"{', '.join(_BOOKKEEPING)}; pass the step as report(metrics, step=...)")
    values = {k: _number(k, v) for k, v in metrics.items()}
    if step is None:
        held = bridge._held
        step = held.bridge.ps.step if held is not None else _reports
    if _writer is None:
        _writer = MetricsWriter(trainer_id=bridge.rank())
    _reports += 1
    return _writer.record(int(step), values)


def average(values: Sequence[float]) -> np.ndarray:
    """The mean of ``values`` (float64) over every trainer of the job, each trainer passing its own; alone, the
    values themselves. Every trainer calls it at the same point (a collective: one that does not is waited
    for, up to the barrier timeout, then named)."""
    flat = np.asarray(values, dtype=np.float64).reshape(-1)
    held = bridge._held
    if held is None:
        if bridge.size() == 1:
            return flat.copy()
        raise RuntimeError("average(): wrap the optimizer in DistributedOptimizer first (the trainers average "
                           "through the pservers it connects to)")
    total, n = held.bridge.ps.sum_over_trainers(flat)
    return total / max(1, n)
