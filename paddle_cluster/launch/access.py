"""The nodes of HOSTS (``make_nodes``, for ``run`` too), and those hosts outside a run (``check``, ``kill``,
``status``, ``logs``, ``plot``, Slurm's shared ROOT_DIR), reached the way ``run`` reaches them: one node session
each (``launch/session.py``), which installs the node library where its hash is new and answers the node's
probe, then ends. The library install and the probe exist only there."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, List, Protocol, Sequence, Tuple

from paddle_cluster.node.session import SessionRequest

from . import dispatch, machines, preflight
from .config import ClusterConfig
from .each_node import NodeResults, each_node
from .errors import ClusterError, HostError
from .hosts import LocalNode, Node
from .session import NodeSession


def make_nodes(cfg: ClusterConfig) -> List[Node]:
    if all(h.is_local for h in cfg.hosts):  # paramiko's import (~0.2 s of CPU) only where a host is remote
        return [LocalNode(i, h, cfg) for i, h in enumerate(cfg.hosts)]
    from .sshnode import SSHNode

    return [(LocalNode if h.is_local else SSHNode)(i, h, cfg) for i, h in enumerate(cfg.hosts)]


def probe_nodes(nodes: Sequence[Node], cfg: ClusterConfig,
                ports: Sequence[int] = ()) -> Tuple[dispatch.Package, NodeResults]:
    """Every node's probe (``ports``: which of them are taken), the node library installed first where it is
    new; the library, and each node's answer or error."""
    with dispatch.library_archive() as lib, open(lib.path, "rb") as f:  # as run reads it (launch/backends/ssh)
        data = f.read()
    req = SessionRequest(cfg.paddle_nic, cfg.root_dir, tuple(ports))

    def probe(n: Node) -> Dict[str, Any]:
        s = NodeSession(n, lib, data, req)
        try:
            return s.open()
        finally:
            s.close()

    return lib, each_node(nodes, probe)


def nodes_with_lib(cfg: ClusterConfig) -> Tuple[List[Node], dispatch.Package, List[Dict[str, Any]]]:
    """The nodes of HOSTS with the node library on each, and each node's probe (its address on PADDLE_NIC)."""
    nodes = make_nodes(cfg)
    lib, res = probe_nodes(nodes, cfg)
    try:
        return nodes, lib, res.ok("installing paddle_cluster on the nodes")
    except BaseException:
        each_node(nodes, lambda n: n.close())
        raise


class CheckLine(Protocol):
    """A row of ``paddle-cluster check``, what one backend checks (a host, a permission): its table cells under
    ``HEADERS`` and, when not ``ok``, the line saying what is wrong."""

    ok: bool
    HEADERS: ClassVar[Tuple[str, ...]]
    WRAP: ClassVar[Tuple[str, ...]]  # the columns that wrap to fit the terminal
    NOUN: ClassVar[str]  # what a row is, for "2 of 3 host(s) failed the check"

    def cells(self) -> List[str]: ...

    def failure(self) -> str: ...


@dataclass(frozen=True)
class CheckRow:
    """A host of HOSTS as ``check`` finds it."""

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

    HEADERS: ClassVar[Tuple[str, ...]] = ("node", "host", "ssh", "python, numpy", "nic", "ports", "ROOT_DIR")
    WRAP: ClassVar[Tuple[str, ...]] = ("host", "python, numpy", "nic", "ports")
    NOUN: ClassVar[str] = "host(s)"

    def cells(self) -> List[str]:
        return [self.node, self.host, self.ssh,
                f"{self.interpreter} ({self.python}), numpy {self.numpy}" if self.python != "-" else "-", self.nic,
                self.ports, f"{self.root_dir}, {self.disk_free} free" if self.disk_free != "-" else self.root_dir]

    def failure(self) -> str:
        return f"{self.node} ({self.host}): {self.problem}"


@dataclass(frozen=True)
class EngineRow:
    """What a backend's engine needs on this machine as ``check`` finds it: the MPI launcher ``run`` would use,
    or the Slurm client commands and the controller."""

    engine: str
    ok: bool
    found: str
    problem: str = ""

    HEADERS: ClassVar[Tuple[str, ...]] = ("engine", "on this machine")
    WRAP: ClassVar[Tuple[str, ...]] = ("on this machine",)
    NOUN: ClassVar[str] = "engine(s)"

    def cells(self) -> List[str]:
        return [self.engine, self.found]

    def failure(self) -> str:
        return f"{self.engine}: {self.problem}"


def check_cluster(cfg: ClusterConfig, ignore: Tuple[str, ...] = ()) -> List[CheckRow]:
    """Preflight every host of HOSTS in parallel (a backend's ``check``); never prompts, never hangs past the
    connect timeout. ``ignore``: the beginnings of problems that do not matter to the backend checking."""
    nodes = make_nodes(cfg)

    def check(n: Node, doc: Dict[str, Any]) -> CheckRow:
        problems = [p for p in preflight.probe_problems(cfg, doc) if not ignore or not p.startswith(ignore)]
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

    _, res = probe_nodes(nodes, cfg, cfg.node_ports())
    each_node(nodes, lambda n: n.close())
    probes: Dict[int, dict] = res.values
    seen = sorted(probes)
    twice = machines.same_machine_problems([nodes[i].label for i in seen], [probes[i] for i in seen])
    same = {seen[k]: why for k, why in twice.items()}
    rows = []
    for n in nodes:
        if n.index in probes:
            row = check(n, probes[n.index])
            if n.index in same:
                row = dataclasses.replace(row, ok=False, problem="; ".join(p for p in (row.problem, same[n.index])
                                                                           if p))
            rows.append(row)
        else:
            err = res.errors[n.index]
            msg = err.message if isinstance(err, HostError) else f"{type(err).__name__}: {err}"
            rows.append(CheckRow(n.name, n.spec.text, False, "FAIL", "-", "-", "-", "-", "-", "-", msg))
    return rows


def as_json(rows: list) -> str:
    """The rows as JSON; a row of ``check`` with its ``kind``: what it is ("host", "engine", "permission")."""
    return json.dumps([{**({"kind": r.NOUN.split("(")[0]} if hasattr(r, "NOUN") else {}), **r.__dict__}
                       for r in rows], indent=1)


def by_kind(rows: Sequence[CheckLine]) -> List[List[CheckLine]]:
    """The rows of ``check``, a table per kind of row (hosts, then the engine...), in order."""
    kinds: Dict[type, List[CheckLine]] = {}
    for r in rows:
        kinds.setdefault(type(r), []).append(r)
    return list(kinds.values())


def verdict(rows: Sequence[CheckLine]) -> None:
    """``check``'s verdict: a ``ClusterError`` counting the failed rows of each kind and saying each one's
    problem, when any failed."""
    counts = [f"{sum(not r.ok for r in same)} of {len(same)} {same[0].NOUN}" for same in by_kind(rows)
              if not all(r.ok for r in same)]
    if counts:
        raise ClusterError(f"{' and '.join(counts)} failed the check:"
                           + "".join(f"\n  {r.failure()}" for r in rows if not r.ok))
