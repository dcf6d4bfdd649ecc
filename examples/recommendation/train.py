"""MovieLens rating prediction on the parameter server: ``python train.py --data DIR [options]``.

Run by ``paddle-cluster run --job_dispatch_package examples/recommendation -- --data DIR``; without a launcher
it starts an in-process pserver and trains alone. See README.md for the model, the data and the results.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Dict, List, Optional, Tuple

import movielens
import numpy as np
from model import Batch, Recommender, all_ids, predict, rmse

from paddle_cluster.contract import JobEnv
from paddle_cluster.ps import OptimizerSpec, PSClient, connect, load_dense
from paddle_cluster.train.data import shard
from paddle_cluster.train.layers import dense_grads, dense_values, set_dense_values, sparse_grads, zero_grads
from paddle_cluster.train.metrics import MetricsWriter, RunningMean, write_final


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", help="ml-1m or ml-100k directory (default $MOVIELENS_DIR, else download ml-1m)")
    ap.add_argument("--mode", choices=("sync", "async"), default="sync")
    ap.add_argument("--passes", type=int, default=6)
    ap.add_argument("--batch-size", "--batch_size", type=int, default=256, help="per trainer and step")
    ap.add_argument("--emb-size", "--emb_size", type=int, default=16, help="embedding and tower output width")
    ap.add_argument("--lr", type=float, default=0.002, help="Adam learning rate of the dense parameters")
    ap.add_argument("--sparse-lr", "--sparse_lr", type=float, default=0.01,
                    help="SGD learning rate of the embedding rows")
    ap.add_argument("--l2", type=float, default=0.05, help="L2 (weight decay) of the dense parameters")
    ap.add_argument("--sparse-l2", "--sparse_l2", type=float, default=0.1,
                    help="L2 of an embedding row, per update of it")
    ap.add_argument("--lr-decay", "--lr_decay", type=float, default=0.6,
                    help="learning rates are multiplied by this each pass")
    ap.add_argument("--init-scale", "--init_scale", type=float, default=0.05,
                    help="embedding rows start uniform in +-this")
    ap.add_argument("--test-fraction", "--test_fraction", type=float, default=0.1)
    ap.add_argument("--split-seed", "--split_seed", type=int, default=0, help="seed of the train/test split")
    ap.add_argument("--seed", type=int, default=1, help="seed of initialisation and shuffling")
    ap.add_argument("--output", default="output")
    args = ap.parse_args(argv)
    if args.passes < 1 or args.batch_size < 1 or args.emb_size < 1:
        ap.error("--passes, --batch_size and --emb_size must be >= 1")
    if not 0 < args.test_fraction < 1:
        ap.error("--test_fraction must be in (0, 1)")
    if args.lr <= 0 or args.sparse_lr <= 0:
        ap.error("learning rates must be > 0")
    return args


def pull_tables(ps: PSClient, ids: Dict[str, np.ndarray]) -> Dict[str, Tuple[np.ndarray, np.ndarray]]:
    return {name: (i, ps.pull_sparse(name, i)) for name, i in ids.items()}


def save_model(ps: PSClient, out_dir: str, tables: Dict[str, Tuple[np.ndarray, np.ndarray]],
               config: Dict[str, object]) -> Dict[str, np.ndarray]:
    """Dense model (``params.npz`` via save_dense), the embedding rows of every id of the data
    (``embeddings.npz``: ``<table>.ids`` sorted, ``<table>.rows``) and ``config.json``; returns the dense
    values as saved, so the evaluation uses exactly what infer.py will load."""
    os.makedirs(out_dir, exist_ok=True)
    params = load_dense(ps.save_dense(out_dir))
    arrays = {}
    for name, (ids, rows) in tables.items():
        arrays[f"{name}.ids"], arrays[f"{name}.rows"] = ids, rows
    tmp = os.path.join(out_dir, ".embeddings.tmp.npz")
    np.savez(tmp, **arrays)
    os.replace(tmp, os.path.join(out_dir, "embeddings.npz"))
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    return params


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    started = time.time()
    env = JobEnv.from_environ()
    trainers = env.trainers if env is not None else 1
    tid = env.trainer_id if env is not None and env.trainer_id is not None else 0
    try:
        data_dir = movielens.data_dir_from(args.data)
        ds = movielens.load(data_dir)
    except (OSError, RuntimeError, ValueError) as e:
        print(f"trainer {tid}: cannot read MovieLens data: {e}", file=sys.stderr, flush=True)
        return 2
    train_idx, test_idx = movielens.split(len(ds.ratings), args.test_fraction, args.split_seed)
    train, test = ds.ratings[train_idx], ds.ratings[test_idx]
    mine = train[np.asarray(shard(np.arange(len(train)), tid, trainers), dtype=np.int64)]
    mean = float(train[:, 2].mean())
    # Equal step counts on every trainer (shards differ by one rating at most), so in sync mode all of
    # them finish a pass on the same step and nobody waits for a trainer that has stopped.
    steps = max(1, math.ceil(len(train) // trainers / args.batch_size))
    print(f"trainer {tid}/{trainers}: {ds.name} from {data_dir}: {len(ds.ratings)} ratings, {len(train)} train "
          f"({len(mine)} in this shard, {steps} steps/pass), {len(test)} test; mode {args.mode}", flush=True)

    # One learning rate for everything so ``set_lr`` can decay it: the dense parameters use Adam at
    # ``lr``; the embedding rows use SGD whose gradients are scaled by sparse_lr / lr, with weight decay
    # divided by the same factor -- exactly SGD at ``sparse_lr`` with L2 ``sparse_l2``.
    gscale = args.sparse_lr / args.lr
    ps = connect(mode=args.mode, optimizer=OptimizerSpec("adam", lr=args.lr, weight_decay=args.l2))
    model = Recommender(args.emb_size, ds.n_jobs, mean, seed=args.seed, vocab=ds.vocab_sizes())
    set_dense_values(model, ps.register_dense(dense_values(model)))
    sparse_spec = OptimizerSpec("sgd", lr=args.lr, weight_decay=args.sparse_l2 / gscale)
    for k, e in enumerate(model.tables()):
        ps.register_sparse(e.table_name, e.dim, **e.id_space(), init_scale=args.init_scale, seed=args.seed * 100 + k,
                           optimizer=sparse_spec)
    # The pservers average the trainers' gradients in sync mode; scaling by the trainer count makes that
    # the sum, so each rating moves the model as much as in a one-trainer run (async applies each push).
    scale = float(trainers if args.mode == "sync" else 1)
    config = {"emb_size": args.emb_size, "n_jobs": ds.n_jobs, "dataset": ds.name, "data_dir": os.path.abspath(data_dir),
              "test_fraction": args.test_fraction, "split_seed": args.split_seed, "ratings": len(ds.ratings)}
    eval_ids = all_ids(ds, ds.ratings)
    metrics = MetricsWriter(tid)
    rng = np.random.default_rng([args.seed, tid])
    step, test_rmse = 0, float("nan")
    try:
        for p in range(args.passes):
            if p and tid == 0:
                ps.set_lr(args.lr * args.lr_decay ** p)
            t0, mse_pass = time.time(), RunningMean()
            for sel in np.array_split(rng.permutation(len(mine)), steps):
                s = mine[sel]
                b = Batch(ds, s[:, 0], s[:, 1])
                set_dense_values(model, ps.step_values())
                rows = {name: ps.pull_sparse(name, ids) for name, ids in b.ids().items()}
                zero_grads(model)
                diff = model.forward(b, rows) - s[:, 2]
                # Gradient of the summed (not mean) squared error: per-rating SGD steps for the rows.
                model.backward((2 * scale) * diff)
                for name, g in sparse_grads(model).items():
                    ps.push_sparse(name, g.ids, g.rows * gscale)
                ps.finish_step({k: v * scale for k, v in dense_grads(model).items()})  # sync: brings the next values
                mse = float(np.mean(diff * diff)) if len(diff) else 0.0
                mse_pass.add(mse, len(diff))
                metrics.log(p, step, mse, samples=len(diff), rmse=math.sqrt(mse))
                step += 1
            train_rmse = math.sqrt(mse_pass.mean)
            line = f"pass {p} trainer {tid}: train_rmse={train_rmse:.4f} ({time.time() - t0:.1f} s)"
            if tid == 0:
                if p == args.passes - 1 and args.mode == "async":
                    ps.wait()
                    if not ps.wait_others_closed(env.barrier_timeout if env is not None else 60.0):
                        print(f"trainer {ps.trainer_id}: other trainers still running; evaluating anyway",
                              file=sys.stderr, flush=True)
                tables = pull_tables(ps, eval_ids)
                params = save_model(ps, os.path.join(args.output, f"pass-{p:05d}"), tables, {**config, "pass": p})
                set_dense_values(model, params)
                test_rmse = rmse(predict(model, ds, test, tables), test[:, 2])
                metrics.log(p, step, train_rmse ** 2, test_rmse=test_rmse, train_rmse=train_rmse)
                line += f" test_rmse={test_rmse:.4f}"
            print(line, flush=True)
    finally:
        metrics.close()
        ps.close()
    if tid == 0:
        write_final("test_rmse", test_rmse, args.output)
        print(f"trainer 0: {args.passes} passes in {time.time() - started:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
