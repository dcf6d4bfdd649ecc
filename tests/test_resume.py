"""``run --resume_from``: a second job continues from the first job's latest complete checkpoint; without a
checkpoint complete for every pserver it is an error that names what was looked for, never a fresh start."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from helpers import assert_nothing_left, checkout_env, cli, local_conf, no_traceback, write_conf

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
if ps.trainer_id == 0 and sys.argv[2:] != ["nosave"]:
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


NOTHING_STARTED = "nothing was started (not starting fresh):"


def test_resume_without_a_complete_checkpoint_is_an_error(tmp_path):
    """A directory that is no checkpoint root, a file, a name no job had, a job that never saved, a step missing
    one pserver's shard and one whose shard has no manifest (a save that did not finish): each is refused before
    anything starts (exit 2, no job directory made), naming the directory looked in and what is missing there.
    Before, each started fresh."""
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "train.py").write_text(TRAIN)
    # PYTHON: local_conf pins this interpreter (it has numpy); two pservers so one shard can be missing.
    conf = local_conf(tmp_path, PADDLE_PORTS_NUM=1, PADDLE_PORTS_NUM_FOR_SPARSE=0, PSERVERS_PER_NODE=2,
                      KILL_GRACE=2.0)
    root = tmp_path / "root"

    def run(*args):
        res = cli(conf, "run", "--job_dispatch_package", str(ws), *args, env=checkout_env(HOME=str(tmp_path)))
        no_traceback(res)
        return res

    def refused(resume_from, *lines):
        res = run("--job_name", "again", "--resume_from", resume_from, "--", "1")
        assert res.returncode == 2, res.stdout + res.stderr
        assert f"error: --resume_from {resume_from}: no checkpoint complete for every pserver in " in res.stderr
        assert NOTHING_STARTED in res.stderr and "leave out --resume_from to start fresh" in res.stderr
        for line in lines:
            assert f"  node0 (localhost): {line}" in res.stderr, res.stderr
        assert "start step=" not in res.stdout  # no trainer ran
        assert not (root / "again").exists()  # nothing written: the same command works once fixed
        return res

    # A directory that is no checkpoint root (as /etc, but one a failing run cannot write checkpoints into).
    other = tmp_path / "etc"
    other.mkdir()
    (other / "hostname").write_text("node0\n")
    refused(str(other), f"no step-NNNNNNNN directory in {other}: no checkpoint was saved there")
    refused(str(other / "hostname"), f"{other}/hostname is not a directory")
    refused("nosuchjob", f"{root}/nosuchjob/checkpoints does not exist (no job of that name ran its pservers here")

    idle = run("--job_name", "idle", "--", "1", "nosave")
    assert idle.returncode == 0, idle.stdout + idle.stderr
    refused("idle", f"{root}/idle/checkpoints")

    first = run("--job_name", "first", "--", "3")
    assert first.returncode == 0, first.stdout + first.stderr
    step = root / "first/checkpoints/step-00000003"
    (step / "pserver-1" / "manifest.json").unlink()
    refused("first", "step-00000003/pserver-1: manifest.json missing (save did not finish); complete here: none")
    shutil.rmtree(step / "pserver-1")
    refused("first", "step-00000003/pserver-1: no pserver-1 shard (directory missing); complete here: none")
    refused(str(root / "first/checkpoints"), "step-00000003/pserver-1: no pserver-1 shard")
    assert_nothing_left_local(root)


def assert_nothing_left_local(root):
    """No process runs in a job directory under ``root`` (every job's processes run in theirs)."""
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{pid}/cwd").startswith(str(root)):
                left.append(pid)
        except OSError:
            pass  # gone meanwhile, or not ours to look at
    assert not left, left


def test_pservers_that_find_no_checkpoint_stop_the_job(tmp_path):
    """Resuming asked through ENV (the launcher does not look): every pserver refuses to start fresh, the job
    fails (exit 1) with the pserver's reason, and nothing is left running."""
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "train.py").write_text(TRAIN)
    missing = tmp_path / "no-checkpoints"
    conf = local_conf(tmp_path, PADDLE_PORTS_NUM=1, PADDLE_PORTS_NUM_FOR_SPARSE=0, KILL_GRACE=2.0,
                      ENV={"PADDLE_RESUME": "latest", "PADDLE_CHECKPOINT_DIR": str(missing)})
    res = cli(conf, "run", "--job_dispatch_package", str(ws), "--job_name", "envresume", "--", "1",
              env=checkout_env(HOME=str(tmp_path)))
    assert res.returncode == 1, res.stdout + res.stderr
    assert "exited with code 3" in res.stderr
    assert f"cannot resume (latest): no checkpoint under {missing}" in res.stderr
    assert "not starting fresh" in res.stderr and "start step=" not in res.stdout
    no_traceback(res)
    assert_nothing_left_local(tmp_path / "root")


def test_resume_checks_every_pserver_node(cluster, tmp_path):
    """On three SSH hosts each pserver keeps its shard on its own node: a step whose shard is gone on one node
    is refused before anything starts, naming that node and that pserver; the complete one is resumed."""
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "train.py").write_text(TRAIN)
    # PSERVER_COMMAND: write_conf's default is the launcher tests' stand-in; this job needs the real pserver.
    conf = write_conf(tmp_path, cluster, PSERVER_COMMAND="{python} -m paddle_cluster.ps", PADDLE_PORTS_NUM=1,
                      PADDLE_PORTS_NUM_FOR_SPARSE=0)
    first = cli(conf, "run", "--job_dispatch_package", str(ws), "--job_name", "first", "--", "3")
    assert first.returncode == 0, first.stdout + first.stderr
    first = cli(conf, "run", "--job_dispatch_package", str(ws), "--job_name", "more", "--resume_from", "first",
                "--", "2")
    assert first.returncode == 0, first.stdout + first.stderr
    assert "--resume_from first: every pserver resumes from step 3 of" in first.stderr
    assert "[trainer.0@node0] start step=3 w0=-1.5" in first.stdout
    newest = cluster.root_dir(1) / "first/checkpoints/step-00000005"
    shutil.rmtree(newest / "pserver-1")
    res = cli(conf, "run", "--job_dispatch_package", str(ws), "--job_name", "again", "--resume_from", "first",
              "--", "1", "nosave")
    assert res.returncode == 0, res.stdout + res.stderr  # step 5 is incomplete, step 3 complete everywhere
    assert "every pserver resumes from step 3" in res.stderr and "start step=3" in res.stdout
    for i in (0, 2):
        shutil.rmtree(cluster.root_dir(i) / "first/checkpoints/step-00000003")
    res = cli(conf, "run", "--job_dispatch_package", str(ws), "--job_name", "third", "--resume_from", "first",
              "--", "1")
    assert res.returncode == 2, res.stdout + res.stderr
    assert NOTHING_STARTED in res.stderr
    assert f"  node1 ({cluster.hosts[1]}): step-00000005/pserver-1: no pserver-1 shard (directory missing); " \
        "complete here: step 3" in res.stderr, res.stderr
    assert f"  node0 ({cluster.hosts[0]}): complete here: step 5" in res.stderr, res.stderr
    assert "no step is complete on every node" in res.stderr
    no_traceback(res)
    assert_nothing_left(cluster)
