"""A job's processes on one node: spawning them, recording them, telling ours from a reused pid, stopping them.

Each process runs in its own process group and dies with the agent (``PR_SET_PDEATHSIG``). Its pid, group and
kernel start time are recorded in ``<job dir>/.paddle_cluster/procs.json``, so ``kill``, ``status`` and
teardown act on exactly those processes and a reused pid is never mistaken for one of ours.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import threading
import time
from typing import Any, Dict, List, Mapping, Optional

from paddle_cluster import contract

STATE_DIR = ".paddle_cluster"
PROCS_FILE = "procs.json"


def _stat_fields(pid: int) -> Optional[List[str]]:
    """The fields of ``/proc/<pid>/stat`` after the command name (state first), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def start_time(pid: int) -> Optional[int]:
    """The kernel's start time of ``pid`` (clock ticks since boot), or None if it is gone."""
    fields = _stat_fields(pid)
    return None if fields is None else int(fields[19])


def alive_as_recorded(pid: int, started: Optional[int]) -> bool:
    """``pid`` runs (not a zombie) and, when ``started`` is known, is still the process recorded then."""
    fields = _stat_fields(pid)
    if fields is None or fields[0] == "Z":
        return False
    return started is None or int(fields[19]) == started


def group_members(pgid: int) -> List[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat_fields(int(entry))
            try:
                if fields is not None and int(fields[2]) == pgid and fields[0] != "Z":
                    pids.append(int(entry))
            except (ValueError, IndexError):
                continue
    return pids


def _has_job_tag(pid: int, job_id: str) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            entries = f.read().split(b"\0")
    except OSError:
        return False
    environ = dict(e.decode(errors="replace").partition("=")[::2] for e in entries if e)
    return contract.job_id_of(environ) == job_id


def job_group_alive(rec: Mapping[str, Any], job_id: str) -> List[int]:
    """Live members of a recorded process group that provably belong to this job."""
    if alive_as_recorded(rec["pid"], rec.get("start_time")):
        return group_members(rec["pgid"]) or [rec["pid"]]
    # The leader is gone; members still in its group are ours only if they carry this job's id.
    return [p for p in group_members(rec["pgid"]) if _has_job_tag(p, job_id)]


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _wait_gone(records: List[Mapping[str, Any]], job_id: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(job_group_alive(r, job_id) for r in records):
        time.sleep(0.05)


def signal_groups(records: List[Mapping[str, Any]], job_id: str, grace: float) -> List[str]:
    """SIGTERM every live group, wait up to ``grace`` s, SIGKILL what is left. Returns the names hit."""
    hit = []
    for rec in records:
        if job_group_alive(rec, job_id):
            hit.append(rec["name"])
            _killpg(rec["pgid"], signal.SIGTERM)
    _wait_gone(records, job_id, grace)
    for rec in records:
        if job_group_alive(rec, job_id):
            _killpg(rec["pgid"], signal.SIGKILL)
    _wait_gone(records, job_id, 5)
    return hit


def _same_host(pid: int, netns: str) -> bool:
    """``pid`` shares our network namespace: it is on this node even where several nodes share one kernel
    (containers, the test cluster's namespaces)."""
    try:
        return os.readlink(f"/proc/{pid}/ns/net") == netns
    except OSError:
        return False


def job_tagged(job_id: str) -> List[int]:
    """Live processes on this node, other than this one, whose environment carries ``job_id``."""
    if not job_id:
        return []
    try:
        netns = os.readlink("/proc/self/ns/net")
    except OSError:
        netns = ""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            pid = int(entry)
            fields = _stat_fields(pid)
            if fields and fields[0] != "Z" and _same_host(pid, netns) and _has_job_tag(pid, job_id):
                out.append(pid)
    return out


def sweep(job_id: str, grace: float = 2.0) -> List[int]:
    """SIGTERM, then after ``grace`` s SIGKILL, every process left with this job's id: what escaped its
    process group (a ``setsid`` daemon, a detached helper) and so outlived ``signal_groups``."""
    hit = job_tagged(job_id)
    for pid in hit:
        _kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and job_tagged(job_id):
        time.sleep(0.05)
    for pid in job_tagged(job_id):
        _kill(pid, signal.SIGKILL)
    return hit


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class Records:
    """``procs.json``: the agent and every process it started. Rewritten atomically on each change."""

    def __init__(self, job_dir: str, job_id: str) -> None:
        self.dir = os.path.join(job_dir, STATE_DIR)
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        self.path = os.path.join(self.dir, PROCS_FILE)
        self.lock = threading.Lock()
        self.data: Dict[str, Any] = {"job_id": job_id, "agent": {"pid": os.getpid(),
                                     "start_time": start_time(os.getpid())}, "procs": []}
        self.save()

    @property
    def procs(self) -> List[Dict[str, Any]]:
        return self.data["procs"]

    def add(self, rec: Dict[str, Any]) -> None:
        with self.lock:
            self.data["procs"].append(rec)
        self.save()

    def save(self) -> None:
        with self.lock:
            tmp = self.path + ".tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(self.data, f, indent=1)
            os.replace(tmp, self.path)


def load_records(job_dir: str) -> Optional[Dict[str, Any]]:
    try:
        with open(os.path.join(job_dir, STATE_DIR, PROCS_FILE)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


_libc = None


def _die_with_parent() -> None:
    """Child pre-exec: new process group, and SIGTERM if the agent dies (even by SIGKILL)."""
    global _libc
    os.setpgid(0, 0)
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
        _libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


_SHELL_CHARS = set("|&;<>()$`\\\"'*?[]#~=%{}\n")


def command_argv(cmd: str) -> List[str]:
    """Run a plain command directly, so PDEATHSIG reaches the program itself; anything else via sh."""
    if _SHELL_CHARS.isdisjoint(cmd):
        return cmd.split()
    return ["/bin/sh", "-c", cmd]


def spawn(cmd: str, cwd: str, env: Mapping[str, str]) -> subprocess.Popen:
    """Start ``cmd`` in its own process group, output (stdout+stderr) on a pipe; raises OSError."""
    return subprocess.Popen(command_argv(cmd), cwd=cwd, env=dict(env), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent,
                            close_fds=True)
