"""The node agent on its own: ``python -m paddle_cluster.node supervise`` gets one ``Start`` carrying its
``NodePlan`` and runs it -- real processes, real TCP readiness checks -- reporting typed events; no launcher."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import os
import queue
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import List

import numpy as np
import pytest
from helpers import free_port_range, wait_for

from paddle_cluster.contract import PSERVER, TRAINER, Endpoint, JobEnv
from paddle_cluster.launch.backends.mpi.backend import RANKS as MPI_RANKS
from paddle_cluster.node import MAIN, procs
from paddle_cluster.node import messages as m

SECRET = "5d4f9c2e7a1b8d3f60e5a9c7b2d4e8f1a3"  # as a job secret must be: not guessable (jobsecret.estimate)

REPO = Path(__file__).resolve().parent.parent

# Listens on every port of its pserver id, then waits to be stopped.
LISTEN = ("import socket, time; from paddle_cluster.contract import JobEnv; e = JobEnv.from_environ(); "
          "ss = [socket.create_server((e.current_ip, p)) for p in e.all_ports(e.pserver_id)]; "
          "print('listening', flush=True); time.sleep(600)")


@contextlib.contextmanager
def file_reads(path: Path):
    """Yields a function counting the times any process closed ``path`` after reading it (inotify's
    IN_CLOSE_NOWRITE), from now on."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
    assert fd >= 0 and libc.inotify_add_watch(fd, os.fsencode(path), 0x10) >= 0, os.strerror(ctypes.get_errno())
    seen = [0]

    def count() -> int:
        with contextlib.suppress(BlockingIOError):
            while True:  # events of a watch on a file: 16 bytes each (wd, mask, cookie, len 0)
                seen[0] += len(os.read(fd, 4096)) // 16
        return seen[0]
    try:
        yield count
    finally:
        os.close(fd)

class Agent:
    """An agent as a subprocess, its events decoded on a queue: ``supervise`` (the plan comes on stdin), or with
    ``plan_file`` ``bootstrap``, as an engine starts it (the plan from the file, no launcher channel)."""

    def __init__(self, tmp: Path, orphan_timeout: float = 30.0, plan_file: str = "", grace: float = 1.0) -> None:
        env = dict(os.environ, PYTHONPATH=str(REPO))
        args = ["supervise", "--orphan-timeout", str(orphan_timeout)]
        if plan_file:
            args = ["bootstrap", "--ranks", MPI_RANKS.text(), "--plan", plan_file]
            # What mpirun sets for rank 0 of 2; test_bootstrap.py runs the agents under the real engines.
            env.update(OMPI_COMM_WORLD_RANK="0", OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_LOCAL_RANK="0")
        self.proc = subprocess.Popen([sys.executable, "-m", "paddle_cluster.node", *args, "--grace", str(grace)],
                                     stdin=subprocess.DEVNULL if plan_file else subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=tmp, env=env)
        self.events: queue.Queue = queue.Queue()
        self.seen: List[m.Event] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in iter(self.proc.stdout.readline, b""):
            ev = m.decode(line.decode())  # anything but a message fails the test here
            if not isinstance(ev, m.Heartbeat):
                self.events.put(ev)

    def send(self, msg) -> None:
        self.proc.stdin.write((m.encode(msg) + "\n").encode())
        self.proc.stdin.flush()

    def wait_for(self, pred, timeout: float = 30.0) -> m.Event:
        """The first event, seen before or arriving within ``timeout`` s, for which ``pred`` holds."""
        for ev in self.seen:
            if pred(ev):
                return ev
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                ev = self.events.get(timeout=0.2)
            except queue.Empty:
                continue
            self.seen.append(ev)
            if pred(ev):
                return ev
        raise AssertionError(f"no such event within {timeout} s; seen: {self.seen}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


@pytest.fixture
def agents():
    made: List[Agent] = []
    yield lambda tmp, **kw: made.append(Agent(tmp, **kw)) or made[-1]
    for a in made:
        a.close()


def node_plan(tmp: Path, pserver_cmd: str, trainer_cmd: str, extra_endpoints=()) -> m.NodePlan:
    port = free_port_range(2)
    env = JobEnv("agenttest-1", (Endpoint("127.0.0.1", port),), 1, ports_num=1, ports_num_for_sparse=1,
                 secret=SECRET, job_dir=str(tmp / "job"), workspace=str(tmp))
    common = env.to_environ()

    def own(role: str, index: int):
        return {k: v for k, v in env.for_process(role, index, "127.0.0.1").to_environ().items() if common.get(k) != v}
    return m.NodePlan(0, "127.0.0.1", str(tmp / "job"), str(tmp), common,
                      (m.ProcPlan("pserver.0", PSERVER, 0, pserver_cmd, "server.log", own(PSERVER, 0)),
                       m.ProcPlan("trainer.0", TRAINER, 0, trainer_cmd, "train.log", own(TRAINER, 0))),
                      (Endpoint("127.0.0.1", port), Endpoint("127.0.0.1", port + 1), *extra_endpoints), 20.0)


def py(code: str) -> str:
    return f"{sys.executable} -c \"{code}\""


def test_runs_its_share_in_order_and_stops_on_request(tmp_path, agents):
    a = agents(tmp_path)
    plan = node_plan(tmp_path, py(LISTEN), py("import os; print('trainer', os.environ['PADDLE_TRAINER_ID'])"))
    a.send(m.Start(plan))
    a.wait_for(lambda e: e == m.Log(0, "pserver.0", "listening"))
    a.wait_for(lambda e: isinstance(e, m.Exited) and e.proc == "trainer.0")
    kinds = [(type(e).__name__, getattr(e, "proc", "")) for e in a.seen if not isinstance(e, m.Log)]
    assert kinds == [("Started", "pserver.0"), ("Ready", ""), ("Started", "trainer.0"), ("Exited", "trainer.0")]
    assert a.seen.index(m.Log(0, "trainer.0", "trainer 0")) < a.seen.index(m.Exited(0, "trainer.0", 0, None))
    job = tmp_path / "job"
    assert stat.S_IMODE(job.stat().st_mode) == 0o700 and (job / "nodefile").read_text() == "0\n"
    assert not (job / ".paddle_cluster" / "env").exists()  # the contract is in the processes' environments only
    assert (job / "log" / "train.log").read_text() == "trainer 0\n"
    ps_pid = next(e.pid for e in a.seen if isinstance(e, m.Started) and e.proc == "pserver.0")
    assert procs.load_records(str(job))["procs"][0]["pid"] == ps_pid
    a.send(m.Stop(0.5))
    stopped = a.wait_for(lambda e: isinstance(e, m.Stopped))
    assert stopped == m.Stopped(0, "stopped by the launcher", ("pserver.0",))
    assert a.proc.wait(timeout=10) == 0
    assert not procs.alive_as_recorded(ps_pid, None)


def test_a_pserver_dying_before_it_listens_is_reported_with_its_output(tmp_path, agents):
    a = agents(tmp_path)
    a.send(m.Start(node_plan(tmp_path, py("import sys; print('bad config'); sys.exit(2)"), py("print(1)"))))
    nr = a.wait_for(lambda e: isinstance(e, m.NotReady))
    assert nr.why.startswith("pserver.0 exited before listening (ports [")
    # its last words and its exit come first, and no trainer starts
    assert a.seen.index(m.Log(0, "pserver.0", "bad config")) < a.seen.index(m.Exited(0, "pserver.0", 2, None))
    assert not [e for e in a.seen if getattr(e, "proc", "") == "trainer.0"]
    a.send(m.Stop())
    a.wait_for(lambda e: isinstance(e, m.Stopped))


def test_trainers_wait_for_every_pserver_of_the_job_not_only_this_nodes(tmp_path, agents):
    other = Endpoint("127.0.0.1", free_port_range(1))  # another node's pserver, not up
    plan = node_plan(tmp_path, py(LISTEN), py("print(1)"), extra_endpoints=(other,))
    a = agents(tmp_path)
    a.send(m.Start(dataclasses.replace(plan, start_timeout=1.0)))
    nr = a.wait_for(lambda e: isinstance(e, m.NotReady))
    assert nr.why == f"nothing listening on {other} within 1 s"
    assert not [e for e in a.seen if getattr(e, "proc", "") == "trainer.0"]
    a.send(m.Stop(0))
    assert a.wait_for(lambda e: isinstance(e, m.Stopped)).killed == ("pserver.0",)


def test_a_vanished_launcher_stops_the_job(tmp_path, agents):
    a = agents(tmp_path)
    a.send(m.Start(node_plan(tmp_path, py(LISTEN), py("import time; print('up', flush=True); time.sleep(600)"))))
    a.wait_for(lambda e: e == m.Log(0, "trainer.0", "up"))
    pids = [e.pid for e in a.seen if isinstance(e, m.Started)]
    a.proc.stdin.close()  # the SSH session is gone
    stopped = a.wait_for(lambda e: isinstance(e, m.Stopped))
    assert stopped.reason == "launcher connection closed" and set(stopped.killed) == {"pserver.0", "trainer.0"}
    assert not any(procs.alive_as_recorded(p, None) for p in pids)


def test_a_silent_launcher_stops_the_job(tmp_path, agents):
    a = agents(tmp_path, orphan_timeout=1.0)
    a.send(m.Start(node_plan(tmp_path, py(LISTEN), py("import time; time.sleep(600)"))))
    stopped = a.wait_for(lambda e: isinstance(e, m.Stopped), timeout=30)
    assert stopped.reason == "launcher silent for 1 s"


def test_the_plan_can_come_from_a_file_without_a_launcher_channel(tmp_path, agents):
    """What a scheduler-started agent does (no stdin): run its node's plan from a file, stop on a signal. The job
    directory an earlier job of that name left, stopped by ``kill``, does not make this one's stop a kill."""
    plan = node_plan(tmp_path, py(LISTEN), py("print('from a file')"))
    state = Path(plan.job_dir) / procs.STATE_DIR
    state.mkdir(parents=True)
    (state / procs.KILL_FILE).write_text(f"{time.time() - 3600}\n")
    (tmp_path / "plans.jsonl").write_text("".join(m.encode(m.Start(p)) + "\n" for p in (
        plan, dataclasses.replace(plan, node=1, job_dir=str(tmp_path / "elsewhere")))))
    a = agents(tmp_path, plan_file=str(tmp_path / "plans.jsonl"))
    assert a.wait_for(lambda e: isinstance(e, m.Exited) and e.proc == "trainer.0").code == 0
    assert m.Log(0, "trainer.0", "from a file") in a.seen and not (tmp_path / "elsewhere").exists()
    a.proc.send_signal(signal.SIGTERM)
    assert a.wait_for(lambda e: isinstance(e, m.Stopped)) == m.Stopped(0, "agent received SIGTERM", ("pserver.0",))
    assert a.proc.wait(timeout=10) == 0


def test_kill_without_grace_cuts_short_an_agent_waiting_out_its_grace_period(tmp_path, agents):
    """A second Ctrl+C of an MPI run: the agents have no channel, so the launcher says it with ``node kill --grace
    0`` while ``node kill --grace 120`` waits for them; a trainer that ignores SIGTERM is SIGKILLed at once."""
    (tmp_path / "hold.py").write_text("import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                                      "print('up', flush=True)\ntime.sleep(600)\n")
    plan = node_plan(tmp_path, py(LISTEN), f"{sys.executable} hold.py")  # no sh between: it gets the SIGTERM
    (tmp_path / "plans.jsonl").write_text(m.encode(m.Start(plan)) + "\n")
    state = tmp_path / "job" / procs.STATE_DIR
    state.mkdir(parents=True)
    (state / procs.NO_GRACE_FILE).write_text(f"{time.time() - 3600}\n")  # an earlier job of that name's
    a = agents(tmp_path, plan_file=str(tmp_path / "plans.jsonl"), grace=120.0)
    a.wait_for(lambda e: e == m.Log(0, "trainer.0", "up"))
    pid = next(e.pid for e in a.seen if isinstance(e, m.Started) and e.proc == "trainer.0")
    trainer = (pid, procs.start_time(pid))

    def kill(grace: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "paddle_cluster.node", "kill", "--job-dir", plan.job_dir,
                                 "--grace", grace], stdout=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=str(REPO)))
    with file_reads(state / procs.NO_GRACE_FILE) as reads:
        first = kill("120")
        a.wait_for(lambda e: isinstance(e, m.Stopping))
        # The earlier marker does not count: the agent, waiting out the grace period, reads it a second time
        # only if the first read did not cut the wait short.
        wait_for(lambda: reads() >= 2, 20, "the agent to read the earlier marker twice")
    assert procs.alive_as_recorded(*trainer) and first.poll() is None
    second = kill("0")
    # Its 20 s limit is far below the grace period of 120 s that the trainer, which ignores SIGTERM, would wait out.
    assert a.wait_for(lambda e: isinstance(e, m.Stopped), timeout=20).killed == ("pserver.0", "trainer.0")
    assert second.wait(timeout=20) == 0 and first.wait(timeout=20) == 0
    assert not procs.alive_as_recorded(*trainer)


def test_an_own_session_agent_runs_the_dispatched_library_and_stops_the_job_when_its_rank_is_killed(tmp_path):
    """Under MPI the rank is ``bootstrap --own-session`` (Hydra SIGKILLs its ranks once mpiexec stops, Open MPI's
    orted a second after its SIGTERM): the agent, its child in a session of its own, runs from the library the
    launcher dispatched, as the rank does, on a host whose python has no paddle_cluster (here: a bare venv's), and
    stops the job once the rank is killed."""
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True, timeout=120)
    plan = node_plan(tmp_path, py(LISTEN), py("import time; print('up', flush=True); time.sleep(600)"))
    (tmp_path / "plans.jsonl").write_text(m.encode(m.Start(plan)) + "\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PMI_RANK="0", PMI_SIZE="1", MPI_LOCALRANKID="0")  # what Hydra sets for rank 0 of 1
    rank = subprocess.Popen([str(bare / "bin" / "python"), "-c", MAIN, str(REPO), "bootstrap", "--ranks",
                             MPI_RANKS.text(), "--plan", str(tmp_path / "plans.jsonl"), "--grace", "1",
                             "--own-session"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                            cwd=tmp_path)
    out: List[str] = []  # the agent's events (its child's too: it inherits the pipe), or why it could not start
    threading.Thread(target=lambda: out.extend(line.decode() for line in iter(rank.stdout.readline, b"")),
                     daemon=True).start()

    def events(kind) -> list:
        return [ev for ev in map(m.decode, [x for x in out if x.startswith("{")]) if isinstance(ev, kind)]
    try:
        def up() -> bool:
            assert rank.poll() is None, f"the rank ended ({rank.returncode}): {''.join(out)}"
            return m.Log(0, "trainer.0", "up") in events(m.Log)
        wait_for(up, 30, "the trainer's line")
        pids = [ev.pid for ev in events(m.Started)]
        rank.kill()  # as Hydra's proxy does
        rank.wait(timeout=10)
        stopped = wait_for(lambda: events(m.Stopped), 30, "the agent's Stopped event")
    finally:
        if rank.poll() is None:
            rank.kill()
    assert stopped == [m.Stopped(0, "agent received SIGTERM", ("pserver.0", "trainer.0"))], out
    assert len(pids) == 2 and not any(procs.alive_as_recorded(pid, None) for pid in pids)


def test_checkpoints_sub_command_lists_the_steps_complete_for_the_given_pservers(tmp_path):
    from paddle_cluster.ps import checkpoint as ckpt

    root = tmp_path / "ck"
    for step, ids in ((10, (0, 1)), (20, (0,))):
        for k in ids:
            ckpt.save_shard(ckpt.step_dir(str(root), step), ckpt.ShardState(
                step, k, 2, "sync", None, [ckpt.BlockState(0, "w", 0, 2, "float32", {}, step, np.zeros(2, "f4"))]))

    def answer(where: Path, ids: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "paddle_cluster.node", "checkpoints", "--root", str(where),
                               "--pservers", ids], capture_output=True, text=True, cwd=REPO, timeout=60)

    def steps(ids: str) -> list:
        out = answer(root, ids)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)["steps"]
    assert steps("0") == [10, 20] and steps("0,1") == [10]
    # A root that exists but cannot be listed is an answer naming it, not a traceback.
    (tmp_path / "not-a-dir").write_text("x")
    bad = answer(tmp_path / "not-a-dir", "0")
    doc = json.loads(bad.stdout)
    assert bad.returncode == 1 and doc["ok"] is False and "not-a-dir cannot be read" in doc["error"]
    assert "Traceback" not in bad.stderr


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def test_the_agents_look_below_itself_reads_its_subtree_not_every_process():
    if procs.subtree(os.getpid()) is None:
        pytest.skip("this kernel keeps no per-thread child lists (CONFIG_PROC_CHILDREN)")
    tree = subprocess.Popen(["sh", "-c", "sleep 60 & setsid sleep 60 & sh -c 'sleep 60' & wait"])
    dead = subprocess.Popen(["true"])  # exits and stays a zombie child until waited for
    try:
        def settled():
            table, zombies = procs.subtree(os.getpid())
            full = procs.process_table()
            sleeps = [p for p in procs.descendants([tree.pid], table) if _cmdline(p) == b"sleep\x0060\x00"]
            return (table, zombies, full) if len(sleeps) == 3 and dead.pid in zombies else None
        table, zombies, full = wait_for(settled, 10, "the tree of sleeps and the zombie", interval=0.02)
        assert set(table) == procs.descendants([os.getpid()], full)  # the same processes a scan of /proc finds
        assert zombies == [dead.pid] and dead.pid not in table
    finally:
        for pid in {tree.pid} | procs.descendants([tree.pid], procs.process_table()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        tree.wait()
        dead.wait()
