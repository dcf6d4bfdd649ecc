"""A job's processes on one node: spawning them, recording them, telling ours from a reused pid, stopping them.

Each process runs in its own process group and dies with the agent (``PR_SET_PDEATHSIG``). Its pid, group and
kernel start time are recorded in ``<job dir>/.paddle_cluster/procs.json``, so ``kill``, ``status`` and
teardown act on exactly those processes and a reused pid is never mistaken for one of ours.
"""

from __future__ import annotations

import ctypes
import json
import os
import shlex
import signal
import subprocess
import threading
import time
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Set, Tuple

from paddle_cluster import contract

STATE_DIR = ".paddle_cluster"
PROCS_FILE = "procs.json"
KILL_FILE = "kill-requested"  # written by the 'kill' sub-command before it signals the agent
NO_GRACE_FILE = "kill-now"  # and by 'kill --grace 0': an agent waiting out its grace period SIGKILLs at once


def stat_fields(pid: int) -> Optional[List[str]]:
    """The fields of ``/proc/<pid>/stat`` after the command name (state first), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def start_time(pid: int) -> Optional[int]:
    """The kernel's start time of ``pid`` (clock ticks since boot), or None if it is gone."""
    fields = stat_fields(pid)
    return None if fields is None else int(fields[19])


def alive_as_recorded(pid: int, started: Optional[int]) -> bool:
    """``pid`` runs (not a zombie) and is still the process recorded with kernel start time ``started``.

    Without a recorded start time nothing matches: the pid alone may since belong to anyone."""
    fields = stat_fields(pid)
    return started is not None and fields is not None and fields[0] != "Z" and int(fields[19]) == started


Table = Dict[int, List[str]]


def process_table() -> Table:
    """Every live (non-zombie) process: pid -> its ``/proc/<pid>/stat`` fields (see ``stat_fields``)."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = stat_fields(int(entry))
            if fields is not None and fields[0] != "Z":
                table[int(entry)] = fields
    return table


def subtree(root: int) -> Optional[Tuple[Table, List[int]]]:
    """The live processes below ``root`` (as ``process_table``) and its zombie children, from the kernel's child
    list of each thread: this reads the job's processes only, where ``process_table`` reads every process of the
    machine (the agent looks twice a second). None where the kernel keeps no child lists (CONFIG_PROC_CHILDREN)."""
    table: Table = {}
    zombies: List[int] = []
    todo = [root]
    while todo:
        pid = todo.pop()
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue  # gone meanwhile
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    kids = [int(k) for k in f.read().split()]
            except FileNotFoundError:
                if os.path.isdir(f"/proc/{pid}/task/{tid}"):
                    return None  # the thread is there, its child list is not: the kernel has none
                continue
            except OSError:
                continue
            for kid in kids:
                fields = stat_fields(kid)
                if fields is None or kid in table:
                    continue
                if fields[0] == "Z":
                    if pid == root:
                        zombies.append(kid)
                    continue
                table[kid] = fields
                todo.append(kid)
    return table, zombies


def _matches(table: Table, rec: Mapping[str, Any]) -> bool:
    fields = table.get(rec.get("pid", -1))
    return fields is not None and rec.get("start_time") is not None and int(fields[19]) == rec["start_time"]


def descendants(roots: Iterable[int], table: Table) -> Set[int]:
    """Every process below ``roots``, whatever its group or session (``setsid`` changes neither parent)."""
    children: Dict[int, List[int]] = {}
    for pid, fields in table.items():
        children.setdefault(int(fields[1]), []).append(pid)
    found: Set[int] = set()
    todo = list(roots)
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def group_members(pgid: int, table: Optional[Table] = None) -> List[int]:
    table = process_table() if table is None else table
    return [pid for pid, fields in table.items() if int(fields[2]) == pgid]


def _has_job_tag(pid: int, job_id: str) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            entries = f.read().split(b"\0")
    except OSError:
        return False
    environ = dict(e.decode(errors="replace").partition("=")[::2] for e in entries if e)
    return contract.job_id_of(environ) == job_id


def job_group_alive(rec: Mapping[str, Any], job_id: str, table: Optional[Table] = None) -> List[int]:
    """Live members of a recorded process group that provably belong to this job."""
    table = process_table() if table is None else table
    members = group_members(rec["pgid"], table)
    if _matches(table, rec):
        return members or [rec["pid"]]
    # The leader is gone; members still in its group are ours only if they carry this job's id.
    return [p for p in members if _has_job_tag(p, job_id)]


def job_pids(state: Mapping[str, Any], table: Optional[Table] = None) -> Set[int]:
    """Every live process of the job on this node, the agent excepted: the recorded processes (pid and start
    time) and their groups, the descendants the agent recorded, and everything below any of them or the agent.
    A process that merely carries the job's id, outside all of these, is not included."""
    table = process_table() if table is None else table
    found: Set[int] = set()
    for rec in state.get("procs", []):
        found.update(job_group_alive(rec, state["job_id"], table))
    found.update(r["pid"] for r in state.get("descendants", []) if _matches(table, r))
    agent = state.get("agent", {})
    roots = found | ({agent["pid"]} if _matches(table, agent) else set())
    return (found | descendants(roots, table)) - {agent.get("pid"), os.getpid()}


def _signal(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _wait_until(done: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def stop_job(state: Mapping[str, Any], grace: float, cut_short: Callable[[], bool] = lambda: False) -> List[str]:
    """SIGTERM every process of the job (``job_pids``), wait up to ``grace`` s (less once ``cut_short()``),
    SIGKILL whatever is left or appeared meanwhile until none is. Returns the names of the recorded processes
    that were running."""
    table = process_table()
    hit = [r["name"] for r in state.get("procs", []) if job_group_alive(r, state["job_id"], table)]
    _signal(job_pids(state, table), signal.SIGTERM)
    _wait_until(lambda: not job_pids(state) or cut_short(), grace)
    _wait_until(lambda: not _kill_left(state), 5)
    return hit


def _kill_left(state: Mapping[str, Any]) -> Set[int]:
    left = job_pids(state)
    _signal(left, signal.SIGKILL)
    return left


def become_subreaper() -> None:
    """Orphaned descendants (a trainer's ``setsid`` child whose parent exited) become the agent's children
    instead of init's, so ``job_pids`` still finds them below the agent (PR_SET_CHILD_SUBREAPER)."""
    libc = _load_libc()
    if libc is not None:
        libc.prctl(36, 1, 0, 0, 0)


def reap_orphans(table: Table, own: Set[int], zombies: Optional[List[int]] = None) -> None:
    """Collect the exit status of dead children the agent adopted (not the ones ``subprocess`` waits for):
    ``zombies`` (``subtree``'s), else every zombie child of the agent in /proc."""
    if zombies is None:
        me = str(os.getpid())
        zombies = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) not in table:
                fields = stat_fields(int(entry))
                if fields is not None and fields[0] == "Z" and fields[1] == me:
                    zombies.append(int(entry))
    for pid in zombies:
        if pid not in own:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass


class Records:
    """``procs.json``: the agent and every process it started. Rewritten atomically on each change."""

    def __init__(self, job_dir: str, job_id: str) -> None:
        self.dir = os.path.join(job_dir, STATE_DIR)
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        self.path = os.path.join(self.dir, PROCS_FILE)
        self.lock = threading.Lock()
        self.data: Dict[str, Any] = {"job_id": job_id, "agent": {"pid": os.getpid(),
                                     "start_time": start_time(os.getpid())}, "procs": [], "descendants": []}
        self.save()

    @property
    def procs(self) -> List[Dict[str, Any]]:
        return self.data["procs"]

    def add(self, rec: Dict[str, Any]) -> None:
        with self.lock:
            self.data["procs"].append(rec)
        self.save()

    def track(self, table: Table) -> None:
        """Record every live process below the agent that is not a recorded one, so ``kill`` finds it even
        after the agent is gone and the process was adopted by init; saved only when the set changed."""
        mine = {r["pid"] for r in self.procs}
        now = sorted((pid, int(table[pid][19])) for pid in descendants([os.getpid()], table) if pid not in mine)
        recs = [{"pid": pid, "start_time": started} for pid, started in now]
        if recs != self.data["descendants"]:
            with self.lock:
                self.data["descendants"] = recs
            self.save()

    def save(self) -> None:
        with self.lock:
            tmp = f"{self.path}.tmp-{os.getpid()}"  # never another process's temporary
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(self.data, f, indent=1)
            os.replace(tmp, self.path)


def request_kill(job_dir: str, grace: Optional[float] = None) -> None:
    """Mark the job as stopped by ``kill``; with ``grace`` 0 also as to be stopped without a grace period."""
    for name in (KILL_FILE, NO_GRACE_FILE) if grace == 0 else (KILL_FILE,):
        fd = os.open(os.path.join(job_dir, STATE_DIR, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW,
                     0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"{time.time()}\n")


def _requested(job_dir: str, name: str, since: float) -> bool:
    try:
        with open(os.path.join(job_dir, STATE_DIR, name)) as f:
            return float(f.read()) >= since
    except (OSError, ValueError):
        return False


def kill_requested(job_dir: str, since: float) -> bool:
    """Whether ``kill`` ran at or after ``since`` (time.time(); a kill of an earlier run of a job of that name,
    whose job directory this run reuses, does not count)."""
    return _requested(job_dir, KILL_FILE, since)


def no_grace_requested(job_dir: str, since: float) -> bool:
    """Whether ``kill --grace 0`` ran at or after ``since``, as ``kill_requested``."""
    return _requested(job_dir, NO_GRACE_FILE, since)


def load_records(job_dir: str) -> Optional[Dict[str, Any]]:
    try:
        with open(os.path.join(job_dir, STATE_DIR, PROCS_FILE)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


_libc: Optional[ctypes.CDLL] = None


def _load_libc() -> Optional[ctypes.CDLL]:
    """libc, loaded in the agent itself: a forked child must not dlopen (another thread of the agent may hold
    the loader's lock at fork time, and the child would wait for it forever)."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
        except OSError:
            return None
    return _libc


def _die_with_parent() -> None:
    """Child pre-exec: new process group, and SIGTERM if the agent dies (even by SIGKILL)."""
    os.setpgid(0, 0)
    if _libc is not None:
        _libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


# Anything the shell would expand or treat as an operator; quotes and backslashes alone are split like sh does.
_SHELL_CHARS = set("|&;<>()$`*?[]#~=%{}\n")


def command_argv(cmd: str) -> List[str]:
    """Run a plain command (quoting allowed) directly, so PDEATHSIG reaches the program itself; anything
    else via sh."""
    if _SHELL_CHARS.isdisjoint(cmd):
        try:
            return shlex.split(cmd)
        except ValueError:  # an unbalanced quote: let sh report it
            pass
    return ["/bin/sh", "-c", cmd]


def spawn(cmd: str, cwd: str, env: Mapping[str, str]) -> subprocess.Popen:
    """Start ``cmd`` in its own process group, output (stdout+stderr) on a pipe; raises OSError."""
    _load_libc()
    return subprocess.Popen(command_argv(cmd), cwd=cwd, env=dict(env), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent,
                            close_fds=True)
