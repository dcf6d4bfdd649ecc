"""Shared helpers: timing statistics, result records, ports, subprocess pservers, /proc readings."""

from __future__ import annotations

import ctypes
import importlib
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from paddle_cluster.contract import PSERVER, TRAINER, Endpoint, JobEnv  # noqa: E402

MB = 1 << 20
SECRET = "b3e2a91f7c4d08e6f5a1c3b97d2e4f60a8c1d5e9b7f3a2c4"  # a job secret as generated: not guessable


@dataclass
class Stats:
    """Median and spread of repeated measurements (seconds, or whatever unit ``samples`` are in)."""

    samples: List[float]

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def lo(self) -> float:
        return min(self.samples)

    @property
    def hi(self) -> float:
        return max(self.samples)

    def pct(self, q: float) -> float:
        s = sorted(self.samples)
        return s[min(len(s) - 1, max(0, int(round(q / 100.0 * (len(s) - 1)))))]

    def spread(self) -> float:
        """(max - min) / median: how noisy the repetitions were."""
        m = self.median
        return (self.hi - self.lo) / m if m else 0.0

    def to_dict(self) -> Dict[str, Any]:
        return {"median": self.median, "min": self.lo, "max": self.hi, "spread": self.spread(), "n": len(self.samples),
                "samples": self.samples}


@dataclass
class Row:
    """One line of the result table."""

    section: str
    name: str
    value: Optional[float]  # the headline number, in ``unit``
    unit: str
    spread: Optional[float] = None  # (max-min)/median of the repetitions
    note: str = ""
    check: str = "ok"  # the correctness check: "ok", "FAILED: ...", or "-" where there is nothing to check
    extra: Dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


@dataclass
class Target:
    """One of the issue's targets: what was measured against what."""

    name: str
    value: Optional[float]
    goal: str
    met: Optional[bool]  # None: not measured (skipped)
    detail: str = ""
    bound: Optional[float] = None  # the best value the cores allow, where both sides are CPU-bound (bench.targets)
    verdict: str = ""  # PASS/MISS and what the bound says of it

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


def timeit(fn: Callable[[], Any], reps: int, warmup: int = 1) -> Stats:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return Stats(out)


def free_port_range(n: int) -> int:
    """First of ``n`` consecutive free ports on 127.0.0.1: the tests' finder (tests/helpers.py)."""
    return tests_helpers().free_port_range(n)


def make_env(hosts: Sequence[str], trainers: int, job_dir: str, *, ports_num: int = 1, sparse_ports: int = 1,
             barrier_timeout: float = 60.0, base_port: Optional[int] = None, integrity: bool = True,
             lane: bool = False) -> JobEnv:
    """``lane``: dense data through a same-host lane; off by default, so every other row measures TCP."""
    per = ports_num + sparse_ports
    if base_port is None:
        base_port = free_port_range(per * len(hosts)) if all(h == "127.0.0.1" for h in hosts) else 7164
    eps = tuple(Endpoint(h, base_port + k * per) for k, h in enumerate(hosts))
    return JobEnv(job_id="bench", pservers=eps, trainers=trainers, ports_num=ports_num,
                  ports_num_for_sparse=sparse_ports, secret=SECRET, job_dir=job_dir, workspace=job_dir,
                  barrier_timeout=barrier_timeout, integrity=integrity, lane=lane)


def proc_environ(env: JobEnv, role: str, index: int, ip: str) -> Dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith("PADDLE_")}
    out.update(env.for_process(role, index, ip).to_environ())
    out["PYTHONPATH"] = REPO + os.pathsep + out.get("PYTHONPATH", "")
    out["PADDLE_LOG_LEVEL"] = "WARNING"
    return out


class Procs:
    """Subprocesses started by one benchmark; ``close`` never leaves one running."""

    def __init__(self, logdir: str) -> None:
        self.logdir = logdir
        os.makedirs(logdir, exist_ok=True)
        self.procs: List[subprocess.Popen] = []

    def start(self, argv: Sequence[str], env: Dict[str, str], name: str, prefix: Sequence[str] = ()
              ) -> subprocess.Popen:
        log = open(os.path.join(self.logdir, f"{name}.log"), "wb")
        p = subprocess.Popen([*prefix, *argv], env=env, stdout=subprocess.PIPE, stderr=log, cwd=REPO,
                             start_new_session=True, stdin=subprocess.PIPE)
        log.close()
        p.log_path = os.path.join(self.logdir, f"{name}.log")  # type: ignore[attr-defined]
        self.procs.append(p)
        return p

    def pserver(self, env: JobEnv, k: int, prefix: Sequence[str] = ()) -> subprocess.Popen:
        p = self.start([sys.executable, "-m", "paddle_cluster.ps"],
                       proc_environ(env, PSERVER, k, env.pservers[k].host), f"pserver{k}", prefix)
        line = p.stdout.readline().decode()
        if not line.startswith("PSERVER_READY"):
            p.wait(10)
            raise RuntimeError(f"pserver {k} did not start: {open(p.log_path).read()[-2000:]}")
        return p

    def trainer(self, env: JobEnv, i: int, args: Sequence[str], ip: str = "127.0.0.1", prefix: Sequence[str] = ()
                ) -> subprocess.Popen:
        return self.start([sys.executable, "-m", "bench.worker", *args], proc_environ(env, TRAINER, i, ip),
                          f"trainer{i}", prefix)

    def close(self) -> None:
        tests_helpers().stop_groups(self.procs)
        self.procs = []


def wait_json(p: subprocess.Popen, timeout: float = 300.0) -> Dict[str, Any]:
    """The last JSON line a worker printed; raises with its log if it failed."""
    import json

    try:
        out, _ = p.communicate(b"\n", timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        raise RuntimeError(f"worker timed out: {open(p.log_path).read()[-2000:]}") from None
    lines = [x for x in out.decode().splitlines() if x.startswith("{")]
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"worker failed (rc={p.returncode}): {open(p.log_path).read()[-3000:]}")
    return json.loads(lines[-1])


def read_json_line(p: subprocess.Popen) -> Dict[str, Any]:
    """The next JSON line a still-running worker prints."""
    import json

    while True:
        line = p.stdout.readline().decode()
        if not line:
            raise RuntimeError(f"worker ended early (rc={p.wait()}): {open(p.log_path).read()[-3000:]}")
        if line.startswith("{"):
            return json.loads(line)


def proc_mem(pid: int) -> Dict[str, int]:
    """VmRSS and VmHWM (peak RSS) of a process, in bytes."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                k, v = line.split(":", 1)
                out[k] = int(v.split()[0]) * 1024
    return out


def loadavg() -> List[float]:
    return [float(x) for x in open("/proc/loadavg").read().split()[:3]]


_CLONE_NEWNET = 0x40000000


def enter_netns(name: str) -> None:
    """Move the calling (single-threaded, freshly forked) process into network namespace ``name``."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns({name})")
    finally:
        os.close(fd)


def _tests_module(name: str):
    """A helper module of tests/ by name (tests/ is on the path only while it loads: the names are generic)."""
    sys.path.insert(0, os.path.join(REPO, "tests"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def tests_helpers():
    """``tests/helpers.py``: the free-port finder, the stand-in processes, the process-group sweep."""
    return _tests_module("helpers")


def sshcluster_module():
    """``tests/sshcluster.py``: the reusable namespace cluster."""
    return _tests_module("sshcluster")


__all__ = ["MB", "Stats", "Row", "Target", "timeit", "make_env", "Procs", "wait_json", "proc_mem", "loadavg",
           "enter_netns", "sshcluster_module", "tests_helpers", "TRAINER", "PSERVER", "JobEnv"]
