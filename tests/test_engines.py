"""The real engines the launch backends build on: Open MPI and Slurm on the namespace hosts.

These tests pin down the engines' behaviour the backends rely on (placement, the variables each engine gives a
process, how processes end on Ctrl+C, scancel and launcher death), not our code: if one fails after an
upgrade, a backend's assumption broke.  Measured figures are printed (``pytest -s``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from enginecluster import SlurmCluster, slurm_unavailable_reason
from helpers import wait_for

# A rank/task that starts a child (in its own session with "setsid") and waits to be killed.
HOLD = """
import os, socket, subprocess, sys, time
child = subprocess.Popen(["/bin/sleep", "300"], start_new_session=sys.argv[1] == "setsid")
line = f"READY {socket.gethostname()} {os.getpid()} {child.pid}"
if len(sys.argv) > 2:
    with open(os.path.join(sys.argv[2], socket.gethostname()), "w") as f:
        f.write(line)
print(line, flush=True)
time.sleep(300)
"""


def _alive(pid: int) -> bool:
    """Running (a zombie answers kill -0 too, so read its state)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# -- Open MPI -----------------------------------------------------------------------------------------------


class _Output:
    """A process's stdout lines, read by a thread so the test can wait for some without blocking."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[str] = []
        threading.Thread(target=self._read, args=(proc.stdout,), daemon=True).start()

    def _read(self, stream) -> None:
        for line in stream:
            self.lines.append(line.rstrip("\n"))

    def fields(self, tag: str) -> list[list[str]]:
        return [line.split()[1:] for line in list(self.lines) if line.startswith(tag + " ")]


def _ssh_clients(key_path: str) -> list[int]:
    """Local processes using the cluster's key: mpirun's ssh clients."""
    out = []
    for d in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if d.name.isdigit() and key_path in (d / "cmdline").read_text() and _alive(int(d.name)):
                out.append(int(d.name))
    return out


def _host_pids(cluster) -> dict[int, list[int]]:
    return {i: cluster.pids(i) for i in range(cluster.n)}


@pytest.fixture
def mpi(mpi_env):
    """mpi_env, and whatever a test leaves on the hosts is killed afterwards (asserted by the tests themselves)."""
    yield mpi_env
    for i in range(mpi_env.cluster.n):
        mpi_env.cluster.kill_all(i)
    for pid in _ssh_clients(mpi_env.cluster.key_path):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _start_holding(mpi, tmp_path: Path, mode: str):
    script = tmp_path / "hold.py"
    script.write_text(HOLD)
    proc = subprocess.Popen(mpi.argv([mpi.cluster.python, str(script), mode]), env=mpi.env, text=True,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out = _Output(proc)
    try:
        ready = wait_for(lambda: len(out.fields("READY")) == 3 and out.fields("READY"), 30, "3 ranks READY")
    except AssertionError:
        proc.kill()
        proc.wait()
        raise AssertionError("mpirun output:\n" + "\n".join(out.lines)) from None
    return proc, out, {host: (int(rank), int(child)) for host, rank, child in ready}


def test_mpirun_starts_one_rank_per_host(mpi, tmp_path):
    script = tmp_path / "rankinfo.py"
    script.write_text("import os, socket\ne = os.environ\n"
                      "print('RANK', socket.gethostname(), e['OMPI_COMM_WORLD_RANK'], e['OMPI_COMM_WORLD_SIZE'],"
                      " e['OMPI_COMM_WORLD_LOCAL_RANK'], os.getcwd(), flush=True)\n")
    t0 = time.monotonic()
    res = subprocess.run(mpi.argv([mpi.cluster.python, str(script)]), env=mpi.env, capture_output=True,
                         text=True, timeout=60, stdin=subprocess.DEVNULL, cwd=tmp_path)
    elapsed = time.monotonic() - t0
    assert res.returncode == 0, res.stdout + res.stderr
    ranks = sorted((line.split()[1:] for line in res.stdout.splitlines() if line.startswith("RANK ")),
                   key=lambda f: int(f[1]))
    # Rank i on node i (hostfile order, one slot each), every rank alone on its host.
    assert [(host, rank, size, local) for host, rank, size, local, _ in ranks] == [
        (f"node{i}", str(i), "3", "0") for i in range(3)], res.stdout
    # mpirun puts each rank in mpirun's own working directory when the host has it (here: shared filesystem).
    assert {r[4] for r in ranks} == {str(tmp_path)}
    print(f"\nmpirun -np 3 over 3 hosts: {elapsed:.2f} s")
    wait_for(lambda: not any(_host_pids(mpi.cluster).values()), 10, "hosts empty after mpirun")


def test_sigint_to_mpirun_ends_every_rank_and_child(mpi, tmp_path):
    proc, out, ready = _start_holding(mpi, tmp_path, "child")
    assert sorted(ready) == ["node0", "node1", "node2"]
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)  # what Ctrl+C in the launcher's terminal delivers to mpirun
    rc = proc.wait(timeout=20)
    exited = time.monotonic() - t0
    wait_for(lambda: not any(_host_pids(mpi.cluster).values()), 15, "every rank, child and orted gone")
    wait_for(lambda: not _ssh_clients(mpi.cluster.key_path), 10, "mpirun's ssh clients gone")
    print(f"\nSIGINT -> mpirun exit {rc} in {exited:.2f} s, all hosts empty in {time.monotonic() - t0:.2f} s")
    assert rc != 0
    assert not any(_alive(pid) for pair in ready.values() for pid in pair)


def test_setsid_grandchild_survives_mpirun_sigint(mpi, tmp_path):
    """Open MPI kills its ranks' process groups only: a child in its own session outlives mpirun and orted.

    This is why the mpi backend needs its own sweep of a job's processes on every host.
    """
    proc, out, ready = _start_holding(mpi, tmp_path, "setsid")
    escaped = {i: ready[f"node{i}"][1] for i in range(3)}
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=20)
    # Everything else ends (the orteds kill their ranks before they exit, so nothing later will kill the
    # grandchildren): what remains on each host is exactly its setsid grandchild.
    wait_for(lambda: _host_pids(mpi.cluster) == {i: [pid] for i, pid in escaped.items()}, 15,
             f"only the setsid grandchildren {escaped} left")
    assert all(_alive(pid) for pid in escaped.values())


def test_sigkill_to_mpirun_ends_every_rank(mpi, tmp_path):
    """Launcher death: the orteds notice the lost link and kill their ranks (and the ranks' children)."""
    proc, out, ready = _start_holding(mpi, tmp_path, "child")
    t0 = time.monotonic()
    proc.kill()
    proc.wait(timeout=10)
    wait_for(lambda: not any(_host_pids(mpi.cluster).values()), 15, "every rank, child and orted gone")
    print(f"\nSIGKILL to mpirun: all hosts empty in {time.monotonic() - t0:.2f} s")


# -- Slurm --------------------------------------------------------------------------------------------------


@pytest.fixture
def slurm(slurm_cluster):
    """The session's Slurm cluster; each test must leave it quiet (no job, every node idle, no process)."""
    yield slurm_cluster
    slurm_cluster.run(["scancel", "--user=root"], check=False)
    slurm_cluster.wait_quiet()


def _sbatch(slurm, *args: str, cwd: Path) -> str:
    res = slurm.run(["sbatch", "--parsable", *args], cwd=cwd)
    return res.stdout.strip().split(";")[0]


def test_srun_runs_one_task_per_node_with_slurm_variables(slurm, tmp_path):
    code = ("import os, socket; e = os.environ; print('TASK', socket.gethostname(), e['SLURM_PROCID'], "
            "e['SLURM_NODEID'], e['SLURM_NTASKS'], e['SLURM_JOB_NODELIST'], flush=True)")
    t0 = time.monotonic()
    res = slurm.run(["srun", "-N3", "--ntasks-per-node=1", slurm.cluster.python, "-c", code], cwd=tmp_path)
    print(f"\nSlurm cluster up in {slurm.startup_seconds:.2f} s; srun -N3 python: {time.monotonic() - t0:.2f} s")
    tasks = sorted((line.split()[1:] for line in res.stdout.splitlines() if line.startswith("TASK ")),
                   key=lambda f: int(f[1]))
    assert [tuple(t) for t in tasks] == [(f"node{i}", str(i), str(i), "3", "node[0-2]") for i in range(3)]
    hostnames = slurm.run(["scontrol", "show", "hostnames", tasks[0][4]]).stdout.split()
    assert hostnames == ["node0", "node1", "node2"]


def test_sbatch_job_goes_running_then_completed(slurm, tmp_path):
    go, out = tmp_path / "go", tmp_path / "job.out"
    script = tmp_path / "job.sh"
    script.write_text(f"#!/bin/sh\nwhile [ ! -e {go} ]; do sleep 0.02; done\n"
                      "srun -N3 --ntasks-per-node=1 hostname\n")
    t0 = time.monotonic()
    job_id = _sbatch(slurm, "-N3", "-o", str(out), str(script), cwd=tmp_path)
    job = slurm.wait_job(job_id, ["RUNNING"])
    running = time.monotonic() - t0
    assert (job["NodeList"], job["BatchHost"], job["NumNodes"]) == ("node[0-2]", "node0", "3")
    go.touch()
    job = slurm.wait_job(job_id, ["COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"])
    print(f"\nsbatch -> RUNNING {running:.2f} s, -> COMPLETED {time.monotonic() - t0:.2f} s")
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), job
    assert sorted(out.read_text().split()) == ["node0", "node1", "node2"]


def test_scancel_ends_batch_job_on_every_host_setsid_included(slurm, tmp_path):
    hold, ready = tmp_path / "hold.py", tmp_path / "ready"
    hold.write_text(HOLD)
    ready.mkdir()
    script = tmp_path / "job.sh"
    script.write_text(f"#!/bin/sh\nsrun -N3 --ntasks-per-node=1 {slurm.cluster.python} {hold} setsid {ready}\n")
    job_id = _sbatch(slurm, "-N3", "-o", str(tmp_path / "job.out"), str(script), cwd=tmp_path)
    wait_for(lambda: len(list(ready.iterdir())) == 3, 20, "3 tasks READY")
    tasks = {f.name: [int(p) for p in f.read_text().split()[2:]] for f in ready.iterdir()}
    assert sorted(tasks) == ["node0", "node1", "node2"]
    assert all(slurm.job_pids(i) for i in range(3))
    t0 = time.monotonic()
    slurm.run(["scancel", job_id])
    wait_for(lambda: not any(slurm.job_pids(i) for i in range(3)), 15, "no job process on any host")
    gone = time.monotonic() - t0
    job = slurm.wait_job(job_id, ["CANCELLED"])
    print(f"\nscancel -> every process on every host gone in {gone:.2f} s")
    assert not any(_alive(pid) for pids in tasks.values() for pid in pids)
    assert job["JobState"] == "CANCELLED"


def test_pending_reasons_are_readable_and_pending_jobs_cancel(slurm, tmp_path):
    go = tmp_path / "go"
    blocker = _sbatch(slurm, "-N3", "--exclusive", "-o", "/dev/null", "--wrap",
                      f"while [ ! -e {go} ]; do sleep 0.02; done", cwd=tmp_path)
    slurm.wait_job(blocker, ["RUNNING"])
    # Accepted, then pending for good: more nodes than the partition has.
    too_big = _sbatch(slurm, "-N4", "-o", "/dev/null", "--wrap", "true", cwd=tmp_path)
    waiting = _sbatch(slurm, "-N1", "-o", "/dev/null", "--wrap", "true", cwd=tmp_path)
    held = _sbatch(slurm, "-N1", "--hold", "-o", "/dev/null", "--wrap", "true", cwd=tmp_path)
    expected = {too_big: "PartitionNodeLimit", waiting: "Resources", held: "JobHeldUser"}
    wait_for(lambda: {j: slurm.show_job(j)["Reason"] for j in expected} == expected, 10, f"reasons {expected}")
    assert {slurm.show_job(j)["JobState"] for j in expected} == {"PENDING"}
    slurm.run(["scancel", *expected])
    for job_id in expected:
        assert slurm.wait_job(job_id, ["CANCELLED"])["JobState"] == "CANCELLED"
    go.touch()
    assert slurm.wait_job(blocker, ["COMPLETED", "FAILED"])["JobState"] == "COMPLETED"


def test_two_clusters_at_once_and_close_leaves_nothing(make_ssh_cluster, tmp_path):
    """Clusters do not see each other; close() cancels running and pending jobs and leaves no process."""
    if slurm_unavailable_reason():
        pytest.skip(slurm_unavailable_reason())
    hosts_a, hosts_b = make_ssh_cluster(2), make_ssh_cluster(1)
    with SlurmCluster(hosts_b) as b:
        a = SlurmCluster(hosts_a)
        try:
            hold, ready = tmp_path / "hold.py", tmp_path / "ready"
            hold.write_text(HOLD)
            ready.mkdir()
            running = _sbatch(a, "-N2", "-o", str(tmp_path / "a.out"), "--wrap",
                              f"srun -N2 {hosts_a.python} {hold} setsid {ready}", cwd=tmp_path)
            pending = _sbatch(a, "-N1", "--hold", "-o", "/dev/null", "--wrap", "true", cwd=tmp_path)
            wait_for(lambda: len(list(ready.iterdir())) == 2, 20, "2 tasks READY")
            assert (sorted(a.active_jobs()), b.active_jobs()) == (sorted([running, pending]), [])
            daemons = a.daemon_pids()
        finally:
            a.close()
        assert not any(_alive(pid) for pid in daemons)
        assert _host_pids(hosts_a) == {0: [], 1: []}
        assert b.run(["srun", "-N1", "hostname"], cwd=tmp_path).stdout.split() == ["node0"]
    assert _host_pids(hosts_b) == {0: []}
