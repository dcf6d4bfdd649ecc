"""``paddle-cluster plot`` draws the curves that the trainers' metrics files hold."""

from __future__ import annotations

import json
import subprocess
import sys

from helpers import checkout_env, local_conf

TRAIN = r'''
import os
from paddle_cluster.train.metrics import MetricsWriter
tid = int(os.environ["PADDLE_TRAINER_ID"])
with MetricsWriter() as m:
    for step in range(20):
        m.log(0, step, loss=(tid + 1) * 10.0 / (step + 1), accuracy=step / 20.0)
'''
PS = "import time; from paddle_cluster.contract import JobEnv; import socket\n" \
     "e = JobEnv.from_environ(); s = [socket.create_server((e.current_ip, p)) for p in e.all_ports(e.pserver_id)]\n" \
     "time.sleep(600)\n"


def test_plot_draws_the_metrics_files(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "train.py").write_text(TRAIN)
    (ws / "ps.py").write_text(PS)
    # PSERVER_COMMAND: the workspace's ps.py only listens; its trainers write the metrics plot draws.
    conf = local_conf(tmp_path, PADDLE_PORTS_NUM=1, PADDLE_PORTS_NUM_FOR_SPARSE=0, TRAINERS_PER_NODE=2,
                      PSERVER_COMMAND="{python} ps.py", KILL_GRACE=1.0)
    env = checkout_env(HOME=str(tmp_path), XDG_STATE_HOME=str(tmp_path / "state"))

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "paddle_cluster", "--conf", str(conf), *args], cwd=tmp_path,
                              capture_output=True, text=True, timeout=120, env=env, stdin=subprocess.DEVNULL)

    run = cli("run", "--job_dispatch_package", str(ws), "--job_name", "curves")
    assert run.returncode == 0, run.stderr
    st = cli("status", "--json")  # each trainer's progress: its latest metrics record
    assert st.returncode == 0, st.stderr
    doc = json.loads(st.stdout)
    assert (doc["job"], doc["outcome"], doc["exit_code"]) == ("curves", "finished", 0), doc
    progress = {r["name"]: r["progress"] for r in doc["processes"]}
    assert progress == {"pserver.0": "", "trainer.0": "pass 0 step 19 loss 0.5", "trainer.1": "pass 0 step 19 loss 1"}
    res = cli("plot", "--out", str(tmp_path / "c.png"))  # default job: the latest of this config
    assert res.returncode == 0, res.stderr
    png = (tmp_path / "c.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    lines = res.stdout.splitlines()
    # Each trainer's loss curve, first and last point exactly as written: (tid+1)*10/(step+1).
    assert any("trainer0" in ln and "loss" in ln and "10 -> 0.5 (20 points, steps 0-19)" in ln for ln in lines)
    assert any("trainer1" in ln and "loss" in ln and "20 -> 1 (20 points, steps 0-19)" in ln for ln in lines)
    assert any("trainer1" in ln and "accuracy" in ln and "0 -> 0.95" in ln for ln in lines)
    assert not any("samples_per_s" in ln and "trainer" in ln and "nan" in ln for ln in lines)
    assert f"paddle-cluster: wrote {tmp_path / 'c.png'}" in res.stderr.splitlines(), res.stderr
    here = cli("plot")  # default: <job name>.png in the working directory, said with its full path
    assert here.returncode == 0 and f"paddle-cluster: wrote {tmp_path / 'curves.png'}" in here.stderr, here.stderr
    assert (tmp_path / "curves.png").read_bytes().startswith(b"\x89PNG")
    missing = cli("plot", "--job_name", "nosuchjob")
    assert missing.returncode == 1 and "no metrics records" in missing.stderr
