"""The issue's goals as targets over a run's headline numbers (``Suite.m``): each a ratio or a figure with its
goal, met or missed, or skipped with the reason its section gave.

A data-path goal also gets its CPU bound (docs/benchmarks.md, "CPU bounds"): the best ratio this many cores
allow given the work each side must do, from the CPU per step measured in the same run (``m["cpu"]``). Our
least work for a step is raw TCP's CPU per byte times the bytes the step moves, plus the pserver's SGD path
measured alone. It is computed only where both sides are CPU-bound: their processes wanted at least
``CPU_BOUND`` of the cores over their repetitions (running, or ready and waiting for a core) and the
machine's cores were that busy (by them or others); there a side's time is its CPU over the cores. Ours
spending more than its least CPU by more than ``1 / FAR`` is ours to fix.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Optional, Tuple

from paddle_cluster.launch.config import ClusterConfig

from . import launcher
from .common import Target
from .cpu import Cpu

DEFAULT_PER_NODE = ClusterConfig.pservers_per_node  # the launcher's default placement: a pserver per node
CPU_BOUND = 0.8  # of the cores: a side wanting this many is taken as CPU-bound
FAR = 0.9  # ours spending more than its least CPU / FAR is ours to fix


Bound = Tuple[Optional[float], str, float, bool, Optional[float]]


def _bound(m: Dict[str, Any], peer: str, ours: str, bytes_moved: int, sgd: str, lower: bool, frames: str = ""
           ) -> Bound:
    """(bound, what it rests on, our least CPU / our CPU, ``lower``, plain sockets' CPU in our frames / ours) of
    the ratio ours / ``peer`` (rates; ``lower``: step times, ours over peer). ``peer`` "raw2": raw TCP moving the
    bytes our step moves; ``frames``: the ``bench.frames`` run of the same trainers and servers."""
    cpu: Dict[str, Cpu] = m.get("cpu", {})
    need = [k for k in ("raw2", sgd, ours, peer) if k not in cpu]
    if need:
        return None, f"no CPU bound: {', '.join(need)} not measured", 1.0, lower, None
    zero = [k for k in ("raw2", ours, peer) if cpu[k].per_step <= 0]
    if zero:
        return None, f"no CPU bound: {', '.join(zero)} too short to measure its CPU", 1.0, lower, None
    raw = cpu["raw2"].per_step / (2 * m["size"]) * bytes_moved  # raw TCP's CPU for our bytes
    least = raw + cpu[sgd].per_step
    other = raw if peer == "raw2" else cpu[peer].per_step
    work = (f"CPU/step: ours {1e3 * cpu[ours].per_step:.0f} ms where {1e3 * least:.0f} would do (raw TCP "
            f"{1e3 * raw:.0f} + SGD {1e3 * cpu[sgd].per_step:.0f}), {peer} {1e3 * other:.0f}")
    cores = os.cpu_count() or 1
    sides = list(dict.fromkeys((ours, "raw2" if peer == "raw2" else peer)))
    busy = ", ".join(f"{k} {cpu[k].busy:.2f} busy / {cpu[k].wanted:.2f} wanted" for k in sides)
    others = [k for k in sides if cpu[k].machine_busy - cpu[k].busy >= 0.25 * cores]
    busy += f" of {cores} cores" + (f" (others took cores during {', '.join(others)})" if others else "")
    eff = least / cpu[ours].per_step
    fr = cpu.get(frames)
    pattern = fr.per_step / cpu[ours].per_step if fr is not None and fr.per_step > 0 else None
    if pattern is not None:
        work += (f"; plain sockets sending the same frames with the same SGD {1e3 * fr.per_step:.0f} ms "
                 f"({pattern / eff:.2f}x the least; ours {1 / pattern:.2f}x them)")
    lane = cpu.get(frames.replace("frames", "shm")) if frames else None
    if lane is not None and lane.per_step > 0:
        work += (f"; the same pattern through shared memory (what a same-host lane costs at least) "
                 f"{1e3 * lane.per_step:.0f} ms")
    by_cpu = cpu[ours].per_step / other if lower else other / cpu[ours].per_step
    work += f"; by CPU (both sides on equal cores) the ratio is {by_cpu:.2f}"
    if eff > 1 / FAR:  # less than the least: the rows' CPU per byte differed (other load, caches), not ours
        return None, (f"no CPU bound: ours spent {1 / eff:.2f}x the least its work needs, so the rows did not "
                      f"cost the same per byte (other load between them); {busy}; {work}"), eff, lower, pattern
    # CPU-bound: it wanted the cores, and they were all busy (had some been idle, it would have had them)
    if any(min(cpu[k].wanted, cpu[k].machine_busy) < CPU_BOUND * cores for k in sides):
        return None, (f"no CPU bound (a side wanted < {CPU_BOUND * cores:.1f} cores, or the machine had them idle): "
                      f"{busy}; {work}"), eff, lower, pattern
    return (least / other if lower else other / least), f"{work}; {busy}", eff, lower, pattern


def _verdict(v: float, met: Optional[bool], ok: Callable[[float], bool], b: Optional[float], eff: float,
             lower: bool, pattern: Optional[float]) -> str:
    if met is None:
        return "skipped"
    if b is None:
        return ("PASS" if met else "MISS") + " (no CPU bound)"
    if (v < b) if lower else (v > b):  # only when the sides had unequal shares of the cores (others' load)
        return ("PASS" if met else "MISS") + f" (beyond its CPU bound {b:.2f}: uneven load, see the CPU figures)"
    if met:
        return f"PASS (CPU bound {b:.2f})"
    far = eff < FAR  # ours spends more CPU than the least by more than 1 / FAR
    if far and pattern is not None and pattern >= FAR:  # so do plain sockets sending the same frames
        why = (f"ours {1 / pattern:.2f}x plain sockets sending the same frames, which need {pattern / eff:.2f}x "
               "the least: the PS's frame pattern")
        return f"MISS (CPU bound {b:.2f}; {why})" if not ok(b) else f"MISS (below the CPU bound {b:.2f}; {why})"
    if not ok(b):
        return f"MISS (CPU bound {b:.2f}" + (f"; ours spends {1 / eff:.2f}x its least CPU: ours to fix)"
                                             if far else ")")
    return f"MISS (below the CPU bound {b:.2f}: ours to fix)" if far else (
        f"MISS (CPU bound {b:.2f}; ours at its least CPU: the rest is not CPU)")


def targets(m: Dict[str, Any], skipped: Dict[str, str], cfg: Dict[str, Any]) -> List[Target]:
    T: List[Target] = []

    def t(name: str, value: Optional[float], goal: str, ok: Callable[[float], bool], detail: str = "",
          bound: Optional[Bound] = None) -> None:
        met = None if value is None else bool(ok(value))
        b, why, eff, lower, pattern = bound or (None, "", 1.0, False, None)
        verdict = ("PASS" if met else "MISS") if value is None or bound is None else _verdict(
            value, met, ok, b, eff, lower, pattern)
        T.append(Target(name, value, goal, met, detail or why, b, "skipped" if met is None else verdict))

    def ratio(a: str, b: str) -> Optional[float]:
        return m[a] / m[b] if a in m and b in m else None

    s = m.get("size", 0)
    t("dense push+pull / raw TCP 2 streams (integrity off)", ratio("dense1_pushpull_off", "raw2"), ">= 0.90",
      lambda v: v >= 0.90, bound=_bound(m, "raw2", "dense1_off", 2 * s, "sgd1", False, "frames1_2"))
    t("2-trainer sync aggregate / raw TCP 2 streams (integrity off)", ratio("dense2_sync_off", "raw2"),
      ">= 0.85", lambda v: v >= 0.85, bound=_bound(m, "raw2", "dense2_off", 4 * s, "sgd2", False, "frames2_2"))
    # Trainers and pservers on one node talk through the same-host lane by default (docs/architecture.md): the
    # same goals for that path, beside the TCP path above that nodes apart take.
    t("dense push+pull, same-host lane / raw TCP 2 streams (integrity off)", ratio("lane1_off", "raw2"), ">= 0.90",
      lambda v: v >= 0.90)
    t("2-trainer sync aggregate, same-host lane / raw TCP 2 streams (integrity off)", ratio("lane2_off", "raw2"),
      ">= 0.85", lambda v: v >= 0.85)
    t("integrity on / off: dense push+pull, same-host lane", ratio("lane1", "lane1_off"), ">= 0.70",
      lambda v: v >= 0.70)
    t("integrity on / off: dense push+pull", ratio("dense1_pushpull", "dense1_pushpull_off"), ">= 0.70",
      lambda v: v >= 0.70)
    t("integrity on / off: 2-trainer sync", ratio("dense2_sync", "dense2_sync_off"), ">= 0.70",
      lambda v: v >= 0.70)
    t("ours / Ray-actor PS (push+pull)", ratio("dense1_pushpull_off", "ray"), ">= 2.5", lambda v: v >= 2.5,
      skipped.get("ray", ""), _bound(m, "ray", "dense1_off", 2 * s, "sgd1", False, "frames1_2"))
    t("ours / pyzmq PS (push+pull)", ratio("dense1_pushpull_off", "zmq"), ">= 3", lambda v: v >= 3.0,
      skipped.get("zmq", ""), _bound(m, "zmq", "dense1_off", 2 * s, "sgd1", False, "frames1_2"))
    t("2-trainer sync step / gloo all-reduce time", ratio("dense2_sync_step_off", "gloo"), "<= 1.2",
      lambda v: v <= 1.2, skipped.get("gloo", ""), _bound(m, "gloo2", "dense2_off", 4 * s, "sgd2", True, "frames2_2"))
    t("2-trainer sync step, same-host lane / gloo all-reduce time", ratio("lane2_step_off", "gloo"), "<= 1.2",
      lambda v: v <= 1.2, skipped.get("gloo", ""))
    for key, where in (("ps_vs_ring", "loopback"), ("ps_vs_ring_shaped", "1 Gbit/s links")):
        r = m.get(key, {})
        for n in (2, 4):
            if key == "ps_vs_ring":
                best = min((k for k in r if k[0] == "ps" and k[1] == n), key=lambda k: r[k], default=None)
                name, goal = f"sync PS step (best of 2, 4 pservers) / gloo, {n} workers, {where}", 1.2
            else:  # across nodes: the launcher's default, a pserver on each worker's node (PSERVERS_PER_NODE)
                best = ("ps", n, n * DEFAULT_PER_NODE)
                name, goal = f"sync PS step, default placement ({best[2]} pservers) / gloo, {n} workers, {where}", (
                    1.15 if n == 4 else 1.2)
            v = None if best not in r or ("gloo", n) not in r else r[best] / r[("gloo", n)]
            b = (_bound(m, f"gloo{n}", f"ps{n}_{best[2]}", 2 * n * s, f"sgd{n}", True, f"frames{n}_{best[2]}")
                 if key == "ps_vs_ring" and best else None)
            t(name, v, f"<= {goal}", lambda v, goal=goal: v <= goal, skipped.get("gloo", ""), b)
    # PyTorch models on the pservers against DDP with gloo, the same global batch (bench/frameworks.py)
    for where, goal in (("one machine", 1.0), ("3 hosts, 1 Gbit/s", 1.1)):
        why = skipped.get("torch", "") or (skipped.get("torchnet", "") if "hosts" in where else "")
        for n in (2, 4):
            for variant, label in (("defaults", "defaults"), ("tcp", "over TCP"), ("fp16", "fp16 compression")):
                v = m.get(("torch", "dense", where, n, variant))
                if v is None and variant != "defaults":
                    continue
                t(f"PyTorch MLP on the pservers ({label}) / DDP gloo, step, {n} trainers, {where}", v,
                  f"<= {goal}", lambda v, goal=goal: v <= goal, why)
        for n in (2, 4):
            v = m.get(("torch", "embedding", where, n, "defaults"))
            t(f"embedding 1 % touched: DDP gloo / pservers (defaults), step, {n} trainers, {where}",
              None if not v else 1 / v, ">= 10", lambda v: v >= 10.0, why)
    for n in (1, 2):
        v = m.get(f"barrier{n}_p99")
        t(f"barrier round trip p99, {n} trainer(s) (ms)", None if v is None else 1e3 * v, "<= 1 ms",
          lambda v: v <= 1.0)
    for op in ("pull", "push"):
        t(f"sparse {op} / numpy in-process (integrity on)", m.get(f"sparse_{op}"), ">= 0.30", lambda v: v >= 0.30)
    for n in (2, 3):
        t(f"push+pull goodput / 1 Gbit/s line rate, {n} nodes (integrity on)", m.get(f"shaped_{n}"), ">= 0.90",
          lambda v: v >= 0.90, skipped.get("shaped", ""))
    why = skipped.get("launcher", "")
    t("launch 1 host (s)", m.get("launch_1"), "<= 1.5 s", lambda v: v <= 1.5, why)
    for key, shell in (("", ""), ("plain_", ", plain shell")):
        t(f"launch 8 hosts / 1 host{shell}", ratio(f"{key}launch_8", f"{key}launch_1"), "<= 1.5", lambda v: v <= 1.5,
          why or launcher.launch_detail(m, key, 8))
    # A new workspace as the user waits (packing included), less a tiny one's dispatch (see docs/benchmarks.md).
    for key, shell in (("", ""), ("loaded_", ", another job loading the machine"), ("plain_", ", plain shell")):
        for n in cfg["dispatch_counts"]:
            goal = 1.15 if n == 3 else 1.3
            t(f"new workspace to {n} host(s) / scp to 1 (1 Gbit/s){shell}", ratio(f"{key}dispatch_user_{n}",
              f"{key}scp"), f"<= {goal}", lambda v, goal=goal: v <= goal, why or launcher.dispatch_detail(m, key, n))
    top = max(cfg["dispatch_counts"])
    for key, shell in (("slow_", ""), ("plainslow_", ", plain shell")):
        t(f"new workspace to {top} hosts / scp to 1 (100 Mbit/s: the cores not the limit){shell}",
          ratio(f"{key}dispatch_user_{top}", f"{key}scp"), "<= 1.3", lambda v: v <= 1.3,
          why or launcher.dispatch_detail(m, key, top))
    t("unchanged re-dispatch: workspace step (s)", m.get("dispatch_again_step"), "< 0.3 s", lambda v: v < 0.3,
      skipped.get("launcher", ""))
    for mem in m.get("mem", []):  # dense.Memory
        t(f"pserver {mem.pserver} memory / design, {mem.what}", mem.ratio, "<= 1.2", lambda v: v <= 1.2,
          mem.note())
    return T
