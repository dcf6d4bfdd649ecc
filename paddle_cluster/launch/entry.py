"""A job as its command line asks for it, settled before anything is dispatched: its spec and name (``job_spec``),
which script trainers run, which program pservers run, and the v2 options among the arguments
(``--trainer_count=4`` -> ``PADDLE_INIT_TRAINER_COUNT``; ``--ports_num`` changes the ports).

Which pserver: ``run --pserver builtin|entry`` when given, else ``PSERVER_COMMAND`` when the config sets it (to any
value, the built-in pserver's own command included), else the entry script when it handles the PSERVER role
(its code compares the role with ``"PSERVER"``, as the seeds' scripts do: ``handles_pserver``), else the built-in
pserver (``python -m paddle_cluster.ps``)."""

from __future__ import annotations

import ast
import dataclasses
import os
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

from .. import contract
from . import journal
from .config import BUILTIN_PSERVER, ENTRY_PSERVER, ClusterConfig, override, refuse_line_break
from .errors import ConfigError
from .plan import JobSpec

ARGS = "-- (the entry script's arguments)"
PSERVER_CHOICES = {"builtin": BUILTIN_PSERVER, "entry": ENTRY_PSERVER}  # run --pserver
_PORT_KEYS = {"port": "paddle_port", "ports_num": "paddle_ports_num",
              "ports_num_for_sparse": "paddle_ports_num_for_sparse"}


@dataclass(frozen=True)
class EntryPlan:
    """The settled config (commands, ports) and what the job's first lines say about it."""

    cfg: ClusterConfig
    init: Dict[str, str]  # v2 options for every process's PADDLE_INIT_* variables
    notes: Tuple[str, ...]


def handles_pserver(source: str) -> bool:
    """Whether a script's code handles the PSERVER role: it names ``"PSERVER"`` (a string constant of exactly that
    text, as in ``role == "PSERVER"``) or a name ``PSERVER`` (``contract.PSERVER``). Docstrings, comments and
    messages such as "one of [TRAINER, PSERVER]" do not count; a script that only checks it is a TRAINER does not
    either. A script that does not parse is read as text."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return '"PSERVER"' in source or "'PSERVER'" in source
    return any((isinstance(n, ast.Constant) and n.value == contract.PSERVER)
               or (isinstance(n, ast.Name) and n.id == contract.PSERVER)
               or (isinstance(n, ast.Attribute) and n.attr == contract.PSERVER) for n in ast.walk(tree))


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
           entry: Optional[str] = None, pserver: Optional[str] = None) -> EntryPlan:
    """The config a job runs with: ``entry`` (``run --entry``) for ENTRY, the v2 port options applied, and the
    pserver chosen (``pserver``: ``run --pserver``, a key of ``PSERVER_CHOICES``; see the module's rule)."""
    for option, value in [("--job_dispatch_package", dispatch_dir), ("--job_workspace", workspace),
                          *((ARGS, a) for a in args)]:
        refuse_line_break(option, value)
    if workspace is not None and not os.path.isabs(workspace):  # else each node resolves it from its own cwd
        raise ConfigError("--job_workspace", workspace, "the workspace's path on every node, absolute (e.g. "
                          "/home/paddle/ws); to copy a directory of this machine, use --job_dispatch_package")
    check_workspace(dispatch_dir)
    if entry is not None:
        cfg = override(cfg, {"entry": ("--entry", entry)})
    try:
        opts = contract.v2_options(args)
    except contract.ContractError as e:
        raise ConfigError(ARGS, None, str(e)) from None
    ports = {_PORT_KEYS[k]: (f"--{k}", int(v)) for k, v in opts.items() if k in _PORT_KEYS}
    if ports:
        cfg = override(cfg, ports)
    if cfg.collective:
        note = _collective(cfg, pserver)
    else:
        chosen = pserver is not None or cfg.pserver_command is not None  # else the script's code decides
        cfg, note = _choose_pserver(cfg, None if chosen else _source(cfg, dispatch_dir, workspace), pserver)
    notes = [note]
    if cfg.pservers_per_node > 1 and cfg.paddle_nic != "lo" and cfg.pserver_runs_entry:
        notes.append(f"PSERVERS_PER_NODE={cfg.pservers_per_node}: {cfg.entry} must name its pserver by "
                     "PADDLE_CURRENT_ENDPOINT; PADDLE_PSERVER_IPS x PADDLE_PSERVER_PORT names one per host")
    if opts:
        notes.append("options: " + ", ".join(f"--{k}={v}" for k, v in opts.items()) + " (PADDLE_INIT_* of every "
                     f"process; the arguments reach every process that runs {cfg.entry})")
    init = {k: v for k, v in opts.items() if k not in _PORT_KEYS}
    return EntryPlan(cfg, init, tuple(notes))


def job_spec(cfg: ClusterConfig, name: Optional[str], dispatch_dir: Optional[str], workspace: Optional[str],
             args: Sequence[str], entry: Optional[str] = None, pserver: Optional[str] = None, reserve: bool = True,
             **fields) -> Tuple[JobSpec, EntryPlan]:
    """The job's spec (``fields``: its other ``JobSpec`` fields) with its config settled (``settle``), and what the
    job's first lines say. Its name: ``name``, else the next free ``JOB<stamp>``, kept as taken (``reserve``; a dry
    run writes nothing) only once the spec is checked: a refused job reserves none."""
    settled = settle(cfg, dispatch_dir, workspace, args, entry, pserver)
    spec = JobSpec(settled.cfg, name or journal.default_job_name(settled.cfg, reserve=False), dispatch_dir, workspace,
                   tuple(args), init=tuple(settled.init.items()), **fields)
    if not name and reserve:
        spec = dataclasses.replace(spec, name=journal.default_job_name(settled.cfg))
    return spec, settled


def _collective(cfg: ClusterConfig, pserver: Optional[str]) -> str:
    """The line saying a job has no pservers, and why; ``run --pserver`` is refused for such a job."""
    why = dict(cfg.options).get("PSERVERS_PER_NODE") or f"PSERVERS_PER_NODE = 0 in {cfg.source}"
    if pserver is not None:
        raise ConfigError("--pserver", pserver, f"this job has no pservers ({why}): drop --pserver, or give the job "
                          "pservers (PSERVERS_PER_NODE >= 1)")
    return (f"no pservers ({why}): {cfg.trainers_per_node} trainer(s) per node, with torch.distributed's and "
            f"paddle.distributed's variables (MASTER_ADDR, MASTER_PORT={cfg.trainer_ports()[0]}, RANK, ...)")


def _choose_pserver(cfg: ClusterConfig, src: Optional[str], option: Optional[str]) -> Tuple[ClusterConfig, str]:
    """The config with PSERVER_COMMAND settled, and the line saying what pservers run, why, and how to change it."""
    e = cfg.entry
    to_builtin = f'run --pserver builtin, or PSERVER_COMMAND = "{BUILTIN_PSERVER}" in conf.py'
    to_entry = f'run --pserver entry, or PSERVER_COMMAND = "{ENTRY_PSERVER}" in conf.py'
    if option is not None:
        cfg = dataclasses.replace(cfg, pserver_command=PSERVER_CHOICES[option])
        what = f"{e} as {contract.ROLE_VAR}=PSERVER" if option == "entry" else \
            "the built-in pserver (python -m paddle_cluster.ps)"
        return cfg, f"pservers run {what}: run --pserver {option}"
    if cfg.pserver_command is not None:
        return cfg, (f"pservers run PSERVER_COMMAND = {cfg.pserver_command!r} (set in {cfg.source}); "
                     "run --pserver builtin|entry overrides it")
    if src is not None and handles_pserver(src):
        return (dataclasses.replace(cfg, pserver_command=ENTRY_PSERVER),
                f"pservers run {e} as {contract.ROLE_VAR}=PSERVER (it handles that role; trainers run it as TRAINER); "
                f"for the built-in pserver instead: {to_builtin}")
    why = (f"{e} does not handle {contract.ROLE_VAR}=PSERVER" if src is not None
           else f"{e} is only on the nodes (--job_workspace), so it was not read")
    return (dataclasses.replace(cfg, pserver_command=BUILTIN_PSERVER),
            f"pservers run the built-in pserver (python -m paddle_cluster.ps): {why}; to run {e} as the pserver "
            f"too: {to_entry}")


def refused_arguments(cfg: ClusterConfig, args: Sequence[str]) -> str:
    """What to say when a process running the entry script exited 2 (argparse's usage error) and the job gave it
    arguments: they reach every process that runs it; a port option is better given to ``run --port``."""
    if not args:
        return ""
    ports = [a for a in args if a.startswith("--") and a[2:].partition("=")[0] in _PORT_KEYS]
    port = (f"; to move the job's ports, give run --port N (PADDLE_PORT) instead of {ports[0]}, which only a script "
            "that accepts it may be given") if ports else ""
    return (f"{cfg.entry} exited 2, a usage error: the arguments after -- ({' '.join(args)}) reach every process "
            f"that runs {cfg.entry}, pservers too when they run it{port}")
