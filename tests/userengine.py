"""The conformance suite's engines as a user drives them (tests/test_conformance.py): the CLI as subprocesses
with the user's conf.py, shell environment and working directory; a run in the background; the sweep of a
job's processes over every host of this machine (one PID space)."""

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
from typing import Callable, List, Optional

import pytest
from conformance_cases import DUAL_HOLD_PY, workspace
from helpers import REPO, free_port_range, rc_python, wait_for

SUITE = secrets.token_hex(2)  # this test session's mark in its job names (Engine.job)

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


def _ssh_engine(request, tmp: Path, name: str) -> Engine:
    if name == "ssh":
        cluster = request.getfixturevalue("ssh_cluster")
        base, opts = os.environ, ["--backend", "ssh"]
    else:
        from enginecluster import mpich_unavailable_reason
        impl = name.split("-")[1]
        if impl == "mpich" and mpich_unavailable_reason():
            pytest.skip(mpich_unavailable_reason())
        mpi = request.getfixturevalue("mpi_env")
        cluster, base, opts = mpi.cluster, mpi.env, ["--backend", "mpi"]
    ctx = rc_python(cluster, tmp)  # the hosts' python with numpy is on the PATH their login shell's rc sets
    ctx.__enter__()
    request.addfinalizer(lambda: ctx.__exit__(None, None, None))

    def quiet() -> None:
        wait_for(lambda: not any(cluster.pids(i) for i in range(cluster.n)), 30, "the hosts to be empty")

    request.addfinalizer(lambda: [cluster.kill_all(i) for i in range(cluster.n)])
    keys = dict(HOSTS=cluster.hosts, ROOT_DIR="/home/paddle", PADDLE_NIC="eth0", PADDLE_PORT=7164,
                PADDLE_PORTS_NUM=2, PADDLE_PORTS_NUM_FOR_SPARSE=1,
                # The test hosts' key and host keys: what a user's ~/.ssh holds (paramiko and mpirun's ssh
                # would not both read a ~/.ssh/config under the test's HOME).
                SSH_IDENTITY_FILE=cluster.key_path, SSH_KNOWN_HOSTS=cluster.known_hosts)
    if name == "mpi-mpich":
        keys["MPI_IMPL"] = "mpich"  # beside Open MPI, `mpirun` is Open MPI's: a MPICH user names it
    # The hosts' home (/root) is this machine's: each host's cache is under its own /home/paddle instead,
    # named by PADDLE_DATA_HOME in ENV (docs/migrating.md#datasets).
    caches = [cluster.root_dir(i) / ".cache" / "paddle" / "dataset" for i in range(cluster.n)]
    for c in caches:
        request.addfinalizer(lambda c=c: shutil.rmtree(c.parent.parent, ignore_errors=True))
    return Engine(name, tmp, readme_conf(tmp / "conf.py", **keys), user_env(tmp, base), opts, 3, 3, quiet,
                  caches=caches, cache_keys={"ENV": {"PADDLE_DATA_HOME": "/home/paddle/.cache/paddle/dataset"}},
                  own_ports=lambda k: ["--port", str(7164 + 100 * k)] if k else [])


def make_engine(request, tmp_path: Path, name: str) -> Engine:
    """The backend ``name`` as a user drives it, with the README's conf.py; its finalizers leave it quiet."""
    home_cache = [tmp_path / ".cache" / "paddle" / "dataset"]  # the user's ~ (HOME is tmp_path: user_env)
    if name == "local":
        # Two pservers and two trainers on the one host (as the built-in local cluster has), so that ids,
        # counts and lists are checked with more than one of each.
        conf = readme_conf(tmp_path / "conf.py", HOSTS=["localhost"], ROOT_DIR=str(tmp_path / "jobs"),
                           PADDLE_NIC="lo", PADDLE_PORT=free_port_range(6), PADDLE_PORTS_NUM=2,
                           PADDLE_PORTS_NUM_FOR_SPARSE=1, PSERVERS_PER_NODE=2, TRAINERS_PER_NODE=2)
        return Engine(name, tmp_path, conf, user_env(tmp_path), [], 2, 2, lambda: None,
                      log_node=lambda t: "localhost", caches=home_cache,
                      own_ports=lambda k: ["--port", str(free_port_range(6))] if k else [], trainers_per_node=2)
    if name in ("ssh", "mpi-openmpi", "mpi-mpich"):
        return _ssh_engine(request, tmp_path, name)
    if name == "slurm":
        slurm = request.getfixturevalue("slurm_cluster")
        # ROOT_DIR on the cluster's shared filesystem (as /home is at a Slurm site); no HOSTS and no BACKEND:
        # Slurm places, and `--backend slurm` on every command chooses the engine.
        conf = readme_conf(tmp_path / "conf.py", ROOT_DIR=str(slurm.shared_dir / tmp_path.name),
                           PADDLE_NIC="eth0", PADDLE_PORT=7164, PADDLE_PORTS_NUM=2, PADDLE_PORTS_NUM_FOR_SPARSE=1)

        def cancel() -> None:
            slurm.run(["scancel", "--user=root"], check=False)
            slurm.wait_quiet()
        request.addfinalizer(cancel)
        # The nodes share this machine's filesystem and get the user's environment (srun --export=ALL), so
        # their ~/.cache is the user's; jobs launched at once may share nodes, so each has its own ports.
        return Engine(name, tmp_path, conf, user_env(tmp_path, slurm.env), ["--backend", "slurm", "--nodes", "3"],
                      3, 3, slurm.wait_quiet, caches=home_cache,
                      own_ports=lambda k: ["--port", str(7164 + 100 * k)] if k else [])
    if name == "k8s":
        from kube.standin import IMAGE
        kube = request.getfixturevalue("kube")
        # conf.py in the directory the user runs from (no --conf): HOSTS x 1 pserver and trainer pods.
        readme_conf(tmp_path / "conf.py", HOSTS=["a", "b"], ROOT_DIR=str(tmp_path / "root"),
                    PADDLE_PORT=free_port_range(3), PADDLE_PORTS_NUM=2, PADDLE_PORTS_NUM_FOR_SPARSE=1)
        eng = Engine(name, tmp_path, None, user_env(tmp_path, kube.env), ["--backend", "k8s", "--image", IMAGE],
                     2, 2, lambda: quiet(), log_node=lambda t: f"trainer.{t}",
                     # A volume every pod mounts (the stand-in's pods see this machine's files), named by
                     # PADDLE_DATA_HOME in ENV: an image has no ~/.cache of the user's.
                     caches=[tmp_path / "datasets"],
                     cache_keys={"ENV": {"PADDLE_DATA_HOME": str(tmp_path / "datasets")}})

        def quiet() -> None:
            left = {}

            def gone() -> bool:
                left.update(objects=sorted(kube.objects()), processes=job_processes(eng.jobs) or kube.processes())
                return not left["objects"] and not left["processes"]
            try:
                wait_for(gone, 60, "no object or pod left")
            except AssertionError:
                raise AssertionError(f"left: {left}") from None
        return eng
    raise AssertionError(name)
