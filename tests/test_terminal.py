"""The terminal experience, driven through a pseudo-terminal as a person would (pexpect): every long-running
command ends at once on Ctrl+C, SIGTERM or SIGHUP and takes what it started on the node with it; ``logs -f``
ends by itself when the job ends. Local mode (``HOSTS = ["localhost"]``): the same agent as over SSH."""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import List

import pexpect
import pytest
from helpers import LISTEN_PS_PY, checkout_env, local_conf

TRAIN_PY = """
import sys, time
print("trainer up", flush=True)
if "--forever" in sys.argv:
    while True:
        print("sleeping", flush=True)
        time.sleep(0.5)
"""


class Local:
    """A one-node local cluster config, a workspace and a sandboxed HOME."""

    def __init__(self, tmp: Path) -> None:
        self.tmp, self.root = tmp, tmp / "root"
        self.ws = tmp / "ws"
        self.ws.mkdir()
        (self.ws / "train.py").write_text(TRAIN_PY)
        (self.ws / "ps.py").write_text(LISTEN_PS_PY)
        self.conf = local_conf(tmp, PSERVERS_PER_NODE=1, TRAINERS_PER_NODE=1, PSERVER_COMMAND="{python} ps.py",
                               KILL_GRACE=2.0)
        self.env = checkout_env(HOME=str(tmp), XDG_STATE_HOME=str(tmp / "state"), XDG_CACHE_HOME=str(tmp / "cache"),
                                TERM="xterm")

    def spawn(self, *args: str) -> pexpect.spawn:
        return pexpect.spawn(sys.executable, ["-m", "paddle_cluster", "--conf", str(self.conf), *args],
                             env=self.env, cwd=str(self.tmp), dimensions=(24, 80), encoding="utf-8",
                             codec_errors="replace", timeout=60)


def procs_of(job_dir: Path) -> List[int]:
    """Processes started for ``job_dir``: the node agents (it is on their command line) and the job's own
    processes (they run in it)."""
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            cmd = Path(f"/proc/{d}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            cwd = os.readlink(f"/proc/{d}/cwd")
        except OSError:
            continue
        if str(job_dir) in cmd or cwd.startswith(str(job_dir)):
            found.append(int(d))
    return found


def wait_until(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def ended(child: pexpect.spawn, timeout: float) -> int:
    """Wait for ``child`` to end within ``timeout`` s; its exit status (128+N for a signal)."""
    child.expect(pexpect.EOF, timeout=timeout)
    child.close()
    return child.exitstatus if child.exitstatus is not None else 128 + child.signalstatus


STOPS = {"Ctrl+C": lambda c: c.sendintr(), "SIGTERM": lambda c: c.kill(signal.SIGTERM),
         "SIGHUP": lambda c: c.kill(signal.SIGHUP)}


@pytest.fixture
def local(tmp_path):
    return Local(tmp_path)


def test_long_running_commands_end_on_ctrl_c_sigterm_and_sighup(local):
    """``logs -f`` (finding 1) and ``run`` end within moments of each stop signal, leaving nothing behind;
    ``logs -f`` on a finished job ends by itself."""
    job_dir = local.root / "live"
    run = local.spawn("run", "--job_dispatch_package", str(local.ws), "--job_name", "live", "--", "--forever")
    try:
        run.expect("sleeping")
        before = set(procs_of(job_dir))
        for how, stop in STOPS.items():
            logs = local.spawn("logs", "node0", "--role", "trainer", "-f")
            logs.expect("sleeping")
            wait_until(lambda: len(set(procs_of(job_dir)) - before) > 0, 10, "the node agent of logs -f")
            stop(logs)
            assert ended(logs, timeout=5) in (0, 130), f"logs -f after {how}"
            wait_until(lambda: not set(procs_of(job_dir)) - before, 5, f"the logs agent to end after {how}")
        run.kill(signal.SIGHUP)
        assert ended(run, timeout=20) == 130
    finally:
        run.terminate(force=True)
    wait_until(lambda: not procs_of(job_dir), 10, "every process of the job to end")
    logs = local.spawn("logs", "node0", "-f")
    logs.expect("trainer up")
    assert ended(logs, timeout=10) == 0, "logs -f of a finished job ends by itself"


def table_lines(child: pexpect.spawn) -> List[str]:
    child.expect(pexpect.EOF, timeout=60)
    child.close()
    text = re.sub(r"\x1b\[[0-9;]*m", "", child.before.replace("\r", ""))  # what the terminal shows
    return [ln for ln in text.splitlines() if ln.strip()]


def test_kill_is_an_outcome_and_status_shows_what_run_printed(local):
    """Finding 3: ``kill`` ends the ``run`` it stops with its own exit status (3), no "error"; ``status`` shows
    the recorded outcome and each process as stopped, in a table that fits 80 columns and names the job
    (finding 5); a finished job's pservers are "finished", however their stop raced with their exit."""
    run = local.spawn("run", "--job_dispatch_package", str(local.ws), "--job_name", "victim", "--", "--forever")
    try:
        run.expect("sleeping")
        killer = local.spawn("kill")
        assert ended(killer, timeout=60) == 0
        assert ended(run, timeout=30) == 3
        said = run.before
        assert "stopped by paddle-cluster kill" in said and "error" not in said, said
    finally:
        run.terminate(force=True)
    lines = table_lines(local.spawn("status"))
    assert all(len(ln) <= 80 for ln in lines), "\n".join(lines)
    assert lines[0].startswith("job victim: stopped by paddle-cluster kill (exit 3)"), lines
    text = "\n".join(lines)
    assert text.count("stopped (kill)") == 2, text

    fin = local.spawn("run", "--job_dispatch_package", str(local.ws), "--job_name", "done")
    assert ended(fin, timeout=120) == 0
    lines = table_lines(local.spawn("status"))
    assert lines[0].startswith("job done: finished (exit 0)"), lines
    states = [ln for ln in lines if "pserver.0" in ln or "trainer.0" in ln]
    assert len(states) == 2 and all("finished" in ln for ln in states), lines
