"""Everyday Paddle patterns (issue 44) as one training loop, run on the pservers through paddle_cluster.paddle or
as plain Paddle on the whole batch, the oracle.

As a trainer: ``python paddle_patterns.py CASE OUT [STEPS]`` trains ``CASE`` for STEPS steps on its 1/size() of
each global batch and pickles ``{"start", "final"}`` (numpy state_dicts) to OUT. ``reference(case, start,
steps)`` is plain Paddle from ``start`` on the whole batch. The loop clears gradients to None
(``clear_grad(set_to_zero=False)``), so a parameter the forward pass did not use has none. The cases:

* ``frozen``: a frozen backbone (``stop_gradient=True``) under AdamW's default weight decay: it never moves.
* ``unused_adamw``, ``unused_sgd``: a head used only for flagged samples: at some steps by no trainer (Paddle
  skips it: no decay, no moments), at others by trainer 0 only (DDP's rule: the others count as zero).
* ``clip_global`` (a ClipGradByGlobalNorm per parameter group), ``clip_norm`` (ClipGradByNorm, Adam),
  ``clip_value`` (ClipGradByValue, Momentum): ``grad_clip`` on the whole batch's gradient, as Paddle clips it.
* ``synchronize``: ``paddle.nn.utils.clip_grad_norm_`` by hand, Horovod's way: ``opt.synchronize()``, clip,
  ``with opt.skip_synchronize(): opt.step()``; plain Paddle clips the whole batch's gradient.
* ``combined``: all of them in one script (frozen backbone, the head, a OneCycleLR rate, ClipGradByGlobalNorm).
"""

from __future__ import annotations

import contextlib
import pickle
import sys
import warnings
from typing import Any, Dict

import numpy as np

warnings.filterwarnings("ignore", message="No ccache found")
import paddle  # noqa: E402

GLOBAL_BATCH, FEATURES, HIDDEN = 12, 5, 4
FLAGGED = ([0, 1], [], [2, 8])  # flagged samples by step % 3: in trainer 0's half only, nowhere, in both halves
CASES = ("frozen", "unused_adamw", "unused_sgd", "clip_global", "clip_norm", "clip_value", "synchronize", "combined")


class Net(paddle.nn.Layer):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = paddle.nn.Linear(FEATURES, HIDDEN)
        self.fc2 = paddle.nn.Linear(HIDDEN, 1)
        self.head = paddle.nn.Linear(FEATURES, 1)  # only for flagged samples

    def forward(self, x: paddle.Tensor, flagged: np.ndarray) -> paddle.Tensor:
        out = self.fc2(paddle.tanh(self.fc1(x)))
        if len(flagged):  # else the head is not in the graph: its grad stays None
            idx = paddle.to_tensor(flagged)
            out = out + paddle.scatter(paddle.zeros_like(out), idx, self.head(paddle.gather(x, idx)))
        return out


def batch(step: int, rank: int = 0, size: int = 1):
    """This trainer's 1/size of the global batch of ``step``: inputs, the flagged rows among them, targets."""
    rng = np.random.default_rng(3000 + step)
    x = rng.standard_normal((GLOBAL_BATCH, FEATURES)).astype(np.float32)
    y = rng.standard_normal((GLOBAL_BATCH, 1)).astype(np.float32)
    n = GLOBAL_BATCH // size
    flagged = np.array([i - rank * n for i in FLAGGED[step % 3] if rank * n <= i < (rank + 1) * n], dtype=np.int64)
    part = slice(rank * n, (rank + 1) * n)
    return paddle.to_tensor(x[part]), flagged, paddle.to_tensor(y[part])


def make(case: str, net: Net) -> paddle.optimizer.Optimizer:
    body = net.fc1.parameters() + net.fc2.parameters()
    if case in ("frozen", "combined"):
        for p in net.fc1.parameters():
            p.stop_gradient = True
    if case == "combined":
        return paddle.optimizer.Momentum(paddle.optimizer.lr.OneCycleLR(0.3, 7), momentum=0.9, weight_decay=0.01,
                                         grad_clip=paddle.nn.ClipGradByGlobalNorm(0.2), parameters=net.parameters())
    if case == "frozen":
        return paddle.optimizer.AdamW(0.02, parameters=net.parameters())  # weight_decay 0.01 by default
    if case == "unused_adamw":
        return paddle.optimizer.AdamW(0.02, weight_decay=0.1, parameters=net.parameters())
    if case == "unused_sgd":
        return paddle.optimizer.SGD(0.1, weight_decay=0.1, parameters=net.parameters())
    if case == "clip_global":
        return paddle.optimizer.Momentum(0.1, momentum=0.9, parameters=[
            {"params": body, "grad_clip": paddle.nn.ClipGradByGlobalNorm(0.2)},
            {"params": net.head.parameters(), "grad_clip": paddle.nn.ClipGradByGlobalNorm(0.05)}])
    if case == "synchronize":
        return paddle.optimizer.Adam(0.05, parameters=net.parameters())
    if case == "clip_norm":
        return paddle.optimizer.Adam(0.05, grad_clip=paddle.nn.ClipGradByNorm(0.1), parameters=net.parameters())
    return paddle.optimizer.Momentum(0.1, momentum=0.9, weight_decay=0.01, grad_clip=paddle.nn.ClipGradByValue(0.05),
                                     parameters=net.parameters())


def numpy(sd: Dict[str, Any]) -> Dict[str, np.ndarray]:
    return {k: np.array(v.numpy()) for k, v in sd.items()}


def train(net: Net, opt: Any, steps: int, rank: int = 0, size: int = 1, by_hand: bool = False) -> None:
    """The loop, the same for plain Paddle and the pservers: ``opt`` is paddle.optimizer's or ppc's; ``by_hand``:
    clip with ``paddle.nn.utils.clip_grad_norm_`` (after ``synchronize()`` on the pservers)."""
    sched = getattr(opt, "optimizer", opt)._learning_rate
    for step in range(steps):
        x, flagged, y = batch(step, rank, size)
        paddle.nn.functional.mse_loss(net(x, flagged), y).backward()
        skip: Any = contextlib.nullcontext()
        if by_hand:
            if hasattr(opt, "synchronize"):
                opt.synchronize()
                skip = opt.skip_synchronize()
            paddle.nn.utils.clip_grad_norm_(net.parameters(), 0.2)
        with skip:
            opt.step()
        opt.clear_grad(set_to_zero=False)
        if isinstance(sched, paddle.optimizer.lr.LRScheduler):
            sched.step()


def reference(case: str, start: Dict[str, np.ndarray], steps: int) -> Dict[str, np.ndarray]:
    """Plain Paddle: the same model from ``start``, the whole global batch every step."""
    net = Net()
    net.set_state_dict({k: paddle.to_tensor(v) for k, v in start.items()})
    train(net, make(case, net), steps, by_hand=case == "synchronize")
    return numpy(net.state_dict())


def main(case: str, out: str, steps: int) -> None:
    import paddle_cluster.paddle as ppc

    out = out.format(rank=ppc.rank())  # "{rank}" in OUT: one file per trainer of a launched job
    paddle.seed(ppc.rank())  # each trainer starts elsewhere: trainer 0's values must win
    net = Net()
    if case in ("frozen", "combined"):  # a pretrained backbone, the same on every trainer (frozen: never sent)
        paddle.seed(7)
        net.fc1.set_state_dict(paddle.nn.Linear(FEATURES, HIDDEN).state_dict())
    opt = ppc.DistributedOptimizer(make(case, net), named_parameters=net.named_parameters())
    start = numpy(ppc.state_dict(net))
    train(net, opt, steps, ppc.rank(), ppc.size(), by_hand=case == "synchronize")
    with open(out, "wb") as f:
        pickle.dump({"start": start, "final": numpy(ppc.state_dict(net))}, f)
    ppc.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 6)
