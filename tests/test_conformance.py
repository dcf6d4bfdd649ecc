"""The conformance suite: the same user scenarios, through the real CLI (``paddle-cluster ...`` subprocesses) and
the README's conf.py, on every backend: the built-in local cluster, ssh (3 namespace hosts), mpi with Open MPI
and with MPICH (over those hosts), slurm (a real Slurm cluster) and k8s (the Kubernetes stand-in).

The engines are tests/engines/'s. A scenario an engine does not offer is declared in its ``not_offered`` with
the reason, and its test checks that the CLI refuses it saying so (not a skip). docs/backends.md's matrix is
generated from these declarations (``python tests/test_conformance.py`` rewrites it;
``test_docs_matrix_is_the_suites`` fails when it drifts).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from typing import Dict, List, Tuple

import pytest
from conformance_cases import BEGIN, DOC, END, EXTRA_VARS, NOT_OFFERED, cases, docs_with_matrix
from engines import DRY_RUN_OPTIONS, ENGINES
from helpers import FIT_A_LINE, wait_for
from userengine import Engine, pserver_pids, user_env, workspace

from paddle_cluster.contract import SOCKET_IFNAME_VARS

# -- fit_a_line with the README's conf.py --------------------------------------------------------------------

MSE = re.compile(r"^\[trainer\.0@[^\]]+\] final test_mse=(\S+)$", re.M)


@pytest.mark.parametrize("engine", cases("fit_a_line"), indirect=True)
def test_fit_a_line(engine: Engine):
    ws = engine.tmp / "fit_a_line"
    shutil.copytree(FIT_A_LINE, ws, ignore=shutil.ignore_patterns("log", "output", "__pycache__"))
    job = engine.job("fit")
    res = engine.run(job, "--job_dispatch_package", str(ws), timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    mse = float(MSE.search(res.stdout).group(1))
    assert mse < 30, res.stdout[-2000:]
    st = engine.cli("status", "--json", "--job_name", job)
    assert st.returncode == 0, st.stdout + st.stderr
    doc = json.loads(st.stdout)
    assert doc["exit_code"] == 0, doc
    assert sum(p["name"].startswith("trainer.") for p in doc["processes"]) == engine.trainers, doc
    lg = engine.cli("logs", engine.log_node(0), "--role", "trainer", "--job_name", job)
    assert lg.returncode == 0 and "final test_mse=" in lg.stdout, lg.stdout + lg.stderr
    # The results come home: trainer 0's output/ into got/node0 (Slurm: the shared job directory's into got/shared;
    # Kubernetes: one line saying how instead).
    got = engine.cli("fetch", "--job_name", job, "--to", "got")
    if engine.name == "k8s":
        assert got.returncode == 1 and "kubectl cp" in got.stderr, got.stderr
    else:
        assert got.returncode == 0, got.stdout + got.stderr
        where = "shared" if engine.name == "slurm" else "node0"
        saved = json.loads((engine.tmp / "got" / where / "output" / "metrics.json").read_text())
        assert saved["test_mse"] == pytest.approx(mse, rel=1e-4), saved
    engine.assert_nothing_left()


# -- the env contract, status and logs during a run, Ctrl+C --------------------------------------------------

ENV_LINE = re.compile(r"^\[(trainer|pserver)\.(\d+)@[^\]]+\] env (\{.*\})$")
NORMALISED: Dict[str, dict] = {}  # backend -> its normalised dump, compared across backends


def envs(lines: List[str]) -> Dict[Tuple[str, int], dict]:
    got = {}
    for line in lines:
        m = ENV_LINE.match(line.strip())
        if m:
            got[m.group(1), int(m.group(2))] = json.loads(m.group(3))
    return got


def check_contract(dumps: Dict[Tuple[str, int], dict], trainers: int, pservers: int) -> None:
    """What holds on every backend: one job, the Fluid and v2 names agreeing, ids and counts of the placement."""
    assert sorted(dumps) == sorted([("pserver", i) for i in range(pservers)] + [("trainer", t) for t in
                                                                                range(trainers)]), sorted(dumps)
    assert len({e["PADDLE_JOB_ID"] for e in dumps.values()}) == 1
    for (role, i), e in dumps.items():
        assert e["PADDLE_TRAINING_ROLE"] == role.upper()
        ips = e["PADDLE_PSERVER_IPS"].split(",")
        assert len(ips) == pservers and e["PADDLE_PSERVER_ENDPOINTS"].count(":") == pservers, e
        assert e["PADDLE_TRAINERS"] == str(trainers), e
        assert e["TRAINING_ROLE"] == role.upper() and e["PADDLE_TRAINERS_NUM"] == e["WORLD_SIZE"] == str(trainers)
        assert len(e["PADDLE_TRAINER_ENDPOINTS"].split(",")) == trainers, e
        assert e["MASTER_ADDR"] == e["PADDLE_TRAINER_ENDPOINTS"].split(",")[0].rpartition(":")[0], e
        if role == "pserver":
            assert e["PADDLE_PSERVERS_IP_PORT_LIST"] == e["PADDLE_PSERVER_ENDPOINTS"], e
            assert f"{e['POD_IP']}:{e['PADDLE_PORT']}" == e["PADDLE_CURRENT_ENDPOINT"], e
        if role == "trainer":
            assert e["RANK"] == str(i) and e["PADDLE_CURRENT_ENDPOINT"] == e["PADDLE_TRAINER_ENDPOINTS"].split(",")[i]
            assert int(e["GROUP_RANK"]) * int(e["LOCAL_WORLD_SIZE"]) + int(e["LOCAL_RANK"]) == i, e
            assert "PADDLE_JOB_SECRET" not in e
            assert e["PADDLE_TRAINER_ID"] == e["PADDLE_INIT_TRAINER_ID"] == str(i)
            assert e["PADDLE_INIT_NUM_GRADIENT_SERVERS"] == str(trainers)
            assert e["PADDLE_INIT_PSERVERS"] == e["PADDLE_PSERVER_IPS"]
            assert e["PADDLE_INIT_PORT"] == e["PADDLE_PSERVER_PORT"]
            assert len(e["PADDLE_TRAINER_KEY"]) == 64
    keys = [e["PADDLE_TRAINER_KEY"] for (role, _), e in dumps.items() if role == "trainer"]
    assert len(set(keys)) == len(keys)  # a key per trainer


def normalise(e: dict, backend: str, job: str) -> dict:
    """A dump with what depends on the placement replaced by its kind: addresses, ports, ids, keys, paths, and
    a list of any length by its first element; the variables ``EXTRA_VARS`` declares for ``backend`` left out."""
    hosts = set(e["PADDLE_PSERVER_IPS"].split(",")) | {e.get("PADDLE_CURRENT_IP", "")} | {
        t.rpartition(":")[0] for t in e["PADDLE_TRAINER_ENDPOINTS"].split(",")}  # on k8s the trainer pods' IPs
    out = {}
    for k, v in sorted(e.items()):
        if (backend, k) in EXTRA_VARS:
            continue
        if k in SOCKET_IFNAME_VARS:  # the engine's network: its conf.py's PADDLE_NIC, a pod's own on Kubernetes
            assert backend != "k8s", f"{k}={v} in a pod: pods bind their own address unless --pod-nic"
            continue
        v = re.sub(rf"\b{job}-[0-9a-f]+\b", "JOB-ID", v.replace(f"/{job}", "/JOB"))
        for h in sorted(hosts - {""}, key=len, reverse=True):
            v = v.replace(h, "HOST")
        v = re.sub(r"/\S*", "PATH", v)
        v = re.sub(r"\b[0-9a-f]{32,}\b", "HEX", v)
        v = re.sub(r"\d+", "N", v)
        out[k] = v.split(",")[0] + (",..." if "," in v else "")
    return out


@pytest.mark.parametrize("engine", cases("env_ctrl_c"), indirect=True)
def test_env_contract_status_logs_and_ctrl_c(engine: Engine):
    job = engine.job("env")
    r = engine.start_holding(job)
    try:
        r.wait_lines(r"^\[pserver\.\d+@[^\]]+\] env ", engine.pservers)
        dumps = envs(r.out)
        check_contract(dumps, engine.trainers, engine.pservers)
        st = engine.cli("status", "--json", "--job_name", job)
        assert st.returncode == 0, st.stdout + st.stderr
        doc = json.loads(st.stdout)
        assert doc["outcome"] is None, doc  # still running
        names = sorted(p["name"] for p in doc["processes"])
        assert names == sorted([f"pserver.{i}" for i in range(engine.pservers)] +
                               [f"trainer.{t}" for t in range(engine.trainers)]), doc
        assert {p["state"] for p in doc["processes"]} == {"running"}, doc
        lg = engine.cli("logs", engine.log_node(1), "--role", "trainer", "--job_name", job)
        assert lg.returncode == 0 and "holding 1" in lg.stdout, lg.stdout + lg.stderr
        r.p.send_signal(signal.SIGINT)
        assert r.wait(120) == 130, r.text()
    finally:
        r.wait(1) if r.p.poll() is None else None
    assert "interrupted" in "".join(r.err), r.text()
    engine.assert_nothing_left()
    # The same variables, of the same kinds, on every backend (those run before this one in the session).
    norm = {role: normalise(dumps[role, 0], engine.name, job) for role in ("trainer", "pserver")}
    for other, theirs in NORMALISED.items():
        diff = {role: {k: (norm[role].get(k), theirs[role].get(k)) for k in set(norm[role]) | set(theirs[role])
                       if norm[role].get(k) != theirs[role].get(k)} for role in norm}
        assert norm == theirs, f"{engine.name} and {other} differ: {diff}"
    NORMALISED[engine.name] = norm


# -- kill from another terminal ------------------------------------------------------------------------------


@pytest.mark.parametrize("engine", cases("kill"), indirect=True)
def test_kill_from_another_process(engine: Engine):
    job = engine.job("kill")
    r = engine.start_holding(job)
    try:
        k = engine.cli("kill", "--job_name", job)
        assert k.returncode == 0, k.stdout + k.stderr
        rc = r.wait(120)
    finally:
        r.wait(1) if r.p.poll() is None else None
    engine.assert_nothing_left()
    err = "".join(r.err)
    assert rc == 3 and "stopped by paddle-cluster kill" in err and "Traceback" not in err, r.text()
    st = engine.cli("status", "--json", "--job_name", job)
    assert st.returncode == 0, st.stdout + st.stderr
    doc = json.loads(st.stdout)
    assert doc["outcome"] == "stopped by paddle-cluster kill" and doc["exit_code"] == 3, doc


# -- a failing trainer ---------------------------------------------------------------------------------------

# A trainer-only script (the built-in pserver serves): trainer 1 says a few things and fails; the others hold.
FAILING_PY = r"""
import os, sys, time
tid = os.environ["PADDLE_TRAINER_ID"]
assert os.environ["PADDLE_TRAINING_ROLE"] == "TRAINER"
if tid == "1":
    for i in range(3):
        print(f"trainer 1 line {i}", flush=True)
    time.sleep(1)
    sys.exit("trainer 1: out of data")
time.sleep(300)
"""


@pytest.mark.parametrize("engine", cases("fail_fast"), indirect=True)
def test_a_failing_trainer_fails_the_job_fast(engine: Engine):
    ws = workspace(engine.tmp, {"train.py": FAILING_PY})
    res = engine.run(engine.job("fail"), "--job_dispatch_package", str(ws), "--pserver", "builtin", timeout=180)
    out = res.stdout + res.stderr
    assert res.returncode == 1, out[-4000:]
    assert "Traceback" not in res.stderr.split("trainer 1: out of data")[-1], res.stderr
    assert "trainer.1" in res.stderr and "trainer 1: out of data" in res.stderr, res.stderr
    assert "trainer 1 line 2" in res.stderr, res.stderr  # its last lines, in the report
    engine.assert_nothing_left()


# -- --max_restarts with a pserver killed ----------------------------------------------------------------------

# Sync SGD lr=0.5 on a gradient of ones: w ends at exactly -0.5 * total whatever was rolled back and replayed.
# Trainer 0 checkpoints every ``every`` steps; every trainer waits at step ``every`` while ``hold`` exists.
RESTART_PY = r"""
import os, sys, time
import numpy as np
from paddle_cluster.ps import OptimizerSpec, connect
total, every, hold = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
ps = connect(mode="sync", optimizer=OptimizerSpec("sgd", lr=0.5))
w = ps.register_dense({"w": np.zeros(1000, np.float32)})["w"]
print(f"start step={ps.step}", flush=True)
while ps.step < total:
    while ps.step == every and os.path.exists(hold):
        time.sleep(0.05)
    ps.push({"w": np.ones(1000, np.float32)})
    if ps.trainer_id == 0 and ps.step % every == 0:
        print(f"checkpoint step={ps.save_checkpoint().step}", flush=True)
w = ps.pull()["w"]
print(f"end step={ps.step} w0={w[0]:g} all_equal={bool((w == w[0]).all())}", flush=True)
ps.close()
"""


@pytest.mark.parametrize("engine", cases("max_restarts"), indirect=True)
def test_max_restarts_recovers_from_a_killed_pserver(engine: Engine):
    ws = workspace(engine.tmp, {"train.py": RESTART_PY})
    hold = engine.tmp / "hold"  # outside /home/paddle: every host sees it (tests/sshcluster.py)
    hold.touch()
    job = engine.job("restart")
    r = engine.start(job, "--job_dispatch_package", str(ws), "--pserver", "builtin", "--max_restarts", "1",
                     "--", "40", "10", str(hold))
    try:
        r.wait_lines(r"\] checkpoint step=10$", 1)
        victims = wait_for(lambda: pserver_pids(job), 30, f"a pserver of {job}")
        os.kill(victims[-1], signal.SIGKILL)
        r.wait_lines(r"\] start step=10$", engine.trainers, timeout=120)  # restarted from the checkpoint
        hold.unlink()
        assert r.wait(180) == 0, r.text()
    finally:
        r.wait(1) if r.p.poll() is None else None
    assert "restarting the job from" in "".join(r.err), r.text()
    ends = [x for x in r.out if "] end step=" in x]
    assert len(ends) == engine.trainers and all("end step=40 w0=-20 all_equal=True" in x for x in ends), ends
    engine.assert_nothing_left()


@pytest.mark.parametrize("name", [e for (s, e) in NOT_OFFERED if s == "max_restarts"])
def test_max_restarts_not_offered_is_refused_saying_why(name, tmp_path):
    backend = ENGINES[name].backend
    res = subprocess.run([sys.executable, "-m", "paddle_cluster", "run", "--backend", backend,
                          *DRY_RUN_OPTIONS[backend], "--max_restarts", "1", "--job_dispatch_package",
                          str(workspace(tmp_path, {"train.py": ""}))],
                         cwd=tmp_path, env=user_env(tmp_path), capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "--max_restarts" in res.stderr and f"not available with BACKEND {backend}" in \
        res.stderr and "Traceback" not in res.stderr, res.stderr


# -- the matrix in docs/backends.md ---------------------------------------------------------------------------


def test_docs_matrix_is_the_suites():
    text = DOC.read_text()
    assert BEGIN in text and END in text, f"{DOC}: no conformance matrix; run python tests/test_conformance.py"
    assert text == docs_with_matrix(text), f"{DOC}'s matrix differs from the suite's: run python {__file__}"


if __name__ == "__main__":
    DOC.write_text(docs_with_matrix(DOC.read_text()))
    print(f"{DOC}: matrix written")
