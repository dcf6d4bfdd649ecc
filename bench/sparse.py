"""Sparse tables: pull and push of unique ids against 2 pservers, and the same gather/scatter-add in numpy."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Dict

import numpy as np

from .common import Procs, Stats, make_env, wait_json


def run(rows: int, width: int, batch: int, warmup: int = 1, reps: int = 5, n_pservers: int = 2,
        integrity: bool = True) -> Dict[str, Any]:
    tmp = tempfile.mkdtemp(prefix="bench-sparse-")
    env = make_env(["127.0.0.1"] * n_pservers, 1, tmp, integrity=integrity)
    procs = Procs(os.path.join(tmp, "logs"))
    try:
        for k in range(n_pservers):
            procs.pserver(env, k)
        args = json.dumps({"rows": rows, "width": width, "batch": batch, "warmup": warmup, "reps": reps})
        res = wait_json(procs.trainer(env, 0, ["sparse", args]))
    finally:
        procs.close()
    return {"pull": Stats(res["pull"]), "push": Stats(res["push"]), "check": res["check"]}


def numpy_inprocess(rows: int, width: int, batch: int, warmup: int = 1, reps: int = 5, lr: float = 0.5
                    ) -> Dict[str, Any]:
    """The same gather (``table[ids]``) and scatter-add (``table[ids] -= lr * g``) on one local array."""
    rng = np.random.default_rng(1)
    table = rng.standard_normal((rows, width)).astype(np.float32)
    g = rng.standard_normal((batch, width)).astype(np.float32)
    lr32 = np.float32(lr)
    pulls, pushes, ok = [], [], True
    import time

    for i in range(warmup + reps):
        ids = np.sort(rng.choice(rows, size=batch, replace=False))
        t0 = time.perf_counter()
        got = table[ids]
        t1 = time.perf_counter()
        table[ids] -= lr32 * g
        t2 = time.perf_counter()
        ok = ok and bool(np.array_equal(table[ids], got - lr32 * g))
        if i >= warmup:
            pulls.append(t1 - t0)
            pushes.append(t2 - t1)
    return {"pull": Stats(pulls), "push": Stats(pushes), "check": "ok" if ok else "FAILED: numpy update mismatch"}
