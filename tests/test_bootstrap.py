"""``node bootstrap`` under the real engines: one agent per host started by ``mpirun`` or ``srun``, the node index
from the engine, the plan from a file (Slurm: completed with the addresses the nodes publish), the same events
and env contract as the ssh backend's agents, and an agent that ends with its processes."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import textwrap
from pathlib import Path

from helpers import small_workspace, wait_for

from paddle_cluster.launch.backends.mpi.backend import RANKS as MPI_RANKS
from paddle_cluster.launch.backends.slurm.backend import RANKS as SLURM_RANKS
from paddle_cluster.launch.config import parse_config
from paddle_cluster.launch.plan import JobSpec, Topology, build_plan
from paddle_cluster.node import messages as m

REPO = Path(__file__).resolve().parent.parent

# A pserver stand-in that listens until every trainer has said it is done (files in the shared workspace,
# $PADDLE_WORKSPACE: processes run in their node-local job directory),
# and a trainer that checks the contract against the node it runs on.
PS_PY = textwrap.dedent('''
    import os, socket, time
    from paddle_cluster.contract import JobEnv
    env = JobEnv.from_environ()
    socks = []
    for port in env.all_ports(env.pserver_id):
        s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((env.current_ip, port)); s.listen(); socks.append(s)
    print("listening", env.current_ip, flush=True)
    while sum(f.startswith("done.") for f in os.listdir(os.environ["PADDLE_WORKSPACE"])) < env.trainers:
        time.sleep(0.05)
''')
TRAIN_PY = textwrap.dedent('''
    import os, socket
    e = os.environ
    node = int(open(os.path.join(e["PADDLE_JOB_DIR"], "nodefile")).read())
    ips = e["PADDLE_PSERVER_IPS"].split(",")
    assert e["PADDLE_CURRENT_IP"] == ips[node] and e["PADDLE_INIT_PSERVERS"] == e["PADDLE_PSERVER_IPS"]
    assert "PADDLE_JOB_SECRET" not in e and len(e["PADDLE_TRAINER_KEY"]) == 64
    tid = e["PADDLE_TRAINER_ID"]
    print(f"trainer {tid} on {socket.gethostname()} node {node} ip {e['PADDLE_CURRENT_IP']}", flush=True)
    ws = e["PADDLE_WORKSPACE"]
    if os.path.exists(os.path.join(ws, f"crash.{tid}")):
        raise SystemExit(3)
    open(os.path.join(ws, f"done.{tid}"), "w").close()
''')


def _plan_file(tmp: Path, ws: Path, root: str, addresses, name: str, pending=()) -> Path:
    cfg = parse_config({"HOSTS": [f"h{i}" for i in range(len(addresses))], "ROOT_DIR": root, "PADDLE_NIC": "eth0",
                        "PSERVER_COMMAND": "{python} ps.py", "PYTHON": os.sys.executable, "PADDLE_PORT": 7164,
                        "START_TIMEOUT": 30.0}, "test")
    topology = dataclasses.replace(Topology.hosts(cfg, addresses), pending=tuple(pending))
    plan = build_plan(JobSpec(cfg, name, workspace=str(ws)), topology)
    path = tmp / "plan.jsonl"
    path.write_text("".join(m.encode(m.Start(n)) + "\n" for n in plan.nodes))
    return path


def _bootstrap(*args: str):
    return [os.sys.executable, "-m", "paddle_cluster.node", "bootstrap", *args]


def _events(text: str):
    return [m.decode(line) for line in text.splitlines() if line.startswith("{")]


def test_bootstrap_under_mpirun(mpi_env, tmp_path):
    cluster = mpi_env.cluster
    ws = small_workspace(tmp_path, TRAIN_PY, PS_PY)
    plan = _plan_file(tmp_path, ws, "/home/paddle", cluster.ips, "boot")
    env = {**mpi_env.env, "PYTHONPATH": str(REPO)}
    argv = mpi_env.argv(_bootstrap("--ranks", MPI_RANKS.text(), "--plan", str(plan)), None, "-x", "PYTHONPATH")
    res = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=90, stdin=subprocess.DEVNULL, cwd=ws)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    evs = _events(res.stdout)
    exited = {(e.node, e.proc): e.code for e in evs if isinstance(e, m.Exited)}
    assert exited == {(i, f"{kind}.{i}"): 0 for i in range(3) for kind in ("pserver", "trainer")}, res.stdout
    assert sorted(e.node for e in evs if isinstance(e, m.Stopped)) == [0, 1, 2]
    logs = {e.line for e in evs if isinstance(e, m.Log) and e.proc.startswith("trainer")}
    assert logs == {f"trainer {i} on node{i} node {i} ip {cluster.ips[i]}" for i in range(3)}
    for i in range(3):  # each host's private job directory got its own log
        assert (cluster.root_dir(i) / "boot" / "log" / "train.log").read_text().startswith(f"trainer {i}")
    wait_for(lambda: not any(cluster.pids(i) for i in range(3)), 10, "hosts empty")


def test_bootstrap_fails_fast_under_mpirun(mpi_env, tmp_path):
    """A trainer exits 3: its agent stops its node and exits 1, and mpirun ends the other ranks."""
    cluster = mpi_env.cluster
    ws = small_workspace(tmp_path, TRAIN_PY, PS_PY)
    (ws / "crash.1").touch()
    plan = _plan_file(tmp_path, ws, "/home/paddle", cluster.ips, "bootfail")
    env = {**mpi_env.env, "PYTHONPATH": str(REPO)}
    argv = mpi_env.argv(_bootstrap("--ranks", MPI_RANKS.text(), "--plan", str(plan)), None, "-x", "PYTHONPATH")
    res = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=90, stdin=subprocess.DEVNULL, cwd=ws)
    assert res.returncode != 0
    evs = _events(res.stdout)
    assert any(isinstance(e, m.Exited) and e.proc == "trainer.1" and e.code == 3 for e in evs), res.stdout
    assert any(isinstance(e, m.Stopped) and e.node == 1 and "trainer.1 failed" in e.reason for e in evs)
    wait_for(lambda: not any(cluster.pids(i) for i in range(3)), 15, "hosts empty")


def test_bootstrap_under_srun_completes_the_plan_with_published_addresses(slurm_cluster, tmp_path):
    slurm = slurm_cluster
    shared = Path(slurm.shared_dir) / "boot"
    shared.mkdir()
    ws = small_workspace(shared, TRAIN_PY, PS_PY)
    placeholders = [m.address_placeholder(i) for i in range(3)]
    plan = _plan_file(shared, ws, "/home/paddle", placeholders, "srunboot", placeholders)
    events = shared / "events.{node}.jsonl"
    res = slurm.run(["srun", "-N3", "--ntasks-per-node=1", "--export=ALL,PYTHONPATH=" + str(REPO),
                     *_bootstrap("--ranks", SLURM_RANKS.text(), "--plan", str(plan), "--events", str(events),
                                 "--rendezvous", str(shared / "rv"), "--nic", "eth0")],
                    cwd=ws, timeout=90, check=False)
    assert res.returncode == 0, res.stdout + res.stderr
    for i in range(3):
        evs = _events((shared / f"events.{i}.jsonl").read_text())
        assert {e.proc: e.code for e in evs if isinstance(e, m.Exited)} == {f"pserver.{i}": 0, f"trainer.{i}": 0}
        lines = [e.line for e in evs if isinstance(e, m.Log) and e.proc == f"trainer.{i}"]
        assert lines == [f"trainer {i} on node{i} node {i} ip {slurm.cluster.ips[i]}"]
    slurm.wait_quiet()
