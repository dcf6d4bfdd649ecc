"""Checks on the nodes before anything is sent or started, from each node's session answer: its probe (NIC
address, numpy, free ports, a writable ROOT_DIR; the same sentences for ``run`` and ``check``), the trainer
command's script is in ``--job_workspace``, the workspace fits ROOT_DIR's free space. (``entry.settle`` checks
the script of ``--job_dispatch_package`` on this machine.) Each failure names the host and the fix.

``paddle-cluster check`` is the same preflight without a job: a row per thing a backend checks (``CheckLine``: a
host of HOSTS, ``check_cluster``; an engine, ``EngineRow``; a permission), a table per kind, and its verdict."""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import posixpath
import shlex
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, List, Optional, Protocol, Sequence, Tuple

from . import machines
from .access import make_nodes, probe_nodes
from .config import ClusterConfig
from .each_node import each_node
from .errors import ClusterError, HostConfigError, HostError
from .hosts import Node
from .plan import JobSpec


def trainer_script(command: str) -> Optional[str]:
    """The workspace file ``command`` (placeholders filled in) runs: ``train.py`` of ``python3 train.py``; None
    for a module (``-m``), an absolute path or a program found on PATH."""
    try:
        words = shlex.split(command)
    except ValueError:
        return None
    if words and os.path.basename(words[0]).startswith("python"):
        words = words[1:]
        while words and words[0].startswith("-"):
            if words[0] in ("-m", "-c"):
                return None
            words = words[1:]
    if not words or words[0].startswith("/") or ("/" not in words[0] and not words[0].endswith(".py")):
        return None
    return words[0]


# What a script's imports need of a real framework: torch itself, or Paddle 2.x/3.x (a bare ``import paddle``,
# ``paddle.v2`` or ``paddle.fluid`` may be the compatibility package's, which needs nothing).
_NEEDS = {"torch": "torch", "paddle_cluster.torch": "torch", "paddle_cluster.paddle": "paddle"}
_PADDLE_2 = ("nn", "optimizer", "distributed", "io", "vision", "static", "amp", "jit", "metric")
PIP = {"torch": "torch==2.13.0", "paddle": "paddlepaddle==3.3.1"}


def frameworks_needed(source: Optional[str]) -> Tuple[str, ...]:
    """The frameworks (``torch``, ``paddle``) an entry script imports, read from its ``import`` statements
    without running it; () when it does not parse."""
    try:
        tree = ast.parse(source or "")
    except (SyntaxError, ValueError):
        return ()
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    found = set()
    for name in names:
        parts = name.split(".")
        for k in range(len(parts), 0, -1):
            if ".".join(parts[:k]) in _NEEDS:
                found.add(_NEEDS[".".join(parts[:k])])
        if parts[0] == "paddle" and len(parts) > 1 and parts[1] in _PADDLE_2:
            found.add("paddle")
    return tuple(sorted(found))


def entry_source(spec: JobSpec) -> Optional[str]:
    """The text of the script the trainers run, when it is on this machine (``--job_dispatch_package``)."""
    script = trainer_script(spec.cfg.commands()[1])
    if not spec.dispatch_dir or script is None:
        return None
    try:
        with open(os.path.join(spec.dispatch_dir, script), encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def framework_problems(cfg: ClusterConfig, doc: Dict[str, Any], needs: Sequence[str]) -> List[str]:
    """The frameworks the entry script imports (``needs``) that the node's interpreter lacks, with the fix."""
    have = doc.get("frameworks") or {}
    script = trainer_script(cfg.commands()[1]) or cfg.entry
    return [f"{script} imports {fw}, which PYTHON there ({cfg.python}: {doc.get('python_path')}) cannot import; "
            f"install it there ({cfg.python} -m pip install {PIP[fw]}) or set PYTHON in {cfg.source} to an "
            "interpreter that has it" for fw in needs if fw in have and have[fw] is None]


def probe_problems(cfg: ClusterConfig, doc: Dict[str, Any]) -> List[str]:
    """What keeps a node from running a job, from its probe (``node/probe.py``): one sentence each, with the fix."""
    problems = []
    if not doc["address"]:
        have = ", ".join(f"{k} ({v or 'no IPv4'})" for k, v in doc["interfaces"].items())
        problems.append(f"PADDLE_NIC = {cfg.paddle_nic!r} has no IPv4 address there"
                        f"{'' if cfg.paddle_nic in doc['interfaces'] else ' (no such interface)'}; "
                        f"it has: {have}. Set PADDLE_NIC to one of them")
    if doc["numpy"] is None:
        problems.append(f"numpy is not installed for {cfg.python} ({doc['python_path']}); "
                        f"install it there: {cfg.python} -m pip install numpy")
    if doc["ports_taken"]:
        problems.append(f"port(s) {', '.join(map(str, doc['ports_taken']))} on {doc['address']} are already in use "
                        "(another job?); choose another PADDLE_PORT (or run --port N) or stop that job")
    if not doc["root"].get("writable"):
        problems.append(f"ROOT_DIR {cfg.root_dir} is not writable: {doc['root'].get('error')}")
    return problems


def check_node(label: str, spec: JobSpec, doc: Dict[str, Any], size: int) -> None:
    """One node's session answer (``node/session.py``: its probe and the workspace's state there) against what
    the job needs: the script is in ``--job_workspace``; ROOT_DIR has room for a workspace of ``size`` bytes
    that must be sent (unpacked as it arrives: no archive is kept)."""
    ws = doc.get("workspace") or {}
    if spec.workspace and ws.get("exists") and ws.get("script") is False:
        path = posixpath.join(spec.workspace, trainer_script(spec.cfg.commands()[1]) or "")
        raise HostConfigError(label, f"{path} (the trainer command's script) does not exist there; copy the "
                              "workspace there, or set TRAINER_COMMAND")
    free = doc["root"].get("free_bytes")
    if size and "need" in ws and free is not None and free < size:
        raise HostError(label, f"ROOT_DIR {spec.cfg.root_dir} has {free / 1e6:.1f} MB free, the workspace needs "
                        f"{size / 1e6:.1f} MB (unpacked); free space there or set ROOT_DIR to a "
                        f"larger disk (df -h {shlex.quote(spec.cfg.root_dir)})")


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
    frameworks: str = ""  # "torch 2.13.0, paddle -": what PYTHON there can import of them (a script's may need)

    HEADERS: ClassVar[Tuple[str, ...]] = ("node", "host", "ssh", "python, numpy", "nic", "ports", "ROOT_DIR")
    WRAP: ClassVar[Tuple[str, ...]] = ("host", "python, numpy", "nic", "ports")
    NOUN: ClassVar[str] = "host(s)"

    def cells(self) -> List[str]:
        return [self.node, self.host, self.ssh,
                f"{self.interpreter} ({self.python}), numpy {self.numpy}{'; ' if self.frameworks else ''}"
                f"{self.frameworks}" if self.python != "-" else "-", self.nic,
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
        problems = [p for p in probe_problems(cfg, doc) if not ignore or not p.startswith(ignore)]
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
            doc.get("python_path") or cfg.python,
            ", ".join(f"{k} {v or '-'}" for k, v in (doc.get("frameworks") or {}).items()))

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
