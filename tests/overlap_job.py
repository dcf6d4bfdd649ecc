"""A PyTorch trainer whose gradients leave during backward (``train/overlap.py``), and the plain-torch reference
it must equal. ``python overlap_job.py OUT [compression]`` trains 6 steps, each trainer on its 1/size() of the
global batch, in the patterns overlap must follow: two backward passes per step (gradient accumulation), a
branch no trainer uses in step 3 (its parameters get no gradient: flagged at step()), one backward pass in step 4
(fewer than the steps before: the rest goes at step()). Writes ``{"start", "final", "buckets"}`` to OUT
(``{rank}`` in it), and whether the trainer mapped a same-host lane. The model is big enough that a step's
gradients leave in several buckets, and its fc2.weight (4.6 MiB) is split over both pservers' lanes."""

from __future__ import annotations

import sys

import torch

FEATURES, HIDDEN, OUT, GLOBAL_BATCH, STEPS = 256, 1100, 8, 16, 6


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(FEATURES, HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, HIDDEN)
        self.fc3 = torch.nn.Linear(HIDDEN, OUT)
        self.side = torch.nn.Linear(FEATURES, OUT)  # a branch some steps do not use

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        y = self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))
        return y if step == 3 else y + self.side(x)


def batch(step: int, rank: int = 0, size: int = 1):
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(GLOBAL_BATCH, FEATURES, generator=g), torch.randn(GLOBAL_BATCH, OUT, generator=g)
    per = GLOBAL_BATCH // size
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def passes(net: Net, step: int, x: torch.Tensor, y: torch.Tensor) -> None:
    """This step's backward passes over ``(x, y)``: two halves (accumulated), one whole batch in step 4."""
    if step == 4:
        torch.nn.functional.mse_loss(net(x, step), y).backward()
        return
    half = len(x) // 2
    for part in (slice(0, half), slice(half, None)):
        (0.5 * torch.nn.functional.mse_loss(net(x[part], step), y[part])).backward()


def optimizer(net: Net) -> torch.optim.Optimizer:
    return torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)


def reference(start: dict) -> dict:
    """Plain torch on the whole batch."""
    net = Net()
    net.load_state_dict(start)
    opt = optimizer(net)
    for step in range(STEPS):
        opt.zero_grad()
        passes(net, step, *batch(step))
        opt.step()
    return {k: v.clone() for k, v in net.state_dict().items()}


def main(out: str, compression: str = "none") -> None:
    import paddle_cluster.torch as pct

    torch.manual_seed(pct.rank() + 7)  # every trainer its own init: trainer 0's wins
    net = Net()
    opt = pct.DistributedOptimizer(optimizer(net), named_parameters=net.named_parameters(),
                                   compression=pct.Compression.fp16 if compression == "fp16" else None)
    start = {k: v.clone() for k, v in net.state_dict().items()}
    for step in range(STEPS):
        opt.zero_grad()
        passes(net, step, *batch(step, pct.rank(), pct.size()))
        opt.step()
    with open("/proc/self/maps") as f:
        lanes = "memfd:paddle-cluster-lane" in f.read()
    torch.save({"start": start, "final": pct.state_dict(net), "buckets": opt.overlap.buckets, "lanes": lanes},
               out.replace("{rank}", str(pct.rank())))
    pct.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
