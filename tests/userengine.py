"""The conformance suite's engines as a user drives them (tests/test_conformance.py): the CLI as subprocesses
with the user's conf.py, shell environment and working directory; a run in the background; the sweep of a
job's processes over every host of this machine (one PID space). Each engine is declared by an ``EngineSpec``
in its module under tests/engines/."""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Tuple

from helpers import REPO, wait_for

SUITE = secrets.token_hex(2)  # this test session's mark in its job names (Engine.job)


# Both roles (PADDLE_TRAINING_ROLE): each prints every PADDLE_* variable (and torchrun's, Paddle fleet's) it got
# as one JSON line; the pserver listens on its ports, the trainer starts a setsid grandchild (which escapes every
# process group); both hold. With the argument ``ignore-term`` the trainers ignore SIGTERM: only SIGKILL ends them.
DUAL_HOLD_PY = r"""
import json, os, signal, socket, subprocess, sys, time
from paddle_cluster.contract import SOCKET_IFNAME_VARS, TORCH_VARS, JobEnv
dump = {k: v for k, v in os.environ.items()
        if k.startswith("PADDLE_") or k in TORCH_VARS + SOCKET_IFNAME_VARS + ("TRAINING_ROLE", "POD_IP")}
if "PADDLE_JOB_SECRET" in dump:
    dump["PADDLE_JOB_SECRET"] = "(set)"  # not into the logs
if os.environ["PADDLE_TRAINING_ROLE"] == "PSERVER":
    env = JobEnv.from_environ()
    socks = [socket.create_server((env.current_ip, port)) for port in env.all_ports(env.pserver_id)]
    print("env " + json.dumps(dump), flush=True)
else:
    print("env " + json.dumps(dump), flush=True)
    subprocess.Popen(["sleep", "300"], start_new_session=True)
    if "ignore-term" in sys.argv[1:]:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("holding", os.environ["PADDLE_TRAINER_ID"], flush=True)
time.sleep(300)
"""


def workspace(tmp: Path, files: Dict[str, str]) -> Path:
    ws = tmp / "ws"
    ws.mkdir()
    for name, text in files.items():
        (ws / name).write_text(text)
    return ws


@dataclass(frozen=True)
class EngineSpec:
    """One engine of the conformance suite, as its module under tests/engines/ declares it."""

    name: str  # its column in the matrix of docs/backends.md
    make: Callable[..., Engine]  # make(request, tmp_path, *the values of ``fixtures``) -> the Engine
    fixtures: Tuple[str, ...] = ()  # what it runs on: the fixtures its module (or conftest.py) gives
    unavailable: Callable[[], Optional[str]] = lambda: None  # why it cannot run here (a skip reason), or None
    # scenario -> why the engine does not offer it: its test checks that the CLI refuses it saying so
    not_offered: Mapping[str, str] = field(default_factory=dict)
    # scenario -> the product bug not fixed yet: xfail(strict=True), so the fix fails the suite until it goes
    known_failures: Mapping[str, str] = field(default_factory=dict)
    # variable -> why this engine adds it to the environment contract (env_ctrl_c compares the rest)
    extra_vars: Mapping[str, str] = field(default_factory=dict)
    # why a job whose launcher was SIGKILLed runs on (launcher_gone); empty: every node's agent stops it
    runs_on_without_launcher: str = ""
    backend: str = ""  # the --backend it drives: its module's BACKEND (set by the registry, engines/__init__.py)


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
    # Each node's dataset cache as seen from here (pre-seeded as a user copies files to every node), and the
    # conf.py keys that point the processes at it where it is not their ~/.cache/paddle/dataset.
    caches: List[Path] = field(default_factory=list)
    cache_keys: dict = field(default_factory=dict)
    # run's arguments giving a second or third job launched at once its own ports where the jobs share hosts
    # (the v2 ``-- --port N``); nothing where every pod has its own address (k8s).
    own_ports: Callable[[int], List[str]] = lambda k: []
    trainers_per_node: int = 1  # TRAINERS_PER_NODE (LOCAL_WORLD_SIZE): a pod, or a host, runs one trainer

    @property
    def conf_file(self) -> Path:
        return self.conf or self.tmp / "conf.py"

    def add_conf(self, **keys) -> None:
        """More keys in the user's conf.py (each caller says why it needs one the README does not have)."""
        with open(self.conf_file, "a") as f:
            f.write("".join(f"{k} = {v!r}\n" for k, v in keys.items()))

    def argv(self, *args: str) -> List[str]:
        conf = ["--conf", str(self.conf)] if self.conf else []
        return [sys.executable, "-m", "paddle_cluster", *conf, *args]

    def cli(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(*args), cwd=self.tmp, env=self.env, capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)

    def job(self, scenario: str) -> str:
        """This backend's job name for ``scenario`` (each backend's jobs apart: the ssh and mpi ones share hosts),
        with this test session's ``SUITE`` token: ``job_processes`` looks machine-wide, and a second suite run on
        the same machine at the same time (two CI runs) must not count as ours."""
        name = f"cf{scenario.replace('_', '')}{self.name.replace('-', '')}{SUITE}"
        self.jobs.append(name)
        return name

    def run(self, job: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return self.cli("run", *self.run_opts, "--job_name", job, *args, timeout=timeout)

    def start(self, job: str, *args: str) -> Running:
        return Running(self.argv("run", *self.run_opts, "--job_name", job, *args), self)

    def start_holding(self, job: str, *args: str) -> Running:
        """``job`` of the dual-role holding workspace (DUAL_HOLD_PY, ``args`` after it) in the background, once
        every trainer says "holding"; a run that does not get there is stopped before the failure is raised."""
        ws = self.tmp / "ws"
        if not (ws / "train.py").exists():  # the workspace of an earlier holding job of this test serves again
            workspace(self.tmp, {"train.py": DUAL_HOLD_PY})
        r = self.start(job, "--job_dispatch_package", str(ws), *args)
        try:
            r.wait_lines(r"\] holding \d", self.trainers)
        except BaseException:
            if r.p.poll() is None:
                r.p.kill()
                r.p.wait()
            raise
        return r

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
        except subprocess.TimeoutExpired:
            raise AssertionError(f"run still running after {timeout:g} s:\n{self.text()}") from None
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


def seed_cache(engine: Engine, dataset: str, *files: Path) -> None:
    """``files`` into every node's dataset cache as dataset ``dataset``'s (``<cache>/<dataset>/<name>``), as a user
    copies them there."""
    for cache in engine.caches:
        for f in files:
            (cache / dataset).mkdir(parents=True, exist_ok=True)
            shutil.copy(f, cache / dataset / f.name)
