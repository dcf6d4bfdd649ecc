"""A fluid model of the sync PS step on shaped links: what the all-to-all pattern itself loses when TCP does
not share a link evenly between its flows.

``n`` nodes, each a trainer and a pserver, on full-duplex links of rate 1. A step is every trainer pushing
its gradient's shard to every other node's pserver and pulling the new values back: each pserver's shard is
``seg`` segments, a segment's replies may go once every trainer's push of that segment is in, and a trainer
starts its next step when all its replies are in (no barrier beyond that). A link is shared by the flows
with bytes to send, max-min fairly, each flow's share weighted by a factor drawn from ``[1, 1 + spread]``
anew every ``hold`` of an ideal step (TCP's uneven, slowly changing shares). With ``spread`` 0 the step
takes the ideal ``2 (n - 1) seg``: every link busy all the time. What it takes above that is the pattern's
loss; a ring all-reduce has one flow per link direction and nothing to share.

``lead``: a push may run at most that many segments ahead of the other trainers' pushes to the same pserver
(flows held together, as a tight fold pool would hold them); by default they are not held.

    python -m bench.linkmodel [--nodes 2 4] [--spread 0 1 3] [--hold 0.1 0.3 1] [--lead 2]
"""

from __future__ import annotations

import argparse
import random
import statistics
from typing import Dict, List, Tuple

Flow = Tuple[str, int, int]  # ("push", trainer, pserver) or ("reply", pserver, trainer): (kind, src node, dst)


def step_times(n: int, spread: float, hold: float, steps: int = 10, seg: int = 16, dt: float = 0.05,
               seed: int = 0, lead: float = float("inf")) -> List[float]:
    """Times between the ends of consecutive global steps (every trainer done), in units of one segment at
    the line rate; the ideal is ``2 (n - 1) seg``."""
    rng = random.Random(seed)
    step = [0] * n
    push = [[0.0] * n for _ in range(n)]  # push[j][k]: trainer j's current step, sent to pserver k
    reply = [[0.0] * n for _ in range(n)]  # reply[k][j]: pserver k to trainer j, trainer j's current step
    done: List[List[float]] = [[] for _ in range(n)]
    weights: Dict[Flow, float] = {}
    epoch, t, ideal = -1, 0.0, 2 * (n - 1) * seg

    def got(k: int, s: int, j: int) -> float:  # what pserver k holds of trainer j's step-s gradient
        return float(seg) if step[j] > s else (push[j][k] if step[j] == s else 0.0)

    while min(len(d) for d in done) < steps:
        if int(t / (hold * ideal)) != epoch:
            epoch, weights = int(t / (hold * ideal)), {}
        flows: List[Tuple[Flow, float]] = []  # (flow, bytes it may still send)
        for j in range(n):
            for k in range(n):
                if k == j:
                    continue  # a trainer's own shard never crosses its link
                held = min(got(k, step[j], i) for i in range(n))  # of this step, from every trainer
                cap = min(float(seg), held + lead)
                if push[j][k] < cap - 1e-9:
                    flows.append((("push", j, k), cap - push[j][k]))
                ready = int(held + 1e-9)  # whole segments
                if reply[k][j] < ready - 1e-9:
                    flows.append((("reply", k, j), ready - reply[k][j]))
        w = [weights.setdefault(f, 1.0 + spread * rng.random()) for f, _ in flows]
        rate = _max_min(n, [f for f, _ in flows], w)
        for i, ((kind, a, b), left) in enumerate(flows):
            d = min(rate[i] * dt, left)
            if kind == "push":
                push[a][b] += d
            else:
                reply[a][b] += d
        t += dt
        for j in range(n):
            if all(reply[k][j] >= seg - 1e-6 for k in range(n) if k != j) and \
                    all(got(j, step[j], i) >= seg - 1e-6 for i in range(n)):
                done[j].append(t)
                step[j] += 1
                push[j] = [float(seg) if k == j else 0.0 for k in range(n)]
                for k in range(n):
                    reply[k][j] = 0.0
            push[j][j] = float(seg)
    ends = [max(d[s] for d in done) for s in range(steps)]
    return [b - a for a, b in zip(ends, ends[1:])]


def _max_min(n: int, flows: List[Flow], w: List[float]) -> List[float]:
    """Weighted max-min fair rates: fill every flow until its first link (source up, destination down) is full."""
    up, down = [1.0] * n, [1.0] * n
    rate = [0.0] * len(flows)
    left = set(range(len(flows)))
    while left:
        best = None
        for cap, end in ((up, 1), (down, 2)):
            for node in range(n):
                on = [i for i in left if flows[i][end] == node]
                if on:
                    share = cap[node] / sum(w[i] for i in on)
                    if best is None or share < best[0]:
                        best = (share, on)
        assert best is not None
        share, on = best
        for i in on:
            rate[i] = share * w[i]
            up[flows[i][1]] -= rate[i]
            down[flows[i][2]] -= rate[i]
            left.discard(i)
    return rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[2, 4], help="nodes, each a trainer and a pserver")
    ap.add_argument("--spread", type=float, nargs="+", default=[0.0, 1.0, 3.0],
                    help="flow weights are drawn from [1, 1 + spread]")
    ap.add_argument("--hold", type=float, nargs="+", default=[0.1, 0.3, 1.0],
                    help="how long a weight holds, in ideal steps")
    ap.add_argument("--seeds", type=int, default=3, help="runs per setting")
    ap.add_argument("--lead", type=float, default=float("inf"),
                    help="segments a push may run ahead of the other trainers' (default: unlimited)")
    a = ap.parse_args()
    print("nodes  spread  hold   line rate reached (mean of the steps after the first, per seed)")
    for n in a.nodes:
        for spread in a.spread:
            for hold in a.hold if spread else a.hold[:1]:
                got = []
                for seed in range(a.seeds):
                    times = step_times(n, spread, hold, seed=seed, lead=a.lead)[1:]
                    got.append(2 * (n - 1) * 16 / statistics.mean(times))
                print(f"{n:5d}  {spread:6.1f}  {hold:4.1f}   " + "  ".join(f"{g:.0%}" for g in got))


if __name__ == "__main__":
    main()
