"""A benchmark trainer: ``python -m bench.worker KIND JSON`` with the job contract in the environment.

Prints one JSON line with its timings and the result of its correctness check. KIND is ``dense`` or
``sparse``. A dense step (phase ``pushpull``) is one ``push_pull``; phase ``apart`` is the same step as
``push`` then ``pull``.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

from bench.cpu import snapshot
from paddle_cluster.ps import OptimizerSpec, connect

LR = 0.5


def _wait_for_all(done_dir: str, me: int, n: int, timeout: float = 300.0) -> None:
    """A file barrier between trainer processes (async mode has no server-side one)."""
    open(os.path.join(done_dir, f"done-{me}"), "w").close()
    deadline = time.monotonic() + timeout
    while not all(os.path.exists(os.path.join(done_dir, f"done-{i}")) for i in range(n)):
        if time.monotonic() > deadline:
            raise TimeoutError("other trainers never finished")
        time.sleep(0.01)


def model_shape(size: int) -> tuple:
    """The float32 parameter ``w`` of a dense run of ``size`` bytes (rows of 1024 once it has 8 of them)."""
    n_elems = size // 4
    return (n_elems // 1024, 1024) if n_elems >= 1024 * 8 else (n_elems,)


def dense(a: dict) -> dict:
    mode, size, warmup, reps = a["mode"], int(a["size"]), int(a["warmup"]), int(a["reps"])
    phases = a.get("phases", ["pushpull"])
    if a.get("stdlib_mac"):  # as a node without the cryptography package: HMAC-SHA256 only
        from paddle_cluster.ps.wire import auth

        auth.OFFER = auth.HmacSha256.CODE
    shape = model_shape(size)
    ps = connect(mode=mode, optimizer=OptimizerSpec("sgd", lr=LR), max_block_bytes=int(a["max_block"]))
    tid, n = ps.trainer_id, ps.env.trainers
    value = np.float32(tid + 1)
    ps.register_dense({"w": np.zeros(shape, dtype=np.float32)})
    g = np.full(shape, value, dtype=np.float32)
    # sync: every step applies the mean of the trainers' values; async: each trainer's own
    per_step = np.float32(LR) * np.float32(sum(range(1, n + 1)) / n) if mode == "sync" else None
    steps = 0
    problems = []

    def check_pull(p: np.ndarray) -> None:
        if mode == "sync":
            want = -per_step * np.float32(steps)
            if p.flat[0] != want or p.flat[-1] != want:
                problems.append(f"after {steps} steps w={p.flat[0]} want {want}")

    def pushpull() -> None:
        nonlocal steps
        out = ps.push_pull({"w": g})
        steps += 1
        check_pull(out["w"])

    def apart() -> None:  # the same step as push, then pull
        nonlocal steps
        ps.push({"w": g})
        steps += 1
        check_pull(ps.pull()["w"])

    def push() -> None:
        nonlocal steps
        ps.wait(ps.push({"w": g}))
        steps += 1

    def pull() -> None:
        check_pull(ps.pull()["w"])

    fns = {"pushpull": pushpull, "apart": apart, "push": push, "pull": pull}
    out = {"trainer": tid, "times": {}, "starts": {}, "cpu": {}}
    watch = [os.getpid(), *a.get("cpu_pids", [])]  # its own CPU and the pservers' (given to trainer 0)
    for _ in range(warmup):
        pushpull()
    for ph in phases:
        cpu0 = snapshot(watch)
        ts, starts = [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            fns[ph]()
            t1 = time.perf_counter()
            ts.append(t1 - t0)
            starts.append(t0)
        out["times"][ph] = ts
        out["starts"][ph] = starts
        out["cpu"][ph] = [cpu0, snapshot(watch)]
    # final check: the whole array equals what the known gradients must have produced
    if mode == "async":
        ps.wait()
        _wait_for_all(a["done_dir"], tid, n)
        total = sum(float(np.float32(i + 1)) for i in range(n)) * steps  # every trainer ran `steps` steps
        want = np.float32(-LR * total)
    else:
        want = -per_step * np.float32(steps)
    final = ps.pull()["w"]
    if not np.all(final == want):
        problems.append(f"final w in [{final.min()}, {final.max()}], want {want}")
    out["steps"] = steps
    out["check"] = "ok" if not problems else "FAILED: " + "; ".join(problems[:3])
    if a.get("hold"):
        # let the benchmark read the pservers' memory while everything is still registered
        print(json.dumps(out), flush=True)
        sys.stdin.readline()
    ps.close()
    return out


def sparse(a: dict) -> dict:
    rows, width, batch = int(a["rows"]), int(a["width"]), int(a["batch"])
    warmup, reps = int(a["warmup"]), int(a["reps"])
    ps = connect(mode="sync", optimizer=OptimizerSpec("sgd", lr=LR))
    ps.register_sparse("emb", width, vocab_size=rows, init_scale=0.1, seed=3)
    # warm-up: create every row once (the measured steps then hit existing rows, the steady state)
    for lo in range(0, rows, batch):
        ps.pull_sparse("emb", np.arange(lo, min(rows, lo + batch)))
    rng = np.random.default_rng(1)
    g = rng.standard_normal((batch, width)).astype(np.float32)
    pulls, pushes, problems = [], [], []
    last_ids, last_rows = None, None
    for i in range(warmup + reps):
        ids = np.sort(rng.choice(rows, size=batch, replace=False))
        t0 = time.perf_counter()
        got = ps.pull_sparse("emb", ids)
        t1 = time.perf_counter()
        if last_ids is not None:
            # rows pushed last step must come back updated by exactly -lr * g
            common, ia, ib = np.intersect1d(last_ids, ids, return_indices=True)
            if not np.allclose(got[ib], last_rows[ia] - np.float32(LR) * g[ia], rtol=1e-6, atol=1e-7):
                problems.append(f"step {i}: pulled rows differ from the expected update")
        t2 = time.perf_counter()
        ps.wait(ps.push_sparse("emb", ids, g))
        t3 = time.perf_counter()
        ps.push({})  # ends the step
        last_ids, last_rows = ids, got.copy()
        if i >= warmup:
            pulls.append(t1 - t0)
            pushes.append(t3 - t2)
    final = ps.pull_sparse("emb", last_ids)
    if not np.allclose(final, last_rows - np.float32(LR) * g, rtol=1e-6, atol=1e-7):
        problems.append("final rows differ from the expected update")
    ps.close()
    return {"pull": pulls, "push": pushes, "check": "ok" if not problems else "FAILED: " + "; ".join(problems[:3])}


def main() -> int:
    kind, args = sys.argv[1], json.loads(sys.argv[2])
    out = {"dense": dense, "sparse": sparse}[kind](args)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
