"""A PaddlePaddle dygraph training script for the paddle_cluster.paddle tests, and the plain-Paddle reference it
must equal.

As a trainer (launched, or alone): ``python paddle_job.py CASE OUT [STEPS [checkpoint] [hidden=N]]`` trains
``CASE`` (a paddle.optimizer with its parameter groups and a StepDecay learning rate) for STEPS steps, each
trainer on its 1/size() of a global batch, from the job's start step on (a resumed job continues), and pickles
``{"start", "final", "rank", "size", "start_step"}`` (state_dicts as numpy) to OUT (``{rank}`` in it: the
trainer's id); trainer 0 also saves the model with ``ppc.save`` to ``OUT.model``. ``checkpoint``: trainer 0
then has the pservers save a checkpoint. The reference (``reference``) is paddle.optimizer on the whole batch.
"""

from __future__ import annotations

import pickle
import sys
import warnings

import numpy as np

warnings.filterwarnings("ignore", message="No ccache found")
import paddle  # noqa: E402

GLOBAL_BATCH, FEATURES, HIDDEN, V, DIM = 12, 5, 4, 40, 3


class Net(paddle.nn.Layer):
    def __init__(self, emb: paddle.nn.Layer = None, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.emb = emb
        self.fc1 = paddle.nn.Linear(FEATURES + (DIM if emb is not None else 0), hidden)
        self.fc2 = paddle.nn.Linear(hidden, 1)

    def forward(self, x: paddle.Tensor, ids: paddle.Tensor) -> paddle.Tensor:
        if self.emb is not None:
            x = paddle.concat([x, self.emb(ids).sum(1)], 1)
        return self.fc2(paddle.tanh(self.fc1(x)))


def _decay_weights(name: str) -> bool:
    return name.endswith(".w_0")  # AdamW's apply_decay_param_fun: weights decay, biases do not


def make(case: str, net: Net) -> paddle.optimizer.Optimizer:
    """The case's optimizer over ``net``, its learning rate a StepDecay halving it every 2 steps."""
    fc1, fc2 = net.fc1.parameters(), net.fc2.parameters()
    emb = [] if net.emb is None else [net.emb.weight]
    L2 = paddle.regularizer.L2Decay
    if case == "sgd":  # a group with L2 decay, one with a learning-rate multiplier; the table its own multiplier
        return paddle.optimizer.SGD(
            paddle.optimizer.lr.StepDecay(0.2, step_size=2, gamma=0.5),
            parameters=[{"params": [net.fc1.weight]}, {"params": [net.fc1.bias], "weight_decay": 0.01},
                        {"params": fc2, "learning_rate": 0.5}, {"params": emb, "learning_rate": 2.5}])
    if case == "momentum":
        return paddle.optimizer.Momentum(
            paddle.optimizer.lr.StepDecay(0.1, step_size=2, gamma=0.5), momentum=0.9, weight_decay=L2(0.001),
            parameters=[{"params": fc1, "use_nesterov": True}, {"params": fc2, "momentum": 0.8, "weight_decay": 0.01}])
    if case == "adagrad":  # the table without decay: paddle's dense table would decay rows no batch touched
        return paddle.optimizer.Adagrad(
            paddle.optimizer.lr.StepDecay(0.1, step_size=2, gamma=0.5), epsilon=1e-6, initial_accumulator_value=0.1,
            weight_decay=0.01, parameters=[{"params": fc1 + fc2}, {"params": emb, "weight_decay": 0.0}])
    if case == "adam":
        return paddle.optimizer.Adam(
            paddle.optimizer.lr.StepDecay(0.02, step_size=2, gamma=0.5),
            parameters=[{"params": fc1, "beta1": 0.8, "beta2": 0.99}, {"params": fc2, "weight_decay": L2(0.01)}])
    return paddle.optimizer.AdamW(paddle.optimizer.lr.StepDecay(0.02, step_size=2, gamma=0.5), weight_decay=0.1,
                                  apply_decay_param_fun=_decay_weights, amsgrad=True, parameters=net.parameters())


CASES = {"sgd": True, "momentum": False, "adagrad": True, "adam": False, "adamw": False}  # case -> has a table


def batch(step: int, rank: int = 0, size: int = 1):
    """This trainer's 1/size of the global batch of ``step``."""
    rng = np.random.default_rng(1000 + step)
    x = rng.standard_normal((GLOBAL_BATCH, FEATURES)).astype(np.float32)
    ids = rng.integers(0, V, (GLOBAL_BATCH, 2))
    y = rng.standard_normal((GLOBAL_BATCH, 1)).astype(np.float32)
    n = GLOBAL_BATCH // size
    part = slice(rank * n, (rank + 1) * n)
    return paddle.to_tensor(x[part]), paddle.to_tensor(ids[part]), paddle.to_tensor(y[part])


def numpy(sd: dict) -> dict:
    return {k: np.array(v.numpy()) for k, v in sd.items()}


def reference(case: str, start: dict, steps: int) -> dict:
    """Plain Paddle: the same model from ``start``, the whole global batch every step."""
    net = Net(paddle.nn.Embedding(V, DIM) if CASES[case] else None)
    net.set_state_dict({k: paddle.to_tensor(v) for k, v in start.items()})
    opt = make(case, net)
    for step in range(steps):
        x, ids, y = batch(step)
        paddle.nn.functional.mse_loss(net(x, ids), y).backward()
        opt.step()
        opt.clear_grad()
        opt._learning_rate.step()
    return numpy(net.state_dict())


def main(case: str, out: str, steps: int = 5, checkpoint: bool = False, hidden: int = HIDDEN) -> None:
    import paddle_cluster.paddle as ppc

    out = out.format(rank=ppc.rank())  # "{rank}" in OUT: one file per trainer of a launched job
    paddle.seed(ppc.rank())  # each trainer starts elsewhere: trainer 0's values must win
    net = Net(ppc.Embedding(V, DIM, init_scale=0.3) if CASES[case] else None, hidden)
    opt = ppc.DistributedOptimizer(make(case, net))
    start = numpy(ppc.state_dict(net))
    sched = opt.optimizer._learning_rate
    for _ in range(opt.start_step):  # a resumed job: the schedule where the checkpoint left it
        sched.step()
    for step in range(opt.start_step, steps):
        x, ids, y = batch(step, ppc.rank(), ppc.size())
        paddle.nn.functional.mse_loss(net(x, ids), y).backward()
        opt.step()
        opt.clear_grad()
        sched.step()
    if checkpoint:
        opt.save_checkpoint()
    with open(out, "wb") as f:
        pickle.dump({"start": start, "final": numpy(ppc.state_dict(net)), "rank": ppc.rank(), "size": ppc.size(),
                     "start_step": opt.start_step}, f)
    ppc.save(net, out + ".model")
    ppc.shutdown()


if __name__ == "__main__":
    args = dict(a.split("=", 1) for a in sys.argv[4:] if "=" in a)
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 5, "checkpoint" in sys.argv[4:],
         int(args.get("hidden", HIDDEN)))
