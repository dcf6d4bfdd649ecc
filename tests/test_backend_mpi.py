"""``run --backend mpi``: the real CLI, real ``mpirun`` (Open MPI) or ``mpiexec.hydra`` (MPICH) over the namespace
hosts' sshd, one rank per host running the node bootstrap: ``status`` (each process's last line), ``logs`` and
``kill`` of a held job, and the chosen MPI starting it; a killed launcher leaves no process on any host; how ranks
place themselves and how the MPI is chosen; ``--resume_from`` checked before ``mpirun``.

The user's paths on both MPIs -- fit_a_line to its target with the README's conf.py, the env contract, Ctrl+C,
``kill``, a failing trainer, a killed launcher, ``--max_restarts`` -- are the conformance suite's
(tests/test_conformance.py; tests/engines/mpi.py: engines mpi-openmpi and mpi-mpich)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner
from enginecluster import mpich_unavailable_reason
from helpers import (
    OMIT,
    ROOT,
    assert_nothing_left,
    checkout_env,
    cli,
    no_traceback,
    small_workspace,
    start_cli,
    wait_for,
    write_conf,
)

from paddle_cluster.cli import main
from paddle_cluster.launch.backends.mpi.backend import MPILiveJob


@pytest.fixture(params=["openmpi", "mpich"])
def hosts(request, mpi_env):
    """The session's hosts, once with Open MPI's mpirun and once with MPICH's Hydra mpiexec (MPI_IMPL)."""
    reason = mpich_unavailable_reason() if request.param == "mpich" else None
    if reason:
        pytest.skip(reason)
    cluster = mpi_env.cluster
    cluster.mpi_impl = request.param
    yield cluster
    for i in range(cluster.n):
        cluster.kill_all(i)


def _conf(tmp: Path, cluster, **over) -> Path:
    return write_conf(tmp, cluster, BACKEND="mpi", MPI_IMPL=cluster.mpi_impl, LD_LIBRARY_PATH="", ENV={}, **over)


def _start_holding(conf: Path, ws: Path, job: str, *more: str):
    """``run`` of the holding workspace, once its 3 trainers hold; (the process, its output lines so far)."""
    p = start_cli(conf, "run", "--job_workspace", str(ws), "--job_name", job, *more)
    lines = []

    def holding() -> bool:
        lines.append(p.stdout.readline())
        return sum("holding" in x for x in lines) == 3

    try:
        wait_for(holding, 120, "3 trainers holding")
    except AssertionError:
        p.kill()
        raise AssertionError("".join(lines) + p.communicate()[1]) from None
    return p, lines


def test_status_logs_and_kill_of_an_mpi_job(hosts, tmp_path):
    ws = small_workspace(tmp_path)
    # PSERVER_COMMAND: small_workspace's ps.py only listens, so the job holds until kill (the user's path with
    # the built-in pserver is the conformance suite's kill[mpi-*]).
    conf = _conf(tmp_path, hosts, PSERVER_COMMAND="{python} ps.py")
    p, _ = _start_holding(conf, ws, "mpikill")
    st = cli(conf, "status", "--json", "--job_name", "mpikill")
    assert st.returncode == 0, st.stderr
    doc = json.loads(st.stdout)
    assert doc["job"] == "mpikill" and doc["outcome"] is None  # still running
    rows = {(r["node"], r["name"]): r for r in doc["processes"]}
    assert sorted(rows) == [(f"node{i}", f"{role}.{i}") for i in range(3) for role in ("pserver", "trainer")]
    assert {r["state"] for r in rows.values()} == {"running"}
    assert rows[("node1", "trainer.1")]["last_line"] == "holding 1"
    lg = cli(conf, "logs", "node2", "--role", "trainer", "--job_name", "mpikill")
    assert lg.returncode == 0 and "holding 2" in lg.stdout, lg.stderr
    res = cli(conf, "kill", "--job_name", "mpikill")
    assert res.returncode == 0, res.stderr
    _, err = p.communicate(timeout=60)
    err = err.decode() if isinstance(err, bytes) else err
    assert p.returncode == 3 and "stopped by paddle-cluster kill" in err and "error" not in err, err
    impl, launcher = ("MPICH", "mpiexec.hydra") if hosts.mpi_impl == "mpich" else ("Open MPI", "mpirun")
    assert re.search(rf"starting one rank per host with {impl} \(/\S*/{launcher}", err), err  # the MPI_IMPL chosen
    assert_nothing_left(hosts)
    st = cli(conf, "status", "--json", "--job_name", "mpikill")
    doc = json.loads(st.stdout)
    assert doc["outcome"] == "stopped by paddle-cluster kill" and doc["exit_code"] == 3, doc
    assert [r["state"] for r in doc["processes"]] == ["stopped (kill)"] * 6, doc


FAIL_ONE_PY = r"""
import os, sys, time
rank = int(os.environ["PADDLE_TRAINER_ID"])
if rank == 1:
    sys.exit("rank 1: out of data")
print(f"holding {rank}", flush=True)
time.sleep(600)
"""


def test_a_failed_job_ends_with_mpirun_not_signalled(hosts, tmp_path, monkeypatch):
    """A trainer fails while the others hold: the launcher's sweep stops them, and mpirun ends with its ranks, so
    ``stop`` never has to signal it (Open MPI's abort on the non-zero rank held mpirun KILL_GRACE + 3 s past its
    ranks, and the run ended only after the launcher's SIGTERM). The CLI runs in this process to see that: a
    second interrupt or an mpirun that outlives its ranks are the only callers of ``request_stop``."""
    signalled = []
    request_stop = MPILiveJob.request_stop

    def watched(job: MPILiveJob, grace: float) -> None:
        signalled.append(grace)
        request_stop(job, grace)

    monkeypatch.setattr(MPILiveJob, "request_stop", watched)
    ws = small_workspace(tmp_path, FAIL_ONE_PY)
    conf = _conf(tmp_path, hosts, PSERVER_COMMAND=OMIT)  # --collective: no pservers, so no stand-in for them
    res = CliRunner().invoke(main, ["--conf", str(conf), "run", "--collective", "--job_workspace", str(ws),
                                    "--job_name", "mpifail"])
    assert res.exit_code == 1 and "trainer.1" in res.output and "rank 1: out of data" in res.output, res.output
    assert signalled == [], res.output
    assert_nothing_left(hosts)


STUBBORN_PY = r"""
import os, signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print(f"holding {os.environ['PADDLE_TRAINER_ID']}", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("hosts", ["openmpi"], indirect=True)  # Hydra's own: tests/test_node_agent.py
def test_a_killed_launcher_s_agents_wait_out_the_grace_period(hosts, tmp_path):
    """The launcher SIGKILLed: mpirun gets SIGTERM (its parent-death signal) and each orted SIGKILLs its rank
    2 s later (odls_base_sigkill_timeout 1), while the agent, beside its rank (``--own-session``), stops
    trainers that ignore SIGTERM with SIGKILL after KILL_GRACE. An agent that was the rank died before that
    and left them running."""
    ws = small_workspace(tmp_path, STUBBORN_PY)
    # KILL_GRACE 3: past orted's SIGKILL with a second to spare. --collective: no pservers, so no stand-in for
    # them (OMIT leaves PSERVER_COMMAND out, as the README's conf.py does).
    conf = _conf(tmp_path, hosts, PSERVER_COMMAND=OMIT, KILL_GRACE=3)
    p, _ = _start_holding(conf, ws, "mpidead", "--collective")
    p.kill()
    p.communicate(timeout=30)
    assert_nothing_left(hosts, within=45)
    st = cli(conf, "status", "--json", "--job_name", "mpidead")
    doc = json.loads(st.stdout)
    assert sorted(r["name"] for r in doc["processes"]) == [f"trainer.{i}" for i in range(3)], doc
    assert "running" not in {r["state"] for r in doc["processes"]}, doc


def test_ranks_place_themselves_by_open_mpi_or_pmi_variables():
    from paddle_cluster.launch.backends.mpi.backend import RANKS
    from paddle_cluster.node.bootstrap import BootstrapError, rank_of

    mpich = {"PMI_RANK": "2", "PMI_SIZE": "3", "MPI_LOCALRANKID": "0", "HOSTNAME": "node2"}
    ompi = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}
    where = rank_of(RANKS, mpich)
    assert (where.node, where.nodes, where.host) == (2, 3, "node2")
    assert (rank_of(RANKS, ompi).node, rank_of(RANKS, ompi).nodes) == (1, 3)
    with pytest.raises(BootstrapError, match="MPI_LOCALRANKID=1: node 2 is not the only process mpirun started"):
        rank_of(RANKS, {**mpich, "MPI_LOCALRANKID": "1"})
    with pytest.raises(BootstrapError, match="PMI_RANK='': expected a number set by mpirun"):
        rank_of(RANKS, {})


def test_mpi_impl_is_chosen_or_detected(tmp_path, monkeypatch):
    from paddle_cluster.launch.backends.mpi.backend import mpi_launcher
    from paddle_cluster.launch.errors import ClusterError

    if not (shutil.which("mpiexec.hydra") and shutil.which("mpirun.openmpi")):
        pytest.skip("needs Open MPI and MPICH side by side: apt-get install openmpi-bin mpich (scripts/test does)")

    assert mpi_launcher("mpich")[0] == "mpich" and mpi_launcher("mpich")[1].endswith("mpiexec.hydra")
    assert mpi_launcher("openmpi")[0] == "openmpi"
    # auto: what `mpirun --version` says (Debian's alternatives make mpirun Open MPI's with both installed)
    assert mpi_launcher("auto")[0] == "openmpi"
    bin_dir = tmp_path / "bin"  # a PATH where mpirun is Hydra's, as with MPICH or Intel MPI alone
    bin_dir.mkdir()
    (bin_dir / "mpirun").symlink_to(mpi_launcher("mpich")[1])
    (bin_dir / "mpiexec.hydra").symlink_to(mpi_launcher("mpich")[1])
    monkeypatch.setenv("PATH", str(bin_dir))
    assert mpi_launcher("auto") == ("mpich", str(bin_dir / "mpiexec.hydra"))
    with pytest.raises(ClusterError, match="apt-get install openmpi-bin.*MPI_IMPL = 'mpich'"):
        mpi_launcher("openmpi")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(ClusterError, match="apt-get install mpich"):
        mpi_launcher("mpich")


def test_resume_from_without_a_checkpoint_is_refused_before_mpirun(hosts, tmp_path):
    """The launcher looks at each host's checkpoints over its own session before ``mpirun``: none is exit 2
    naming where it looked on each host, nothing started (before, the pservers started fresh)."""
    conf = _conf(tmp_path, hosts)
    res = cli(conf, "run", "--job_dispatch_package", str(small_workspace(tmp_path)), "--resume_from", "nosuchjob")
    assert res.returncode == 2, res.stdout + res.stderr
    assert "--resume_from nosuchjob: no checkpoint complete for every pserver" in res.stderr
    for i in range(3):
        assert f"  node{i} ({hosts.hosts[i]}): {ROOT}/nosuchjob/checkpoints does not exist" in res.stderr, res.stderr
    no_traceback(res)
    assert_nothing_left(hosts)


def test_check_names_the_launcher_run_would_use_or_says_how_to_install_it(hosts, tmp_path):
    conf = _conf(tmp_path, hosts)
    launcher = shutil.which("mpirun.openmpi" if hosts.mpi_impl == "openmpi" else "mpiexec.hydra")
    said = subprocess.run([launcher, "--version"], capture_output=True, text=True, timeout=60).stdout
    version = re.search(r"(?:\(Open MPI\)|\(OpenRTE\)|Version:)\s+(\S+)", said).group(1)
    ok = cli(conf, "check", "--backend", "mpi")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.count("writable") == 3, ok.stdout  # the hosts' rows, as before
    row = [ln for ln in ok.stdout.splitlines() if ln.startswith("mpi ")]
    assert len(row) == 1 and f"MPI_IMPL = '{hosts.mpi_impl}': {launcher}" in row[0], ok.stdout
    assert version in row[0] and ("Open MPI" if hosts.mpi_impl == "openmpi" else "MPICH") in row[0], row

    # A machine without the MPI (a PATH without it; the hosts are reached over SSH, as before): the hosts still
    # pass, the engine's row fails with the hint `run` gives, and check exits 1 without a traceback.
    empty = tmp_path / "bin"
    empty.mkdir()
    res = cli(conf, "check", "--backend", "mpi", env=checkout_env(PATH=str(empty)))
    no_traceback(res)
    assert res.returncode == 1, res.stdout + res.stderr
    assert res.stdout.count("writable") == 3 and "MISSING" in res.stdout, res.stdout
    assert "1 of 1 engine(s) failed the check:" in res.stderr, res.stderr
    hint = ("apt-get install mpich" if hosts.mpi_impl == "mpich" else "apt-get install openmpi-bin")
    assert "mpi: --backend mpi" in res.stderr and hint in res.stderr, res.stderr
    run = cli(conf, "run", "--job_dispatch_package", str(small_workspace(tmp_path)), "--job_name", "nompi",
              env=checkout_env(PATH=str(empty)))
    assert run.returncode != 0 and hint in run.stderr, run.stderr  # the same hint as run's
