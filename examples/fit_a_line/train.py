"""Seed 003's Fluid quick start: linear regression on UCI housing with 2 pservers and 2 trainers.

One script for both roles, chosen by ``PADDLE_TRAINING_ROLE`` as in the seed. Run it with
``paddle-cluster run --job_dispatch_package examples/fit_a_line [-- --mode async --passes 20 ...]``, or
alone (``python train.py``) to train locally against an in-process pserver.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from paddle_cluster.train import data, fluid, layers
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


def samples(rows: np.ndarray):
    return [(r[:FEATURES], r[FEATURES:]) for r in rows]


def build_program(seed: int = 0) -> fluid.Program:
    """y_predict = fc(x, size=1); avg_loss = mean(square_error_cost(y_predict, y))."""
    return fluid.Program(layers.Linear("fc_0", FEATURES, 1, seed=seed), loss=layers.SquareError(),
                         inputs="x", label="y")


def train_reader(train: np.ndarray, trainer_id: int, trainers: int, batch_size: int, seed: int):
    # Shuffle the whole training set with a seed every trainer shares, then take this trainer's shard: the
    # trainers' batches of one step together are exactly the batch a single trainer with batch_size *
    # trainers would see, so sync training matches the one-trainer run.
    shuffled = data.shuffle(data.from_list(samples(train)), buf_size=len(train), seed=seed)
    return data.batch(data.shard_reader(shuffled, trainer_id, trainers), batch_size)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=("sync", "async"), default="sync")
    ap.add_argument("--passes", type=int, default=20)
    ap.add_argument("--batch-size", "--batch_size", type=int, default=8, help="per trainer")
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.passes < 1 or args.batch_size < 1:
        ap.error("--passes and --batch-size must be at least 1")

    main_prog = build_program(args.seed)
    fluid.optimizer.SGD(learning_rate=args.lr).minimize(main_prog)
    test_prog = main_prog.clone(for_test=True)
    place = fluid.CPUPlace()
    feeder = fluid.DataFeeder(place=place, feed_list=["x", "y"])
    exe = fluid.Executor(place)

    # fetch distributed training environment setting (the seed's variables; the launcher's
    # PADDLE_PSERVER_ENDPOINTS / PADDLE_CURRENT_ENDPOINT also cover several pservers on one host)
    training_role = os.getenv("PADDLE_TRAINING_ROLE", None)
    port = os.getenv("PADDLE_PSERVER_PORT", "6174")
    pserver_ips = os.getenv("PADDLE_PSERVER_IPS", "")
    trainer_id = int(os.getenv("PADDLE_TRAINER_ID", "0"))
    pserver_endpoints = os.getenv("PADDLE_PSERVER_ENDPOINTS") or ",".join(f"{ip}:{port}" for ip in
                                                                          pserver_ips.split(","))
    trainers = int(os.getenv("PADDLE_TRAINERS", "1"))
    current_endpoint = os.getenv("PADDLE_CURRENT_ENDPOINT") or os.getenv("PADDLE_CURRENT_IP", "") + ":" + port

    if training_role is None:  # not launched: one local trainer, in-process pserver
        trainer_prog = main_prog
    else:
        t = fluid.DistributeTranspiler()
        t.transpile(trainer_id=trainer_id, program=main_prog, pservers=pserver_endpoints, trainers=trainers,
                    sync_mode=args.mode == "sync")
        if training_role == "PSERVER":
            pserver_prog = t.get_pserver_program(current_endpoint)
            startup_prog = t.get_startup_program(current_endpoint, pserver_prog)
            exe.run(startup_prog)
            exe.run(pserver_prog)
            return
        if training_role != "TRAINER":
            raise AssertionError("PADDLE_TRAINING_ROLE should be one of [TRAINER, PSERVER]")
        trainer_prog = t.get_trainer_program()

    train, test = load_housing()
    reader = train_reader(train, trainer_id, trainers, args.batch_size, args.seed)
    test_feed = feeder.feed(samples(test))
    metrics = MetricsWriter(trainer_id)
    exe.run(fluid.default_startup_program())
    start, step, test_mse = time.time(), 0, None
    for pass_id in range(args.passes):
        losses = []
        for batch in reader():
            loss, = exe.run(trainer_prog, feed=feeder.feed(batch), fetch_list=["loss"])
            metrics.log(pass_id, step, loss[0], samples=len(batch))
            losses.append(float(loss[0]))
            step += 1
        if trainer_id == 0:
            test_mse = exe.run(test_prog, feed=test_feed, fetch_list=["loss"])[0][0]
            fluid.io.save_params(exe, f"output/pass-{pass_id:05d}", main_prog)
            print(f"Pass {pass_id}: train loss {np.mean(losses):.3f}, test mse {test_mse:.3f}")
    metrics.close()
    # destroy the resource of this trainer on the pservers
    exe.close()
    if trainer_id == 0:
        print(f"{args.passes} passes of {step} steps in {time.time() - start:.1f} s ({args.mode}, "
              f"{trainers} trainer(s))")
        write_final("test_mse", test_mse)


if __name__ == "__main__":
    main()
