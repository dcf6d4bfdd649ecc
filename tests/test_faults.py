"""Fault injection on the SSH test cluster (tests/sshcluster.py), one test per fault.

Each test ends with the outcome (recovered / failed cleanly), the final parameters where it recovered, and
zero processes left in every namespace. The workspace's train.py pushes a gradient of ones with SGD lr=0.5
every step, so in sync mode the final parameters are exactly ``-0.5 * TOTAL`` whatever was rolled back and
replayed; trainer 0 checkpoints every EVERY steps. Timings are printed (``pytest -s``) for
docs/reliability.md.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from test_launcher import assert_nothing_left, no_traceback, wait_for, write_conf

TRAIN_PY = r'''
import os, sys, time
import numpy as np
from paddle_cluster.runtime import OptimizerSpec, connect
total, every, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
delay = float(os.environ.get("STEP_DELAY", "0.05"))
n = int(os.environ.get("PARAM_SIZE", "40000"))
ps = connect(mode=mode, optimizer=OptimizerSpec("sgd", lr=0.5))
w = ps.register_dense({"w": np.zeros(n, np.float32)})["w"]
print(f"start step={ps.step} w0={w[0]:g}", flush=True)   # a resumed job starts at the checkpoint's step
g = np.ones(n, np.float32)
while ps.step < total:
    ps.pull()
    ps.push({"w": g})
    if ps.trainer_id == 0 and ps.step % every == 0:
        info = ps.save_checkpoint()
        print(f"checkpoint step={info.step}", flush=True)
    time.sleep(delay)
w = ps.pull()["w"]
print(f"end step={ps.step} w0={w[0]:g} all_equal={bool((w == w[0]).all())}", flush=True)
ps.close()
'''

# A pserver that, when SLOW_SAVE_STEP is its checkpoint's step, writes half the shard file and then stalls,
# so a test can SIGKILL it in the middle of the write.
SLOW_PS_PY = r'''
import os, sys, time
from paddle_cluster.runtime import checkpoint as ckpt
from paddle_cluster import pserver
real = ckpt.write_atomic
def write_atomic(path, write):
    stall = os.environ.get("SLOW_SAVE_STEP")
    if stall and f"step-{int(stall):08d}" in path and path.endswith("shard.npz"):
        def slow(f):
            write(f)
            f.flush()
            f.truncate(f.tell() // 2)
            print(f"WRITING {path}", flush=True)
            time.sleep(3600)
        return real(path, slow)
    return real(path, write)
ckpt.write_atomic = write_atomic
sys.exit(pserver.main())
'''

TOTAL, EVERY = 60, 10
FAST = {"BARRIER_TIMEOUT": 5.0, "ORPHAN_TIMEOUT": 5.0, "KILL_GRACE": 1.0, "START_TIMEOUT": 20.0,
        "SSH_CONNECT_TIMEOUT": 4.0, "PSERVER_COMMAND": "{python} -m paddle_cluster.pserver",
        "PADDLE_PORTS_NUM": 1, "PADDLE_PORTS_NUM_FOR_SPARSE": 0, "ENV": {}}


def workspace(tmp: Path) -> Path:
    ws = tmp / "ws"
    ws.mkdir(exist_ok=True)
    (ws / "train.py").write_text(TRAIN_PY)
    (ws / "slow_ps.py").write_text(SLOW_PS_PY)
    return ws


def conf(tmp: Path, cluster, name: str = "conf.py", **over) -> Path:
    return write_conf(tmp, cluster, name, **{**FAST, **over})


class Launch:
    """``paddle-cluster run`` in the background; every output line kept with the time it arrived."""

    def __init__(self, conf_path: Path, *args: str) -> None:
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-m", "paddle_cluster", "--conf", str(conf_path), "run",
                                      *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     stdin=subprocess.DEVNULL)
        self.lines: list = []  # (time, stream, line)
        self._lock = threading.Lock()
        self._readers = [threading.Thread(target=self._read, args=(f, k), daemon=True)
                         for f, k in ((self.proc.stdout, "out"), (self.proc.stderr, "err"))]
        for t in self._readers:
            t.start()

    def _read(self, f, kind: str) -> None:
        for line in iter(f.readline, ""):
            with self._lock:
                self.lines.append((time.monotonic(), kind, line.rstrip("\n")))

    def find(self, pattern: str, after: float = 0.0):
        """(time, line) of the first line at or after ``after`` matching the regex, or None."""
        with self._lock:
            for t, _, line in self.lines:
                if t >= after and re.search(pattern, line):
                    return t, line
        return None

    def wait_line(self, pattern: str, timeout: float = 60.0, after: float = 0.0):
        return wait_for(lambda: self.find(pattern, after), timeout, f"a line matching {pattern!r}; got:\n"
                        + self.text()[-3000:])

    def finish(self, timeout: float = 120.0) -> int:
        try:
            self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        for t in self._readers:
            t.join(timeout=5)
        return self.proc.returncode

    @property
    def stdout(self) -> str:
        return "\n".join(line for _, k, line in self.lines if k == "out")

    @property
    def stderr(self) -> str:
        return "\n".join(line for _, k, line in self.lines if k == "err")

    def text(self) -> str:
        return "\n".join(f"{k}: {line}" for _, k, line in self.lines)


def proc_pid(cluster, node: int, job: str, name: str) -> int:
    """The pid the agent recorded for process ``name`` of ``job`` on ``node`` (latest record wins)."""
    path = cluster.root_dir(node) / job / ".paddle_cluster" / "procs.json"

    def get():
        try:
            recs = [p for p in json.loads(path.read_text())["procs"] if p["name"] == name]
        except (OSError, ValueError, KeyError):
            return None
        return recs[-1]["pid"] if recs else None
    return wait_for(get, 30, f"{name} of {job} on node{node}")


def final_w(run: Launch, trainers: int = 3) -> float:
    ends = [run.find(rf"\[trainer\.{t}@node\d\] end step=") for t in range(trainers)]
    assert all(ends), run.text()[-3000:]
    values = {float(re.search(r"w0=(\S+)", e[1]).group(1)) for e in ends}
    assert all("all_equal=True" in e[1] for e in ends)
    assert len(values) == 1, values
    return values.pop()


def report(row: str, outcome: str, **facts) -> None:
    print(f"\nFAULT {row}: {outcome}; " + ", ".join(f"{k}={v}" for k, v in facts.items()))


@pytest.fixture
def cluster(ssh_cluster):
    yield ssh_cluster
    for i in range(len(ssh_cluster.hosts)):
        ssh_cluster.kill_all(i)


def _run_args(ws: Path, job: str, *extra: str, mode: str = "sync", total: int = TOTAL, every: int = EVERY):
    return ("--job_dispatch_package", str(ws), "--job_name", job, *extra, "--", str(total), str(every), mode)


@pytest.mark.timeout(120)
def test_sigkill_pserver_restarts_from_checkpoint(cluster, tmp_path):
    run = Launch(conf(tmp_path, cluster), *_run_args(workspace(tmp_path), "f_kill_ps", "--max_restarts", "2"))
    run.wait_line(r"checkpoint step=20")
    pid = proc_pid(cluster, 1, "f_kill_ps", "pserver.1")
    os.kill(pid, signal.SIGKILL)
    t_kill = time.monotonic()
    t_det, line = run.wait_line(r"restarting the job from", 30)
    assert re.search(rf"pserver\.1 on node1 \({cluster.hosts[1]}\) killed by SIGKILL; restarting the job from "
                     r"checkpoint step (20|30) \(restart 1 of 2\)", line), line
    step = int(re.search(r"step (\d+)", line).group(1))
    t_back, _ = run.wait_line(rf"\[trainer\.0@node0\] start step={step} w0={-0.5 * step:g}$", 60, after=t_det)
    assert run.finish(120) == 0, run.text()[-3000:]
    assert "finished: all 3 trainer(s) exited 0 after 1 restart(s)" in run.stderr
    w = final_w(run)
    assert w == -0.5 * TOTAL
    no_traceback(subprocess.CompletedProcess([], 0, run.stdout, run.stderr))
    assert_nothing_left(cluster)
    report("SIGKILL pserver", "recovered", resumed_step=step, detect_s=f"{t_det - t_kill:.1f}",
           recover_s=f"{t_back - t_kill:.1f}", final_w=w)


@pytest.mark.timeout(120)
def test_sigkill_pserver_without_restarts_fails_fast(cluster, tmp_path):
    run = Launch(conf(tmp_path, cluster), *_run_args(workspace(tmp_path), "f_kill_ps0"))
    run.wait_line(r"checkpoint step=10")
    os.kill(proc_pid(cluster, 2, "f_kill_ps0", "pserver.2"), signal.SIGKILL)
    t_kill = time.monotonic()
    assert run.finish(60) == 1
    took = time.monotonic() - t_kill
    assert f"pserver.2 on node2 ({cluster.hosts[2]}) killed by SIGKILL while trainers were still running" \
        in run.stderr, run.stderr
    assert_nothing_left(cluster)
    report("SIGKILL pserver, no --max_restarts", "failed cleanly", exit_s=f"{took:.1f}")
