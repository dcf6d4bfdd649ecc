"""A PyTorch model on the pservers (``paddle_cluster.torch``) against the same model under DDP with gloo.

The same model, the same global batch split over the same number of trainer processes, the same SGD: the
whole training step (forward, backward, the exchange, the update) timed in every trainer, the slowest
trainer's per step. Two models: a dense MLP of ``size`` bytes of parameters, and an embedding table of a
million rows of which 1 % is touched per step (on the pservers only those rows travel; DDP all-reduces the
whole table's gradient). Both sides end with the same parameters (the check). Integrity is off on the
pservers, as gloo has no MACs: the same work (the ``peers`` section's convention).

Run as a worker: ``python -m bench.frameworks '{"kind": "ps"|"ddp", ...}'`` prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from .common import MB, Procs, Stats, free_port_range, make_env, proc_environ, wait_json

GLOBAL_BATCH = 64  # samples per step, split over the trainers
LR = 0.01
INIT_SCALE = 0.01


def _missing() -> Optional[str]:
    try:
        import torch  # noqa: F401
    except ImportError:
        return "torch is not installed (pip install torch==2.13.0)"
    return None


# -- one worker -----------------------------------------------------------------------------------------------


def _model(a: Dict[str, Any], ps: bool) -> Any:
    import torch

    torch.manual_seed(0)  # every worker of both sides starts from the same values
    if a["model"] == "dense":
        w = a["width"]
        return torch.nn.Sequential(torch.nn.Linear(w, w), torch.nn.ReLU(), torch.nn.Linear(w, w))

    class Bag(torch.nn.Module):
        """Each sample: the mean of its ids' rows, then a linear score."""

        def __init__(self) -> None:
            super().__init__()
            self.out = torch.nn.Linear(a["dim"], 1)  # first: the same draw on both sides
            if ps:
                import paddle_cluster.torch as pct

                self.emb = pct.Embedding(a["rows"], a["dim"], name="emb", init_scale=INIT_SCALE)
            else:  # the rows the pservers would create, all of them
                from paddle_cluster.ps import init_rows

                self.emb = torch.nn.Embedding(a["rows"], a["dim"])
                with torch.no_grad():
                    self.emb.weight.copy_(torch.from_numpy(init_rows(np.arange(a["rows"]), a["dim"], INIT_SCALE, 0)))

        def forward(self, ids: Any) -> Any:
            return self.out(self.emb(ids).mean(dim=1)).squeeze(-1)

    return Bag()


def _batch(a: Dict[str, Any], step: int) -> Tuple[Any, Any]:
    """This worker's part of step ``step``'s global batch (the same global batch on both sides)."""
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    n, lo = GLOBAL_BATCH // a["world"], GLOBAL_BATCH // a["world"] * a["rank"]
    if a["model"] == "dense":
        x = torch.randn(GLOBAL_BATCH, a["width"], generator=g)
        y = torch.randn(GLOBAL_BATCH, a["width"], generator=g)
    else:  # 1 % of the rows, distinct, spread over the global batch
        per = max(1, a["rows"] // 100 // GLOBAL_BATCH)
        x = torch.randperm(a["rows"], generator=g)[:per * GLOBAL_BATCH].reshape(GLOBAL_BATCH, per)
        y = torch.randn(GLOBAL_BATCH, generator=g)
    return x[lo:lo + n], y[lo:lo + n]


def worker(a: Dict[str, Any]) -> Dict[str, Any]:
    import torch

    torch.set_num_threads(1)  # both sides alike: one compute thread per trainer
    ps = a["kind"] == "ps"
    if ps:
        import paddle_cluster.torch as pct

        model = _model(a, ps=True)
        opt = pct.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                       named_parameters=model.named_parameters())
    else:
        import datetime

        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a['port']}", rank=a["rank"],
                                world_size=a["world"], timeout=datetime.timedelta(seconds=120))
        model = torch.nn.parallel.DistributedDataParallel(_model(a, ps=False))
        opt = torch.optim.SGD(model.parameters(), lr=LR)
    times: List[float] = []
    for step in range(a["warmup"] + a["reps"]):
        x, y = _batch(a, step)
        t0 = time.perf_counter()
        opt.zero_grad()
        # The sum over this worker's samples over the global batch: averaged over the trainers (both sides
        # average gradients), the gradient of the global batch's mean loss.
        loss = torch.nn.functional.mse_loss(model(x), y, reduction="sum") * (a["world"] / GLOBAL_BATCH)
        loss.backward()
        opt.step()
        if step >= a["warmup"]:
            times.append(time.perf_counter() - t0)
    if ps:
        state = pct.state_dict(model)
        pct.shutdown()
    else:
        state = model.module.state_dict()
        dist.destroy_process_group()
    # What the check compares: a few numbers of the final parameters, the same on both sides.
    digest = {k: [float(v.double().sum()), float(v.double().abs().sum())] for k, v in sorted(state.items())}
    return {"times": times, "digest": digest}


# -- the runs ---------------------------------------------------------------------------------------------


def _run(kind: str, args: Dict[str, Any], world: int) -> Tuple[Stats, Dict[str, Any]]:
    """``world`` workers of ``kind`` (with 2 pservers for "ps"): the slowest worker's time per step, and
    rank 0's digest of the final parameters."""
    with tempfile.TemporaryDirectory(prefix="bench-torch-") as d:
        procs = Procs(os.path.join(d, "log"))
        try:
            if kind == "ps":
                env = make_env(["127.0.0.1", "127.0.0.1"], world, d, integrity=False, barrier_timeout=120.0)
                for k in range(2):
                    procs.pserver(env, k)
                environ = [proc_environ(env, "TRAINER", i, "127.0.0.1") for i in range(world)]
                port = 0
            else:
                port = free_port_range(1)
                base = {k: v for k, v in os.environ.items() if not k.startswith(("PADDLE_", "MASTER_"))}
                environ = [dict(base, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
                           for _ in range(world)]
            workers = [procs.start([sys.executable, "-m", "bench.frameworks",
                                    json.dumps(dict(args, kind=kind, rank=i, world=world, port=port))],
                                   environ[i], f"{kind}{i}") for i in range(world)]
            out = [wait_json(p, timeout=600) for p in workers]
        finally:
            procs.close()
    per_step = [max(ts) for ts in zip(*(o["times"] for o in out))]
    return Stats(per_step), out[0]["digest"]


def _same(a: Dict[str, Any], b: Dict[str, Any]) -> str:
    """"ok" when the two sides' final parameters agree (float32 sums over differently ordered reductions)."""
    if a.keys() != b.keys():
        return f"FAILED: parameters differ: {sorted(a)} vs {sorted(b)}"
    for k in a:
        for x, y in zip(a[k], b[k]):
            if abs(x - y) > 1e-3 * max(1.0, abs(x), abs(y)):
                return f"FAILED: {k} ends at {a[k]} on the pservers, {b[k]} under DDP"
    return "ok"


def measure(model: str, size: int, warmup: int, reps: int, world: int, rows: int = 1_000_000, dim: int = 32
            ) -> Tuple[Optional[Stats], Optional[Stats], str]:
    """(pservers' step, DDP's step, check) for ``model`` "dense" (an MLP of ``size`` bytes of parameters) or
    "embedding" (``rows`` x ``dim``, 1 % touched per step); (None, None, why) without torch."""
    why = _missing()
    if why:
        return None, None, why
    width = max(64, int((size / 8) ** 0.5))  # two width x width layers of float32
    args = {"model": model, "width": width, "rows": rows, "dim": dim, "warmup": warmup, "reps": reps}
    ps, ps_digest = _run("ps", args, world)
    ddp, ddp_digest = _run("ddp", args, world)
    return ps, ddp, _same(ps_digest, ddp_digest)


def describe(model: str, size: int, rows: int, dim: int) -> str:
    if model == "dense":
        width = max(64, int((size / 8) ** 0.5))
        return f"MLP {width}x{width}x2 ({2 * width * width * 4 / MB:.0f} MB)"
    return f"embedding {rows:,} x {dim} ({rows * dim * 4 / MB:.0f} MB), 1 % of rows per step"


if __name__ == "__main__":
    print(json.dumps(worker(json.loads(sys.argv[1]))), flush=True)
