"""A PyTorch model on the pservers (``paddle_cluster.torch``) against the same model under DDP with gloo.

The same model, the same global batch split over the same number of trainer processes, the same SGD: the
whole training step (forward, backward, the exchange, the update) timed in every trainer, the slowest
trainer's per step, and the CPU of every process (trainers, pservers, DDP's ranks) over the timed steps. Two
models: a dense MLP of ``size`` bytes of parameters learning a fixed teacher (so a loss falls: the time to a
target loss), and an embedding table of a million rows of which 1 % is touched per step (on the pservers only
those rows travel; DDP all-reduces the whole table's gradient). Both sides end with the same parameters (the
check; with gradient compression, losses within 2 % of DDP's at every step). Integrity is off on the pservers,
as gloo has no MACs: the same work (the ``peers`` section's convention). A ``Setup`` says where: one machine
(two pservers, as the built-in local cluster) or the shaped hosts of ``tests/sshcluster.py`` (a pserver per
node, the launcher's default), with the same-host lane (the default) or over TCP, with or without compression.

Run as a worker: ``python -m bench.frameworks '{"kind": "ps"|"ddp", ...}'`` prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from .common import MB, REPO, TRAINER, Procs, Stats, free_port_range, make_env, proc_environ, wait_json
from .cpu import Cpu, combine, snapshot

GLOBAL_BATCH = 64  # samples per step, split over the trainers
LR = {"dense": 0.001, "embedding": 0.01}  # the MLP's loss sums 2896 outputs: at 0.01 it diverges by step 5
INIT_SCALE = 0.01
TARGET = 0.75  # time to target: until the global batch's loss is at most this much of the first step's
DDP_NODE_PORT = 29500  # DDP's rendezvous on node 0 of a cluster (its own network namespace: the port is free)


def _missing() -> Optional[str]:
    try:
        import torch  # noqa: F401
    except ImportError:
        return "torch is not installed (pip install torch==2.13.0)"
    return None


def no_compression(name: str) -> Optional[str]:
    """Why the pservers' side cannot compress its gradients by ``name`` here (None: it can, or "" asked)."""
    if not name:
        return None
    import paddle_cluster.torch as pct

    if getattr(getattr(pct, "Compression", None), name, None) is None:
        return f"this build's DistributedOptimizer has no compression {name!r} (pct.Compression.{name})"
    return None


@dataclass(frozen=True)
class Setup:
    """Where and how one side of a row runs; DDP runs on the same nodes with the same ranks."""

    trainers: int
    lane: bool = True  # the job's default: the same-host lane where a trainer and a pserver share a node
    compression: str = ""  # the DistributedOptimizer's gradient compression (``pct.Compression.<name>``), "" none
    cluster: Any = None  # tests/sshcluster.SSHCluster: trainer i on node i % n, a pserver per node; None: loopback
    steps: int = 0  # steps beyond the warm-up and repetitions (time to target)

    def pservers(self) -> List[str]:
        """One pserver per node, the launcher's default (``PSERVERS_PER_NODE = 1``); on one machine the
        built-in local cluster's two."""
        return list(self.cluster.ips) if self.cluster is not None else ["127.0.0.1"] * 2

    def node(self, i: int) -> int:
        return i % self.cluster.n if self.cluster is not None else 0

    def ip(self, i: int) -> str:
        return self.cluster.ips[self.node(i)] if self.cluster is not None else "127.0.0.1"

    def prefix(self, node: int) -> List[str]:
        return self.cluster._enter(node) if self.cluster is not None else []


@dataclass
class Side:
    """One side's run: the slowest trainer's time per timed step, the CPU of every process over those steps,
    the global batch's loss at every step and the time from the first step's start to each step's end."""

    step: Stats
    cpu: Cpu
    digest: Dict[str, List[float]]
    losses: List[float]
    ends: List[float]

    def to_target(self, target: float) -> Optional[Tuple[int, float]]:
        """(steps, seconds) until the loss was at most ``target``; None if it never was."""
        for k, loss in enumerate(self.losses):
            if loss <= target:
                return k + 1, self.ends[k]
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
    if a["model"] == "dense":  # a teacher the MLP can partly learn: ReLU of a fixed permutation of the input
        x = torch.randn(GLOBAL_BATCH, a["width"], generator=g)[lo:lo + n]
        perm = torch.randperm(a["width"], generator=torch.Generator().manual_seed(7))
        return x, torch.relu(x[:, perm])
    per = max(1, a["rows"] // 100 // GLOBAL_BATCH)  # 1 % of the rows, distinct, spread over the global batch
    x = torch.randperm(a["rows"], generator=g)[:per * GLOBAL_BATCH].reshape(GLOBAL_BATCH, per)
    y = torch.randn(GLOBAL_BATCH, generator=g)
    return x[lo:lo + n], y[lo:lo + n]


def worker(a: Dict[str, Any]) -> Dict[str, Any]:
    import torch

    torch.set_num_threads(1)  # both sides alike: one compute thread per trainer
    ps = a["kind"] == "ps"
    lr = LR[a["model"]]
    if ps:
        import paddle_cluster.torch as pct

        model = _model(a, ps=True)
        kw = {"compression": getattr(pct.Compression, a["compression"])} if a["compression"] else {}
        opt = pct.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr),
                                       named_parameters=model.named_parameters(), **kw)
    else:
        import datetime

        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://{a['master']}", rank=a["rank"],
                                world_size=a["world"], timeout=datetime.timedelta(seconds=120))
        model = torch.nn.parallel.DistributedDataParallel(_model(a, ps=False))
        opt = torch.optim.SGD(model.parameters(), lr=lr)
    watch = [os.getpid(), *a["cpu_pids"]]  # its own CPU, and the pservers' (given to trainer 0)
    times: List[float] = []
    starts: List[float] = []
    ends: List[float] = []
    losses: List[float] = []
    cpu: List[Dict[str, float]] = []
    total = a["warmup"] + a["reps"] + a["steps"]
    batches = [_batch(a, step) for step in range(total)]  # made first: their CPU (a 1M randperm) is not the step's
    for step, (x, y) in enumerate(batches):
        if step == a["warmup"]:
            cpu.append(snapshot(watch))
        t0 = time.perf_counter()
        opt.zero_grad()
        # The sum over this worker's samples over the global batch: averaged over the trainers (both sides
        # average gradients), the gradient of the global batch's mean loss.
        loss = torch.nn.functional.mse_loss(model(x), y, reduction="sum") * (a["world"] / GLOBAL_BATCH)
        loss.backward()
        opt.step()
        t1 = time.perf_counter()
        if step == a["warmup"] + a["reps"] - 1:
            cpu.append(snapshot(watch))
        starts.append(t0)
        ends.append(t1)
        losses.append(float(loss))
        if a["warmup"] <= step < a["warmup"] + a["reps"]:
            times.append(t1 - t0)
    if ps:
        state = pct.state_dict(model)
        pct.shutdown()
    else:
        state = model.module.state_dict()
        dist.destroy_process_group()
    # What the check compares: a few numbers of the final parameters, the same on both sides.
    digest = {k: [float(v.double().sum()), float(v.double().abs().sum())] for k, v in sorted(state.items())}
    return {"times": times, "starts": starts, "ends": ends, "losses": losses, "cpu": cpu, "digest": digest}


# -- the runs ---------------------------------------------------------------------------------------------


def _run(kind: str, args: Dict[str, Any], setup: Setup) -> Side:
    """``setup.trainers`` workers of ``kind`` ("ps": with a pserver per node, "ddp"), each on its node."""
    world = setup.trainers
    names: Dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="bench-torch-") as d:
        procs = Procs(os.path.join(d, "log"))
        try:
            pids: List[int] = []
            master = ""
            if kind == "ps":
                hosts = setup.pservers()
                env = make_env(hosts, world, d, integrity=False, barrier_timeout=120.0, lane=setup.lane)
                for k in range(len(hosts)):
                    p = procs.pserver(env, k, setup.prefix(k))
                    pids.append(p.pid)
                    names[str(p.pid)] = f"pserver {k}"
                environ = [proc_environ(env, TRAINER, i, setup.ip(i)) for i in range(world)]
            else:
                master = (f"{setup.ip(0)}:{DDP_NODE_PORT}" if setup.cluster is not None
                          else f"127.0.0.1:{free_port_range(1)}")
                base = {k: v for k, v in os.environ.items() if not k.startswith(("PADDLE_", "MASTER_"))}
                base["PYTHONPATH"] = REPO
                if setup.cluster is not None:
                    base["GLOO_SOCKET_IFNAME"] = "eth0"  # a node's own link, not its loopback
                environ = [base] * world
            workers = []
            for i in range(world):
                a = dict(args, kind=kind, rank=i, world=world, master=master, compression=setup.compression,
                         steps=setup.steps, cpu_pids=pids if i == 0 else [])
                p = procs.start([sys.executable, "-m", "bench.frameworks", json.dumps(a)], environ[i], f"{kind}{i}",
                                setup.prefix(setup.node(i)))
                names[str(p.pid)] = f"trainer {i}" if kind == "ps" else f"rank {i}"
                workers.append(p)
            out = [wait_json(p, timeout=600) for p in workers]
        finally:
            procs.close()
    reps = len(out[0]["times"])
    per_step = [max(ts) for ts in zip(*(o["times"] for o in out))]
    cpu = combine([Cpu.between(*o["cpu"], reps, names) for o in out], reps)
    origin = max(o["starts"][0] for o in out)  # every worker in its first step: the job's start
    ends = [max(e) - origin for e in zip(*(o["ends"] for o in out))]
    losses = [sum(ls) / world for ls in zip(*(o["losses"] for o in out))]  # the global batch's mean loss
    return Side(Stats(per_step), cpu, out[0]["digest"], losses, ends)


def _same(ps: Side, ddp: Side, compression: str) -> str:
    """"ok" when the two sides end with the same parameters (float32 sums over differently ordered reductions);
    with compression, when the losses stay within 2 % of DDP's at every step (rounded gradients differ)."""
    if compression:
        worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(ps.losses, ddp.losses))
        return "ok" if worst <= 0.02 else f"FAILED: with {compression} the loss strays {100 * worst:.1f}% from DDP's"
    a, b = ps.digest, ddp.digest
    if a.keys() != b.keys():
        return f"FAILED: parameters differ: {sorted(a)} vs {sorted(b)}"
    for k in a:
        for x, y in zip(a[k], b[k]):
            if not abs(x - y) <= 1e-3 * max(1.0, abs(x), abs(y)):  # NaN fails too
                return f"FAILED: {k} ends at {a[k]} on the pservers, {b[k]} under DDP"
    return "ok"


def width(size: int) -> int:
    return max(64, int((size / 8) ** 0.5))  # two width x width layers of float32


def args_for(model: str, size: int, warmup: int, reps: int, rows: int = 1_000_000, dim: int = 32
             ) -> Dict[str, Any]:
    """The workers' arguments for ``model`` "dense" (an MLP of ``size`` bytes of parameters) or "embedding"
    (``rows`` x ``dim``, 1 % touched per step)."""
    return {"model": model, "width": width(size), "rows": rows, "dim": dim, "warmup": warmup, "reps": reps}


def ddp(args: Dict[str, Any], setup: Setup) -> Side:
    """DDP with gloo on ``setup``'s nodes and ranks (its lane and compression do not apply)."""
    return _run("ddp", args, setup)


def pservers(args: Dict[str, Any], setup: Setup, against: Side) -> Tuple[Side, str]:
    """The pservers' side and its check against DDP's run ``against`` of the same ``args``."""
    side = _run("ps", args, setup)
    return side, _same(side, against, setup.compression)


def describe(model: str, size: int, rows: int, dim: int) -> str:
    if model == "dense":
        w = width(size)
        return f"MLP {w}x{w}x2 ({2 * w * w * 4 / MB:.0f} MB)"
    return f"embedding {rows:,} x {dim} ({rows * dim * 4 / MB:.0f} MB), 1 % of rows per step"


if __name__ == "__main__":
    print(json.dumps(worker(json.loads(sys.argv[1]))), flush=True)
