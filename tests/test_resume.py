"""``run --resume_from``: a second job continues from the first job's latest complete checkpoint."""

from __future__ import annotations

import subprocess
import sys

from helpers import checkout_env, local_conf

TRAIN = r'''
import sys
import numpy as np
from paddle_cluster.ps import OptimizerSpec, connect
steps = int(sys.argv[1])
ps = connect(mode="sync", optimizer=OptimizerSpec("sgd", lr=0.5))
w = ps.register_dense({"w": np.zeros(20000, np.float32)})["w"]
print(f"start step={ps.step} w0={w[0]:g}", flush=True)
for _ in range(steps):
    ps.push({"w": np.ones(20000, np.float32)})   # each step: w -= 0.5
w = ps.pull()["w"]
if ps.trainer_id == 0:
    info = ps.save_checkpoint()
    print(f"saved step={info.step}", flush=True)
print(f"end step={ps.step} w0={w[0]:g} all_equal={bool((w == w[0]).all())}", flush=True)
ps.close()
'''


def test_second_job_resumes_from_the_first(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "train.py").write_text(TRAIN)
    conf = local_conf(tmp_path, PADDLE_PORTS_NUM=1, PADDLE_PORTS_NUM_FOR_SPARSE=0, PSERVERS_PER_NODE=2,
                      TRAINERS_PER_NODE=2, KILL_GRACE=2.0)

    def run(*args):
        return subprocess.run([sys.executable, "-m", "paddle_cluster", "--conf", str(conf), "run",
                               "--job_dispatch_package", str(ws), *args], capture_output=True, text=True,
                              timeout=120, env=checkout_env(HOME=str(tmp_path)), stdin=subprocess.DEVNULL)

    first = run("--job_name", "first", "--", "3")
    assert first.returncode == 0, first.stdout + first.stderr
    assert "[trainer.0@node0] end step=3 w0=-1.5 all_equal=True" in first.stdout
    assert (tmp_path / "root/first/checkpoints/step-00000003/pserver-1/manifest.json").exists()

    second = run("--job_name", "second", "--resume_from", "first", "--", "2")
    assert second.returncode == 0, second.stdout + second.stderr
    for t in (0, 1):
        assert f"[trainer.{t}@node0] start step=3 w0=-1.5" in second.stdout  # the checkpoint's values win
        assert f"[trainer.{t}@node0] end step=5 w0=-2.5 all_equal=True" in second.stdout
    assert (tmp_path / "root/first/checkpoints/step-00000005").is_dir()  # new checkpoints go there too
