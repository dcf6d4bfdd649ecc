"""The terminal experience, driven through a pseudo-terminal as a person would (pexpect): every long-running
command ends at once on Ctrl+C, SIGTERM or SIGHUP and takes what it started on the node with it; ``logs -f``
ends by itself when the job ends. Local mode (``HOSTS = ["localhost"]``): the same agent as over SSH."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional

import pexpect
import pytest
from helpers import LISTEN_PS_PY, checkout_env, local_conf

TRAIN_PY = """
import sys, time
print("trainer up", flush=True)
if "--fail" in sys.argv:
    print("giving up", flush=True)
    sys.exit(3)
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
        # PSERVER_COMMAND: a pserver that only listens; the tests are about the terminal's output.
        self.conf = local_conf(tmp, PSERVERS_PER_NODE=1, TRAINERS_PER_NODE=1, PSERVER_COMMAND="{python} ps.py",
                               KILL_GRACE=2.0)
        self.env = checkout_env(HOME=str(tmp), XDG_STATE_HOME=str(tmp / "state"), XDG_CACHE_HOME=str(tmp / "cache"),
                                TERM="xterm")

    def spawn(self, *args: str, conf: Optional[Path] = None) -> pexpect.spawn:
        return pexpect.spawn(sys.executable, ["-m", "paddle_cluster", "--conf", str(conf or self.conf), *args],
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
        said = outcome_line(run.before)
    finally:
        run.terminate(force=True)
    wait_until(lambda: not procs_of(job_dir), 10, "every process of the job to end")
    assert_status_says(local, "live", "interrupted (Ctrl+C, SIGTERM or SIGHUP) (exit 130)", said)
    logs = local.spawn("logs", "node0", "-f")
    logs.expect("trainer up")
    assert ended(logs, timeout=10) == 0, "logs -f of a finished job ends by itself"


def table_lines(child: pexpect.spawn) -> List[str]:
    child.expect(pexpect.EOF, timeout=60)
    child.close()
    return shown(child.before)


def shown(text: str) -> List[str]:
    """The non-empty lines a terminal shows for ``text`` (escape sequences and carriage returns dropped)."""
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text.replace("\r", ""))
    return [ln for ln in text.splitlines() if ln.strip()]


def outcome_line(text: str) -> str:
    """The last line ``run`` printed about how the job ended, without ``paddle-cluster: [error: ]``."""
    said = [ln for ln in shown(text) if ln.startswith("paddle-cluster: ")]
    return re.sub(r"^paddle-cluster: (error: )?", "", said[-1])


def assert_status_says(local: Local, job: str, outcome: str, said: str) -> None:
    """``status`` of ``job`` in an 80-column terminal: every line fits, the title names the job and its
    outcome, and the caption is the line ``run`` printed (``said``), as recorded. (Above it, the config it
    read: a path, which the terminal wraps like any long path.)"""
    config, *lines = table_lines(local.spawn("status", "--job_name", job))
    assert config == f"paddle-cluster: config {local.conf}", config
    assert all(len(ln) <= 80 for ln in lines), "\n".join(lines)
    assert lines[0].rstrip() == f"job {job}: {outcome}", lines
    assert " ".join(said.split()) in " ".join(" ".join(lines).split()), (said, lines)


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
    assert_status_says(local, "victim", "stopped by paddle-cluster kill (exit 3)", outcome_line(said))
    lines = table_lines(local.spawn("status"))
    text = "\n".join(lines)
    assert text.count("stopped (kill)") == 2, text

    fin = local.spawn("run", "--job_dispatch_package", str(local.ws), "--job_name", "done")
    assert ended(fin, timeout=120) == 0
    assert_status_says(local, "done", "finished (exit 0)", outcome_line(fin.before))
    lines = table_lines(local.spawn("status"))
    states = [ln for ln in lines if "pserver.0" in ln or "trainer.0" in ln]
    assert len(states) == 2 and all("finished" in ln for ln in states), lines


def test_failed_run_names_the_process_and_status_shows_the_same(local):
    """A failing trainer: ``run`` names the process, its exit code and last lines (exit 1); ``status`` shows the
    same outcome, and the trainer's state, in 80 columns."""
    run = local.spawn("run", "--job_dispatch_package", str(local.ws), "--job_name", "bad", "--", "--fail")
    assert ended(run, timeout=120) == 1
    said = outcome_line(run.before)
    lines = shown(run.before)
    assert "paddle-cluster: error: trainer.0 on node0 (localhost) exited with code 3" in lines, lines
    assert any("giving up" in ln for ln in lines[lines.index(
        "paddle-cluster: error: trainer.0 on node0 (localhost) exited with code 3"):]), lines  # its last lines
    assert said.startswith("trainer.0 on node0 (localhost) exited with code 3"), said
    assert_status_says(local, "bad", "failed (exit 1)", said)
    assert any(ln.startswith("trainer.0") and "exited 3" in ln for ln in table_lines(local.spawn("status"))), lines


def test_check_table_fits_80_columns_and_says_local(local):
    """``check`` in local mode, in an 80-column terminal: the table alone, every line fits, and the ssh column
    says the node is local, not "ok"."""
    lines = table_lines(local.spawn("check"))
    assert all(len(ln) <= 80 for ln in lines), "\n".join(lines)
    assert lines[0].split()[:3] == ["node", "host", "ssh"], lines
    row = [ln for ln in lines if ln.startswith("node0")]
    assert len(row) == 1 and row[0].split()[1:3] == ["localhost", "local"], lines
    assert "ssh ok" not in "\n".join(lines)


def test_output_for_the_person_at_the_terminal(local):
    """Finding 5: the built-in pserver's INFO lines stay in its log file unless ``run --verbose``; an upload bar
    only on a terminal and only for a node actually sent the archive (never a bar, then "already held"); no
    stray blank line when the output is not a terminal."""
    conf = local_conf(local.tmp, "builtin.py", PSERVERS_PER_NODE=1, TRAINERS_PER_NODE=1)  # the real pserver
    first = local.spawn("run", "--job_dispatch_package", str(local.ws), "--job_name", "one", conf=conf)
    assert ended(first, timeout=120) == 0
    lines = shown(first.before)
    assert any(ln.startswith("upload node0") for ln in lines), lines
    assert not any(" pserver[0] INFO " in ln for ln in lines), lines
    assert " pserver[0] INFO " in (local.root / "one" / "log" / "server.log").read_text()

    again = local.spawn("run", "--job_dispatch_package", str(local.ws), "--job_name", "two", conf=conf)
    assert ended(again, timeout=120) == 0
    lines = shown(again.before)
    assert "paddle-cluster: node0 already held this package: not sent again" in lines, lines
    assert not any(ln.startswith("upload") for ln in lines), lines

    (local.ws / "more.txt").write_text("a new workspace: sent again\n")
    for job, verbose in (("piped", ()), ("piped-v", ("--verbose",))):
        res = subprocess.run([sys.executable, "-m", "paddle_cluster", "--conf", str(conf), "run", *verbose,
                              "--job_dispatch_package", str(local.ws), "--job_name", job], capture_output=True,
                             text=True, timeout=120, env=local.env, cwd=str(local.tmp), stdin=subprocess.DEVNULL)
        assert res.returncode == 0, res.stdout + res.stderr
        for text in (res.stdout, res.stderr):
            assert text.strip() and "" not in text.splitlines(), repr(text)  # no blank line
        assert "upload" not in res.stderr, res.stderr  # "piped" was sent the new workspace: still no bar
        assert ("already held this package" in res.stderr) == bool(verbose), res.stderr
        assert (" pserver[0] INFO " in res.stdout) == bool(verbose), res.stdout
