"""The launcher's one way onto the hosts of HOSTS outside a run: the node library installed where its hash is new,
then node sub-commands (``kill``, ``status``, ``logs``, ``plot``), and the ``check`` preflight's probe."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Dict, List

from . import dispatch, machines, preflight
from .config import ClusterConfig, HostSpec
from .errors import ClusterError, HostError
from .fanout import fanout
from .hosts import Node, make_nodes


def nodes_with_lib(cfg: ClusterConfig) -> tuple:
    nodes = make_nodes(cfg)
    return nodes, dispatch.install_library(nodes)


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
