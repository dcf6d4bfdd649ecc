"""What the ``kill``, ``status``, ``logs`` and ``metrics`` sub-commands read from a job directory on a node."""

from __future__ import annotations

import dataclasses
import json
import os
import select
import signal
import stat
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

from . import procs


@dataclass(frozen=True)
class KillOutcome:
    """One recorded process as ``kill`` left it: whether it ran before, and how it ended (``killed by SIGTERM``,
    ``exited 0``, ``still running``, ...). ``kill`` prints these; the launcher reads them back."""

    name: str
    pid: int
    running: bool
    how: str


def kill(job_dir: str, grace: float) -> Dict[str, Any]:
    """Stop the job's agent (it stops its own children first), then any recorded process still alive. Says
    how each recorded process stands afterwards: ``procs`` of {name, pid, running (before the kill), how}, ``how``
    as its record ends (``killed by SIGTERM``, ``exited 0``, ``killed by SIGKILL`` after the grace period) or
    ``still running``."""
    state = procs.load_records(job_dir)
    if state is None:
        return {"found": False, "stopped": [], "procs": []}
    job_id = state["job_id"]
    running = [p["name"] for p in state["procs"] if procs.job_group_alive(p, job_id)]
    agent = state.get("agent", {})
    pid, started = agent.get("pid", -1), agent.get("start_time")
    by_agent = procs.alive_as_recorded(pid, started)
    if by_agent:
        # The agent then reports "stopped by paddle-cluster kill", not a failure; with grace 0 it also stops
        # waiting out the grace period of a stop already under way (a second Ctrl+C of an MPI run).
        procs.request_kill(job_dir, grace)
        _signal_agent(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace + 6
        while time.monotonic() < deadline and procs.alive_as_recorded(pid, started):
            time.sleep(0.05)
    # What the agent did not stop (it is gone, or hung): the recorded processes, their groups, the
    # descendants it recorded (also those init adopted after it died), and everything below them.
    procs.stop_job(state, grace)
    if procs.alive_as_recorded(pid, started):
        _signal_agent(pid, signal.SIGKILL)
    left = [p["name"] for p in state["procs"] if procs.job_group_alive(p, job_id)]
    after = procs.load_records(job_dir) or state  # with the exits the agent saw

    def how(rec: Dict[str, Any]) -> str:
        if rec["name"] in left:
            return "still running"
        if rec.get("signal") is not None:
            return f"killed by {signal.Signals(rec['signal']).name}"
        if rec.get("exit_code") is not None:
            return f"exited {rec['exit_code']}"
        return "gone after SIGTERM" if rec["name"] in running else "gone"

    return {"found": True, "stopped": running, "left": left, "procs": [
        dataclasses.asdict(KillOutcome(p["name"], p["pid"], p["name"] in running, how(p))) for p in after["procs"]]}


def _signal_agent(pid: int, sig: int) -> None:
    """The agent found alive may end (its job done) before the signal reaches it: then it is stopped already."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def last_line(path: str) -> str:
    """The last non-empty line in the last 4 KiB of ``path``, a file the job writes: only a regular file is read
    (a FIFO or a device there holds nothing up)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return ""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return ""
        os.lseek(fd, max(0, st.st_size - 4096), os.SEEK_SET)
        lines = [x for x in os.read(fd, 4096).decode(errors="replace").splitlines() if x.strip()]
        return lines[-1] if lines else ""
    except OSError:
        return ""
    finally:
        os.close(fd)


def progress(job_dir: str, name: str) -> str:
    """A trainer's latest metrics record, e.g. ``pass 2 step 340 loss 0.5312``; "" when it has none."""
    role, _, idx = name.partition(".")
    if role != "trainer":
        return ""
    line = last_line(os.path.join(job_dir, "log", f"metrics.trainer{idx}.jsonl"))
    try:
        rec = json.loads(line)
    except (ValueError, RecursionError):
        return ""
    parts = [f"{k} {rec[k]:.4g}" if isinstance(rec.get(k), float) else f"{k} {rec[k]}"
             for k in ("pass", "step", "loss") if k in rec]
    return " ".join(parts)


def ended_state(p: Dict[str, Any]) -> Optional[str]:
    """How a recorded process ended, from its record alone; None when the record says nothing yet."""
    if p.get("stopped"):  # still running when the agent stopped the job: whatever its exit status says
        return f"stopped ({p['stopped']})"
    if p.get("exit_code") is not None:
        return f"exited {p['exit_code']}"
    if p.get("signal") is not None:
        return f"killed by {signal.Signals(p['signal']).name}"
    return None


def state_of(p: Dict[str, Any], job_id: str) -> str:
    if procs.job_group_alive(p, job_id):
        return "running"
    return ended_state(p) or "gone"


def status(job_dir: str) -> Dict[str, Any]:
    state = procs.load_records(job_dir)
    if state is None:
        return {"found": False, "procs": []}
    return {"found": True, "procs": [
        {"name": p["name"], "role": p["role"], "pid": p["pid"], "state": state_of(p, state["job_id"]),
         "address": p.get("address"),
         "last_line": last_line(p["log"]), "progress": progress(job_dir, p["name"])} for p in state["procs"]]}


def print_logs(job_dir: str, role: str, n: int, follow: bool, ended: Optional[Callable[[], bool]] = None,
               watch_stdin: bool = True) -> int:
    """Print the last ``n`` lines of the role's log files (tagged when there are several); then follow them
    until ``ended()`` (default: the job's processes on this node are gone) or, with ``watch_stdin``, stdin
    closes. (A Slurm job's logs are followed from the login machine, where its pids are not.)"""
    ended = ended or (lambda: job_ended(job_dir))
    log_dir = os.path.join(job_dir, "log")
    if not os.path.isdir(log_dir):
        print(f"no log directory {log_dir}", file=sys.stderr)
        return 1
    prefixes = {"trainer": ("train",), "pserver": ("server",), "all": ("train", "server")}[role]
    files = sorted(f for f in os.listdir(log_dir) if f.startswith(prefixes) and f.endswith(".log"))
    if not files:
        print(f"no {role} logs in {log_dir}", file=sys.stderr)
        return 1
    handles = []
    for name in files:
        f = open(os.path.join(log_dir, name), "rb")
        lines = f.read().decode(errors="replace").splitlines()
        tag = f"[{name}] " if len(files) > 1 else ""
        for line in lines[-n:] if n > 0 else []:
            print(tag + line)
        handles.append((tag, f))
    sys.stdout.flush()
    if not follow:
        return 0
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    partial = {id(f): b"" for _, f in handles}
    next_check = 0.0
    while True:
        over = False
        if time.monotonic() >= next_check:  # read what the job wrote before it ended, then stop
            over, next_check = ended(), time.monotonic() + 1.0
        got = False
        for tag, f in handles:
            chunk = f.read()
            if chunk:
                got = True
                data = partial[id(f)] + chunk
                *done, partial[id(f)] = data.split(b"\n")
                for line in done:
                    print(tag + line.decode(errors="replace"))
        sys.stdout.flush()
        if over and not got:
            return 0
        # Without news: has the launcher gone (Ctrl+C, closed terminal, lost SSH)?
        if not got and (_stdin_closed(0.2) if watch_stdin else time.sleep(0.2)):
            return 0


def job_ended(job_dir: str) -> bool:
    """No agent and no process of the job is alive (a job directory without records has not started)."""
    state = procs.load_records(job_dir)
    if state is None:
        return False
    agent = state.get("agent", {})
    if agent.get("pid") and procs.alive_as_recorded(agent["pid"], agent.get("start_time")):
        return False
    return not any(procs.job_group_alive(p, state["job_id"]) for p in state["procs"])


def _stdin_closed(timeout: float) -> bool:
    """Whether stdin reached its end within ``timeout`` s (what it says otherwise is ignored)."""
    try:
        r, _, _ = select.select([0], [], [], timeout)
        return bool(r) and not os.read(0, 4096)
    except (OSError, ValueError):
        time.sleep(timeout)
        return False


def metrics(job_dir: str) -> Dict[str, List[Any]]:
    """Every trainer's metrics records on this node (torn lines skipped)."""
    log_dir = os.path.join(job_dir, "log")
    out: Dict[str, List[Any]] = {}
    names = sorted(os.listdir(log_dir)) if os.path.isdir(log_dir) else []
    for name in names:
        if name.startswith("metrics.trainer") and name.endswith(".jsonl"):
            recs = []
            with open(os.path.join(log_dir, name), errors="replace") as f:
                for line in f:
                    try:
                        rec = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(rec, dict):
                        recs.append(rec)
            out[name[len("metrics."):-len(".jsonl")]] = recs
    return out
