"""A PyTorch training script for the paddle_cluster.torch tests, and the plain-torch reference it must equal.

As a trainer (launched, or alone): ``python torch_job.py CASE OUT [STEPS [checkpoint]]`` trains ``CASE`` (an
optimizer with its parameter groups and an LR scheduler) for STEPS steps, each trainer on its 1/size() of a
global batch, from the job's start step on (a resumed job continues), and writes ``{"start", "final"}``
state_dicts to OUT (``{rank}`` in it: the trainer's id); trainer 0 also saves the model with ``pct.save`` to
``OUT.model``. ``checkpoint``: trainer 0 then has the pservers save a checkpoint. The reference (``reference``)
is torch.optim on the whole batch.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

GLOBAL_BATCH, FEATURES, HIDDEN, V, DIM = 12, 5, 4, 40, 3


class Net(torch.nn.Module):
    def __init__(self, emb: torch.nn.Module = None, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.emb = emb
        self.fc1 = torch.nn.Linear(FEATURES + (DIM if emb is not None else 0), hidden)
        self.fc2 = torch.nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self.emb is not None:
            x = torch.cat([x, self.emb(ids).sum(1)], 1)
        return self.fc2(torch.tanh(self.fc1(x)))


def _groups(case: str, net: Net) -> list:
    fc1, fc2 = list(net.fc1.parameters()), list(net.fc2.parameters())
    emb = [] if net.emb is None else [{"params": [net.emb.weight], "lr": 0.5}]
    if case == "sgd":  # every SGD variant, one per group; the table plain SGD (lazy rows equal dense exactly)
        return [{"params": [net.fc1.weight]},
                {"params": [net.fc1.bias], "momentum": 0.9, "dampening": 0.3, "weight_decay": 0.01},
                {"params": [net.fc2.weight], "momentum": 0.9, "nesterov": True},
                {"params": [net.fc2.bias], "weight_decay": 0.1}] + emb
    if case == "adagrad":
        return [{"params": fc1, "lr_decay": 0.05},
                {"params": fc2, "weight_decay": 0.01}] + emb
    if case == "adam":
        return [{"params": fc1, "amsgrad": True}, {"params": fc2, "weight_decay": 0.01, "betas": (0.8, 0.99)}]
    return list(net.parameters())


# case -> (torch.optim class, its defaults, a table in the model, the scheduler on the wrapper (else the wrapped))
CASES = {
    "sgd": (torch.optim.SGD, {"lr": 0.2}, True, True),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.1, "initial_accumulator_value": 0.1}, True, False),
    "adam": (torch.optim.Adam, {"lr": 0.02}, False, True),
    "adamw": (torch.optim.AdamW, {"lr": 0.02, "weight_decay": 0.1}, False, False),
}


def batch(step: int, rank: int = 0, size: int = 1):
    """This trainer's 1/size of the global batch of ``step``."""
    rng = np.random.default_rng(1000 + step)
    x = rng.standard_normal((GLOBAL_BATCH, FEATURES)).astype(np.float32)
    ids = rng.integers(0, V, (GLOBAL_BATCH, 2))
    y = rng.standard_normal((GLOBAL_BATCH, 1)).astype(np.float32)
    n = GLOBAL_BATCH // size
    part = slice(rank * n, (rank + 1) * n)
    return torch.from_numpy(x[part]), torch.from_numpy(ids[part]), torch.from_numpy(y[part])


def make(case: str, net: Net):
    cls, defaults, _, on_wrapper = CASES[case]
    return cls(_groups(case, net), **defaults)


def scheduler(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def reference(case: str, start: dict, steps: int) -> dict:
    """Plain torch: the same model from ``start``, the whole global batch every step."""
    net = Net(torch.nn.Embedding(V, DIM) if CASES[case][2] else None)
    net.load_state_dict(start)
    opt = make(case, net)
    sched = scheduler(opt)
    for step in range(steps):
        x, ids, y = batch(step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x, ids), y).backward()
        opt.step()
        sched.step()
    return net.state_dict()


def main(case: str, out: str, steps: int = 5, checkpoint: bool = False, hidden: int = HIDDEN,
         mode: str = "sync") -> None:
    import paddle_cluster.torch as pct

    out = out.format(rank=pct.rank())  # "{rank}" in OUT: one file per trainer of a launched job
    torch.manual_seed(pct.rank())  # each trainer starts elsewhere: trainer 0's values must win
    net = Net(pct.Embedding(V, DIM, init_scale=0.3) if CASES[case][2] else None, hidden)
    inner = make(case, net)
    opt = pct.DistributedOptimizer(inner, named_parameters=net.named_parameters(), mode=mode)
    start = {k: v.clone() for k, v in pct.state_dict(net).items()}
    sched = scheduler(opt if CASES[case][3] else inner)
    for _ in range(opt.start_step):  # a resumed job: the schedule where the checkpoint left it
        sched.step()
    for step in range(opt.start_step, steps):
        x, ids, y = batch(step, pct.rank(), pct.size())
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x, ids), y).backward()
        opt.step()
        sched.step()
    if checkpoint:
        opt.save_checkpoint()
    torch.save({"start": start, "final": pct.state_dict(net), "rank": pct.rank(), "size": pct.size(),
                "start_step": opt.start_step}, out)
    pct.save(net, out + ".model")
    pct.shutdown()


if __name__ == "__main__":
    args = dict(a.split("=", 1) for a in sys.argv[4:] if "=" in a)
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 5, "checkpoint" in sys.argv[4:],
         int(args.get("hidden", HIDDEN)), args.get("mode", "sync"))
