"""Every process on a host runs the interpreter its preflight checked (issue 24, item 3): the hosts' Python with
numpy is only on the PATH their login shell's rc file sets (as pyenv, conda or environment modules do), while
``/usr/bin/python3`` has no numpy. ``check --backend mpi`` shows that interpreter as an absolute path, and ``run
--backend mpi`` with the README's conf.py (no PYTHON key) runs every pserver and trainer with it, although Open
MPI puts ``/usr/bin`` first on its ranks' PATH."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from helpers import OMIT, assert_nothing_left, cli, no_traceback, rc_python, write_conf, write_settings

# A trainer-only script: prints the interpreter it runs as, and trains with the built-in pserver (numpy on both).
TRAIN_PY = '''
import sys
import numpy as np
from paddle_cluster.ps import OptimizerSpec, connect

print("INTERPRETER", sys.executable, flush=True)
ps = connect(mode="sync", optimizer=OptimizerSpec("sgd", lr=0.5))
v = ps.register_dense({"w": np.zeros(3, dtype=np.float32)})
for _ in range(5):
    v = ps.push_pull({"w": v["w"] - 1})
print("TRAINED", ps.trainer_id, flush=True)
ps.close()
'''


def test_mpi_runs_the_interpreter_the_login_shell_finds(mpi_env, tmp_path):
    cluster = mpi_env.cluster
    has_numpy = subprocess.run(["/usr/bin/python3", "-c", "import numpy"], capture_output=True).returncode == 0
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "train.py").write_text(TRAIN_PY)
    # The README's conf.py: no PYTHON (and no PSERVER_COMMAND: train.py does not handle the PSERVER role).
    conf = write_conf(tmp_path, cluster, BACKEND="mpi", PYTHON=OMIT, PSERVER_COMMAND=OMIT, LD_LIBRARY_PATH="",
                      ENV={}, START_TIMEOUT=60.0)
    try:
        with rc_python(cluster, tmp_path) as python:
            chk = cli(conf, "check", "--backend", "mpi")
            assert chk.returncode == 0, chk.stdout + chk.stderr
            assert chk.stdout.count(python) == 3, chk.stdout  # every host's row names the absolute interpreter
            res = cli(conf, "run", "--job_dispatch_package", str(ws), "--job_name", "rcpy", timeout=300)
            no_traceback(res)
            assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
            for i in range(3):
                assert f"[trainer.{i}@node{i}] INTERPRETER {python}" in res.stdout, res.stdout[-3000:]
                assert f"[trainer.{i}@node{i}] TRAINED {i}" in res.stdout
                server_log = (cluster.root_dir(i) / "rcpy" / "log" / "server.log").read_text()
                assert "PSERVER_READY" in server_log, server_log[-2000:]
            # the ssh backend runs the same absolute path (the same plan: one rule for every backend)
            res = cli(conf, "run", "--backend", "ssh", "--job_dispatch_package", str(ws), "--job_name", "rcssh")
            assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
            assert f"[trainer.2@node2] INTERPRETER {python}" in res.stdout
            for job in ("rcpy", "rcssh"):
                for i in range(3):
                    recs = json.loads((cluster.root_dir(i) / job / ".paddle_cluster" / "procs.json").read_text())
                    assert all(r["cmd"].startswith(f"{python} ") for r in recs["procs"]), recs["procs"]
    finally:
        for i in range(cluster.n):
            cluster.kill_all(i)
    assert_nothing_left(cluster)
    if not has_numpy:
        print("\n/usr/bin/python3 has no numpy here: the run proves mpirun's ranks did not use it")


def test_check_backend_slurm_names_the_interpreter_srun_will_run(tmp_path):
    bindir = tmp_path / "modules" / "bin"  # what `module load python` would put first on PATH
    bindir.mkdir(parents=True)
    (bindir / "python3").symlink_to(os.path.realpath(sys.executable))
    conf = write_settings(tmp_path / "conf.py", {"BACKEND": "slurm", "ROOT_DIR": str(tmp_path / "shared"),
                                                 "PADDLE_NIC": "eth0"})  # a Slurm conf.py: no HOSTS
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}"}
    res = cli(conf, "check", "--json", env=env)
    # this machine's NIC and ports are not the nodes': its row passes (the engine's row, Slurm's commands and
    # controller, is test_backend_slurm's; there is no controller here)
    row, engine = json.loads(res.stdout)
    assert row["ok"] and "node0 (" not in res.stderr and engine["engine"] == "slurm", res.stdout + res.stderr
    assert row["interpreter"] == str(bindir / "python3") and row["numpy"] not in ("-", "MISSING"), row
