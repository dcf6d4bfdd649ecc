"""Running a node sub-command (``python -m paddle_cluster.node ARGS``) from the node library installed on a node,
over that node's connection: its command line, and its one-line JSON answer."""

from __future__ import annotations

from typing import Any, Dict, List

from paddle_cluster.node import MAIN

from .hosts import Node
from .package import Package


def agent_argv(node: Node, lib: Package, *args: str) -> List[str]:
    """The command line that runs ``python -m paddle_cluster.node ARGS`` from the installed library."""
    return [node.cfg.python, "-c", MAIN, f"{node.cfg.root_dir}/.paddle_cluster/lib/{lib.sha256}", *args]


def agent_json(node: Node, lib: Package, *args: str, what: str, timeout: float = 120,
               stdin: str = "") -> Dict[str, Any]:
    """A node sub-command's JSON answer (``stdin``: what it reads)."""
    return node.run_json(agent_argv(node, lib, *args), what, timeout, stdin)
