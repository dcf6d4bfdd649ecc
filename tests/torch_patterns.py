"""Everyday PyTorch patterns (issue 44) as one training loop, run on the pservers through paddle_cluster.torch or
as plain torch on the whole batch, the oracle.

As a trainer: ``python torch_patterns.py CASE OUT [STEPS]`` trains ``CASE`` for STEPS steps on its 1/size() of
each global batch and writes ``{"start", "final"}`` state_dicts to OUT. ``reference(case, start, steps)`` is
plain torch from ``start`` on the whole batch. The cases:

* ``frozen``: a frozen backbone (``requires_grad=False``) under AdamW's default weight decay: it never moves.
* ``unused_adamw``, ``unused_sgd``: a head used only for flagged samples: at some steps by no trainer (torch
  skips it: no decay, no momentum, no Adam step), at others by trainer 0 only (DDP: the others count as zero).
  ``unused_sgd``'s head is in a plain-SGD group with weight decay (the pservers' segment-folding path).
* ``onecycle_adam``, ``cyclic``, ``plateau``: OneCycleLR cycling Adam's beta1, CyclicLR cycling SGD's momentum
  (``cycle_momentum=True``), ReduceLROnPlateau on a metric every trainer sees alike.
* ``clip_sgd``, ``clip_adam``: ``clip_grad_norm_`` of the whole batch's gradient, Horovod's way:
  ``opt.synchronize()``, clip, ``with opt.skip_synchronize(): opt.step()``; plain torch clips the whole batch's.
* ``combined``: all of them in one script (frozen backbone, the head, OneCycleLR cycling SGD's momentum,
  clipping).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Dict, Optional

import numpy as np
import torch

GLOBAL_BATCH, FEATURES, HIDDEN = 12, 5, 4
# Flagged samples of the global batch by step % 3: in trainer 0's half only, nowhere, in both halves.
FLAGGED = ([0, 1], [], [2, 8])


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(FEATURES, HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, 1)
        self.head = torch.nn.Linear(FEATURES, 1)  # only for flagged samples

    def forward(self, x: torch.Tensor, flag: torch.Tensor) -> torch.Tensor:
        out = self.fc2(torch.tanh(self.fc1(x)))
        if flag.any():  # else the head is not in the graph: its grad stays None
            extra = torch.zeros_like(out)
            extra[flag] = self.head(x[flag])
            out = out + extra
        return out


def batch(step: int, rank: int = 0, size: int = 1):
    """This trainer's 1/size of the global batch of ``step``: inputs, head flags, targets."""
    rng = np.random.default_rng(2000 + step)
    x = rng.standard_normal((GLOBAL_BATCH, FEATURES)).astype(np.float32)
    y = rng.standard_normal((GLOBAL_BATCH, 1)).astype(np.float32)
    flag = np.zeros(GLOBAL_BATCH, dtype=bool)
    flag[FLAGGED[step % 3]] = True
    n = GLOBAL_BATCH // size
    part = slice(rank * n, (rank + 1) * n)
    return torch.from_numpy(x[part]), torch.from_numpy(flag[part]), torch.from_numpy(y[part])


def _optimizer(case: str, net: Net) -> torch.optim.Optimizer:
    body = list(net.fc1.parameters()) + list(net.fc2.parameters())
    if case in ("frozen", "combined"):
        net.fc1.requires_grad_(False)
    if case == "frozen":
        return torch.optim.AdamW(net.parameters(), lr=0.02)  # weight_decay 0.01 by default
    if case == "unused_adamw":
        return torch.optim.AdamW(net.parameters(), lr=0.02, weight_decay=0.1)
    if case == "unused_sgd":
        return torch.optim.SGD([{"params": body, "momentum": 0.9, "weight_decay": 0.01},
                                {"params": net.head.parameters(), "weight_decay": 0.1}], lr=0.1)
    if case in ("cyclic", "plateau", "clip_sgd", "combined"):
        return torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    return torch.optim.Adam(net.parameters(), lr=0.05)


def _scheduler(case: str, opt: torch.optim.Optimizer, steps: int) -> Optional[Any]:
    S = torch.optim.lr_scheduler
    if case.startswith("onecycle") or case == "combined":
        return S.OneCycleLR(opt, max_lr=0.3, total_steps=steps + 1)
    if case == "cyclic":
        return S.CyclicLR(opt, base_lr=0.01, max_lr=0.2, step_size_up=2)
    if case == "plateau":
        return S.ReduceLROnPlateau(opt, factor=0.5, patience=0)
    return None


CASES = ("frozen", "unused_adamw", "unused_sgd", "onecycle_adam", "cyclic", "plateau", "clip_sgd", "clip_adam",
         "combined")
MAX_NORM = 0.2


def train(case: str, net: Net, opt: Any, steps: int, rank: int = 0, size: int = 1, first: int = 0) -> None:
    """The loop, the same for plain torch and the pservers: ``opt`` is torch.optim's or pct's."""
    sched = _scheduler(case, opt, steps)
    clip = case.startswith("clip") or case == "combined"
    for step in range(first, steps):
        x, flag, y = batch(step, rank, size)
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x, flag), y).backward()
        skip: Any = contextlib.nullcontext()
        if clip:
            if hasattr(opt, "synchronize"):
                opt.synchronize()
                skip = opt.skip_synchronize()
            torch.nn.utils.clip_grad_norm_(net.parameters(), MAX_NORM)
        with skip:
            opt.step()
        if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
            sched.step([1.0, 1.0, 2.0, 0.5, 3.0, 3.0, 4.0][step % 7])  # one metric for every trainer
        elif sched is not None:
            sched.step()


def reference(case: str, start: Dict[str, torch.Tensor], steps: int) -> Dict[str, torch.Tensor]:
    """Plain torch: the same model from ``start``, the whole global batch every step."""
    net = Net()
    net.load_state_dict(start)
    train(case, net, _optimizer(case, net), steps)
    return net.state_dict()


def main(case: str, out: str, steps: int) -> None:
    import paddle_cluster.torch as pct

    out = out.format(rank=pct.rank())  # "{rank}" in OUT: one file per trainer of a launched job
    torch.manual_seed(pct.rank())  # each trainer starts elsewhere: trainer 0's values must win
    net = Net()
    if case in ("frozen", "combined"):  # a pretrained backbone, the same on every trainer (frozen: never sent)
        torch.manual_seed(7)
        net.fc1.load_state_dict(torch.nn.Linear(FEATURES, HIDDEN).state_dict())
    opt = pct.DistributedOptimizer(_optimizer(case, net), named_parameters=net.named_parameters())
    start = {k: v.clone() for k, v in pct.state_dict(net).items()}
    train(case, net, opt, steps, pct.rank(), pct.size())
    torch.save({"start": start, "final": pct.state_dict(net)}, out)
    pct.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 6)
