"""``run --backend slurm``: the real CLI against a real Slurm cluster (slurmctld, one slurmd per namespace host),
ROOT_DIR on the shared filesystem. A conf.py without HOSTS trains fit_a_line and ``plot`` reads it; Ctrl+C of a
pending job; a node that finishes first; a failing trainer fails the job fast with its last lines, and
``--max_restarts`` resubmits; ``--detach`` + ``status``/``logs``/``kill``; a run inside ``salloc`` is its step
for ``status``/``logs``/``kill``; resource options and pass-through;
fail-fast inside the allocation.

The user's paths every backend shares -- fit_a_line with the README's conf.py, the env contract, Ctrl+C of a
running job, ``kill`` from another terminal, a failing trainer, ``--max_restarts`` from a checkpoint, several jobs
at once -- are the conformance suite's (tests/test_conformance.py; tests/engines/slurm.py)."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from helpers import FIT_A_LINE, free_port_range, no_traceback, small_workspace, wait_for

from paddle_cluster.launch.backends.slurm.jobs import active, job_info
from paddle_cluster.launch.backends.slurm.options import SlurmOptions, batch_script
from paddle_cluster.launch.errors import ClusterError

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def slurm(slurm_cluster):
    yield slurm_cluster
    slurm_cluster.run(["scancel", "--user=root"], check=False)
    slurm_cluster.wait_quiet()


def _setup(slurm, tmp: Path, hold: bool = True, **over):
    settings = {"BACKEND": "slurm", "ROOT_DIR": str(slurm.shared_dir / tmp.name), "PADDLE_NIC": "eth0",
                "PYTHON": sys.executable, "START_TIMEOUT": 60.0, "KILL_GRACE": 2.0, "ORPHAN_TIMEOUT": 20.0}
    if hold:
        settings["PSERVER_COMMAND"] = "{python} ps.py"
    settings.update(over)
    conf = tmp / "conf.py"
    conf.write_text("".join(f"{k} = {v!r}\n" for k, v in settings.items()))
    env = {k: v for k, v in slurm.env.items() if not k.startswith(("PADDLE_", "XDG_", "SLURM_JOB"))}
    env.update(HOME=str(tmp), PYTHONPATH=str(REPO), SLURM_CONF=str(slurm.conf))
    return conf, env, small_workspace(tmp)


def _cli(conf, env, *args, timeout=300):
    return subprocess.run([sys.executable, "-m", "paddle_cluster", "--conf", str(conf), *args], env=env,
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


class _Run:
    """A ``run`` in the background, its output collected line by line."""

    def __init__(self, conf, env, *args):
        self.p = subprocess.Popen([sys.executable, "-m", "paddle_cluster", "--conf", str(conf), "run", *args],
                                  env=env, text=True, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE)
        self.out, self.err = [], []
        self.readers = [threading.Thread(target=lambda s=stream, k=sink: k.extend(iter(s.readline, "")),
                                         daemon=True) for stream, sink in ((self.p.stdout, self.out),
                                                                           (self.p.stderr, self.err))]
        for t in self.readers:
            t.start()

    def wait(self, timeout=60):
        rc = self.p.wait(timeout=timeout)
        for t in self.readers:  # everything it printed
            t.join(timeout)
        return rc


def test_a_conf_py_without_hosts_runs_with_backend_slurm_and_plot_reads_the_shared_filesystem(slurm, tmp_path):
    """A Slurm user's conf.py: no HOSTS (the allocation gives the nodes) and no BACKEND (``--backend slurm``).
    (PYTHON is pinned as in ``_setup``: this interpreter has numpy, the hosts' login shells do not.)"""
    conf, env, _ = _setup(slurm, tmp_path, hold=False)
    conf.write_text("".join(ln + "\n" for ln in conf.read_text().splitlines() if not ln.startswith("BACKEND")))
    res = _cli(conf, env, "run", "--backend", "slurm", "--nodes", "2", "--job_dispatch_package", str(FIT_A_LINE),
               "--job_name", "nohosts", "--", "--passes", "3", timeout=600)
    no_traceback(res)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert re.search(r"submitted Slurm job \d+", res.stderr) and "running on node[0-1]" in res.stderr, res.stderr
    # plot finds the job (the journal says Slurm) and its trainers' metrics under each node's directory.
    out = tmp_path / "nohosts.png"
    pl = _cli(conf, env, "plot", "--job_name", "nohosts", "-o", str(out))
    assert pl.returncode == 0 and out.stat().st_size > 0, pl.stderr
    assert {ln.split()[0] for ln in pl.stdout.splitlines()} == {"trainer0", "trainer1"}, pl.stdout
    slurm.wait_quiet()


# Node 0 finishes first: its pserver exits 0 once its trainer is done, and trainer 0 is done at once; the
# other trainers take longer than ORPHAN_TIMEOUT. (Files in the shared workspace, $PADDLE_WORKSPACE.)
EARLY_PS_PY = """
import os, socket, time
from paddle_cluster.contract import JobEnv
env = JobEnv.from_environ()
socks = [socket.create_server((env.current_ip, port)) for port in env.all_ports(env.pserver_id)]
print("listening", flush=True)
# Done once its own trainer is, and once every trainer has started: a trainer starts only after its node saw every
# pserver listening, so no node is still waiting to see this one (it would wait for a pserver that has gone).
ws = os.environ["PADDLE_WORKSPACE"]
need = [f"done.{env.pserver_id}"] + [f"started.{t}" for t in range(env.trainers)]
while not all(os.path.exists(os.path.join(ws, name)) for name in need):
    time.sleep(0.05)
"""
LATE_TRAIN_PY = """
import os, time
tid = int(os.environ["PADDLE_TRAINER_ID"])
open(os.path.join(os.environ["PADDLE_WORKSPACE"], f"started.{tid}"), "w").close()
time.sleep(0 if tid == 0 else 9)
open(os.path.join(os.environ["PADDLE_WORKSPACE"], f"done.{tid}"), "w").close()
print("done", tid, flush=True)
"""


def test_a_node_that_finishes_first_is_neither_a_failure_nor_lost(slurm, tmp_path):
    conf, env, _ = _setup(slurm, tmp_path, ORPHAN_TIMEOUT=6.0)
    ws = tmp_path / "early"
    ws.mkdir()
    (ws / "train.py").write_text(LATE_TRAIN_PY)
    (ws / "ps.py").write_text(EARLY_PS_PY)
    res = _cli(conf, env, "run", "--nodes", "3", "--job_dispatch_package", str(ws), "--job_name", "slurmearly")
    no_traceback(res)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "finished: all 3 trainer(s) exited 0" in res.stderr
    slurm.wait_quiet()

def test_ctrl_c_cancels_a_pending_job(slurm, tmp_path):
    conf, env, ws = _setup(slurm, tmp_path)
    go = tmp_path / "go"
    blocker = slurm.run(["sbatch", "--parsable", "-N3", "--exclusive", "-o", "/dev/null", "--wrap",
                         f"while [ ! -e {go} ]; do sleep 0.05; done"], cwd=tmp_path).stdout.strip()
    slurm.wait_job(blocker, ["RUNNING"])
    r = _Run(conf, env, "--nodes", "3", "--job_dispatch_package", str(ws), "--job_name", "slurmpend")
    wait_for(lambda: any("pending: Resources" in x for x in r.err), 60, "the pending reason")
    r.p.send_signal(signal.SIGINT)
    assert r.wait() == 130, "".join(r.err)
    assert slurm.active_jobs() == [blocker]  # ours is gone, not queued for nobody
    go.touch()
    slurm.wait_quiet()


def test_failing_trainer_fails_the_job_fast_with_its_last_lines(slurm, tmp_path):
    conf, env, ws = _setup(slurm, tmp_path)
    (ws / "crash-1").touch()
    res = _cli(conf, env, "run", "--nodes", "3", "--job_dispatch_package", str(ws), "--job_name", "slurmfail",
               "--max_restarts", "1")
    no_traceback(res)
    assert res.returncode == 1, res.stderr
    assert "trainer.1 on node1" in res.stderr and "exited with code 3" in res.stderr
    assert "| about to crash" in res.stderr
    assert "slurmfail/node1/log/train.log" in res.stderr  # where that log is, on the shared filesystem
    # The restart is a second Slurm job (no checkpoint: from scratch), where trainer 1 fails again.
    assert "restarting the job from scratch (no complete checkpoint yet) (restart 1 of 1)" in res.stderr
    jobs = re.findall(r"submitted Slurm job (\d+)", res.stderr)
    assert len(set(jobs)) == 2, res.stderr
    assert res.stdout.count("[trainer.1@node1] about to crash") == 2 and "no restarts left" in res.stderr
    slurm.wait_quiet()


def test_detach_then_status_logs_and_kill(slurm, tmp_path):
    conf, env, ws = _setup(slurm, tmp_path)
    res = _cli(conf, env, "run", "--nodes", "3", "--detach", "--job_dispatch_package", str(ws),
               "--job_name", "slurmdet")
    assert res.returncode == 0, res.stderr
    job_id = re.search(r"is Slurm job (\d+)", res.stderr).group(1)
    assert slurm.active_jobs() == [job_id]
    log = slurm.shared_dir / tmp_path.name / "slurmdet" / "node1" / "log" / "train.log"
    wait_for(lambda: log.exists() and "holding 1" in log.read_text(), 90, "trainer 1 holding")
    st = _cli(conf, env, "status", "--json")
    assert st.returncode == 0, st.stderr
    assert f"Slurm job {job_id}: RUNNING" in st.stderr
    assert [r["state"] for r in json.loads(st.stdout)["processes"]] == ["running"] * 6, st.stdout
    lg = _cli(conf, env, "logs", "node1", "--role", "trainer")
    assert lg.returncode == 0 and "holding 1" in lg.stdout, lg.stderr
    k = _cli(conf, env, "kill")
    assert k.returncode == 0, k.stderr
    assert f"Slurm job {job_id} (job slurmdet): " in k.stdout, k.stdout
    assert "nothing of it is left in squeue" in k.stdout, k.stdout
    assert job_id not in slurm.active_jobs()
    slurm.wait_quiet()
    st = _cli(conf, env, "status", "--json")
    assert [r["state"] for r in json.loads(st.stdout)["processes"]] == ["stopped (kill)"] * 6, st.stdout


def test_a_run_inside_an_allocation_is_its_step_for_status_logs_and_kill(slurm, tmp_path):
    """``salloc -N2`` then ``run --backend slurm`` inside it (SLURM_JOB_ID set: run starts the srun step itself).
    From another terminal ``status``, ``logs`` and ``kill`` find that step; ``kill`` ends the run (exit 3) and
    every process of the step, and leaves the user's allocation running until it ends by itself."""
    conf, env, ws = _setup(slurm, tmp_path)
    go, rc = tmp_path / "go", tmp_path / "rc"
    cli = shlex.join([sys.executable, "-m", "paddle_cluster", "--conf", str(conf), "run", "--backend", "slurm",
                      "--nodes", "2", "--job_dispatch_package", str(ws), "--job_name", "inalloc"])
    # The allocation's shell runs the CLI, then stays until the test lets it go: kill must not have ended it.
    shell = f"{cli} >{tmp_path}/run.out 2>{tmp_path}/run.err; echo $? >{rc}; while [ ! -e {go} ]; do sleep 0.05; done"
    alloc = subprocess.Popen(["salloc", "-N2", "-J", "myalloc", "bash", "-c", shell], env=env, cwd=tmp_path,
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        log = slurm.shared_dir / tmp_path.name / "inalloc" / "node1" / "log" / "train.log"
        wait_for(lambda: log.exists() and "holding 1" in log.read_text(), 90, "trainer 1 holding")
        (job_id,) = slurm.active_jobs()
        err = (tmp_path / "run.err").read_text()
        step = re.search(r"Slurm step (\d+\.\d+) runs job inalloc", err).group(1)
        assert step.startswith(f"{job_id}."), err
        st = _cli(conf, env, "status", "--json")
        assert st.returncode == 0, st.stderr
        assert f"Slurm step {step}: RUNNING (allocation {job_id}: RUNNING)" in st.stderr, st.stderr
        assert [r["state"] for r in json.loads(st.stdout)["processes"]] == ["running"] * 4, st.stdout
        lg = _cli(conf, env, "logs", "node0", "--role", "trainer")
        assert lg.returncode == 0 and "holding 0" in lg.stdout, lg.stderr
        k = _cli(conf, env, "kill")
        assert k.returncode == 0, k.stderr
        assert f"Slurm step {step} (job inalloc): ended; nothing of it is left in squeue" in k.stdout, k.stdout
        wait_for(rc.exists, 60, "the run inside the allocation to end")
        assert rc.read_text().strip() == "3", (tmp_path / "run.err").read_text()  # stopped by paddle-cluster kill
        # The allocation still runs, with no step and no process of the job left on its nodes.
        assert slurm.active_jobs() == [job_id] and slurm.show_job(job_id)["JobState"] == "RUNNING"
        assert slurm.run(["squeue", "-h", "-s", "-j", job_id]).stdout.strip() == ""
        wait_for(lambda: not any(slurm.job_pids(i) for i in range(slurm.cluster.n)), 20, "no process on a node")
        st = _cli(conf, env, "status", "--json")
        assert f"Slurm step {step}: ENDED (allocation {job_id}: RUNNING)" in st.stderr, st.stderr
        assert [r["state"] for r in json.loads(st.stdout)["processes"]] == ["stopped (kill)"] * 4, st.stdout
    finally:
        go.touch()
        alloc.wait(60)
    slurm.wait_quiet()


def test_detached_jobs_are_found_through_the_journal_whatever_the_config_says(slurm, tmp_path):
    """The config's BACKEND is ssh; two jobs were submitted with --backend slurm: status, logs and kill of the
    older one (by name) and of the latest reach each on Slurm through the journal's handles."""
    conf, env, ws = _setup(slurm, tmp_path, BACKEND="ssh", HOSTS=["localhost"])
    ids = {}
    # Slurm may place both on one node: the second job takes other ports (--port, as a v2 user would)
    for name, nodes, more in (("first", "2", ()), ("second", "1", ("--", "--port", str(free_port_range(4))))):
        res = _cli(conf, env, "run", "--backend", "slurm", "--nodes", nodes, "--detach", "--job_dispatch_package",
                   str(ws), "--job_name", name, *more)
        assert res.returncode == 0, res.stderr
        ids[name] = re.search(r"is Slurm job (\d+)", res.stderr).group(1)
    log = slurm.shared_dir / tmp_path.name / "first" / "node1" / "log" / "train.log"
    wait_for(lambda: log.exists() and "holding 1" in log.read_text(), 90, "trainer 1 of the first job holding")
    st = _cli(conf, env, "status", "--job_name", "first", "--json")
    assert st.returncode == 0, st.stderr
    assert f"Slurm job {ids['first']}: RUNNING" in st.stderr
    assert len(json.loads(st.stdout)["processes"]) == 4, st.stdout
    lg = _cli(conf, env, "logs", "node1", "--role", "trainer", "--job_name", "first")
    assert lg.returncode == 0 and "holding 1" in lg.stdout, lg.stderr
    k = _cli(conf, env, "kill", "--job_name", "first")
    assert k.returncode == 0 and f"Slurm job {ids['first']}" in k.stdout, k.stderr
    assert slurm.active_jobs() == [ids["second"]]
    k = _cli(conf, env, "kill")
    assert k.returncode == 0 and f"Slurm job {ids['second']}" in k.stdout, k.stderr
    assert slurm.active_jobs() == []


def test_no_answer_from_slurm_is_not_a_finished_job(slurm, tmp_path, monkeypatch):
    """A job Slurm has forgotten is gone; a controller that does not answer says nothing of the job: the
    launcher following it keeps following and ``kill`` keeps trying, neither takes it for gone."""
    monkeypatch.setenv("SLURM_CONF", str(slurm.conf))
    assert job_info("999999") == {} and active("999999") is False
    unreachable = tmp_path / "slurm.conf"
    unreachable.write_text(re.sub(r"SlurmctldPort=\d+", f"SlurmctldPort={free_port_range(1)}",
                                  slurm.conf.read_text()) + "MessageTimeout=1\n")
    monkeypatch.setenv("SLURM_CONF", str(unreachable))
    with pytest.raises(ClusterError, match="looking up Slurm job 999999"):
        job_info("999999")
    assert active("999999") is None


def test_node_directories_are_only_node_n_directories(tmp_path):
    """A dispatched workspace is the shared job directory: its own files named node* are not nodes."""
    from paddle_cluster.launch.backends.slurm.jobs import _node_dirs
    from paddle_cluster.launch.config import load_config

    conf = tmp_path / "conf.py"
    conf.write_text(f"HOSTS = ['localhost']\nROOT_DIR = {str(tmp_path / 'root')!r}\n")
    cfg = load_config(str(conf))
    top = Path(cfg.job_dir("j"))
    for name in ("node10", "node2", "node0", "nodeX"):
        (top / name).mkdir(parents=True)
    (top / "nodes.txt").write_text("a\n")
    (top / "node_config.py").write_text("x = 1\n")
    (top / "node3").write_text("a file, not a node\n")
    assert [Path(d).name for d in _node_dirs(cfg, "j")] == ["node0", "node2", "node10"]
    assert _node_dirs(cfg, "missing") == []


# -- resources and pass-through ------------------------------------------------------------------------------


def test_resource_options_reach_the_slurm_job(slurm, tmp_path):
    """What Slurm users set on every submission reaches the real job: ``scontrol show job`` shows it, and the
    step got the CPUs per task (srun asks again: since Slurm 22.05 it does not inherit them)."""
    conf, env, ws = _setup(slurm, tmp_path)
    res = _cli(conf, env, "run", "--nodes", "3", "--detach", "--job_dispatch_package", str(ws), "--job_name",
               "slurmres", "--cpus-per-task", "2", "--mem", "100M", "--exclusive", "--gres", "gpu:1",
               "--constraint", slurm.feature, "--time", "10:00", "--sbatch-arg=--comment=paddle two words",
               "--sbatch-arg", "--nice=7")
    assert res.returncode == 0, res.stderr
    job_id = re.search(r"is Slurm job (\d+)", res.stderr).group(1)
    log = slurm.shared_dir / tmp_path.name / "slurmres" / "node2" / "log" / "train.log"
    wait_for(lambda: log.exists() and "holding 2" in log.read_text(), 90, "trainer 2 holding")
    text = slurm.run(["scontrol", "-o", "show", "job", job_id]).stdout
    job = slurm.show_job(job_id)
    assert job["JobState"] == "RUNNING" and job["NumNodes"] == "3", text
    assert job["CPUs/Task"] == "2" and job["MinCPUsNode"] == "2", text
    assert job["MinMemoryNode"] == "100M", text
    assert job["OverSubscribe"] == "NO", text  # --exclusive
    assert job["Features"] == slurm.feature and job["TimeLimit"] == "00:10:00", text
    assert job["TresPerNode"] == "gres:gpu:1", text
    assert "Comment=paddle two words " in text and job["Nice"] == "7", text
    step = slurm.run(["scontrol", "-o", "show", "step", f"{job_id}.0"]).stdout
    assert re.search(r"\bCPUs=6\b", step) and re.search(r"\bTasks=3\b", step), step
    script = (slurm.shared_dir / tmp_path.name / "slurmres" / ".paddle_cluster" / "attempt-1" / "job.sh").read_text()
    assert '#SBATCH --comment="paddle two words"' in script and "#SBATCH --exclusive" in script, script
    assert _cli(conf, env, "kill").returncode == 0
    slurm.wait_quiet()


def test_more_than_slurm_can_grant_is_its_error_and_nothing_is_queued(slurm, tmp_path):
    conf, env, ws = _setup(slurm, tmp_path)
    res = _cli(conf, env, "run", "--nodes", "3", "--job_dispatch_package", str(ws), "--job_name", "slurmbig",
               "--gres", f"gpu:{slurm.gpus + 1}")
    no_traceback(res)
    assert res.returncode != 0 and "submitting the job: sbatch --parsable" in res.stderr, res.stderr
    assert "Requested node configuration is not available" in res.stderr, res.stderr
    assert slurm.active_jobs() == []
    # status then says what run said, not "no Slurm job recorded ... is ROOT_DIR the shared filesystem ...?"
    st = _cli(conf, env, "status")
    assert st.returncode == 1 and "job slurmbig never reached Slurm: run ended it failed (exit 1): submitting the " \
        "job: sbatch --parsable" in st.stderr, st.stderr


@pytest.mark.parametrize("args, words", [
    (["--mem", "lots"], ["--mem 'lots'", "4G"]),
    (["--sbatch-arg=--nodes=5"], ["--sbatch-arg '--nodes=5'", "sets sbatch --nodes itself", "--nodes"]),
    (["--sbatch-arg=-J", "--sbatch-arg=x"], ["--sbatch-arg '-J'", "--job-name itself"]),
    (["--sbatch-arg=mail"], ["--sbatch-arg 'mail'", "one sbatch option"]),
    (["--gres", "gpu: 2"], ["--gres 'gpu: 2'", "without spaces"]),
])
def test_bad_slurm_options_are_refused_before_anything_is_submitted(tmp_path, args, words):
    conf = tmp_path / "conf.py"
    conf.write_text(f"BACKEND = 'slurm'\nROOT_DIR = {str(tmp_path / 'root')!r}\nPADDLE_NIC = 'eth0'\n")
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "train.py").write_text("print('hi')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PADDLE_", "SLURM_"))}
    env.update(HOME=str(tmp_path), PYTHONPATH=str(REPO))
    res = _cli(conf, env, "run", "--nodes", "2", "--job_dispatch_package", str(tmp_path / "ws"), *args)
    no_traceback(res)
    assert res.returncode == 2 and all(w in res.stderr for w in words), res.stderr  # a usage error
    assert not (tmp_path / "root").exists()  # refused before anything was prepared


def test_slurm_options_on_another_backend_are_a_usage_error(tmp_path):
    conf = tmp_path / "conf.py"
    conf.write_text(f"HOSTS = ['localhost']\nROOT_DIR = {str(tmp_path / 'root')!r}\n")
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "train.py").write_text("print('hi')\n")
    env = {**os.environ, "HOME": str(tmp_path), "PYTHONPATH": str(REPO)}
    res = _cli(conf, env, "run", "--job_dispatch_package", str(tmp_path / "ws"), "--gres", "gpu:1")
    assert res.returncode == 2 and "--gres: for --backend slurm only" in res.stderr, res.stderr


def test_batch_script_renders_every_option_as_an_sbatch_line():
    """The rendered script alone says what was asked (``sbatch job.sh`` submits it again)."""
    opts = SlurmOptions(2, partition="gpu", qos="high", reservation="maint", gres="gpu:a100:4", cpus_per_task=8,
                        mem="64G", exclusive=True, constraint="a100&ib", account="ml",
                        sbatch_args=("--gpus-per-task=1", "--comment=two words", "--mail-type=END,FAIL"))
    text = batch_script("fit", 1, ["--nodes=2", "--chdir=/shared/my jobs"], ["srun", "python3", "-m", "x"])
    assert text.splitlines()[2:4] == ["#SBATCH --nodes=2", '#SBATCH --chdir="/shared/my jobs"']
    lines = batch_script("fit", 1, [], ["true"]).splitlines()
    assert lines[0] == "#!/bin/sh" and lines[-1] == "exec true"
    got = [ln for ln in batch_script("fit", 1, opts.sbatch_options(), ["true"]).splitlines() if ln.startswith("#SB")]
    assert got == ["#SBATCH --partition=gpu", "#SBATCH --account=ml", "#SBATCH --gres=gpu:a100:4",
                   "#SBATCH --cpus-per-task=8", "#SBATCH --mem=64G", "#SBATCH --constraint=a100&ib",
                   "#SBATCH --qos=high", "#SBATCH --reservation=maint", "#SBATCH --exclusive",
                   "#SBATCH --gpus-per-task=1", '#SBATCH --comment="two words"', "#SBATCH --mail-type=END,FAIL"]
    with pytest.raises(ClusterError, match="double quote"):
        batch_script("fit", 1, ['--comment=say "hi"'], ["true"])


# -- fail-fast inside the allocation when no launcher follows ------------------------------------------------

# A pserver (ps.py) or trainer (train.py) that runs until told to fail: file fail-<role>-<id> in FLAGS.
FAIL_ON_FLAG = """
import os, sys, time
role = "{role}"
i = os.environ["PADDLE_TRAINER_ID" if role == "trainer" else "PADDLE_PSERVER_ID"]
{serve}
print(role, i, "holding", flush=True)
while not os.path.exists(os.path.join({flags!r}, f"fail-{{role}}-{{i}}")):
    time.sleep(0.1)
print(role, i, "failing", flush=True)
sys.exit(4)
"""
SERVE = """
import socket
from paddle_cluster.contract import JobEnv
env = JobEnv.from_environ()
socks = [socket.create_server((env.current_ip, port)) for port in env.all_ports(env.pserver_id)]
"""


def _fail_on_flag(ws: Path) -> Path:
    """``ws`` (of ``_setup``) with both roles failing on a flag file in ``ws/../flags``."""
    flags = ws.parent / "flags"
    flags.mkdir()
    (ws / "train.py").write_text(FAIL_ON_FLAG.format(role="trainer", serve="", flags=str(flags)))
    (ws / "ps.py").write_text(FAIL_ON_FLAG.format(role="pserver", serve=SERVE, flags=str(flags)))
    return ws


def _ends_failed_with_nothing_left(slurm, job_id: str, timeout: float) -> None:
    job = slurm.wait_job(job_id, ["FAILED", "COMPLETED", "CANCELLED"], timeout=timeout)
    assert job["JobState"] == "FAILED", job  # the job ended by itself, as failed
    slurm.wait_quiet()  # every step and process on every node gone, nothing queued


@pytest.mark.parametrize("role", ["trainer", "pserver"])
def test_detached_job_fails_fast_inside_the_allocation(slurm, tmp_path, role):
    conf, env, ws = _setup(slurm, tmp_path)
    _fail_on_flag(ws)
    res = _cli(conf, env, "run", "--nodes", "3", "--detach", "--job_dispatch_package", str(ws), "--job_name", "det")
    assert res.returncode == 0, res.stderr
    job_id = re.search(r"is Slurm job (\d+)", res.stderr).group(1)
    logs = slurm.shared_dir / tmp_path.name / "det"
    wait_for(lambda: all((logs / f"node{i}" / "log" / "train.log").exists() and "holding" in
                         (logs / f"node{i}" / "log" / "train.log").read_text() for i in range(3)), 90, "3 holding")
    (tmp_path / "flags" / f"fail-{role}-1").touch()
    _ends_failed_with_nothing_left(slurm, job_id, 60)
    st = _cli(conf, env, "status", "--json")
    rows = {r["name"]: r["state"] for r in json.loads(st.stdout)["processes"]}
    assert "4" in rows[f"{role}.1"], rows  # its exit status, and every other process was stopped
    assert all(state != "running" for state in rows.values()), rows


def test_job_fails_fast_after_its_launcher_died(slurm, tmp_path):
    """A followed job keeps going after a failure while its launcher decides; once the launcher is gone (SIGKILL)
    the nodes notice its lease has stopped and a failed trainer ends the whole job, as with --detach."""
    conf, env, ws = _setup(slurm, tmp_path, ORPHAN_TIMEOUT=5.0)
    _fail_on_flag(ws)
    r = _Run(conf, env, "--nodes", "3", "--job_dispatch_package", str(ws), "--job_name", "orphan")
    wait_for(lambda: sum("holding" in x for x in r.out) == 6, 90, "3 pservers and 3 trainers holding")
    job_id = re.search(r"submitted Slurm job (\d+)", "".join(r.err)).group(1)
    r.p.kill()
    r.wait()
    assert slurm.show_job(job_id)["JobState"] == "RUNNING"  # it runs on without its launcher, as documented
    (tmp_path / "flags" / "fail-trainer-2").touch()
    _ends_failed_with_nothing_left(slurm, job_id, 60)
    events = (slurm.shared_dir / tmp_path.name / "orphan" / ".paddle_cluster" / "attempt-1" / "events.2.jsonl")
    assert "no word from the launcher for 5 s" in events.read_text()


def test_an_agent_keeps_going_only_while_the_lease_changes(tmp_path):
    """The node side of the lease: a failure is the launcher's to judge while the lease file keeps changing; once
    it has not changed for the timeout (or never appeared), the agent fails fast."""
    from paddle_cluster.node.supervisor import NoChannel

    lease = tmp_path / "launcher.lease"
    ch = NoChannel(fail_fast=False, lease=str(lease), lease_timeout=1.0)
    for beat in range(8):  # 1.6 s of a launcher renewing it every 0.2 s
        lease.write_text(f"1 {beat}\n")
        ch.get(0.2)
        assert not ch.fail_fast
    ch.get(1.2)  # the launcher stopped renewing (the file stays, unchanged)
    assert ch.fail_fast and ch.orphaned
    never = NoChannel(fail_fast=False, lease=str(tmp_path / "missing"), lease_timeout=0.5)
    never.get(0.7)
    assert never.fail_fast


def test_resume_from_without_a_checkpoint_is_refused_before_submitting(slurm, tmp_path):
    """The shared checkpoint directory is looked at before anything is submitted: none is exit 2 naming it, no
    job in Slurm (before, the pservers started fresh)."""
    conf, env, ws = _setup(slurm, tmp_path)
    res = _cli(conf, env, "run", "--nodes", "3", "--job_dispatch_package", str(ws), "--resume_from", "nosuchjob")
    assert res.returncode == 2, res.stdout + res.stderr
    root = slurm.shared_dir / tmp_path.name
    assert f"  the shared filesystem: {root}/nosuchjob/checkpoints does not exist" in res.stderr, res.stderr
    assert "nothing was started (not starting fresh)" in res.stderr
    no_traceback(res)
    assert not list(root.glob("JOB*"))  # no job directory made
    assert slurm.run(["squeue", "-h"], check=False).stdout.strip() == ""


def test_check_looks_at_the_slurm_commands_and_the_controller(slurm, tmp_path):
    conf, env, ws = _setup(slurm, tmp_path, hold=False)
    ok = _cli(conf, env, "check")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    (row,) = [ln for ln in ok.stdout.splitlines() if ln.startswith("slurm ")]
    version = subprocess.run(["scontrol", "--version"], env=env, capture_output=True, text=True).stdout.strip()
    assert "sbatch, srun, squeue, scancel, scontrol" in row and version in row and "UP" in row, ok.stdout

    # The controller does not answer (a slurm.conf naming a port where nothing listens): that row fails, the
    # machine's row still passes, exit 1 with the reason.
    port = free_port_range(1)
    (tmp_path / "down.conf").write_text(re.sub(r"(?m)^SlurmctldPort=\S+", f"SlurmctldPort={port}",
                                               slurm.conf.read_text()))
    down = _cli(conf, {**env, "SLURM_CONF": str(tmp_path / "down.conf")}, "check", timeout=120)
    no_traceback(down)
    assert down.returncode == 1 and "the controller: " in down.stdout, down.stdout + down.stderr
    assert "1 of 1 engine(s) failed the check:" in down.stderr and "slurmctld" in down.stderr, down.stderr
    assert "host(s)" not in down.stderr, down.stderr

    # No Slurm commands on this machine (a PATH without them; PYTHON is absolute): the row names them all and
    # gives the hint run gives.
    empty = tmp_path / "bin"
    empty.mkdir()
    res = _cli(conf, {**env, "PATH": str(empty)}, "check")
    no_traceback(res)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "MISSING: sbatch, srun, squeue, scancel, scontrol" in res.stdout, res.stdout
    hint = "run on a machine with the Slurm client commands (a login node), or install them"
    assert hint in res.stderr and "host(s)" not in res.stderr, res.stderr
    run = _cli(conf, {**env, "PATH": str(empty)}, "run", "--nodes", "1", "--job_dispatch_package", str(ws),
               "--job_name", "x")
    assert run.returncode != 0 and hint in run.stderr, run.stderr  # run's hint, the same
