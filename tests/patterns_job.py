"""A small training script for the everyday patterns of docs/pytorch.md's second table, on PyTorch or Paddle,
and the plain-framework references it must equal.

``python patterns_job.py FW SCENARIO OUT`` (FW: torch or paddle), two trainers on uneven shards of one batch
(trainer 0 three samples, trainer 1 one: DDP's rule averages the trainers' means):
- ``report``: each step ``report({"loss", "lr"})`` and ``average(loss)`` driving a ReduceLROnPlateau;
- ``leave``: trainer 1 ends (``shutdown()``) after 2 of the 4 steps; trainer 0's shard alone is then the step;
- ``empty``: trainer 1's shard is empty from step 1 on (its ``step()`` must refuse it in one line);
- ``broadcast``, ``average`` (torch): a BatchNorm model, its buffers under that rule; ``ddp OUT PORT RANK`` is
  the reference, the same model under DDP.
OUT (``{rank}`` in it: the trainer's id) gets JSON: the start and final parameters, each step's loss and
average.
"""

from __future__ import annotations

import json
import sys
import warnings

import numpy as np

STEPS = 4
X = (np.arange(12, dtype=np.float32).reshape(4, 3) / 10)
Y = (X.sum(1, keepdims=True) * 0.5 - 0.2).astype(np.float32)
SHARDS = (slice(0, 3), slice(3, 4))


def _plateau_kw() -> dict:
    # A 90 % relative improvement every step or the rate halves: the averaged loss decides each step.
    return {"factor": 0.5, "patience": 0, "threshold": 0.9}


def run_torch(scenario: str, out: str) -> None:
    import torch

    import paddle_cluster.torch as pct

    torch.manual_seed(0)
    net = torch.nn.Linear(3, 1)
    opt = pct.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=net.named_parameters())
    start = {k: v.tolist() for k, v in pct.state_dict(net).items()}
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, **_plateau_kw())
    x, y = torch.from_numpy(X), torch.from_numpy(Y)
    losses, avgs = [], []
    for step in range(STEPS):
        if scenario == "leave" and pct.rank() == 1 and step == 2:
            break
        part = SHARDS[pct.rank()] if not (scenario == "empty" and pct.rank() == 1 and step >= 1) else slice(0, 0)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(net(x[part]), y[part])
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if scenario == "report":
            pct.report({"loss": loss, "lr": opt.param_groups[0]["lr"]})
            avg = pct.average(loss.detach())
            avgs.append(avg.item())
            sched.step(avg)
    res = {"rank": pct.rank(), "start": start, "losses": losses, "avgs": avgs}
    if pct.rank() == 0:
        res["final"] = {k: v.tolist() for k, v in pct.state_dict(net).items()}
    pct.shutdown()
    json.dump(res, open(out.format(rank=res["rank"]), "w"))


def _bn_net():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))


def _bn_batch(step: int, rank: int):
    import torch

    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(8, 3, generator=g) * (1 + step), torch.randn(8, 1, generator=g)
    return x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4]


def run_torch_bn(out: str, how: str = "broadcast") -> None:
    """A BatchNorm model, DDP's buffer rule (``how``): each trainer's state_dict (its own buffers) after 3 steps."""
    import torch

    import paddle_cluster.torch as pct

    net = _bn_net()
    opt = pct.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                   named_parameters=net.named_parameters(), buffers=how)
    for step in range(3):
        x, y = _bn_batch(step, pct.rank())
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
    res = {"rank": pct.rank(), "state": {k: v.tolist() for k, v in net.state_dict().items()}}
    pct.shutdown()
    json.dump(res, open(out.format(rank=res["rank"]), "w"))


def run_ddp_bn(out: str, port: str, rank: str) -> None:
    """The reference: the same under torch DDP (gloo, broadcast_buffers=True), 2 processes."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=int(rank), world_size=2)
    net = torch.nn.parallel.DistributedDataParallel(_bn_net(), broadcast_buffers=True)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(3):
        x, y = _bn_batch(step, int(rank))
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
    json.dump({"state": {k: v.tolist() for k, v in net.module.state_dict().items()}},
              open(out.format(rank=rank), "w"))
    dist.destroy_process_group()


def reference_torch(scenario: str, start: dict) -> dict:
    """Plain torch on the whole batch by DDP's rule: the mean of the trainers' mean losses."""
    import torch

    net = torch.nn.Linear(3, 1)
    net.load_state_dict({k: torch.tensor(v) for k, v in start.items()})
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, **_plateau_kw())
    x, y = torch.from_numpy(X), torch.from_numpy(Y)
    avgs = []
    for step in range(STEPS):
        shards = SHARDS if not (scenario == "leave" and step >= 2) else SHARDS[:1]
        opt.zero_grad()
        parts = [torch.nn.functional.mse_loss(net(x[s]), y[s]) for s in shards]
        loss = sum(parts) / len(parts)
        loss.backward()
        opt.step()
        avgs.append(loss.item())
        if scenario == "report":
            sched.step(loss.detach())
    return {"final": {k: v.tolist() for k, v in net.state_dict().items()}, "avgs": avgs}


def run_paddle(scenario: str, out: str) -> None:
    warnings.filterwarnings("ignore", message="No ccache found")
    import paddle

    import paddle_cluster.paddle as ppc

    paddle.seed(0)
    net = paddle.nn.Linear(3, 1)
    sched = paddle.optimizer.lr.ReduceOnPlateau(0.1, **_plateau_kw())
    opt = ppc.DistributedOptimizer(paddle.optimizer.Momentum(learning_rate=sched, momentum=0.9,
                                                             parameters=net.parameters()),
                                   named_parameters=net.named_parameters())
    start = {k: v.numpy().tolist() for k, v in ppc.state_dict(net).items()}
    x, y = paddle.to_tensor(X), paddle.to_tensor(Y)
    losses, avgs = [], []
    for step in range(STEPS):
        if scenario == "leave" and ppc.rank() == 1 and step == 2:
            break
        part = SHARDS[ppc.rank()] if not (scenario == "empty" and ppc.rank() == 1 and step >= 1) else slice(0, 0)
        loss = paddle.nn.functional.mse_loss(net(x[part]), y[part])
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
        if scenario == "report":
            ppc.report({"loss": loss, "lr": opt.get_lr()})
            avg = ppc.average(loss.detach())
            avgs.append(float(avg))
            sched.step(avg)
    res = {"rank": ppc.rank(), "start": start, "losses": losses, "avgs": avgs}
    if ppc.rank() == 0:
        res["final"] = {k: v.numpy().tolist() for k, v in ppc.state_dict(net).items()}
    ppc.shutdown()
    json.dump(res, open(out.format(rank=res["rank"]), "w"))


def reference_paddle(scenario: str, start: dict) -> dict:
    import paddle

    net = paddle.nn.Linear(3, 1)
    net.set_state_dict({k: paddle.to_tensor(np.array(v, dtype=np.float32)) for k, v in start.items()})
    sched = paddle.optimizer.lr.ReduceOnPlateau(0.1, **_plateau_kw())
    opt = paddle.optimizer.Momentum(learning_rate=sched, momentum=0.9, parameters=net.parameters())
    x, y = paddle.to_tensor(X), paddle.to_tensor(Y)
    avgs = []
    for step in range(STEPS):
        shards = SHARDS if not (scenario == "leave" and step >= 2) else SHARDS[:1]
        parts = [paddle.nn.functional.mse_loss(net(x[s]), y[s]) for s in shards]
        loss = sum(parts) / len(parts)
        loss.backward()
        opt.step()
        opt.clear_grad()
        avgs.append(float(loss))
        if scenario == "report":
            sched.step(loss.detach())
    return {"final": {k: v.numpy().tolist() for k, v in net.state_dict().items()}, "avgs": avgs}


if __name__ == "__main__":
    if sys.argv[1] == "ddp":
        run_ddp_bn(*sys.argv[2:])
    elif sys.argv[2] in ("broadcast", "average"):
        run_torch_bn(sys.argv[3], sys.argv[2])
    else:
        {"torch": run_torch, "paddle": run_paddle}[sys.argv[1]](sys.argv[2], sys.argv[3])
