"""``python -m bench.top``: what ``paddle-cluster top``'s figures cost a training step (docs/benchmarks.md#top).

In one run, against a baseline measured in the same run: a trainer's sync ``push_pull`` of a small dense
vector (the step where a per-frame cost weighs most) with the counters on (as shipped) and off (the counting
calls replaced by no-ops, the timed call unwrapped), interleaved; plus the once-a-second work, timed apart: a
process writing its figures file and the node agent sampling ``/proc`` for its processes. The cost of a step
is the difference of the step times plus that second's work spread over the step. Times are CPU times of
this process (the trainer and the in-process pserver together): what the figures cost, not what a loaded
machine's other work adds to a wall clock.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Callable, List

import numpy as np

from paddle_cluster.node import procs
from paddle_cluster.node import top as node_top
from paddle_cluster.ps import OptimizerSpec, connect
from paddle_cluster.ps import counters as C
from paddle_cluster.ps.client import PSClient


def _steps(step: Callable[[], None], n: int) -> float:
    t0 = time.process_time()
    for _ in range(n):
        step()
    return (time.process_time() - t0) / n


def _per_call(fn: Callable[[], None], n: int) -> float:
    """The median CPU time of ``n`` calls (the clock ticks coarsely: a batch of 20 per sample)."""
    times = []
    for _ in range(n // 20):
        t0 = time.process_time()
        for _ in range(20):
            fn()
        times.append((time.process_time() - t0) / 20)
    return statistics.median(times)


def main(argv: List[str] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--floats", type=int, default=1024, help="dense floats per step (default 1024: 4 KiB)")
    ap.add_argument("--steps", type=int, default=200, help="steps per measurement")
    ap.add_argument("--rounds", type=int, default=40, help="on/off rounds, interleaved (medians compared)")
    a = ap.parse_args(argv)

    ps = connect(mode="sync", optimizer=OptimizerSpec("sgd", lr=0.01))  # an in-process pserver on loopback
    ps.register_dense({"w": np.zeros(a.floats, np.float32)})
    g = np.ones(a.floats, np.float32)
    timed, bare = (lambda: ps.push_pull({"w": g})), (lambda: PSClient.push_pull.__wrapped__(ps, {"w": g}))
    real = C.PROCESS.add_wait

    def counting(on: bool) -> None:
        # The bytes counted in the stream stay on (a list item's addition per frame, inside ``send``): the
        # difference measured is the barrier waits' timing and the timed call.
        C.PROCESS.add_wait = real if on else (lambda *_: None)  # type: ignore[method-assign]

    _steps(timed, a.steps // 4)  # warm up
    on_t, off_t = [], []
    for _ in range(a.rounds):
        counting(True)
        on_t.append(_steps(timed, a.steps))
        counting(False)
        off_t.append(_steps(bare, a.steps))
    counting(True)
    on, off = statistics.median(on_t), statistics.median(off_t)

    with tempfile.TemporaryDirectory() as d:
        os.makedirs(os.path.join(d, "log"))
        os.makedirs(os.path.join(d, procs.STATE_DIR))
        w = C.FiguresWriter(os.path.join(d, "log", "figures.trainer.0.json"), lambda: {"step": ps.step,
                                                                                       "ps_seconds": ps.ps_seconds})
        write_s = _per_call(w.write, 200)
        s = node_top.Sampler(d, period=0.0)  # every call writes, as once a second
        me = os.getpid()
        recs = [{"name": f"trainer.{i}", "pid": me} for i in range(4)]  # an agent with 4 processes
        records = procs.Records(d, "bench")
        for r in recs:
            records.add({**r, "role": "TRAINER", "start_time": procs.start_time(me), "pgid": os.getpgid(0)})

        def sample() -> None:
            table = (procs.subtree(os.getppid()) or (procs.process_table(), None))[0]
            table[me] = procs.stat_fields(me)
            s.sample(recs, table)
        sample_s = _per_call(sample, 200)
        snap_s = _per_call(lambda: node_top.snapshot(d), 200)
        tally = [0, 0]

        def count() -> None:
            tally[0] += 4136
        count_s = _per_call(count, 20000)  # a frame's byte count (in ``Stream``: always on above)
    ps.close()

    per_second = write_s + sample_s  # the agent and each process, once a second each (a node: more processes)
    frames = 4  # a push_pull with one pserver: the trainer's frame and reply, the pserver's two
    cost = (on - off) / off + frames * count_s / off + per_second  # the second's work: that share of every step
    print(f"step ({a.floats * 4} B dense push_pull, sync, loopback): {off * 1e6:.1f} us without counters, "
          f"{on * 1e6:.1f} us with them ({(on - off) / off:+.2%}; CPU time, medians of {a.rounds} interleaved "
          f"rounds of {a.steps} steps)")
    print(f"byte counts: {count_s * 1e9:.0f} ns a frame, {frames} frames a step: {frames * count_s / off:.3%}")
    print(f"once a second: a process's figures file {write_s * 1e6:.0f} us, the agent's /proc sample (4 processes) "
          f"{sample_s * 1e6:.0f} us: {per_second:.3%} of a core; a 'node top' read {snap_s * 1e6:.0f} us (per frame, "
          "while top runs)")
    print(f"cost of top's figures per step: {cost:.2%} (target: under 1 %)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
