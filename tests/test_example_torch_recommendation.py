"""examples/torch_recommendation through ``paddle-cluster run`` (2 pservers, 2 trainers, sync) on a slice of ml-100k:
it trains, reports its metric, and its saved model loads into a plain torch twin."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import checkout_env, dataset_dir, local_conf

torch = pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "torch_recommendation"
ML100K = dataset_dir("movielens", "ml-100k", var="MOVIELENS_100K")


@pytest.mark.timeout(120)
@pytest.mark.skipif(not (ML100K / "u.data").is_file(), reason=f"MovieLens ml-100k not found at {ML100K}")
def test_two_trainers_train_and_save_a_plain_torch_model(tmp_path):
    # ENV: one torch thread per trainer, as examples/run_targets.py runs it (4 processes share this machine's cores).
    conf = local_conf(tmp_path, PADDLE_PORTS_NUM=1, PADDLE_PORTS_NUM_FOR_SPARSE=1, PSERVERS_PER_NODE=2,
                      TRAINERS_PER_NODE=2, ENV={"OMP_NUM_THREADS": "1"})
    res = subprocess.run([sys.executable, "-m", "paddle_cluster", "--conf", str(conf), "run",
                          "--job_dispatch_package", str(EXAMPLE), "--job_name", "tr", "--", "--data", str(ML100K),
                          "--limit", "8000", "--passes", "2"],
                         capture_output=True, text=True, timeout=110, env=checkout_env(HOME=str(tmp_path)),
                         stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rmse = [float(v) for v in re.findall(r"^\[trainer\.0@node0\] pass \d test_rmse=(\S+)$", res.stdout, re.M)]
    assert len(rmse) == 2 and rmse[1] < rmse[0] < 1.2, res.stdout[-2000:]  # 1.2: above the mean predictor's ~1.12
    assert f"final test_rmse={rmse[1]:.4f}" in res.stdout
    sd = torch.load(tmp_path / "root" / "tr" / "output" / "model.pt", weights_only=True)  # never unpickled
    users, movies = sd["user.weight"].shape[0], sd["movie.weight"].shape[0]

    class Plain(torch.nn.Module):  # the example's model with torch's own Embedding
        def __init__(self):
            super().__init__()
            self.user, self.movie = torch.nn.Embedding(users, 17), torch.nn.Embedding(movies, 17)
            self.fc_u, self.fc_v = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
            self.mu = torch.nn.Parameter(torch.zeros(1))

    Plain().load_state_dict(sd)
