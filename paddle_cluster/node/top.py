"""The figures ``paddle-cluster top`` shows of a node's processes.

The agent reads ``/proc`` (``Sampler``: CPU % over the last second and resident memory of each process with its
descendants) and writes them to ``<job dir>/.paddle_cluster/top.json`` once a second; each process writes its
own counters (``ps.counters``: step, traffic, a pserver's rows, budget and barrier waits). ``snapshot`` joins
them with the process records and each trainer's last metrics record: what ``node top`` prints.
"""

from __future__ import annotations

import json
import os
import stat
import time
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

from paddle_cluster.contract import figures_path

from . import jobdir, procs

FILE = "top.json"
PERIOD_S = 1.0
_TICK = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


def usage(pids: Iterable[int], table: procs.Table) -> Tuple[int, int]:
    """CPU clock ticks used (utime + stime) and resident bytes of ``pids`` together."""
    ticks = rss = 0
    for pid in pids:
        f = table.get(pid)
        if f is not None:
            ticks += int(f[11]) + int(f[12])
            rss += int(f[21]) * _PAGE
    return ticks, rss


class Usage:
    """CPU % (since the previous look) and resident bytes of named processes, each with its descendants."""

    def __init__(self) -> None:
        self._last: Dict[str, tuple] = {}  # name -> (monotonic time, ticks)

    def of(self, records: Iterable[Mapping[str, Any]], table: procs.Table) -> Dict[str, Dict[str, Any]]:
        """``{name: {"rss": bytes, "cpu": percent}}`` of the ``records`` (name, pid) alive in ``table``; "cpu"
        from a process's second look on."""
        mono = time.monotonic()
        out: Dict[str, Dict[str, Any]] = {}
        for rec in records:
            pid = rec["pid"]
            if pid not in table:
                continue
            ticks, rss = usage([pid, *procs.descendants([pid], table)], table)
            fig: Dict[str, Any] = {"rss": rss}
            last = self._last.get(rec["name"])
            if last is not None and mono > last[0]:
                fig["cpu"] = 100.0 * (ticks - last[1]) / _TICK / (mono - last[0])
            self._last[rec["name"]] = (mono, ticks)
            out[rec["name"]] = fig
        return out


class Sampler:
    """The agent's side: fed the process table it already reads (``Supervisor._track``), writes each recorded
    process's CPU % and RSS at most every ``period`` s."""

    def __init__(self, job_dir: str, period: float = PERIOD_S) -> None:
        self.path = os.path.join(job_dir, procs.STATE_DIR, FILE)
        self.period = period
        self.usage = Usage()
        self._at = 0.0

    def sample(self, records: List[Mapping[str, Any]], table: procs.Table) -> None:
        mono = time.monotonic()
        if mono - self._at < self.period:
            return
        self._at = mono
        out = self.usage.of(records, table)
        tmp = f"{self.path}.tmp-{os.getpid()}"
        try:
            with open(tmp, "w") as f:
                json.dump({"time": time.time(), "procs": out}, f)
            os.replace(tmp, self.path)
        except OSError:
            pass  # a full disk: ``top`` shows these figures as old; the agent's work goes on


READ_MAX = 1 << 20  # a figures file is a few hundred bytes; a bigger one (a job's own doing) is not read


def _read_json(path: str) -> Optional[Dict[str, Any]]:
    """The JSON object in ``path`` (the job writes these files: only a regular file, at most READ_MAX, is read,
    so a FIFO, a device or a huge file cannot hold ``top``)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        data = os.read(fd, READ_MAX + 1)
        doc = json.loads(data) if len(data) <= READ_MAX else None
        return doc if isinstance(doc, dict) else None
    except (OSError, ValueError, RecursionError):
        return None
    finally:
        os.close(fd)


def own(job_dir: str, name: str) -> Dict[str, Any]:
    """Process ``name``'s own figures (``ps.counters``: {} when it writes none) and, a trainer's, its last
    metrics record."""
    return {"figures": _read_json(figures_path(job_dir, name)) or {}, "metrics": _last_metrics(job_dir, name)}


def _last_metrics(job_dir: str, name: str) -> Optional[Dict[str, Any]]:
    role, _, idx = name.partition(".")
    if role != "trainer":
        return None
    try:
        rec = json.loads(jobdir.last_line(os.path.join(job_dir, "log", f"metrics.trainer{idx}.jsonl")))
    except (ValueError, RecursionError):
        return None
    return rec if isinstance(rec, dict) else None


def age(figures: Mapping[str, Any], now: float) -> Optional[float]:
    """Seconds since a process's own figures were written (None: it writes none)."""
    t = figures.get("time")
    return now - t if isinstance(t, (int, float)) else None


def snapshot(job_dir: str, here: bool = True) -> Dict[str, Any]:
    """Every recorded process of the job on this node: its record's state, the agent's ``/proc`` figures, its
    own counters and (trainers) its last metrics record; ``time`` is this node's clock, against which the
    ``*_at`` times and ``age`` (seconds since a process's counters were written) are read.

    ``here``: the processes run on this machine. A job directory read from another one (a Slurm node's, on the
    shared filesystem) has its pids elsewhere: a process runs while its agent's latest figures list it."""
    state = procs.load_records(job_dir)
    now = time.time()
    if state is None:
        return {"found": False, "time": now, "procs": []}
    agent = _read_json(os.path.join(job_dir, procs.STATE_DIR, FILE)) or {}
    fresh = now - agent.get("time", 0) < 5 * PERIOD_S  # an agent gone (job ended) leaves old figures behind
    out = []
    for p in state["procs"]:
        name = p["name"]
        listed = fresh and name in agent.get("procs", {})
        st = jobdir.state_of(p, state["job_id"]) if here else jobdir.ended_state(p) or (
            "running" if listed else "unknown (its agent's figures are old or missing)")
        figs = own(job_dir, name)
        row = {"name": name, "role": p["role"], "pid": p["pid"], "state": st, "started_at": p.get("started_at"),
               "exit_code": p.get("exit_code"), "signal": p.get("signal"), "stopped": p.get("stopped"),
               "address": p.get("address"), **figs, "age": age(figs["figures"], now)}
        row.update(agent.get("procs", {}).get(name, {}) if fresh and st == "running" else {})
        out.append(row)
    return {"found": True, "time": now, "procs": out}
