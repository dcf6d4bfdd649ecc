"""``paddle-cluster plot``: training curves per trainer, from the metrics files every trainer writes."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Sequence

from . import nodecmd
from .access import nodes_with_lib
from .config import ClusterConfig
from .each_node import each_node
from .errors import JOB_NAME_FIX, ClusterError
from .hosts import Node
from .shown import printable

# Keys of a metrics record that are bookkeeping, not curves.
_NOT_CURVES = {"pass", "step", "time", "trainer", "samples"}
_SPARK = "▁▂▃▄▅▆▇█"


@dataclass(frozen=True)
class Curve:
    trainer: str
    metric: str
    steps: List[float]
    values: List[float]


def collect(cfg: ClusterConfig, job_name: str) -> Dict[str, List[dict]]:
    """``{"trainer0": [records...], ...}`` gathered from every node's ``<job dir>/log``."""
    nodes, lib, _ = nodes_with_lib(cfg)
    job_dir = cfg.job_dir(job_name)

    def read(n: Node) -> Dict[str, List[dict]]:
        return nodecmd.agent_json(n, lib, "metrics", "--job-dir", job_dir, what="reading metrics")
    try:
        per_node = each_node(nodes, read).ok(f"reading the metrics of {job_name}")
    finally:
        each_node(nodes, lambda n: n.close())
    merged: Dict[str, List[dict]] = {}
    for doc in per_node:
        for trainer, recs in doc.items():
            merged.setdefault(trainer, []).extend(recs)
    if not any(merged.values()):
        raise ClusterError(f"job {job_name} has no metrics records (log/metrics.trainer*.jsonl) on any node: its "
                           "trainers wrote none (they write them with paddle_cluster.train.metrics.MetricsWriter), "
                           f"or there is no such job here ({JOB_NAME_FIX})")
    return merged


def plot(records: Dict[str, List[dict]], job_name: str, path: str) -> List[str]:
    """Job ``job_name``'s curves (``records``: ``collect``'s) drawn into the PNG ``path``; a line per curve for the
    terminal: its trainer, metric, sparkline, first and last value and steps."""
    cs = curves(records)
    draw_png(cs, path, f"{job_name}: {len({c.trainer for c in cs})} trainer(s)")
    return [f"{printable(c.trainer):>9} {printable(c.metric):<14} {sparkline(c.values)} {c.values[0]:.4g} -> "
            f"{c.values[-1]:.4g} ({len(c.values)} points, steps {c.steps[0]:g}-{c.steps[-1]:g})" for c in cs]


def curves(records: Dict[str, List[dict]]) -> List[Curve]:
    """One curve per (trainer, numeric metric), ordered by step."""
    out = []
    for trainer in sorted(records, key=lambda t: (len(t), t)):
        recs = sorted((r for r in records[trainer] if isinstance(r.get("step"), (int, float))),
                      key=lambda r: r["step"])
        metrics = sorted({k for r in recs for k, v in r.items()
                          if k not in _NOT_CURVES and isinstance(v, (int, float)) and not isinstance(v, bool)})
        for m in metrics:
            pts = [(r["step"], r[m]) for r in recs if isinstance(r.get(m), (int, float)) and math.isfinite(r[m])]
            if pts:
                out.append(Curve(trainer, m, [p[0] for p in pts], [p[1] for p in pts]))
    return out


def draw_png(cs: Sequence[Curve], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = sorted({c.metric for c in cs}, key=lambda m: (m != "loss", m))
    fig, axes = plt.subplots(len(metrics), 1, figsize=(9, 3.2 * len(metrics)), squeeze=False)
    for ax, m in zip(axes[:, 0], metrics):
        for c in cs:
            if c.metric == m:
                ax.plot(c.steps, c.values, label=c.trainer, linewidth=1.2)
        ax.set_ylabel(m)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if m == "loss" and all(v > 0 for c in cs if c.metric == m for v in c.values):
            ax.set_yscale("log")
        ax.legend(loc="best", fontsize="small")
    axes[0, 0].set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def sparkline(values: Sequence[float], width: int = 40) -> str:
    """The curve in ``width`` block characters (each the mean of its bucket), for the terminal."""
    if not values:
        return ""
    n = min(width, len(values))
    buckets = [values[i * len(values) // n:(i + 1) * len(values) // n] for i in range(n)]
    means = [sum(b) / len(b) for b in buckets]
    lo, hi = min(means), max(means)
    span = (hi - lo) or 1.0
    return "".join(_SPARK[min(len(_SPARK) - 1, int((v - lo) / span * (len(_SPARK) - 1) + 0.5))] for v in means)
