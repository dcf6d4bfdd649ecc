"""Checks on the nodes before anything is sent or started, from each node's session answer: the trainer
command's script is in ``--job_workspace``, the workspace fits ROOT_DIR's free space. (``entry.settle`` checks
the script of ``--job_dispatch_package`` on this machine; ports, NIC, numpy and ROOT_DIR are probed by the
backend.) Each failure names the host and the fix."""

from __future__ import annotations

import os
import posixpath
import shlex
from typing import Any, Dict, Optional

from .errors import HostError
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


def check_node(label: str, spec: JobSpec, doc: Dict[str, Any], size: int) -> None:
    """One node's session answer (``node/session.py``: its probe and the workspace's state there) against what
    the job needs: the script is in ``--job_workspace``; ROOT_DIR has room for a workspace of ``size`` bytes
    that must be sent (an archive, then unpacked: twice that)."""
    ws = doc.get("workspace") or {}
    if spec.workspace and ws.get("exists") and ws.get("script") is False:
        path = posixpath.join(spec.workspace, trainer_script(spec.cfg.commands()[1]) or "")
        raise HostError(label, f"{path} (the trainer command's script) does not exist there; copy the workspace "
                        "there, or set TRAINER_COMMAND")
    free = doc["root"].get("free_bytes")
    if size and "need" in ws and free is not None and free < 2 * size:
        raise HostError(label, f"ROOT_DIR {spec.cfg.root_dir} has {free / 1e6:.1f} MB free, the workspace needs "
                        f"{2 * size / 1e6:.1f} MB (archive and unpacked); free space there or set ROOT_DIR to a "
                        f"larger disk (df -h {shlex.quote(spec.cfg.root_dir)})")
