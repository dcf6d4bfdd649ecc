"""Which program runs as pserver (issue 24, item 2), on this machine with the real built-in pserver and real
trainers: a trainer-only script that checks its role runs, an explicit PSERVER_COMMAND is honoured even when it
equals the built-in pserver's command, ``run --pserver`` chooses either way, and a pserver that exits before
listening while running the entry script says how to choose the built-in pserver."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from helpers import checkout_env, cli, local_conf, no_traceback

from paddle_cluster.launch import entry
from paddle_cluster.launch.backends.k8s import backend as k8s_backend
from paddle_cluster.launch.config import parse_config
from paddle_cluster.launch.plan import JobSpec, build_plan

# A trainer-only script, as a user writes it: it checks that it runs as a trainer and trains with the runtime.
TRAINER_ONLY = '''
import os, sys
assert os.environ["PADDLE_TRAINING_ROLE"] == "TRAINER", os.environ["PADDLE_TRAINING_ROLE"]
import numpy as np
from paddle_cluster.ps import OptimizerSpec, connect

ps = connect(mode="sync", optimizer=OptimizerSpec("sgd", lr=0.5))
values = ps.register_dense({"w": np.zeros(4, dtype=np.float32)})
target = np.arange(4, dtype=np.float32)
for step in range(20):
    values = ps.push_pull({"w": values["w"] - target})
print("TRAINED", ps.trainer_id, round(float(np.abs(values["w"] - target).max()), 3), flush=True)
ps.close()
'''

# A script that handles both roles, as the seeds' do, marking which role ran it.
BOTH_ROLES = TRAINER_ONLY.replace(
    'assert os.environ["PADDLE_TRAINING_ROLE"] == "TRAINER", os.environ["PADDLE_TRAINING_ROLE"]',
    'if os.environ["PADDLE_TRAINING_ROLE"] == "PSERVER":\n'
    '    print("SCRIPT AS PSERVER", flush=True)\n'
    '    from paddle_cluster.ps.__main__ import main\n'
    '    sys.exit(main([]))')


def _ws(tmp: Path, text: str) -> Path:
    ws = tmp / "ws"
    ws.mkdir(exist_ok=True)
    (ws / "train.py").write_text(text)
    return ws


def _first_line(stderr: str) -> str:
    return next(line for line in stderr.splitlines() if line.startswith("paddle-cluster: "))


def test_a_trainer_only_script_that_checks_its_role_runs_with_the_builtin_pserver(tmp_path):
    conf = local_conf(tmp_path, PSERVERS_PER_NODE=2, TRAINERS_PER_NODE=2)
    res = cli(conf, "run", "--job_dispatch_package", str(_ws(tmp_path, TRAINER_ONLY)), "--job_name", "tonly")
    no_traceback(res)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    first = _first_line(res.stderr)
    assert first.startswith("paddle-cluster: pservers run the built-in pserver (python -m paddle_cluster.ps): "
                            "train.py does not handle PADDLE_TRAINING_ROLE=PSERVER"), first
    assert "run --pserver entry" in first  # and how to change it
    for t in (0, 1):
        assert f"TRAINED {t} 0.0" in res.stdout, res.stdout[-2000:]


def test_pserver_command_set_to_the_builtin_one_is_honoured(tmp_path):
    # PSERVER_COMMAND pinned: the key under test (docs/migrating.md's advice, ignored before because it equals
    # the default); the script handles both roles, so without the key pservers would run it.
    conf = local_conf(tmp_path, PSERVERS_PER_NODE=1, TRAINERS_PER_NODE=2,
                      PSERVER_COMMAND="{python} -m paddle_cluster.ps")
    ws = _ws(tmp_path, BOTH_ROLES)
    res = cli(conf, "run", "--job_dispatch_package", str(ws), "--job_name", "explicit")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "SCRIPT AS PSERVER" not in res.stdout
    assert "PSERVER_COMMAND = '{python} -m paddle_cluster.ps' (set in" in _first_line(res.stderr)
    # the option chooses the other way over the key
    res = cli(conf, "run", "--job_dispatch_package", str(ws), "--job_name", "opt", "--pserver", "entry")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "[pserver.0@node0] SCRIPT AS PSERVER" in res.stdout
    assert "run --pserver entry" in _first_line(res.stderr)


def test_a_script_that_handles_the_role_runs_as_pserver_by_default(tmp_path):
    conf = local_conf(tmp_path, PSERVERS_PER_NODE=1, TRAINERS_PER_NODE=1)
    res = cli(conf, "run", "--job_dispatch_package", str(_ws(tmp_path, BOTH_ROLES)), "--job_name", "both")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "[pserver.0@node0] SCRIPT AS PSERVER" in res.stdout
    first = _first_line(res.stderr)
    assert first.startswith("paddle-cluster: pservers run train.py as PADDLE_TRAINING_ROLE=PSERVER"), first
    assert "run --pserver builtin" in first


def test_entry_script_dying_as_pserver_says_how_to_choose_the_builtin_pserver(tmp_path):
    conf = local_conf(tmp_path, PSERVERS_PER_NODE=1, TRAINERS_PER_NODE=1)
    res = cli(conf, "run", "--job_dispatch_package", str(_ws(tmp_path, TRAINER_ONLY)), "--job_name", "dies",
              "--pserver", "entry")
    # the script's traceback is quoted in the report ("  | "); the launcher itself prints none
    assert not [line for line in res.stderr.splitlines() if line.startswith("Traceback")], res.stderr
    assert res.returncode != 0
    assert "AssertionError: PSERVER" in res.stderr, res.stderr[-3000:]  # the script's own last words
    assert ("pservers ran train.py as PADDLE_TRAINING_ROLE=PSERVER and it exited before listening; if train.py "
            "is a trainer-only script, run the built-in pserver: run --pserver builtin, or PSERVER_COMMAND = "
            '"{python} -m paddle_cluster.ps" in conf.py') in res.stderr, res.stderr[-3000:]


def test_k8s_pods_run_the_pserver_the_launcher_chose(tmp_path, monkeypatch):
    # The cluster's permission answers only (no API server here); what is under test is the pods' commands.
    monkeypatch.setattr(k8s_backend.Kubectl, "may", lambda self, verb, resource: True)
    ws = _ws(tmp_path, TRAINER_ONLY)
    cfg = parse_config({"HOSTS": ["a"], "BACKEND": "k8s", "K8S_IMAGE": "img:1"}, "conf.py",
                       k8s_backend.K8sBackend.conf_keys)
    for option, want in ((None, ["python3", "-m", "paddle_cluster.ps"]), ("entry", ["python3", "train.py", "--x"])):
        settled = entry.settle(cfg, None, str(ws), ["--x"], pserver=option)
        be = k8s_backend.K8sBackend(cfg, k8s_backend.K8sOptions.from_config(cfg))  # made before settling, as run
        spec = JobSpec(settled.cfg, "kjob", workspace="/workspace", trainer_args=("--x",))
        prepared = be.prepare(spec, lambda _s: None)
        request = be.render(build_plan(spec, prepared.topology), prepared)
        assert list(request.job.pserver_cmd) == want


def test_the_first_line_names_the_pserver_on_the_builtin_local_cluster_too(tmp_path):
    # The built-in local cluster listens on the fixed ports 7164-7165, which other jobs on this machine may hold:
    # a --job_workspace that is nowhere stops the run after its first lines, before any port is used.
    env = checkout_env(HOME=str(tmp_path), XDG_STATE_HOME=str(tmp_path / "state"))
    env.pop("PADDLE_CLUSTER_CONF", None)
    res = subprocess.run([sys.executable, "-m", "paddle_cluster", "run", "--job_workspace", str(tmp_path / "nope"),
                          "--job_name", "demo"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
                         stdin=subprocess.DEVNULL)
    lines = res.stderr.splitlines()
    assert lines[0].startswith("paddle-cluster: pservers run the built-in pserver"), lines[:3]
    assert "run --pserver entry" in lines[0]
    assert lines[1].startswith("paddle-cluster: no conf.py or cluster.yaml in "), lines[:3]
    assert res.returncode == 2 and "no such directory there" in res.stderr, res.stderr  # a configuration error
