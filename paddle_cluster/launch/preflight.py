"""Checks on the nodes before anything is sent or started, from each node's session answer: its probe (NIC
address, numpy, free ports, a writable ROOT_DIR; the same sentences for ``run`` and ``check``), the trainer
command's script is in ``--job_workspace``, the workspace fits ROOT_DIR's free space. (``entry.settle`` checks
the script of ``--job_dispatch_package`` on this machine.) Each failure names the host and the fix."""

from __future__ import annotations

import os
import posixpath
import shlex
from typing import Any, Dict, List, Optional

from .config import ClusterConfig
from .errors import HostConfigError, HostError
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
