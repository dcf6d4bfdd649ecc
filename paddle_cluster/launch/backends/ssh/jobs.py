"""``kill``, ``status`` and ``logs`` of a job on the hosts of HOSTS (the SSH and MPI backends)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, List, Optional

from paddle_cluster.node.jobdir import KillOutcome

from ... import nodecmd
from ...access import nodes_with_lib
from ...config import ClusterConfig
from ...each_node import each_node
from ...errors import JOB_NAME_FIX, ClusterError, HostError, UsageError
from ...hosts import Node
from ...interrupt import stoppable
from ..base import ProcRow


@dataclass(frozen=True)
class NodeKill:
    node: str
    found: bool  # the job has a directory with process records on this node
    stopped: List[KillOutcome]  # the processes that ran before the kill

    def line(self, job_name: str) -> str:
        """What ``kill`` did on this node, one line."""
        if not self.found:
            return f"{self.node}: no job {job_name} here"
        if not self.stopped:
            return f"{self.node}: nothing of job {job_name} was running"
        return f"{self.node}: " + "; ".join(f"{p.name} (pid {p.pid}) {p.how}" for p in self.stopped)


def kill_job(cfg: ClusterConfig, job_name: str) -> List[NodeKill]:
    """Stop every process recorded for ``job_name`` on every node (SIGTERM, KILL_GRACE, SIGKILL); nothing else is
    touched. Each node says how each process that was running before ended."""
    nodes, lib, _ = nodes_with_lib(cfg)
    job_dir = cfg.job_dir(job_name)

    def running(n: Node) -> List[str]:
        doc = nodecmd.agent_json(n, lib, "status", "--job-dir", job_dir, what=f"reading job {job_name}")
        return [p["name"] for p in doc["procs"] if p["state"] == "running"]

    def kill(n: Node) -> NodeKill:
        doc = nodecmd.agent_json(n, lib, "kill", "--job-dir", job_dir, "--grace", str(cfg.kill_grace),
                                 what=f"stopping job {job_name}", timeout=cfg.kill_grace + 60)
        was = before[n.index]
        return NodeKill(n.label, doc["found"], [KillOutcome(**p) for p in doc["procs"]
                                                if p["running"] or p["name"] in was])
    try:
        # What runs everywhere, before any node is told: once one node's agent stops, the running launcher stops
        # the job on the others, which their own kill then finds ended (and must still report).
        snapshot = each_node(nodes, running)
        snapshot.ok(f"reading job {job_name}")
        before = snapshot.values
        return each_node(nodes, kill).ok(f"kill {job_name}")
    finally:
        each_node(nodes, lambda n: n.close())


def kill_summary(cfg: ClusterConfig, job_name: str, nodes: List[NodeKill]) -> str:
    """The last line of ``kill``: how many processes it stopped where, or that nothing of the job ran; a job no
    node knows is an error (exit 1, as ``status`` of it)."""
    hit = [n for n in nodes if n.stopped]
    if not any(n.found for n in nodes):  # a mistyped name must not read as "stopped, all is well"
        raise ClusterError(f"job {job_name}: no node has a record of it (no {cfg.job_dir(job_name)} with process "
                           f"records on any of the {len(nodes)} node(s)), so nothing was stopped; {JOB_NAME_FIX}")
    if not hit:
        return (f"job {job_name}: nothing was running on any of its {len(nodes)} node(s); nothing stopped "
                "(paddle-cluster status shows how it ended)")
    total = sum(len(n.stopped) for n in hit)
    left = sum(1 for n in hit for p in n.stopped if p.how == "still running")
    return (f"job {job_name}: stopped {total - left} process(es) on {len(hit)} node(s) (SIGTERM, SIGKILL after "
            f"KILL_GRACE={cfg.kill_grace:g} s)" + (f"; {left} still running" if left else ""))


def job_status(cfg: ClusterConfig, job_name: str, ended: Optional[dict] = None) -> List[ProcRow]:
    """Every process of the job as its node records it; with ``ended`` (the outcome ``run`` recorded) a job that
    finished shows every process it stopped as finished (a pserver's own exit races with its stop)."""
    nodes, lib, probes = nodes_with_lib(cfg)
    job_dir = cfg.job_dir(job_name)

    def status(n: Node) -> List[ProcRow]:
        doc = nodecmd.agent_json(n, lib, "status", "--job-dir", job_dir, what="reading job status")
        addr = probes[n.index].get("address") or "?"
        # each process's own address as its agent recorded it (a local pserver's loopback one), else the node's
        return [ProcRow(n.name, n.spec.text, p.get("address") or addr, p["name"], p["role"], p["pid"], p["state"],
                        p.get("progress", ""), p["last_line"]) for p in doc["procs"]]
    try:
        rows = [r for per in each_node(nodes, status).ok(f"status of {job_name}") for r in per]
    finally:
        each_node(nodes, lambda n: n.close())
    if ended and ended.get("exit_code") == 0:
        rows = [dataclasses.replace(r, state="finished") if r.state in ("exited 0", "stopped (launcher)")
                else r for r in rows]
    if not rows:
        raise ClusterError(f"job {job_name} has no recorded processes under {job_dir} on any node; {JOB_NAME_FIX}")
    return rows


def resolve_node(cfg: ClusterConfig, text: str) -> int:
    """``node0``, ``0`` or a host as written in HOSTS (or its bare host name)."""
    t = text.strip()
    idx: Optional[int] = None
    if t.startswith("node") and t[4:].isdigit():
        idx = int(t[4:])
    elif t.isdigit():
        idx = int(t)
    else:
        for i, h in enumerate(cfg.hosts):
            if t in (h.text, h.host):
                idx = i
    if idx is None or not 0 <= idx < len(cfg.hosts):
        names = ", ".join(f"node{i} ({h.text})" for i, h in enumerate(cfg.hosts))
        raise UsageError(f"unknown node {text!r}; this cluster has {names}")
    return idx


def stream_logs(cfg: ClusterConfig, job_name: str, node_text: str, role: str, n: int, follow: bool,
                out: Callable[[str], None]) -> int:
    idx = resolve_node(cfg, node_text)
    nodes, lib, _ = nodes_with_lib(cfg)
    node = nodes[idx]
    args = ["logs", "--job-dir", cfg.job_dir(job_name), "--role", role, "-n", str(n)]
    try:
        # Without -f, the lines; with -f, first whether there are logs to follow: a followed stream's exit status
        # is not seen (a mistyped job name printed 'no log directory ...' and exited 0).
        res = node.run(nodecmd.agent_argv(node, lib, *args[:-1], "0" if follow else str(n)), timeout=120)
        if res.exit_code != 0:
            raise HostError(node.label, f"{res.stderr.strip() or 'no logs'} (job {job_name}); {JOB_NAME_FIX}")
        if not follow:
            for line in res.stdout.splitlines():
                out(line)
            return 0
        with stoppable():
            stream = node.stream(nodecmd.agent_argv(node, lib, *args, "-f"))
            try:
                for line in stream.lines():  # ends by itself once the job has ended (the node agent stops)
                    out(line)
            except KeyboardInterrupt:
                pass
            finally:
                stream.close()  # the node agent ends when its stdin does
        return 0
    finally:
        for nd in nodes:
            nd.close()
