"""A PyTorch trainer whose gradients leave during backward (``train/overlap.py``), and the plain-torch reference
it must equal. ``python overlap_job.py OUT [compression]`` trains 6 steps, each trainer on its 1/size() of the
global batch, in the patterns overlap must follow: two backward passes per step (gradient accumulation), a
branch no trainer uses in step 3 (its parameters get no gradient: flagged at step()), one backward pass in step 4
(fewer than the steps before: the rest goes at step()). Writes ``{"start", "final", "buckets", "sent"}`` to OUT
(``{rank}`` in it: the bytes it sent), and whether the trainer mapped a same-host lane. The model is big enough
that a step's gradients leave in several buckets, and its fc2.weight (4.6 MiB) is split over both pservers'
lanes. ``clip`` instead of a compression: each step's gradient clipped after ``synchronize()``."""

from __future__ import annotations

import sys

import torch

FEATURES, HIDDEN, OUT, GLOBAL_BATCH, STEPS = 256, 1100, 8, 16, 6
CLIP = 0.05  # below the whole batch's gradient norm at every step: the clipping does change each step


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


def reference(start: dict, clip: bool = False) -> dict:
    """Plain torch on the whole batch (``clip``: its gradient's norm clipped to ``CLIP``)."""
    net = Net()
    net.load_state_dict(start)
    opt = optimizer(net)
    for step in range(STEPS):
        opt.zero_grad()
        passes(net, step, *batch(step))
        if clip:
            torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)
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
        if compression == "clip":  # Horovod's pattern: the whole batch's gradient, clipped, then applied
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
    from paddle_cluster.ps.counters import PROCESS

    sent = PROCESS.interval()["sent"]  # bytes this trainer sent to the pservers over TCP (what `top` shows)
    with open("/proc/self/maps") as f:
        lanes = "memfd:paddle-cluster-lane" in f.read()
    torch.save({"start": start, "final": pct.state_dict(net), "buckets": opt.overlap.buckets, "lanes": lanes,
                "sent": sent, "model_bytes": sum(p.numel() * 4 for p in net.parameters())},
               out.replace("{rank}", str(pct.rank())))
    pct.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
