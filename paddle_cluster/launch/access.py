"""The nodes of HOSTS (``make_nodes``, for ``run`` too), and those hosts outside a run (``check``, ``kill``,
``status``, ``logs``, ``plot``, Slurm's shared ROOT_DIR), reached the way ``run`` reaches them: one node session
each (``launch/session.py``), which installs the node library where its hash is new and answers the node's
probe, then ends. The library install and the probe exist only there."""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

from paddle_cluster.node.session import SessionRequest

from . import dispatch
from .config import ClusterConfig
from .each_node import NodeResults, each_node
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
