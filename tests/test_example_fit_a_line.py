"""examples/fit_a_line through the real CLI: real processes on this machine over loopback TCP."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import checkout_env, local_conf, ports_free

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "fit_a_line"
BUILTIN_PORTS = range(7164, 7168)  # the built-in default: 2 pservers x (1 dense + 1 sparse port)
FINAL = re.compile(r"^\[trainer\.0@node0\] final test_mse=(\S+)$", re.M)


def _env(home: Path) -> dict:
    return checkout_env({k: v for k, v in os.environ.items() if not k.startswith(("PADDLE_", "XDG_"))},
                        HOME=str(home))


def _conf(tmp: Path, pservers: int = 2, trainers: int = 2, **extra: str) -> Path:
    """A conf.py equal to the built-in default but for the port (and what ``extra`` sets)."""
    local_conf(tmp, PADDLE_PORTS_NUM=1, PADDLE_PORTS_NUM_FOR_SPARSE=1, PSERVERS_PER_NODE=pservers,
               TRAINERS_PER_NODE=trainers, **extra)
    return tmp / "root"


def run_example(tmp: Path, job: str, *trainer_args: str, conf: bool = True, **conf_extra: str):
    """Run the example from ``tmp`` (HOME there too); returns (result, job dir, final test MSE or None)."""
    tmp.mkdir(parents=True, exist_ok=True)
    if conf:
        root = _conf(tmp, **conf_extra)
    else:  # no conf.py anywhere: the built-in local default, ROOT_DIR under HOME
        root = tmp / "paddle_cluster_jobs"
    cmd = [sys.executable, "-m", "paddle_cluster", "run", "--job_dispatch_package", str(EXAMPLE), "--job_name", job]
    if trainer_args:
        cmd += ["--", *trainer_args]
    res = subprocess.run(cmd, cwd=tmp, env=_env(tmp), capture_output=True, text=True, timeout=120)
    m = FINAL.search(res.stdout)
    return res, root / job, float(m.group(1)) if m else None


def check_outputs(res, job_dir: Path, mse) -> None:
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert mse is not None and mse < 30, res.stdout[-2000:]
    assert json.loads((job_dir / "output" / "metrics.json").read_text()) == {"test_mse": mse}
    assert (job_dir / "output" / "pass-00000" / "params.npz").is_file()
    for tid in (0, 1):
        lines = (job_dir / "log" / f"metrics.trainer{tid}.jsonl").read_text().splitlines()
        recs = [json.loads(line) for line in lines]
        assert recs and recs[-1]["trainer"] == tid and all(r["loss"] >= 0 for r in recs)
    inf = subprocess.run([sys.executable, "infer.py"], cwd=job_dir, env=_env(job_dir), capture_output=True, text=True,
                         timeout=60)
    assert inf.returncode == 0, inf.stderr
    got = float(re.search(r"^test_mse=(\S+)$", inf.stdout, re.M).group(1))
    assert got == pytest.approx(mse, rel=1e-5), inf.stdout


def test_node_library_ships_fluid():
    """Trainers import paddle_cluster.train from the library the launcher installs on every node."""
    from paddle_cluster.launch import dispatch

    assert "train" in dispatch.NODE_SIDE, "add train to NODE_SIDE in paddle_cluster/launch/dispatch.py"


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """The README's demo: two pservers and two trainers, sync, the example's defaults (batch 8 per trainer)."""
    tmp = tmp_path_factory.mktemp("fit_default")
    # The built-in default listens on 7164..7167; if another job holds them, the same layout on free ports.
    return run_example(tmp, "demo", conf=not ports_free(BUILTIN_PORTS))


def test_default_local_cluster(default_run):
    """The example handles PADDLE_TRAINING_ROLE=PSERVER, so its own script serves as pserver, as in seed 003 (what
    PSERVER_COMMAND = "{python} train.py" sets; that the key is honoured is tests/test_pserver_choice.py's)."""
    res, job_dir, mse = default_run
    check_outputs(res, job_dir, mse)
    assert "all 2 trainer(s) exited 0" in res.stderr
    assert "pservers run train.py as PADDLE_TRAINING_ROLE=PSERVER" in res.stderr.splitlines()[0], res.stderr
    server_log = (job_dir / "log" / "server.1.log").read_text()
    assert "PSERVER_READY 1" in server_log and "all 2 trainers closed" in server_log


def test_one_trainer_matches_two_trainers_sync(tmp_path, default_run):
    """1 trainer x 1 pserver with batch 16 sees each step's global batch of 2 trainers x batch 8."""
    res, job_dir, mse = run_example(tmp_path, "one", "--batch-size", "16", pservers=1, trainers=1)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert mse == pytest.approx(default_run[2], rel=0.02)
