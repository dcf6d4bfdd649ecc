"""The node side fails safe, on the SSH test cluster (tests/sshcluster.py) and real processes: job names that
are not plain names are refused by the CLI and by the agent; processes that ``setsid`` away from their group
are still stopped, by the agent's teardown and by ``kill`` after the agent is gone.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading

import pytest
from helpers import (
    EVERY,
    ROOT,
    Launch,
    assert_nothing_left,
    checkout_env,
    cli,
    conf,
    make_workspace,
    proc_pid,
    start_cli,
    wait_for,
    workspace,
    write_conf,
)

from paddle_cluster.launch.backends.mpi.backend import RANKS as MPI_RANKS
from paddle_cluster.node import messages as m


def node_cmd(cluster, i: int, *args: str, stdin: str = "", **env: str) -> subprocess.CompletedProcess:
    """``python -m paddle_cluster.node ARGS`` inside node ``i`` (this checkout's library), ``env`` added."""
    return cluster.exec(i, [cluster.python, "-m", "paddle_cluster.node", *args], env=checkout_env(**env),
                        input=stdin, check=False, timeout=60)


def _modes(cluster, paths):
    return [cluster.exec(i, ["stat", "-c", "%a", *paths]).stdout.split() for i in range(len(cluster.hosts))]


@pytest.mark.timeout(120)
def test_job_names_are_plain_names(cluster, tmp_path):
    """``--job_name ..`` chmod-700'd ROOT_DIR's parent and a newline crashed the agent: both are refused, by the
    CLI with the rule, and again by the agent on the node."""
    conf = write_conf(tmp_path, cluster)
    ws = make_workspace(tmp_path / "ws")
    before = _modes(cluster, ["/home", ROOT])
    for bad in ("..", "a/b", "a\nb", "x" * 101, ".paddle_cluster"):
        res = cli(conf, "run", "--job_dispatch_package", str(ws), "--job_name", bad)
        assert res.returncode == 2, (bad, res.stderr)
        assert f"Invalid value for '--job_name': job name {bad!r}" in res.stderr, res.stderr
        assert "Traceback" not in res.stderr
    res = cli(conf, "status", "--job_name", "../paddle")
    assert res.returncode == 2 and "Invalid value for '--job_name'" in res.stderr
    res = cli(conf, "run", "--job_dispatch_package", str(ws), "--resume_from", "../x")
    assert res.returncode == 2 and "absolute checkpoint directory" in res.stderr
    # The agent checks again: a job directory whose last part is not a plain name is refused, untouched.
    for bad in (f"{ROOT}/..", f"{ROOT}/a\nb", f"{ROOT}/"):
        plan = m.NodePlan(node=0, address=cluster.ips[0], job_dir=bad, cwd=ROOT, environ={"PADDLE_JOB_ID": "j-1"},
                          procs=(), endpoints=(), start_timeout=5.0)
        (tmp_path / "plan").write_text(m.encode(m.Start(plan)) + "\n")
        # the agent as mpirun starts it (rank 0 of 1 in mpirun's variables): the plan from a file
        out = node_cmd(cluster, 0, "bootstrap", "--ranks", MPI_RANKS.text(), "--plan", str(tmp_path / "plan"),
                       OMPI_COMM_WORLD_RANK="0", OMPI_COMM_WORLD_SIZE="1", OMPI_COMM_WORLD_LOCAL_RANK="0")
        stopped = m.decode(out.stdout.strip().splitlines()[-1])
        assert out.returncode == 1 and isinstance(stopped, m.Stopped), out
        assert stopped.reason.startswith(f"refusing job directory {bad!r}: job name"), stopped
        for sub in ("kill", "status"):
            out = node_cmd(cluster, 0, sub, "--job-dir", bad)
            assert out.returncode == 2 and '"ok": false' in out.stdout and "job name" in out.stdout, out
        out = node_cmd(cluster, 0, "unpack", "--archive", "/nonexistent.tar", "--dest", bad)
        assert out.returncode == 2 and "refusing job directory" in out.stdout, out
    assert _modes(cluster, ["/home", ROOT]) == before
    assert not (cluster.root_dir(0) / "a\nb").exists()
    assert_nothing_left(cluster)


# A trainer whose child leaves its process group and session (``setsid``), as a daemonising helper would.
ESCAPING_TRAIN_PY = r'''
import os, subprocess, time
child = subprocess.Popen(["setsid", "sleep", "3600"])
print(f"ESCAPED {child.pid}", flush=True)
if os.environ.get("SLEEP_FOREVER"):
    time.sleep(3600)
'''


def _escaping_workspace(tmp_path):
    ws = make_workspace(tmp_path / "ws")
    (ws / "train.py").write_text(ESCAPING_TRAIN_PY)
    return ws


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.timeout(120)
def test_teardown_stops_a_child_that_left_its_group(cluster, tmp_path):
    """Each trainer starts ``setsid sleep`` and exits 0; the job's teardown used to leave the sleeps running
    (they were outside every recorded group). The agent is a child subreaper now: it adopts them and stops them."""
    conf = write_conf(tmp_path, cluster)
    res = cli(conf, "run", "--job_dispatch_package", str(_escaping_workspace(tmp_path)), "--job_name", "escape1")
    assert res.returncode == 0, res.stdout + res.stderr
    pids = [int(x) for x in re.findall(r"ESCAPED (\d+)", res.stdout)]
    assert len(pids) == 3, res.stdout
    assert not [p for p in pids if _alive(p)], "a setsid child outlived the job"
    assert_nothing_left(cluster)


def _records(cluster, i: int, job: str) -> dict:
    try:
        return json.loads((cluster.root_dir(i) / job / ".paddle_cluster" / "procs.json").read_text())
    except (OSError, ValueError):
        return {}


@pytest.mark.timeout(150)
def test_kill_after_the_agent_died_finds_a_child_that_left_its_group(cluster, tmp_path):
    """SIGKILL node1's agent: its trainer dies with it (PDEATHSIG) but the trainer's ``setsid`` child is
    adopted by init, outside every recorded group. ``paddle-cluster kill`` still finds it -- the agent recorded
    it (pid and start time) -- and spares a look-alike carrying the same job id."""
    job = "escape2"
    conf = write_conf(tmp_path, cluster, ENV={"SLEEP_FOREVER": "1"})
    run = start_cli(conf, "run", "--job_dispatch_package", str(_escaping_workspace(tmp_path)), "--job_name", job)
    decoy = None
    try:
        log = cluster.root_dir(1) / job / "log" / "train.log"
        line = wait_for(lambda: re.search(rb"ESCAPED (\d+)", log.read_bytes()) if log.exists() else None, 60,
                        "the trainer's setsid child")
        sleeper = int(line.group(1))
        wait_for(lambda: sleeper in [d["pid"] for d in _records(cluster, 1, job).get("descendants", [])], 30,
                 "the agent to record the setsid child")
        state = _records(cluster, 1, job)
        decoy = cluster.popen(1, ["sleep", "3600"], env=dict(os.environ, PADDLE_JOB_ID=state["job_id"]),
                              start_new_session=True)
        os.kill(state["agent"]["pid"], signal.SIGKILL)
        run.communicate(timeout=60)
        assert run.returncode == 4  # lost contact with node1: its agent can no longer report anything
        wait_for(lambda: not _alive(state["procs"][-1]["pid"]), 30, "the trainer to die with its agent")
        assert _alive(sleeper), "the setsid child is expected to outlive its agent (adopted by init)"
        k = cli(conf, "kill", "--job_name", job)
        assert k.returncode == 0, k.stderr
        wait_for(lambda: not _alive(sleeper), 10, "kill to stop the setsid child")
        assert decoy.poll() is None, "kill touched a process that only carries the job's id"
    finally:
        if decoy is not None:
            decoy.kill()
            decoy.wait()
        if run.poll() is None:
            run.kill()
            run.communicate()
    assert_nothing_left(cluster)


@pytest.mark.timeout(60)
def test_a_record_without_start_time_matches_nothing(cluster, tmp_path):
    """A record whose start time is null (or another process's) named any process with that pid: ``kill``
    would signal whoever holds the pid now. Such records match nothing."""
    job = "nullstart"
    victim = cluster.popen(0, ["sleep", "3600"], start_new_session=True)
    try:
        pid = victim.pid
        wait_for(lambda: _comm(pid) == "sleep", 10, "the sleep to start")
        started = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[19])
        state_dir = cluster.root_dir(0) / job / ".paddle_cluster"
        state_dir.mkdir(parents=True)
        rec = {"role": "TRAINER", "pid": pid, "pgid": pid, "log": "/dev/null", "cmd": "x", "exit_code": None,
               "signal": None}
        (state_dir / "procs.json").write_text(json.dumps({
            "job_id": "nullstart-1", "agent": {"pid": pid, "start_time": None},
            "procs": [{**rec, "name": "trainer.0", "start_time": None},
                      {**rec, "name": "trainer.1", "start_time": started + 1}],
            "descendants": [{"pid": pid, "start_time": None}, {"pid": pid, "start_time": started - 1}]}))
        out = node_cmd(cluster, 0, "kill", "--job-dir", f"{ROOT}/{job}", "--grace", "1")
        assert out.returncode == 0, out
        assert json.loads(out.stdout)["stopped"] == []
        assert victim.poll() is None and _alive(pid)
    finally:
        victim.kill()
        victim.wait()
    assert_nothing_left(cluster)


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


# 40 MB of carriage returns and no newline (a progress bar), then a marker line; then it waits.
FLOOD_TRAIN_PY = r'''
import os, sys, time
chunk = b"\r" * (1 << 20)
for _ in range(40):
    os.write(1, chunk)
os.write(1, b"\nFLOOD DONE\n")
time.sleep(3600)
'''


def _vm_hwm_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


@pytest.mark.timeout(150)
def test_output_without_newlines_is_streamed_in_bounded_pieces(cluster, tmp_path):
    """150 MB of ``\\r`` grew the agent to 166 MB (it read a whole line before passing it on). It now reads the
    pipe itself and passes over-long lines on in pieces of at most 32 KiB: its peak RSS stays small, and the
    output reaches the log file and the launcher whole."""
    job = "flood"
    ws = make_workspace(tmp_path / "ws")
    (ws / "train.py").write_text(FLOOD_TRAIN_PY)
    conf = write_conf(tmp_path, cluster, hosts=cluster.hosts[:1])
    run = subprocess.Popen([sys.executable, "-m", "paddle_cluster", "--conf", str(conf), "run",  # bytes: \r kept
                            "--job_dispatch_package", str(ws), "--job_name", job], stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    try:
        log = cluster.root_dir(0) / job / "log" / "train.log"
        wait_for(lambda: log.exists() and b"FLOOD DONE" in log.read_bytes()[-64:], 90, "the flood to be logged")
        agent = _records(cluster, 0, job)["agent"]["pid"]
        peak = _vm_hwm_kib(agent)
        assert log.read_bytes().count(b"\r") == 40 << 20
        k = cli(conf, "kill", "--job_name", job)
        assert k.returncode == 0, k.stderr
        out, _ = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
            run.communicate()
    assert peak < 60 * 1024, f"agent peak RSS {peak} KiB"
    tag = b"[trainer.0@node0] "
    pieces = [line[len(tag):] for line in out.split(b"\n") if line.startswith(tag + b"\r")]
    assert sum(len(p) for p in pieces) == 40 << 20 and max(len(p) for p in pieces) <= 32 << 10
    assert tag + b"FLOOD DONE" in out
    assert_nothing_left(cluster)


# PYTHON for every node-side process: root without the capabilities that let it read anything, so a file's mode
# bits bind it as they bind any user; at a path with a space (PYTHON used to be split into two words there).
NO_DAC_PYTHON = """#!/bin/sh
exec setpriv --bounding-set -dac_override,-dac_read_search --inh-caps -dac_override,-dac_read_search "%s" "$@"
"""


@pytest.mark.timeout(150)
def test_restart_refuses_a_checkpoint_it_cannot_read(cluster, tmp_path):
    """A checkpoint a node could not read was left out of the complete steps, so a restart began from an older
    step or from scratch (and overwrote progress). Node1's manifests are made unreadable and its pserver killed:
    the restart is refused with the node, the path and the cause; nothing is started from scratch."""
    job = "unreadable"
    py_dir = tmp_path / "py bin"
    py_dir.mkdir()
    python = py_dir / "python3"
    python.write_text(NO_DAC_PYTHON % cluster.python)
    python.chmod(0o755)
    run = Launch(conf(tmp_path, cluster, PYTHON=str(python)), "--job_dispatch_package", str(workspace(tmp_path)),
                 "--job_name", job, "--max_restarts", "1", "--", "100000", str(EVERY), "sync")
    try:
        run.wait_line(r"checkpoint step=20", 60)
        manifests = sorted((cluster.root_dir(1) / job / "checkpoints").glob("step-*/pserver-1/manifest.json"))
        assert manifests
        for f in manifests:
            f.chmod(0)
        os.kill(proc_pid(cluster, 1, job, "pserver.1"), signal.SIGKILL)
        assert run.finish(90) == 1, run.text()[-3000:]
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
            run.finish(10)
    err = run.stderr
    assert f"pserver.1 on node1 ({cluster.hosts[1]}) killed by SIGKILL" in err and "cannot restart:" in err, err
    assert re.search(rf"node1 \({re.escape(cluster.hosts[1])}\): .*checkpoint {ROOT}/{job}/checkpoints/step-\d+/"
                     r"pserver-1/manifest.json cannot be read: Permission denied", err), err
    assert "restarting the job" not in err
    run.assert_no_launcher_traceback()
    assert_nothing_left(cluster)


def _agent(cluster, tmp_path, job: str) -> subprocess.Popen:
    """A ``supervise`` agent on node0 (this checkout's library) running one sleeping trainer."""
    plan = m.NodePlan(node=0, address=cluster.ips[0], job_dir=f"{ROOT}/{job}", cwd=ROOT,
                      environ={"PADDLE_JOB_ID": f"{job}-1"}, procs=(m.ProcPlan("trainer.0", "TRAINER", 0, "sleep 600",
                                                                             "train.log"),),
                      endpoints=(), start_timeout=5.0)
    agent = cluster.popen(0, [cluster.python, "-m", "paddle_cluster.node", "supervise", "--orphan-timeout", "120",
                              "--grace", "1"], env=checkout_env(), stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE)
    agent.stdin.write((m.encode(m.Start(plan)) + "\n").encode())
    agent.stdin.flush()
    for line in agent.stdout:
        if isinstance(m.decode(line.decode()), m.Started):
            return agent
    raise AssertionError(f"the agent ended before starting its trainer (exit {agent.wait()})")


def _stopped(agent: subprocess.Popen) -> m.Stopped:
    for line in agent.stdout:
        ev = m.decode(line.decode())
        if isinstance(ev, m.Stopped):
            agent.wait(30)
            return ev
    raise AssertionError("the agent ended without a Stopped event")


@pytest.mark.timeout(100)
def test_agent_reads_every_command_it_has_received(cluster, tmp_path):
    """The agent read stdin through a buffered reader after ``select``: a Stop that arrived in the same read as
    a Ping sat in the buffer, unseen, until more input came (a stop sent at 6 s acted on at 8 s). Here nothing
    comes after it, and the launcher's silence allowance is 120 s: the Stop is still acted on, as a Stop."""
    agent = _agent(cluster, tmp_path, "stdin1")
    try:
        agent.stdin.write((m.encode(m.Ping()) + "\n" + m.encode(m.Stop(0.5)) + "\n").encode())
        agent.stdin.flush()
        ev = _stopped(agent)
        assert ev.reason == "stopped by the launcher" and ev.killed == ("trainer.0",), ev
    finally:
        agent.kill()
        agent.wait()
    assert_nothing_left(cluster)


@pytest.mark.timeout(100)
def test_agent_refuses_an_endless_line_from_the_launcher(cluster, tmp_path):
    """A line without end on the agent's stdin was buffered without bound; past 16 MiB the agent now stops the
    job, saying why."""
    agent = _agent(cluster, tmp_path, "stdin2")

    def flood() -> None:
        try:
            for _ in range(20):
                agent.stdin.write(b"x" * (1 << 20))
            agent.stdin.flush()
        except (BrokenPipeError, ValueError):
            pass  # the agent stopped reading: what this test waits for

    threading.Thread(target=flood, daemon=True).start()
    try:
        ev = _stopped(agent)
        assert ev.reason == "a message from the launcher longer than 16777216 bytes" and ev.killed == ("trainer.0",)
    finally:
        agent.kill()
        agent.wait()
    assert_nothing_left(cluster)


def test_kill_when_the_agent_ends_between_the_look_and_the_signal(tmp_path, monkeypatch):
    """``node kill`` finds the job's agent alive, and the agent ends (its job done) before the SIGTERM reaches it:
    a stopped agent, not an error (``kill`` of the conformance suite once failed with ProcessLookupError there on
    a loaded machine). The agent is a real process; the patch only places its end inside that window."""
    from paddle_cluster.node import jobdir, procs

    agent = subprocess.Popen(["sleep", "60"])
    started = int(procs.stat_fields(agent.pid)[19])
    (tmp_path / procs.STATE_DIR).mkdir()
    (tmp_path / procs.STATE_DIR / procs.PROCS_FILE).write_text(json.dumps(
        {"job_id": "j", "procs": [], "agent": {"pid": agent.pid, "start_time": started}}))
    request_kill = procs.request_kill

    def agent_ends_meanwhile(job_dir, grace=None):  # noqa: ANN001
        request_kill(job_dir, grace)
        agent.kill()
        agent.wait()  # reaped: its pid is no one's now

    monkeypatch.setattr(procs, "request_kill", agent_ends_meanwhile)
    doc = jobdir.kill(str(tmp_path), 1.0)
    assert doc["found"] and doc["procs"] == [] and doc["left"] == [], doc
