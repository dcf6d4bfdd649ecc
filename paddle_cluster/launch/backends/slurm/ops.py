"""``kill``, ``status`` and ``logs`` of Slurm jobs: Slurm knows the job, the shared filesystem holds each node's
records and logs (``backend.py`` for the layout)."""

from __future__ import annotations

import os
import re
from typing import List, Mapping, Optional, Tuple

from paddle_cluster.node import jobdir, procs

from ...config import ClusterConfig
from ...errors import ClusterError
from ...interrupt import stoppable
from ..base import ProcRow
from .backend import active, cancel_job, job_info, node_dir, saved_job_id


def _job_id(cfg: ClusterConfig, name: str, handle: Mapping[str, str]) -> str:
    job_id = handle.get("slurm_job") or saved_job_id(cfg.job_dir(name))
    if not job_id:
        raise ClusterError(f"no Slurm job recorded for job {name} in {cfg.job_dir(name)}/.paddle_cluster; is "
                           "ROOT_DIR the shared filesystem it was started with?")
    return job_id


def _node_dirs(cfg: ClusterConfig, name: str) -> List[str]:
    """Each node's directory, in node order. Only ``node<N>`` directories: a dispatched workspace is the
    shared job directory, and its own files may start with "node" too."""
    top = cfg.job_dir(name)
    try:
        found = [(int(e.name[4:]), e.path) for e in os.scandir(top)
                 if re.fullmatch(r"node\d+", e.name) and e.is_dir()]
    except OSError:
        return []
    return [path for _, path in sorted(found)]


def kill(cfg: ClusterConfig, name: str, handle: Mapping[str, str]) -> str:
    job_id = _job_id(cfg, name, handle)
    for d in _node_dirs(cfg, name):
        if procs.load_records(d) is not None:  # its agent then says "stopped by paddle-cluster kill", as on ssh
            procs.request_kill(d)
    state = cancel_job(job_id, cfg.kill_grace + 60)
    return f"Slurm job {job_id} (job {name}): {state}; nothing of it is left in squeue"


def status(cfg: ClusterConfig, name: str, handle: Mapping[str, str]) -> Tuple[str, List[ProcRow]]:
    """(Slurm's line about the job, a row per process from every node's records)."""
    job_id = _job_id(cfg, name, handle)
    info = job_info(job_id)
    state = info.get("JobState", "unknown to Slurm (finished long ago?)")
    head = f"Slurm job {job_id}: {state}"
    if info.get("Reason") not in (None, "None"):
        head += f" ({info['Reason']})"
    if info.get("NodeList") not in (None, "(null)"):
        head += f" on {info['NodeList']}"
    rows: List[ProcRow] = []
    for d in _node_dirs(cfg, name):
        rec = procs.load_records(d)
        for p in (rec or {}).get("procs", []):
            # The pids are on the nodes, not here: while the record says nothing, Slurm's state tells.
            st = jobdir.ended_state(p) or ("running" if state == "RUNNING" else f"ended ({state})")
            rows.append(ProcRow(os.path.basename(d), "", "", p["name"], p["role"], p["pid"], st,
                                jobdir.progress(d, p["name"]), jobdir.last_line(p["log"])))
    return head, rows


def logs(cfg: ClusterConfig, name: str, handle: Mapping[str, str], node_text: str, role: str, n: int,
         follow: bool) -> int:
    t = node_text.strip()
    idx: Optional[int] = int(t[4:]) if t.startswith("node") and t[4:].isdigit() else int(t) if t.isdigit() else None
    d = node_dir(cfg.job_dir(name), idx if idx is not None else -1)
    if idx is None or not os.path.isdir(d):
        have = ", ".join(os.path.basename(x) for x in _node_dirs(cfg, name)) or "none yet"
        raise ClusterError(f"unknown node {node_text!r} of Slurm job {name}; its nodes: {have}")
    job_id = _job_id(cfg, name, handle)
    with stoppable():
        try:
            return jobdir.print_logs(d, role, n, follow, ended=lambda: active(job_id) is False,
                                      watch_stdin=False)
        except KeyboardInterrupt:
            return 0
