"""``run --backend k8s`` end to end against the Kubernetes stand-in (tests/kube_standin.py: the Job controller,
scheduler, kubelet and DNS it models, each pod a real process in a network namespace of its own): a job to
its end, a name clash that changes nothing of the other job, and a failing trainer ending the whole job."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest
from k8s_standin import IMAGE, REPO, StandIn
from rt_helpers import free_port_range

EXAMPLE = REPO / "examples" / "fit_a_line"
# Trainer 1 fails after a second; the others train as usual.
FLAKY = """import os, runpy, sys, time
if os.environ.get("PADDLE_TRAINING_ROLE") == "TRAINER" and os.environ["PADDLE_TRAINER_ID"] == "1":
    time.sleep(1)
    sys.exit("trainer 1: out of data")
sys.argv[0] = "train.py"
runpy.run_path("train.py", run_name="__main__")
"""


@pytest.fixture
def kube(make_ssh_cluster, tmp_path):
    cluster = make_ssh_cluster(4)
    k = StandIn(cluster, tmp_path / "kube")
    yield k
    k.close()
    assert k.processes() == []


@pytest.fixture
def job_dir(tmp_path: Path, kube) -> Path:
    """A user's directory: conf.py as the README has it, and the workspace as the image would hold it."""
    ws = tmp_path / "ws"
    shutil.copytree(EXAMPLE, ws, ignore=shutil.ignore_patterns("log", "output", "__pycache__"))
    (ws / "flaky.py").write_text(FLAKY)
    port = free_port_range(2)
    (tmp_path / "conf.py").write_text(f'HOSTS = ["a", "b"]\nROOT_DIR = "{tmp_path}/root"\nPADDLE_PORT = {port}\n'
                                      'PADDLE_PORTS_NUM = 1\nPADDLE_PORTS_NUM_FOR_SPARSE = 1\n')
    return tmp_path


def cli(kube: StandIn, cwd: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {k: v for k, v in kube.env.items() if not k.startswith("PADDLE_")}
    env.update(PYTHONPATH=str(REPO), HOME=str(cwd), XDG_STATE_HOME=str(cwd / "state"))
    return subprocess.run([sys.executable, "-m", "paddle_cluster", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def run_args(cwd: Path, *more: str) -> List[str]:
    return ["run", "--backend", "k8s", "--image", IMAGE, "--pservers", "1", "--trainers", "2", "--job_workspace",
            str(cwd / "ws"), *more]


def test_a_job_runs_to_its_end_and_leaves_nothing(kube: StandIn, job_dir: Path) -> None:
    res = cli(kube, job_dir, *run_args(job_dir, "--job_name", "fit", "--", "--passes", "2"))
    assert res.returncode == 0, res.stdout + res.stderr
    assert re.search(r"^final test_mse=\S+$", res.stdout, re.M) or "final test_mse" in res.stdout + res.stderr
    assert kube.objects() == {}, kube.objects()  # every object of the job deleted, pods included


def test_a_name_clash_changes_nothing_of_the_other_job(kube: StandIn, job_dir: Path) -> None:
    # Another team's job "fit", created from paddle-cluster's own manifests and left running.
    render = cli(kube, job_dir, "render", "k8s", "--image", IMAGE, "--job_name", "fit", "--pservers", "1",
                 "--trainers", "2", "--job_workspace", str(job_dir / "ws"))
    assert render.returncode == 0, render.stderr
    assert kube.kubectl("create", "--filename", "-", stdin=render.stdout).returncode == 0
    kube.wait(lambda: len([p for p in kube.pods() if p["status"].get("phase") == "Running"]) == 3, 60, "3 pods")
    before = json.dumps(kube.objects(), sort_keys=True)
    res = cli(kube, job_dir, *run_args(job_dir, "--job_name", "fit", "--", "--passes", "2"))
    assert res.returncode != 0 and "Traceback" not in res.stderr, res.stderr
    (line,) = [ln for ln in res.stderr.splitlines() if "already has" in ln]
    assert "secret/fit-secret" in line and "job.batch/fit-trainer" in line and "nothing was changed" in line, line
    after = {k: v for k, v in kube.objects().items() if not k.startswith("Pod/")}
    assert json.dumps(after, sort_keys=True) == json.dumps(
        {k: v for k, v in json.loads(before).items() if not k.startswith("Pod/")}, sort_keys=True)
    assert len([p for p in kube.pods() if p["status"].get("phase") == "Running"]) == 3
    assert kube.kubectl("delete", "jobs.batch,services,secrets", "--selector", "paddle-cluster/job=fit",
                        "--cascade=foreground", "--wait=true").returncode == 0


def test_a_failing_trainer_ends_the_whole_job(kube: StandIn, job_dir: Path) -> None:
    res = cli(kube, job_dir, *run_args(job_dir, "--job_name", "fit", "--entry", "flaky.py", "--", "--passes",
                                        "500"))
    out = res.stdout + res.stderr
    assert res.returncode == 1, out
    assert "trainer 1: out of data" in out and "trainer.1" in out, out
    assert kube.objects() == {}, kube.objects()
