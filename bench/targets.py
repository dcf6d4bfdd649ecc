"""The issue's goals as targets over a run's headline numbers (``Suite.m``): each a ratio or a figure with its
goal, met or missed, or skipped with the reason its section gave."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

from .common import Target


def targets(m: Dict[str, Any], skipped: Dict[str, str], cfg: Dict[str, Any]) -> List[Target]:
    T: List[Target] = []

    def t(name: str, value: Optional[float], goal: str, ok: Callable[[float], bool], detail: str = "") -> None:
        T.append(Target(name, value, goal, None if value is None else bool(ok(value)), detail))

    def ratio(a: str, b: str) -> Optional[float]:
        return m[a] / m[b] if a in m and b in m else None

    t("dense push+pull / raw TCP 2 streams (integrity off)", ratio("dense1_pushpull_off", "raw2"), ">= 0.90",
      lambda v: v >= 0.90)
    t("2-trainer sync aggregate / raw TCP 2 streams (integrity off)", ratio("dense2_sync_off", "raw2"),
      ">= 0.85", lambda v: v >= 0.85)
    t("integrity on / off: dense push+pull", ratio("dense1_pushpull", "dense1_pushpull_off"), ">= 0.70",
      lambda v: v >= 0.70)
    t("integrity on / off: 2-trainer sync", ratio("dense2_sync", "dense2_sync_off"), ">= 0.70",
      lambda v: v >= 0.70)
    t("ours / Ray-actor PS (push+pull)", ratio("dense1_pushpull_off", "ray"), ">= 2.5", lambda v: v >= 2.5,
      skipped.get("ray", ""))
    t("ours / pyzmq PS (push+pull)", ratio("dense1_pushpull_off", "zmq"), ">= 3", lambda v: v >= 3.0,
      skipped.get("zmq", ""))
    t("2-trainer sync step / gloo all-reduce time", ratio("dense2_sync_step_off", "gloo"), "<= 1.2",
      lambda v: v <= 1.2, skipped.get("gloo", ""))
    for key, where in (("ps_vs_ring", "loopback"), ("ps_vs_ring_shaped", "1 Gbit/s links")):
        r = m.get(key, {})
        for n in (2, 4):
            best = min((r[k] for k in r if k[0] == "ps" and k[1] == n), default=None)
            v = None if best is None or ("gloo", n) not in r else best / r[("gloo", n)]
            t(f"sync PS step (best of 2, 4 pservers) / gloo, {n} workers, {where}", v, "<= 1.2",
              lambda v: v <= 1.2, skipped.get("gloo", ""))
    for n in (1, 2):
        v = m.get(f"barrier{n}_p99")
        t(f"barrier round trip p99, {n} trainer(s) (ms)", None if v is None else 1e3 * v, "<= 1 ms",
          lambda v: v <= 1.0)
    for op in ("pull", "push"):
        t(f"sparse {op} / numpy in-process (integrity on)", m.get(f"sparse_{op}"), ">= 0.30", lambda v: v >= 0.30)
    for n in (2, 3):
        t(f"push+pull goodput / 1 Gbit/s line rate, {n} nodes (integrity on)", m.get(f"shaped_{n}"), ">= 0.90",
          lambda v: v >= 0.90, skipped.get("shaped", ""))
    t("launch 1 host (s)", m.get("launch_1"), "<= 1.5 s", lambda v: v <= 1.5, skipped.get("launcher", ""))
    t("launch 8 hosts / 1 host", ratio("launch_8", "launch_1"), "<= 1.5", lambda v: v <= 1.5,
      skipped.get("launcher", ""))
    for n in cfg["dispatch_counts"]:
        t(f"dispatch to {n} host(s) / scp to 1 (1 Gbit/s)", ratio(f"dispatch_full_{n}", "scp"), "<= 1.3",
          lambda v: v <= 1.3, skipped.get("launcher", ""))
    top = max(cfg["dispatch_counts"])
    t(f"dispatch to {top} hosts / scp to 1 (100 Mbit/s: the cores not the limit)",
      ratio(f"slow_dispatch_full_{top}", "slow_scp"), "<= 1.3", lambda v: v <= 1.3,
      skipped.get("launcher", ""))
    t("unchanged re-dispatch: workspace step (s)", m.get("dispatch_again_step"), "< 0.3 s", lambda v: v < 0.3,
      skipped.get("launcher", ""))
    for what, k, r, _peak, _idle in m.get("mem", []):
        t(f"pserver {k} memory / bytes held, {what}", r, "<= 1.2", lambda v: v <= 1.2)
    return T
