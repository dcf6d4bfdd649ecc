"""No file on any node holds the job secret readable by another user, on every backend, and none is left once the
job ends: ssh never writes it (tests/test_security.py), mpi and slurm write each node's plan 0600 from its first
byte in a directory made private (a ``plans`` directory left at 0755 once let user nobody read a running job's
secret), and the node removes it once read; on k8s only the Secret object holds it. Each backend's test looks,
while a job runs, for the secret in every file user nobody can read, and once it ended in every file, whatever
its mode (``helpers.secret_holders``)."""

from __future__ import annotations

import json
import os
import pwd
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import (
    REPO,
    assert_nothing_left,
    cli,
    proc_pid,
    secret_holders,
    small_workspace,
    start_cli,
    wait_for,
    write_conf,
)

from paddle_cluster.node import private

NOBODY = pwd.getpwnam("nobody")


def _node(*args: str, stdin: bytes = b"") -> dict:
    """``python -m paddle_cluster.node ARGS``' answer, as the launcher runs it on a node."""
    res = subprocess.run([sys.executable, "-m", "paddle_cluster.node", *args], input=stdin, capture_output=True,
                         timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    return json.loads(res.stdout.decode().splitlines()[-1])


def test_a_private_file_is_owner_only_from_its_first_byte_whatever_was_there(tmp_path):
    plans = tmp_path / ".paddle_cluster" / "plans"
    plans.mkdir(parents=True, mode=0o755)
    plans.chmod(0o755)  # as `mkdir -p` left it once: mkdir -p -m 700 would not have changed it
    path = plans / "job.1.jsonl"
    path.write_text("stale")
    path.chmod(0o644)  # a file already at that name keeps its mode through O_TRUNC: it is replaced instead
    old = os.umask(0)  # nor does a permissive umask widen it
    try:
        assert _node("private", "--write", str(path), stdin=b"the secret") == {"ok": True}
    finally:
        os.umask(old)
    assert path.read_bytes() == b"the secret" and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(plans.stat().st_mode) == 0o700 and os.listdir(plans) == ["job.1.jsonl"]
    assert secret_holders([tmp_path], ["the secret"]) == ([str(path)], [])
    assert _node("private", "--remove", str(path)) == {"ok": True, "removed": True} and not path.exists()


def test_a_plans_directory_of_another_user_or_a_link_is_refused_naming_it(tmp_path):
    theirs = tmp_path / "theirs" / "plans"
    theirs.mkdir(parents=True)
    os.chown(theirs, NOBODY.pw_uid, NOBODY.pw_gid)
    doc = _node("private", "--write", str(theirs / "j.1.jsonl"), stdin=b"s")
    assert doc["ok"] is False and f"{theirs} belongs to uid {NOBODY.pw_uid}" in doc["error"], doc
    assert os.listdir(theirs) == []
    (tmp_path / "link").mkdir()
    (tmp_path / "link" / "plans").symlink_to(theirs)
    doc = _node("private", "--write", str(tmp_path / "link" / "plans" / "j.1.jsonl"), stdin=b"s")
    assert doc["ok"] is False and "is not a directory of its own" in doc["error"], doc
    with pytest.raises(private.PrivateError):
        private.write_private(str(theirs / "x"), b"s")
    assert os.listdir(theirs) == []


def _environ(pid: int) -> dict:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def _state_files() -> list:
    """The launcher's own state (journal) files on this machine."""
    state = Path(os.environ.get("XDG_STATE_HOME", Path.home() / ".local" / "state")) / "paddle-cluster"
    return [state] if state.is_dir() else []


@pytest.mark.timeout(240)
def test_mpi_plans_are_private_while_the_job_runs_and_gone_after(mpi_env, tmp_path):
    """A ``plans`` directory already there at 0755 on every host (and a stale 0644 plan of that name on node0):
    made 0700 and replaced; while the job runs nobody reads the secret anywhere under ROOT_DIR (each rank removed
    its plan once read); once killed no file holds it."""
    cluster = mpi_env.cluster
    cluster.mpi_impl = "openmpi"
    ws = small_workspace(tmp_path)
    # PSERVER_COMMAND: ps.py listens and holds, so the job runs until kill (as test_backend_mpi's held jobs).
    conf = write_conf(tmp_path, cluster, BACKEND="mpi", MPI_IMPL="openmpi", LD_LIBRARY_PATH="", ENV={},
                      PSERVER_COMMAND="{python} ps.py")
    roots = [cluster.root_dir(i) for i in range(cluster.n)]
    for root in roots:
        plans = root / ".paddle_cluster" / "plans"
        plans.mkdir(parents=True, exist_ok=True)
        plans.chmod(0o755)
    (roots[0] / ".paddle_cluster" / "plans" / "mpisec.1.jsonl").write_text("stale\n")
    p = start_cli(conf, "run", "--job_workspace", str(ws), "--job_name", "mpisec")
    try:
        secret = _environ(proc_pid(cluster, 0, "mpisec", "pserver.0"))["PADDLE_JOB_SECRET"]
        wait_for(lambda: all((r / "mpisec" / "log" / "train.log").exists() for r in roots), 60, "3 trainers")
        held, readable = secret_holders(roots, [secret])
        assert readable == [] and held == [], (held, readable)  # each rank removed its plan once read
        for root in roots:
            assert stat.S_IMODE((root / ".paddle_cluster" / "plans").stat().st_mode) == 0o700
        assert cli(conf, "kill", "--job_name", "mpisec").returncode == 0
        p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    held, _ = secret_holders([*roots, *_state_files()], [secret])
    assert held == [] and [list((r / ".paddle_cluster" / "plans").glob("mpisec.*")) for r in roots] == [[]] * 3
    assert_nothing_left(cluster)


@pytest.mark.timeout(240)
def test_slurm_plans_are_private_while_the_job_runs_and_gone_after(slurm_cluster, tmp_path):
    """ROOT_DIR on the filesystem the nodes share: each node's plan is its own, 0600, removed by that node once
    read; while the job runs nobody reads the secret anywhere under ROOT_DIR (the batch script, the events, the
    logs); once killed no file holds it."""
    slurm = slurm_cluster
    root = slurm.shared_dir / tmp_path.name
    # PSERVER_COMMAND: ps.py listens and holds, so the job runs until kill (as test_backend_slurm's held jobs).
    settings = {"BACKEND": "slurm", "ROOT_DIR": str(root), "PADDLE_NIC": "eth0", "PYTHON": sys.executable,
                "PSERVER_COMMAND": "{python} ps.py", "KILL_GRACE": 2.0}
    conf = tmp_path / "conf.py"
    conf.write_text("".join(f"{k} = {v!r}\n" for k, v in settings.items()))
    env = {k: v for k, v in slurm.env.items() if not k.startswith(("PADDLE_", "XDG_", "SLURM_JOB"))}
    env.update(HOME=str(tmp_path), PYTHONPATH=str(REPO), SLURM_CONF=str(slurm.conf))
    ws = small_workspace(tmp_path)
    argv = [sys.executable, "-m", "paddle_cluster", "--conf", str(conf)]
    p = subprocess.Popen([*argv, "run", "--nodes", "3", "--job_dispatch_package", str(ws), "--job_name", "slsec"],
                         env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        logs = [root / "slsec" / f"node{i}" / "log" / "train.log" for i in range(3)]
        wait_for(lambda: all(f.exists() and "holding" in f.read_text() for f in logs), 120, "3 trainers holding")
        pid = json.loads((root / "slsec" / "node0" / ".paddle_cluster" / "procs.json").read_text())["procs"][0]["pid"]
        secret = _environ(pid)["PADDLE_JOB_SECRET"]
        held, readable = secret_holders([root], [secret])
        assert readable == [] and held == [], (held, readable)  # each node removed its plan once read
        assert list((root / "slsec" / ".paddle_cluster").glob("attempt-1/job.sh"))  # what sbatch ran is there
        k = subprocess.run([*argv, "kill", "--job_name", "slsec"], env=env, capture_output=True, text=True,
                           timeout=120)
        assert k.returncode == 0, k.stderr
        p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
        slurm.run(["scancel", "--user=root"], check=False)
        slurm.wait_quiet()
    held, _ = secret_holders([root, *_state_files()], [secret])
    assert held == [], held


@pytest.mark.timeout(240)
def test_k8s_only_the_secret_object_holds_it(kube_cluster, tmp_path):
    """The Secret object holds the job secret and nothing else does: the pods get it by reference, no other
    object of the cluster's store, no file of the pods (their logs, volumes, job directories) nor of the launcher
    holds it, while the job runs for nobody, and once it was killed for anyone."""
    from kube.standin import IMAGE

    # PSERVER_COMMAND: ps.py listens and holds, so the job runs until kill.
    (tmp_path / "conf.py").write_text(f'HOSTS = ["a", "b"]\nROOT_DIR = "{tmp_path}/root"\n'
                                      'PSERVER_COMMAND = "{python} ps.py"\n')
    ws = small_workspace(tmp_path)
    env = {k: v for k, v in kube_cluster.env.items() if not k.startswith("PADDLE_")}
    env.update(PYTHONPATH=str(REPO), HOME=str(tmp_path), XDG_STATE_HOME=str(tmp_path / "state"))

    def cli_k8s(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "paddle_cluster", *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=180)

    store = kube_cluster.root / "objects.json"  # the API server's store, where the Secret object is
    res = cli_k8s("run", "--backend", "k8s", "--image", IMAGE, "--pservers", "1", "--trainers", "2",
                  "--job_workspace", str(ws), "--job_name", "k8sec", "--detach")
    assert res.returncode == 0, res.stderr
    try:
        (secret_obj,) = kube_cluster.objects("Secret/default/k8sec").values()
        secret = secret_obj["data"]["job-secret"]
        def holding() -> int:
            logs = [kube_cluster.store.log("default", p["metadata"]["name"]) for p in kube_cluster.pods()
                    if p["metadata"]["name"].startswith("k8sec-trainer")]
            return sum(f.exists() and "holding" in f.read_text() for f in logs)
        kube_cluster.wait(lambda: holding() == 2, 120, "2 trainers holding")
        others = {k: v for k, v in kube_cluster.objects(ns="default").items() if k != "Secret/default/k8sec"}
        assert secret not in json.dumps(others), [k for k, v in others.items() if secret in json.dumps(v)]
        held, readable = secret_holders([kube_cluster.root, tmp_path], [secret], skip=[store])
        assert readable == [] and held == [], (held, readable)
    finally:
        k = cli_k8s("kill", "--job_name", "k8sec")
    assert k.returncode == 0, k.stderr
    held, _ = secret_holders([kube_cluster.root, tmp_path], [secret], skip=[store])
    assert held == [] and secret not in json.dumps(kube_cluster.objects()), held
