"""What ``run --backend slurm`` asks of the allocation (``SlurmOptions``: the sbatch options, checked) and the
batch script that asks it."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from typing import List, Optional, Tuple

from ...errors import ConfigError

# sbatch options the backend sets itself (one task per node, its script, output and directory): a pass-through
# of one of them would break the job rather than tune it.
OWNED = {"-N": "--nodes", "--nodes": "--nodes", "-n": "--ntasks", "--ntasks": "--ntasks",
         "--ntasks-per-node": "--ntasks-per-node", "-o": "--output", "--output": "--output", "-e": "--error",
         "--error": "--error", "-D": "--chdir", "--chdir": "--chdir", "-J": "--job-name", "--job-name": "--job-name",
         "--parsable": "--parsable", "--wrap": "--wrap", "-a": "--array", "--array": "--array"}
_MEM = re.compile(r"\d+[KMGT]?")


@dataclass(frozen=True)
class SlurmOptions:
    """What ``run --backend slurm`` asks of the allocation: the sbatch options users set on every submission, and
    any other sbatch option passed through as written (``sbatch_args``)."""

    nodes: int
    partition: Optional[str] = None
    time: Optional[str] = None
    account: Optional[str] = None
    detach: bool = False
    gres: Optional[str] = None
    cpus_per_task: Optional[int] = None
    mem: Optional[str] = None
    exclusive: bool = False
    constraint: Optional[str] = None
    qos: Optional[str] = None
    reservation: Optional[str] = None
    sbatch_args: Tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.mem is not None and not _MEM.fullmatch(self.mem):
            raise ConfigError("--mem", repr(self.mem), "give a size per node as sbatch takes it, a number with an "
                              "optional unit K, M, G or T (e.g. 4G, 4096M; 0 asks for all of each node's memory)")
        if self.cpus_per_task is not None and self.cpus_per_task < 1:
            raise ConfigError("--cpus-per-task", self.cpus_per_task, "give 1 or more")
        for flag, value in (("--gres", self.gres), ("--constraint", self.constraint), ("--qos", self.qos),
                            ("--reservation", self.reservation), ("--partition", self.partition),
                            ("--time", self.time), ("--account", self.account)):
            if value is not None and (not value.strip() or any(c.isspace() for c in value)):
                raise ConfigError(flag, repr(value), f"give a value without spaces (sbatch {flag}=VALUE)")
        for arg in self.sbatch_args:
            name = arg.split("=", 1)[0]
            if not arg.startswith("-") or "\n" in arg:
                raise ConfigError("--sbatch-arg", repr(arg), "give one sbatch option as written on sbatch's command "
                                  "line, e.g. --sbatch-arg=--mail-type=END or --sbatch-arg=--gpus-per-node=2")
            if name in OWNED:
                raise ConfigError("--sbatch-arg", repr(arg), f"paddle-cluster sets sbatch {OWNED[name]} itself (one "
                                  "task per node, its own script, output and directory); use --nodes for the "
                                  "node count and --job_name for the name")

    def sbatch_options(self) -> List[str]:
        """The options of the job's allocation, as sbatch takes them (the script's ``#SBATCH`` lines)."""
        named = (("partition", self.partition), ("time", self.time), ("account", self.account),
                 ("gres", self.gres), ("cpus-per-task", self.cpus_per_task), ("mem", self.mem),
                 ("constraint", self.constraint), ("qos", self.qos), ("reservation", self.reservation))
        return [f"--{k}={v}" for k, v in named if v is not None] + (["--exclusive"] if self.exclusive else []) + \
            list(self.sbatch_args)


def batch_script(name: str, attempt: int, options: List[str], srun: List[str]) -> str:
    """The batch script: every sbatch option as an ``#SBATCH`` line (so the file alone says what was asked, and
    ``sbatch job.sh`` submits it again), then the one ``srun`` step."""
    lines = ["#!/bin/sh", f"# paddle-cluster job {name}, start {attempt}"]
    lines += [f"#SBATCH {_sbatch_quoted(o)}" for o in options]
    return "\n".join([*lines, f"exec {shlex.join(srun)}", ""])


def _sbatch_quoted(option: str) -> str:
    """An option for an ``#SBATCH`` line: sbatch splits those on blanks and honours double quotes."""
    if not any(c.isspace() or c == '"' for c in option):
        return option
    name, eq, value = option.partition("=")
    if '"' in option:
        raise ConfigError("--sbatch-arg", repr(option), "a double quote cannot be passed through an #SBATCH line")
    return f'{name}="{value}"' if eq else f'"{option}"'
