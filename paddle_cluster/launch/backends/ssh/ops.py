"""The commands around a job: ``kill``, ``status``, ``logs`` and the ``check`` preflight."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

from ... import dispatch, machines, preflight
from ...config import ClusterConfig, HostSpec
from ...errors import ClusterError, HostError
from ...fanout import fanout
from ...hosts import Node, make_nodes
from ...interrupt import stoppable


def nodes_with_lib(cfg: ClusterConfig) -> tuple:
    nodes = make_nodes(cfg)
    return nodes, dispatch.install_library(nodes)


@dataclass(frozen=True)
class Stopped:
    """A process ``kill`` found running, and how it ended (``killed by SIGTERM``, ``still running``, ...)."""

    name: str
    pid: int
    how: str


@dataclass(frozen=True)
class NodeKill:
    node: str
    found: bool  # the job has a directory with process records on this node
    stopped: List[Stopped]

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
    nodes, lib = nodes_with_lib(cfg)
    job_dir = cfg.job_dir(job_name)

    def running(n: Node) -> List[str]:
        doc = dispatch.agent_json(n, lib, "status", "--job-dir", job_dir, what=f"reading job {job_name}")
        return [p["name"] for p in doc["procs"] if p["state"] == "running"]

    def kill(n: Node) -> NodeKill:
        doc = dispatch.agent_json(n, lib, "kill", "--job-dir", job_dir, "--grace", str(cfg.kill_grace),
                                  what=f"stopping job {job_name}", timeout=cfg.kill_grace + 60)
        was = before[n.index]
        return NodeKill(n.label, doc["found"], [Stopped(p["name"], p["pid"], p["how"]) for p in doc["procs"]
                                                if p["running"] or p["name"] in was])
    try:
        # What runs everywhere, before any node is told: once one node's agent stops, the running launcher stops
        # the job on the others, which their own kill then finds ended (and must still report).
        snapshot = fanout(nodes, running)
        snapshot.ok(f"reading job {job_name}")
        before = snapshot.values
        return fanout(nodes, kill).ok(f"kill {job_name}")
    finally:
        fanout(nodes, lambda n: n.close())


def kill_summary(cfg: ClusterConfig, job_name: str, nodes: List[NodeKill]) -> str:
    """The last line of ``kill``: how many processes it stopped where, or that nothing of the job ran."""
    hit = [n for n in nodes if n.stopped]
    if not hit:
        return (f"job {job_name}: nothing was running on any of its {len(nodes)} node(s); nothing stopped "
                "(paddle-cluster status shows how it ended)")
    total = sum(len(n.stopped) for n in hit)
    left = sum(1 for n in hit for p in n.stopped if p.how == "still running")
    return (f"job {job_name}: stopped {total - left} process(es) on {len(hit)} node(s) (SIGTERM, SIGKILL after "
            f"KILL_GRACE={cfg.kill_grace:g} s)" + (f"; {left} still running" if left else ""))


@dataclass(frozen=True)
class ProcRow:
    node: str
    host: str
    address: str
    name: str
    role: str
    pid: Optional[int]  # None where there is no pid to show: a Kubernetes pod's process (see ``pod``)
    state: str
    progress: str
    last_line: str
    pod: str = ""  # Kubernetes: the pod the process is

    @property
    def pid_text(self) -> str:
        """What the ``pid`` column shows: the pid, or the pod."""
        return str(self.pid) if self.pid is not None else f"pod/{self.pod}" if self.pod else "-"


def job_status(cfg: ClusterConfig, job_name: str, ended: Optional[dict] = None) -> List[ProcRow]:
    """Every process of the job as its node records it; with ``ended`` (the outcome ``run`` recorded) a job that
    finished shows every process it stopped as finished (a pserver's own exit races with its stop)."""
    nodes, lib = nodes_with_lib(cfg)
    job_dir = cfg.job_dir(job_name)

    def status(n: Node) -> List[ProcRow]:
        doc = dispatch.agent_json(n, lib, "status", "--job-dir", job_dir, what="reading job status")
        probe = dispatch.agent_json(n, lib, "probe", "--nic", cfg.paddle_nic, "--root", cfg.root_dir,
                                    what="probing the node")
        addr = probe.get("address") or "?"
        # each process's own address as its agent recorded it (a local pserver's loopback one), else the node's
        return [ProcRow(n.name, n.spec.text, p.get("address") or addr, p["name"], p["role"], p["pid"], p["state"],
                        p.get("progress", ""), p["last_line"]) for p in doc["procs"]]
    try:
        rows = [r for per in fanout(nodes, status).ok(f"status of {job_name}") for r in per]
    finally:
        fanout(nodes, lambda n: n.close())
    if ended and ended.get("exit_code") == 0:
        rows = [dataclasses.replace(r, state="finished") if r.state in ("exited 0", "stopped (launcher)")
                else r for r in rows]
    if not rows:
        raise ClusterError(f"job {job_name} has no recorded processes under {job_dir} on any node")
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
        raise ClusterError(f"unknown node {text!r}; this cluster has {names}")
    return idx


def stream_logs(cfg: ClusterConfig, job_name: str, node_text: str, role: str, n: int, follow: bool,
                out: Callable[[str], None]) -> int:
    idx = resolve_node(cfg, node_text)
    nodes, lib = nodes_with_lib(cfg)
    node = nodes[idx]
    args = ["logs", "--job-dir", cfg.job_dir(job_name), "--role", role, "-n", str(n)]
    try:
        if not follow:
            res = node.run(dispatch.agent_argv(node, lib, *args), timeout=120)
            if res.exit_code != 0:
                raise HostError(node.label, res.stderr.strip() or f"no logs for job {job_name}")
            for line in res.stdout.splitlines():
                out(line)
            return 0
        with stoppable():
            stream = node.stream(dispatch.agent_argv(node, lib, *args, "-f"))
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


@dataclass(frozen=True)
class CheckRow:
    node: str
    host: str
    ok: bool
    ssh: str
    python: str
    numpy: str
    nic: str
    ports: str
    root_dir: str
    disk_free: str
    problem: str = ""
    interpreter: str = "-"  # the absolute path every process there runs (PYTHON as the login shell resolves it)


def check_cluster(cfg: ClusterConfig) -> List[CheckRow]:
    """Preflight every host in parallel; never prompts, never hangs past the connect timeout. With BACKEND slurm
    the nodes are not known before the allocation: this machine is checked (srun runs the nodes with its
    environment, on the shared ROOT_DIR), for the interpreter and ROOT_DIR only."""
    slurm = cfg.backend == "slurm"
    if slurm:
        cfg = dataclasses.replace(cfg, hosts=(HostSpec.parse("localhost"),))
    elif cfg.backend == "k8s":
        raise ClusterError("check --backend k8s: pods run the image's python3 (K8S_IMAGE), which no host here "
                           "can probe; try the image with: docker run IMAGE python3 -c 'import numpy'")
    nodes = make_nodes(cfg)
    ports = ",".join(map(str, cfg.node_ports()))

    def check(n: Node) -> CheckRow:
        try:
            dispatch.ensure_package(n, lib, "lib")
        except HostError as e:
            return CheckRow(n.name, n.spec.text, False, "FAIL", "-", "-", "-", "-", "-", "-", e.message)
        doc = dispatch.agent_json(n, lib, "probe", "--nic", cfg.paddle_nic, "--ports", ports,
                                  "--root", cfg.root_dir, what="probing")
        probes[n.index] = doc
        problems = preflight.probe_problems(cfg, doc)
        if slurm:  # this machine's NIC and ports are not the nodes'
            problems = [p for p in problems if not p.startswith(("PADDLE_NIC", "port("))]
        root = doc["root"]
        free = root.get("free_bytes")
        if free is not None and free < 1 << 30:
            problems.append(f"only {free / 2**30:.2f} GiB free under ROOT_DIR; free space there or set ROOT_DIR "
                            "to a larger disk")
        return CheckRow(
            n.name, n.spec.text, not problems, "local" if n.spec.is_local else "ok", doc["python"],
            doc["numpy"] or "MISSING",
            f"{cfg.paddle_nic}={doc['address'] or 'MISSING'}",
            "taken: " + ",".join(map(str, doc["ports_taken"])) if doc["ports_taken"] else "free",
            "writable" if root.get("writable") else "NOT WRITABLE",
            f"{free / 2**30:.1f} GiB" if free is not None else "-", "; ".join(problems),
            doc.get("python_path") or cfg.python)

    probes: Dict[int, dict] = {}
    with dispatch.library_archive() as lib:
        res = fanout(nodes, check)
    fanout(nodes, lambda n: n.close())
    seen = sorted(probes)
    twice = machines.same_machine_problems([nodes[i].label for i in seen], [probes[i] for i in seen])
    same = {seen[k]: why for k, why in twice.items()}
    rows = []
    for n in nodes:
        if n.index in same and n.index in res.values:
            row = res.values[n.index]
            rows.append(dataclasses.replace(row, ok=False, problem="; ".join(p for p in (row.problem, same[n.index])
                                                                              if p)))
        elif n.index in res.values:
            rows.append(res.values[n.index])
        else:
            err = res.errors[n.index]
            msg = err.message if isinstance(err, HostError) else f"{type(err).__name__}: {err}"
            rows.append(CheckRow(n.name, n.spec.text, False, "FAIL", "-", "-", "-", "-", "-", "-", msg))
    return rows


def as_json(rows: list) -> str:
    return json.dumps([r.__dict__ for r in rows], indent=1)


def status_json(job_name: str, ended: Optional[Dict[str, Any]], rows: List[ProcRow]) -> str:
    """``status --json``: the job, how it ended (null fields while it runs or when it ended elsewhere), its rows."""
    ended = ended or {}
    return json.dumps({"job": job_name, "outcome": ended.get("outcome"), "exit_code": ended.get("exit_code"),
                       "message": ended.get("message"), "processes": [r.__dict__ for r in rows]}, indent=1)
