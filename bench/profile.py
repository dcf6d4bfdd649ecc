"""``python -m bench.profile``: where one dense push+pull's time goes (the numbers behind docs/benchmarks.md).

Two pservers and ``--trainers`` trainers as separate processes, a ``--mb`` MB model in 4 MB blocks, SGD;
prints, for a step as ``push`` then ``pull`` and as one ``push_pull`` (``ROUNDS`` alternating rounds of
``--steps`` each), the median step (and its push and pull) and each process's CPU time per step (user,
system) and how often its threads were put on a core (wake-ups), so a step can be read as CPU work vs waiting.
``--off``: integrity off. ``--lane``: dense data through same-host lanes (docs/architecture.md).
``--perf FILE``: also record the processes with ``perf record -g`` for
``perf report -i FILE --no-children --sort dso,sym``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import List, Optional, Tuple

from .common import MB, TRAINER, Procs, make_env, proc_environ
from .cpu import proc_times, schedstat

_TRAINER = """
import json, sys, time, numpy as np
from paddle_cluster.ps import OptimizerSpec, connect
ps = connect(mode="sync", optimizer=OptimizerSpec("sgd", lr=0.5))
w = np.zeros(({n} // 1024, 1024), np.float32)
ps.register_dense({{"w": w}})
g = np.ones_like(w)
for _ in range(2):
    ps.push_pull({{"w": g}})
print("READY", flush=True)
while True:
    phase = sys.stdin.readline().strip()
    if not phase:
        break
    t = {{"push": [], "pull": [], "step": []}}
    for _ in range({steps}):
        t0 = time.perf_counter()
        if phase == "apart":
            ps.wait(ps.push({{"w": g}})); t1 = time.perf_counter(); ps.pull()
        else:
            ps.push_pull({{"w": g}}); t1 = t0
        t2 = time.perf_counter()
        t["push"].append(t1 - t0); t["pull"].append(t2 - t1); t["step"].append(t2 - t0)
    print(json.dumps(t), flush=True)
ps.close()
"""
PHASES = (("apart", "push then pull"), ("push_pull", "push_pull"))
ROUNDS = 3  # the phases alternate, a round of each at a time, so neither gets the load of a moment alone


def cpu(pid: int) -> Tuple[float, float, int]:
    """(user, system) CPU seconds of a process so far, and how many times its live threads were put on a
    core (a wake-up or a preemption each)."""
    return (*proc_times(pid), schedstat(pid)[2])


def run(size: int, trainers: int, integrity: bool, steps: int, perf: Optional[str] = None, lane: bool = False) -> str:
    tmp = tempfile.mkdtemp(prefix="bench-profile-")
    env = make_env(["127.0.0.1"] * 2, trainers, tmp, integrity=integrity, lane=lane)
    procs = Procs(os.path.join(tmp, "logs"))
    try:
        ps = [procs.pserver(env, k) for k in range(2)]
        code = _TRAINER.format(n=size // 4, steps=steps)
        tr = [procs.start([sys.executable, "-c", code], proc_environ(env, TRAINER, i, "127.0.0.1"), f"trainer{i}")
              for i in range(trainers)]
        for p in tr:
            if not p.stdout.readline().startswith(b"READY"):
                raise RuntimeError(open(p.log_path).read()[-2000:])
        pids: List[int] = [p.pid for p in ps + tr]
        rec = None
        if perf:
            rec = subprocess.Popen(["perf", "record", "-F", "999", "-g", "-o", perf, "-p", ",".join(map(str, pids))],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(0.5)
        names = ["pserver0", "pserver1"] + [f"trainer{i}" for i in range(trainers)]
        lines = [f"integrity {'on' if integrity else 'off'}, {trainers} trainer(s), {size // MB} MB, "
                 + ("same-host lanes" if lane else "TCP")]
        times = {ph: {"push": [], "pull": [], "step": []} for ph, _ in PHASES}
        used = {ph: [(0.0, 0.0, 0)] * len(pids) for ph, _ in PHASES}
        for _ in range(ROUNDS):
            for ph, _ in PHASES:
                before = [cpu(p) for p in pids]
                for p in tr:
                    p.stdin.write(ph.encode() + b"\n")
                    p.stdin.flush()
                for k, v in [json.loads(p.stdout.readline()) for p in tr][0].items():
                    times[ph][k] += v
                used[ph] = [(u + a[0] - b[0], s + a[1] - b[1], w + a[2] - b[2])
                            for (u, s, w), b, a in zip(used[ph], before, [cpu(p) for p in pids])]
        for p in tr:
            p.stdin.write(b"\n")
            p.stdin.flush()
        n = ROUNDS * steps
        for ph, label in PHASES:
            med = {k: sorted(v)[len(v) // 2] for k, v in times[ph].items()}
            per = [(name, 1e3 * u / n, 1e3 * s / n, w / n) for name, (u, s, w) in zip(names, used[ph])]
            total = sum(u + s for _, u, s, _ in per)
            split = f"push {1e3 * med['push']:.1f} / pull {1e3 * med['pull']:.1f} / " if med["push"] else ""
            lines.append(f"  {label}: step {split}push+pull {1e3 * med['step']:.1f} ms "
                         f"({2 * trainers * size / med['step'] / 1e9:.2f} GB/s); CPU ms per step (user+sys, "
                         "times a thread was put on a core): "
                         + ", ".join(f"{name} {u:.0f}+{s:.0f} ({w:.0f})" for name, u, s, w in per)
                         + f"; total {total:.0f} ms = {total / (1e3 * med['step']):.2f} cores")
        if rec:
            rec.send_signal(signal.SIGINT)
            rec.wait()
        for p in tr:
            p.wait(30)
        return "\n".join(lines) + f"\nload {os.getloadavg()[0]:.1f}"
    finally:
        procs.close()


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__.split("\n")[0])
    ap.add_argument("--off", action="store_true", help="integrity off")
    ap.add_argument("--trainers", type=int, default=1)
    ap.add_argument("--mb", type=int, default=64)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--perf", help="also write a perf record here")
    ap.add_argument("--lane", action="store_true", help="dense data through same-host lanes")
    a = ap.parse_args(argv)
    print(run(a.mb * MB, a.trainers, not a.off, a.steps, a.perf, a.lane), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
