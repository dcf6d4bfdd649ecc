"""The conformance suite's engines as a user drives them (tests/test_conformance.py): the CLI as subprocesses
with the user's conf.py, shell environment and working directory; a run in the background; the sweep of a
job's processes over every host of this machine (one PID space)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, List, Optional

from helpers import REPO, wait_for


@dataclass
class Engine:
    """One backend as a user drives it: the conf.py, the environment and working directory of their shell,
    and the ``run`` options the engine needs."""

    name: str
    tmp: Path
    conf: Optional[Path]
    env: dict
    run_opts: List[str]
    trainers: int
    pservers: int
    quiet: Callable[[], None]  # waits until the engine runs nothing of ours, else fails saying what is left
    log_node: Callable[[int], str] = lambda t: f"node{t}"
    jobs: List[str] = field(default_factory=list)

    def argv(self, *args: str) -> List[str]:
        conf = ["--conf", str(self.conf)] if self.conf else []
        return [sys.executable, "-m", "paddle_cluster", *conf, *args]

    def cli(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(*args), cwd=self.tmp, env=self.env, capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)

    def job(self, scenario: str) -> str:
        """This backend's job name for ``scenario`` (each backend's jobs apart: the ssh and mpi ones share hosts)."""
        name = f"cf{scenario.replace('_', '')}{self.name.replace('-', '')}"
        self.jobs.append(name)
        return name

    def run(self, job: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return self.cli("run", *self.run_opts, "--job_name", job, *args, timeout=timeout)

    def start(self, job: str, *args: str) -> Running:
        return Running(self.argv("run", *self.run_opts, "--job_name", job, *args), self)

    def assert_nothing_left(self) -> None:
        self.quiet()
        wait_for(lambda: not job_processes(self.jobs), 30, f"no process of {self.jobs} left")


class Running:
    """A ``run`` in the background, its output collected line by line."""

    def __init__(self, argv: List[str], engine: Engine) -> None:
        self.p = subprocess.Popen(argv, cwd=engine.tmp, env=engine.env, text=True, stdin=subprocess.DEVNULL,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.out: List[str] = []
        self.err: List[str] = []
        self.readers = [threading.Thread(target=lambda s=s, k=k: k.extend(iter(s.readline, "")), daemon=True)
                        for s, k in ((self.p.stdout, self.out), (self.p.stderr, self.err))]
        for t in self.readers:
            t.start()

    def text(self) -> str:
        return "".join(self.out)[-3000:] + "".join(self.err)[-3000:]

    def wait_lines(self, pattern: str, n: int, timeout: float = 120) -> List[str]:
        def got():
            lines = [x for x in list(self.out) if re.search(pattern, x)]
            assert self.p.poll() is None or len(lines) >= n, f"run ended ({self.p.returncode}):\n{self.text()}"
            return lines if len(lines) >= n else None
        return wait_for(got, timeout, f"{n} lines matching {pattern!r}")

    def wait(self, timeout: float = 120) -> int:
        try:
            rc = self.p.wait(timeout=timeout)
        finally:
            if self.p.poll() is None:
                self.p.kill()
                self.p.wait()
        for t in self.readers:
            t.join(10)
        return rc


def job_processes(jobs: List[str]) -> List[str]:
    """Processes of this machine (one PID space for every host, pod and Slurm node here) whose environment
    places them in one of ``jobs`` (PADDLE_JOB_DIR under ``<root>/<job>``): what a job left running."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for var in env:
            if var.startswith(b"PADDLE_JOB_DIR="):
                parts = var.decode(errors="replace").split("=", 1)[1].split("/")
                if any(j in parts for j in jobs):
                    found.append(f"{pid}: {Path(f'/proc/{pid}/cmdline').read_bytes()[:200]!r}")
    return found


def readme_conf(path: Path, **keys) -> Path:
    """conf.py with the README's keys (and the few ``keys`` a caller adds, each saying why)."""
    path.write_text("".join(f"{k} = {v!r}\n" for k, v in keys.items()))
    return path


def user_env(tmp: Path, base: Optional[dict] = None, **over: str) -> dict:
    """A user's shell: this interpreter's bin first on PATH (an activated venv), a HOME (and so a job journal)
    of the test's own, no PADDLE_* or Slurm job variables leaking from the test's environment."""
    env = {k: v for k, v in (base or os.environ).items() if not k.startswith(("PADDLE_", "SLURM_JOB", "XDG_"))}
    env.update(PATH=f"{Path(sys.executable).parent}:{env.get('PATH', '/usr/bin:/bin')}", HOME=str(tmp),
               PYTHONPATH=str(REPO), **over)
    return env


def pserver_pids(job: str) -> List[int]:
    """The built-in pservers of ``job`` running on this machine's hosts."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"paddle_cluster.ps" in cmd and b"PADDLE_TRAINING_ROLE=PSERVER" in env and any(
                v.startswith(b"PADDLE_JOB_DIR=") and f"/{job}".encode() in v for v in env):
            pids.append(int(pid))
    return pids
