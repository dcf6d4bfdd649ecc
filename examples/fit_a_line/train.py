"""Seed 003's Fluid quick start: linear regression on UCI housing with 2 pservers and 2 trainers.

Written on the runtime's own API: a ``train.layers`` model and the parameter-server client, one pull ->
forward -> backward -> push per step. One script for both roles, chosen by ``PADDLE_TRAINING_ROLE`` as in the
seed. Run it with ``paddle-cluster run --job_dispatch_package examples/fit_a_line [-- --mode async --passes 20
...]``, or alone (``python train.py``) to train locally against an in-process pserver.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from paddle_cluster.contract import JobEnv, ProcessEnv
from paddle_cluster.ps import OptimizerSpec, connect, serve
from paddle_cluster.train import data, layers, losses
from paddle_cluster.train.metrics import MetricsWriter, write_final

HERE = os.path.dirname(os.path.abspath(__file__))
FEATURES = 13


def load_housing(path: str = os.path.join(HERE, "housing.data"), ratio: float = 0.8):
    """(train, test) rows of 13 features + price, normalised as ``paddle.dataset.uci_housing`` did:
    per feature (x - mean) / (max - min) over the whole file; the first 80 % of rows train, the rest test."""
    d = np.fromfile(path, sep=" ").reshape(-1, FEATURES + 1)
    mx, mn, avg = d.max(axis=0), d.min(axis=0), d.sum(axis=0) / d.shape[0]
    for i in range(FEATURES):
        d[:, i] = (d[:, i] - avg[i]) / (mx[i] - mn[i])
    offset = int(d.shape[0] * ratio)
    return d[:offset].astype(np.float32), d[offset:].astype(np.float32)


def columns(rows: np.ndarray):
    """(features, prices) of a batch of rows."""
    rows = np.asarray(rows, dtype=np.float32).reshape(-1, FEATURES + 1)
    return rows[:, :FEATURES], rows[:, FEATURES:]


def build_model(seed: int = 0) -> layers.Linear:
    """Fluid's ``y_predict = fc(x, size=1)``; the loss is ``mean(square_error_cost(y_predict, y))``."""
    return layers.Linear("fc_0", FEATURES, 1, seed=seed)


def mse(model: layers.Layer, rows: np.ndarray) -> np.float32:
    """The model's mean squared error on ``rows`` (float32, as the trainers compute it)."""
    x, y = columns(rows)
    return np.float32(losses.SquareError().forward(model.forward(x), y))


def train_reader(train: np.ndarray, trainer_id: int, trainers: int, batch_size: int, seed: int):
    # Shuffle the whole training set with a seed every trainer shares, then take this trainer's shard: the
    # trainers' batches of one step together are exactly the batch a single trainer with batch_size *
    # trainers would see, so sync training matches the one-trainer run.
    shuffled = data.shuffle(data.from_list(list(train)), buf_size=len(train), seed=seed)
    return data.batch(data.shard_reader(shuffled, trainer_id, trainers), batch_size)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=("sync", "async"), default="sync")
    ap.add_argument("--passes", type=int, default=20)
    ap.add_argument("--batch-size", "--batch_size", type=int, default=8, help="per trainer")
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.passes < 1 or args.batch_size < 1:
        ap.error("--passes and --batch-size must be at least 1")

    if os.getenv("PADDLE_TRAINING_ROLE") == "PSERVER":
        # The seed starts this script as pserver too: serve with the runtime's pserver until every trainer closed.
        return serve(JobEnv.from_environ(), ProcessEnv.from_environ())

    # The launcher's contract (None when run alone: connect() then starts an in-process pserver).
    env = JobEnv.from_environ()
    trainers = env.trainers if env is not None else 1
    trainer_id = env.trainer_id if env is not None and env.trainer_id is not None else 0
    mode = args.mode if env is not None else "sync"
    model, loss = build_model(args.seed), losses.SquareError()
    ps = connect(mode, OptimizerSpec("sgd", lr=args.lr), env=env)
    layers.set_dense_values(model, ps.register_dense(layers.dense_values(model)))  # trainer 0's values win

    train, test = load_housing()
    reader = train_reader(train, trainer_id, trainers, args.batch_size, args.seed)
    metrics = MetricsWriter(trainer_id)
    start, step, test_mse = time.time(), 0, None
    for pass_id in range(args.passes):
        pass_losses = []
        for batch in reader():
            x, y = columns(batch)
            layers.set_dense_values(model, ps.step_values())
            layers.zero_grads(model)
            value = loss.forward(model.forward(x), y)
            model.backward(loss.backward())
            ps.finish_step(layers.dense_grads(model))  # sync: one exchange brings the next step's values
            metrics.log(pass_id, step, value, samples=len(batch))
            pass_losses.append(value)
            step += 1
        if trainer_id == 0:
            layers.set_dense_values(model, ps.pull())  # the pservers' newest values
            test_mse = mse(model, test)
            ps.save_dense(f"output/pass-{pass_id:05d}")  # params.npz, as in the seed: trainer 0 saves each pass
            print(f"Pass {pass_id}: train loss {np.mean(pass_losses):.3f}, test mse {test_mse:.3f}")
    metrics.close()
    ps.close()  # the pservers stop waiting for this trainer
    if trainer_id == 0:
        print(f"{args.passes} passes of {step} steps in {time.time() - start:.1f} s ({mode}, "
              f"{trainers} trainer(s))")
        write_final("test_mse", test_mse)
    return 0


if __name__ == "__main__":
    sys.exit(main())
