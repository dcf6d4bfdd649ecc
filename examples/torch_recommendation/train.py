"""MovieLens rating prediction in PyTorch, its embedding tables on the pservers (paddle_cluster.torch).

    paddle-cluster run --job_dispatch_package examples/torch_recommendation -- --data /path/to/ml-100k
    python examples/torch_recommendation/train.py --data /path/to/ml-100k        # alone: an in-process pserver

rating = mu + b_user + b_movie + fc_u(user row) . fc_v(movie row); the user and movie rows (the last column
is the bias) are pct.Embedding tables on the pservers, mu and the two FCs dense. Adagrad for all (rows: lazily,
their accumulators per row), weight decay on the rows only. Every trainer reads the data, splits it 90/10 with
the same seed and trains on its 1/size() of each global batch; trainer 0 evaluates the test part after every
pass, prints ``final test_rmse=...`` and saves the model as a plain torch state_dict (output/model.pt).
"""

from __future__ import annotations

import argparse
import glob
import gzip
import io
import os
import sys
import urllib.request
import zipfile

import numpy as np
import torch

import paddle_cluster.torch as pct

ML100K_URL = "https://files.grouplens.org/datasets/movielens/ml-100k.zip"


def ratings(data: str) -> np.ndarray:
    """(n, 3) int64 user, movie, rating from ml-100k (``u.data``) or ml-1m (``ratings*.dat[.gz]``)."""
    if os.path.isfile(os.path.join(data, "u.data")):
        return np.loadtxt(os.path.join(data, "u.data"), dtype=np.int64, usecols=(0, 1, 2))
    files = sorted(glob.glob(os.path.join(data, "ratings*.dat*")))
    if not files:
        sys.exit(f"train.py: {data} holds neither ml-100k's u.data nor ml-1m's ratings*.dat: pass --data DIR")
    opener = gzip.open if files[0].endswith(".gz") else open
    with opener(files[0], "rt") as f:
        return np.array([line.split("::")[:3] for line in f if line.strip()], dtype=np.int64)


def data_dir(arg: str) -> str:
    """--data, else $MOVIELENS_DIR, else ml-100k downloaded from GroupLens into ./data."""
    path = arg or os.environ.get("MOVIELENS_DIR", "")
    if path:
        return path
    target = os.path.join("data", "ml-100k")
    if not os.path.isfile(os.path.join(target, "u.data")):
        try:
            with urllib.request.urlopen(ML100K_URL, timeout=60) as r:
                zipfile.ZipFile(io.BytesIO(r.read())).extractall("data")
        except OSError as e:
            sys.exit(f"train.py: cannot download {ML100K_URL} ({e}); pass --data DIR (ml-100k or ml-1m)")
    return target


class Recommender(torch.nn.Module):
    def __init__(self, users: int, movies: int, dim: int, mean: float) -> None:
        super().__init__()
        self.user = pct.Embedding(users, dim + 1, init_scale=0.05, seed=1)  # rows on the pservers
        self.movie = pct.Embedding(movies, dim + 1, init_scale=0.05, seed=2)
        self.fc_u = torch.nn.Linear(dim, dim)
        self.fc_v = torch.nn.Linear(dim, dim)
        self.mu = torch.nn.Parameter(torch.tensor([mean]))

    def forward(self, users: torch.Tensor, movies: torch.Tensor) -> torch.Tensor:
        u, v = self.user(users), self.movie(movies)
        dot = (self.fc_u(u[:, :-1]) * self.fc_v(v[:, :-1])).sum(1)
        return self.mu + u[:, -1] + v[:, -1] + dot


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default="", help="ml-100k or ml-1m directory (else $MOVIELENS_DIR, else download)")
    ap.add_argument("--mode", default="sync", choices=("sync", "async"))
    ap.add_argument("--passes", type=int, default=6)
    ap.add_argument("--batch_size", type=int, default=256, help="the global batch, split over the trainers")
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--row_l2", type=float, default=0.01)
    ap.add_argument("--lr_decay", type=float, default=0.7, help="the rate is multiplied by this after every pass")
    ap.add_argument("--limit", type=int, default=0, help="use only the first N ratings (0: all)")
    ap.add_argument("--output", default="output")
    a = ap.parse_args()

    r = ratings(data_dir(a.data))
    r = r[:a.limit] if a.limit else r
    order = np.random.default_rng(0).permutation(len(r))
    n_test = len(r) // 10
    test, train = r[order[:n_test]], r[order[n_test:]]
    torch.manual_seed(0)
    model = Recommender(int(r[:, 0].max()) + 1, int(r[:, 1].max()) + 1, a.dim, float(train[:, 2].mean()))
    dense = [p for n, p in model.named_parameters() if not n.endswith("weight") or n.startswith("fc")]
    rows = [model.user.weight, model.movie.weight]
    opt = pct.DistributedOptimizer(torch.optim.Adagrad([{"params": dense}, {"params": rows, "weight_decay": a.row_l2}],
                                                       lr=a.lr), named_parameters=model.named_parameters(),
                                   mode=a.mode)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, a.lr_decay)  # the pservers follow it
    rank, size = pct.rank(), pct.size()
    per = a.batch_size // size
    steps = len(train) // (per * size)
    shuffle = np.random.default_rng(1)
    for p in range(a.passes):
        perm = shuffle.permutation(len(train))  # the same on every trainer: each takes its part of a batch
        for s in range(steps):
            b = train[perm[s * per * size + rank * per:s * per * size + (rank + 1) * per]]
            opt.zero_grad()
            pred = model(torch.from_numpy(b[:, 0]), torch.from_numpy(b[:, 1]))
            torch.nn.functional.mse_loss(pred, torch.from_numpy(b[:, 2]).float()).backward()
            opt.step()
        if rank == 0:
            with torch.no_grad():
                pred = model(torch.from_numpy(test[:, 0]), torch.from_numpy(test[:, 1])).clamp(1, 5)
                rmse = float(((pred - torch.from_numpy(test[:, 2]).float()) ** 2).mean().sqrt())
            print(f"pass {p} test_rmse={rmse:.4f}", flush=True)
        sched.step()
    if rank == 0:
        os.makedirs(a.output, exist_ok=True)
        pct.save(model, os.path.join(a.output, "model.pt"))
        print(f"final test_rmse={rmse:.4f}", flush=True)
    pct.shutdown()


if __name__ == "__main__":
    main()
