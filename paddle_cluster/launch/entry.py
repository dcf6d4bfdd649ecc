"""A job's entry script and options, settled before anything is dispatched: which script trainers run, whether
pservers run it too (it handles ``PADDLE_TRAINING_ROLE``, as the seeds' scripts do), and the v2 options among
the arguments (``--trainer_count=4`` -> ``PADDLE_INIT_TRAINER_COUNT``; ``--ports_num`` changes the ports)."""

from __future__ import annotations

import ast
import dataclasses
import os
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

from .. import contract
from .config import ClusterConfig, override
from .errors import ConfigError

ROLE_VAR = "PADDLE_TRAINING_ROLE"
DEFAULT_PSERVER = ClusterConfig(hosts=()).pserver_command
_PORT_KEYS = {"port": "paddle_port", "ports_num": "paddle_ports_num",
              "ports_num_for_sparse": "paddle_ports_num_for_sparse"}


@dataclass(frozen=True)
class EntryPlan:
    """The settled config (commands, ports) and what the job's first lines say about it."""

    cfg: ClusterConfig
    init: Dict[str, str]  # v2 options for every process's PADDLE_INIT_* variables
    notes: Tuple[str, ...]


def reads_role(source: str) -> bool:
    """Whether a script's code names ``PADDLE_TRAINING_ROLE`` (a string constant of exactly that text, so a
    docstring mentioning it does not count); a script that does not parse is read as text."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return ROLE_VAR in source
    return any(isinstance(n, ast.Constant) and n.value == ROLE_VAR for n in ast.walk(tree))


def check_workspace(dispatch_dir: Optional[str]) -> None:
    """``--job_dispatch_package DIR`` is a directory here, said before anything is read from it."""
    if dispatch_dir and not os.path.isdir(dispatch_dir):
        what = "is not a directory" if os.path.exists(dispatch_dir) else "no such directory"
        raise ConfigError("--job_dispatch_package", dispatch_dir, f"{what} ({os.path.abspath(dispatch_dir)}); give "
                          "the local directory to copy to every node")


def _source(cfg: ClusterConfig, dispatch_dir: Optional[str], workspace: Optional[str]) -> Optional[str]:
    """The entry script's text, read on this machine; None when it is only on the nodes (--job_workspace)."""
    path = os.path.join(dispatch_dir or workspace or "", cfg.entry)
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError as e:
        if dispatch_dir:
            ws = os.path.abspath(dispatch_dir)
            why = f"no such file in the workspace {ws}" if not os.path.lexists(path) else \
                f"cannot read {os.path.abspath(path)}: {e.strerror or e}"
            scripts = sorted(n for n in os.listdir(ws) if n.endswith(".py"))[:6]
            has = f" (its scripts: {', '.join(scripts)})" if scripts else " (it has no .py file)"
            raise cfg.error("entry", f"{why}{has}; name the script trainers run with --entry SCRIPT or ENTRY in "
                            "the config (default train.py)") from None
        return None


def settle(cfg: ClusterConfig, dispatch_dir: Optional[str], workspace: Optional[str], args: Sequence[str],
           entry: Optional[str] = None) -> EntryPlan:
    """The config a job runs with: ``entry`` (``run --entry``) for ENTRY, the v2 port options applied, and
    PSERVER_COMMAND running the entry script when it handles both roles and was left at its default."""
    check_workspace(dispatch_dir)
    if entry is not None:
        cfg = override(cfg, {"entry": ("--entry", entry)})
    try:
        opts = contract.v2_options(args)
    except contract.ContractError as e:
        raise ConfigError("-- (the entry script's arguments)", None, str(e)) from None
    ports = {_PORT_KEYS[k]: (f"--{k}", int(v)) for k, v in opts.items() if k in _PORT_KEYS}
    if ports:
        cfg = override(cfg, ports)
    notes = []
    if cfg.pserver_command != DEFAULT_PSERVER:
        notes.append(f"pservers run PSERVER_COMMAND = {cfg.pserver_command!r} (from {cfg.source})")
    else:
        src = _source(cfg, dispatch_dir, workspace)
        if src is not None and reads_role(src):
            cfg = dataclasses.replace(cfg, pserver_command="{python} {entry}")
            notes.append(f"{cfg.entry} reads {ROLE_VAR}: pservers run it too (PSERVER role), trainers as TRAINER")
        elif src is not None:
            notes.append(f"{cfg.entry} does not read {ROLE_VAR}: pservers run the built-in pserver "
                         "(python -m paddle_cluster.ps)")
        else:
            notes.append(f"{cfg.entry} is not on this machine, so pservers run the built-in pserver; to run the "
                         f"script in both roles set PSERVER_COMMAND = \"{{python}} {cfg.entry}\"")
    if cfg.pservers_per_node > 1 and cfg.paddle_nic != "lo" and "{entry}" in cfg.pserver_command:
        notes.append(f"PSERVERS_PER_NODE={cfg.pservers_per_node}: {cfg.entry} must name its pserver by "
                     "PADDLE_CURRENT_ENDPOINT; PADDLE_PSERVER_IPS x PADDLE_PSERVER_PORT names one per host")
    if opts:
        notes.append("options: " + ", ".join(f"--{k}={v}" for k, v in opts.items()) + " (PADDLE_INIT_* of every "
                     f"process; the arguments reach every process that runs {cfg.entry})")
    init = {k: v for k, v in opts.items() if k not in _PORT_KEYS}
    return EntryPlan(cfg, init, tuple(notes))
