"""Ctrl+C while a node hangs before it answers: ``run`` stops every node's session (the hung one's included) and
ends within seconds naming the node, instead of waiting out the 300 s reply timeout; a second Ctrl+C while a stop
waits on a silent node ends the launcher at once, naming it and the ``kill`` that cleans it up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from enginecluster import mpi_unavailable_reason
from helpers import assert_nothing_left, checkout_env, make_workspace, wait_for, write_conf


def _launch(conf: Path, *args: str) -> subprocess.Popen:
    """``run`` in a process group of its own, which a test signals as a terminal signals its foreground group."""
    return subprocess.Popen([sys.executable, "-m", "paddle_cluster", "--conf", str(conf), "run", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=checkout_env(),
                            stdin=subprocess.DEVNULL, start_new_session=True)


def _hanging_python(tmp: Path, python: str, host: str) -> Path:
    """A PYTHON that on ``host`` (its hostname: each namespace host has its own) hangs before the interpreter
    runs, as a login script or a wrapper that waits would; elsewhere it is the interpreter."""
    wrapper = tmp / "python"
    wrapper.write_text(f'#!/bin/sh\nif [ "$(hostname)" = {host} ]; then touch {tmp}/hung; sleep 600; fi\n'
                       f'exec {python} "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


@pytest.mark.parametrize("backend", ["ssh", "mpi"])
def test_ctrl_c_while_a_node_hangs_at_start(cluster, tmp_path, backend):
    """(mpi prepares the hosts as ssh does, over a node session each, before mpirun starts a rank anywhere.)"""
    if backend == "mpi" and mpi_unavailable_reason():
        pytest.skip(mpi_unavailable_reason())
    ws = make_workspace(tmp_path / "ws")
    # PYTHON is pinned to a wrapper: the hang under test is the node's interpreter never starting (the only key
    # that runs something of the user's on a node before its session answers); PSERVER_COMMAND is write_conf's.
    conf = write_conf(tmp_path, cluster, BACKEND=backend,
                      PYTHON=str(_hanging_python(tmp_path, cluster.python, "node1")))
    proc = _launch(conf, "--job_dispatch_package", str(ws), "--job_name", f"hung-{backend}")
    try:
        wait_for(lambda: (tmp_path / "hung").exists() or proc.poll() is not None, 60, "node1's PYTHON to hang")
        assert proc.poll() is None, proc.communicate()
        os.killpg(proc.pid, signal.SIGINT)
        # The deadline on the wait is the check: run ends within seconds, not after the 300 s reply timeout.
        out, err = _ended(proc, 15, "Ctrl+C while node1 hangs")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 130, out + err
    assert "Traceback" not in err and "unexpected error" not in err, err
    # (node0 and node2 may be named too, with what was awaited of them, when Ctrl+C came before their answers)
    assert f"node1 ({cluster.hosts[1]}) had not answered (starting the node session)" in err, err
    assert_nothing_left(cluster, within=5)


def _ended(proc: subprocess.Popen, deadline: float, after: str):
    """``proc``'s output once it ends, failing the test if it has not ended ``deadline`` seconds after ``after``."""
    try:
        return proc.communicate(timeout=deadline)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher leads its process group (_launch)
        out, err = proc.communicate()
        pytest.fail(f"run still running {deadline} s after {after}\n{out}{err}")


def _agent(cluster, i: int) -> int:
    """The pid of node ``i``'s agent: its node session, which became the agent (ssh), or what its rank started
    beside it (mpi: ``bootstrap`` without ``--own-session``)."""
    for pid in cluster.pids(i):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if (b"from paddle_cluster.node.session import main" in argv[2]
                    or b"bootstrap" in argv and b"--own-session" not in argv):
                return pid
        except OSError:
            pass
    raise AssertionError(f"no agent on node{i}")


@pytest.mark.parametrize("backend", ["ssh", "mpi"])
def test_second_ctrl_c_while_a_node_does_not_confirm_its_stop(cluster, tmp_path, backend):
    """SIGTERM (as Ctrl+C) while node1's agent is frozen (SIGSTOP: a node that stalls): the stop waits for its
    confirmation; a second Ctrl+C ends run at once, naming the kill that cleans up, which does. ssh names node1
    (its stop waits 2 s more for the confirmations); mpi, whose stop waits on mpirun, ends at run's 5 s bound."""
    if backend == "mpi" and mpi_unavailable_reason():
        pytest.skip(mpi_unavailable_reason())
    ws = make_workspace(tmp_path / "ws")
    # write_conf's PYTHON (this interpreter) and PSERVER_COMMAND: make_workspace's ps.py only listens, its
    # train.py holds with SLEEP_FOREVER. KILL_GRACE 30: the first stop waits that long or longer on node1's frozen
    # agent (ssh: KILL_GRACE + 15 s for its confirmation; mpi: `node kill` there), well past the second's bounds.
    conf = write_conf(tmp_path, cluster, BACKEND=backend, KILL_GRACE=30.0,
                      ENV={"MY_SETTING": "42", "SLEEP_FOREVER": "1"})
    job = f"frozen-{backend}"  # its own job directory on the session's hosts
    proc = _launch(conf, "--job_dispatch_package", str(ws), "--job_name", job)
    agent = None
    try:
        wait_for(lambda: all(b"sleeping" in _read(cluster.root_dir(i) / job / "log/train.log") for i in range(3))
                 or proc.poll() is not None, 60, "the trainers to start")
        assert proc.poll() is None, proc.communicate()
        agent = _agent(cluster, 1)
        os.kill(agent, signal.SIGSTOP)
        os.killpg(proc.pid, signal.SIGTERM)
        wait_for(lambda: not (_job_processes(cluster, 0) or _job_processes(cluster, 2)) or proc.poll() is not None,
                 30, "the job's processes on node0 and node2 to stop")
        assert proc.poll() is None, proc.communicate()  # still waiting for node1's confirmation
        os.killpg(proc.pid, signal.SIGINT)
        out, err = _ended(proc, 10, "the second Ctrl+C")  # run's own bound is 5 s
    finally:
        if agent is not None:
            os.kill(agent, signal.SIGCONT)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 130, out + err
    assert "Traceback" not in err, err
    if backend == "ssh":
        assert f"no stop confirmation from node1 ({cluster.hosts[1]})" in err, err
    assert f"`paddle-cluster kill --job_name {job}` stops them" in err, err
    assert "every process was stopped" not in err, err
    res = subprocess.run([sys.executable, "-m", "paddle_cluster", "--conf", str(conf), "kill", "--job_name", job],
                         capture_output=True, text=True, timeout=60, env=checkout_env(), stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stdout + res.stderr
    assert_nothing_left(cluster, within=10)


def _job_processes(cluster, i: int) -> list:
    """The job's trainers and pservers (make_workspace's train.py and ps.py) running on node ``i``."""
    found = []
    for pid in cluster.pids(i):
        try:
            if set(Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")) & {b"train.py", b"ps.py"}:
                found.append(pid)
        except OSError:
            pass
    return found


def _read(p: Path) -> bytes:
    try:
        return p.read_bytes()
    except OSError:
        return b""
