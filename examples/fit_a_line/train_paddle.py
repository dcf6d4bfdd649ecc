"""fit_a_line in PaddlePaddle 3 dygraph, its parameters on the pservers: ``paddle.nn.Linear`` on UCI housing,
``paddle.optimizer.SGD`` wrapped in ``paddle_cluster.paddle.DistributedOptimizer``.

The same data, normalisation, shuffling and sharding as ``train.py`` (the numpy version); the training loop is
plain Paddle plus two lines. Run it with ``paddle-cluster run --job_dispatch_package examples/fit_a_line
--entry train_paddle.py [-- --mode async --passes 20 ...]``, or alone (``python train_paddle.py``) against an
in-process pserver. Trainer 0 writes the final model (``output/fit_a_line.pdparams``, a plain Paddle
state_dict) and prints ``final test_mse=<value>``.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

import numpy as np
from train import FEATURES, columns, load_housing, train_reader

from paddle_cluster.train.metrics import MetricsWriter, write_final

warnings.filterwarnings("ignore", message="No ccache found")  # paddle's import warns when no C++ cache exists
import paddle  # noqa: E402

import paddle_cluster.paddle as ppc  # noqa: E402


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

    paddle.seed(args.seed)
    model = paddle.nn.Linear(FEATURES, 1)
    opt = ppc.DistributedOptimizer(paddle.optimizer.SGD(learning_rate=args.lr, parameters=model.parameters()),
                                   mode=args.mode if ppc.size() > 1 else "sync")  # as train.py: alone is sync
    rank, size = ppc.rank(), ppc.size()

    train, test = load_housing()
    reader = train_reader(train, rank, size, args.batch_size, args.seed)
    metrics = MetricsWriter(rank)
    step = 0
    for pass_id in range(args.passes):
        for batch in reader():
            x, y = (paddle.to_tensor(a) for a in columns(batch))
            loss = paddle.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()  # the gradient out, the pservers' new values in
            opt.clear_grad()
            metrics.log(pass_id, step, float(loss), samples=len(batch))
            step += 1
    metrics.close()
    if rank == 0:
        os.makedirs("output", exist_ok=True)
        ppc.save(model, "output/fit_a_line.pdparams")  # the final values (async: once every trainer is done)
        x, y = columns(test)
        with paddle.no_grad():
            test_mse = float(paddle.nn.functional.mse_loss(model(paddle.to_tensor(x)), paddle.to_tensor(y)))
        print(f"{args.passes} passes of {step} steps ({args.mode}, {size} trainer(s)): test mse {test_mse:.5f}")
        write_final("test_mse", np.float32(test_mse))
    ppc.shutdown()  # the pservers stop waiting for this trainer
    return 0


if __name__ == "__main__":
    sys.exit(main())
