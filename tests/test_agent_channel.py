"""The launcher's side of the agent channel, on the SSH test cluster (tests/sshcluster.py): lines that are not
events are shown and never end the reader, an over-long line is dropped without being held whole, and the
event queue is bounded with back-pressure that still lets a stop through.
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

import pytest
from helpers import assert_nothing_left, make_workspace, wait_for, write_conf


class PeakRSS:
    """The peak RSS (VmHWM) of a running process, sampled until it exits (VmHWM starts afresh at exec)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.kib = pid, 0
        self._t = threading.Thread(target=self._watch, daemon=True)
        self._t.start()

    def _watch(self) -> None:
        while True:
            try:
                with open(f"/proc/{self.pid}/status") as f:
                    hwm = [int(ln.split()[1]) for ln in f if ln.startswith("VmHWM:")]
            except OSError:
                return
            if not hwm:  # a zombie: it has exited
                return
            self.kib = max(self.kib, hwm[0])
            time.sleep(0.05)

    def result(self) -> int:
        self._t.join(timeout=10)
        return self.kib


def launch(conf, *args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "paddle_cluster", "--conf", str(conf), "run", *args],
                            stdin=subprocess.DEVNULL, **kw)


# What the agent's command (the node session that becomes the agent, or a restart's ``supervise``) prints before
# the agent starts: lines that are not events, one nested too deeply for json, and one 150 MB line.
NOISY_PYTHON = """#!/bin/sh
case " $* " in *" supervise "*|*"node.session import main"*)
  printf '[1, 2]\\n"just a string"\\n{"type": "Log"}\\n'
  head -c 100000 /dev/zero | tr '\\0' '['; echo
  printf '{"type":"Note","node":0,"line":"'; head -c 157286400 /dev/zero | tr '\\0' a; printf '"}\\n'
esac
exec "%s" "$@"
"""


@pytest.mark.timeout(180)
def test_lines_that_are_not_events_are_shown_and_a_huge_one_is_dropped(cluster, tmp_path):
    """A line nested too deeply for json ended the launcher's reader (the job then failed as "lost contact"),
    and one 150 MB line was read whole. Now every such line is shown as the agent's, the 150 MB one as one
    line saying it was dropped, the launcher's peak RSS stays small, and the job runs to its end. PYTHON is a
    path with a space in it (it was split into two words)."""
    py_dir = tmp_path / "my python"
    py_dir.mkdir()
    python = py_dir / "python3"
    python.write_text(NOISY_PYTHON % cluster.python)
    python.chmod(0o755)
    # PYTHON: the test is about an interpreter that writes to the agent's channel before the agent speaks.
    conf = write_conf(tmp_path, cluster, hosts=cluster.hosts[:1], PYTHON=str(python))
    run = launch(conf, "--job_dispatch_package", str(make_workspace(tmp_path / "ws")), "--job_name", "noisy",
                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = PeakRSS(run.pid)
    out, err = run.communicate(timeout=150)
    assert run.returncode == 0, out[-3000:] + err[-3000:]
    assert "ENV OK trainer 0 of 1" in out and "job noisy finished" in err
    for shown in ("[agent@node0] [1, 2]", '[agent@node0] "just a string"', '[agent@node0] {"type": "Log"}',
                  "[agent@node0] [[[[[[[["):
        assert shown in out, shown
    dropped = re.findall(r"\[agent@node0\] \(a line of (\d+) bytes was dropped: over the 1048576-byte limit", out)
    assert [int(n) for n in dropped] == [150 * 2**20 + 35], dropped
    assert max(len(line) for line in out.splitlines()) < 5000
    assert peak.result() < 150 * 1024, f"launcher peak RSS {peak.kib} KiB"
    assert_nothing_left(cluster)


# Output as fast as the pipe takes it: 1 MB writes of 10000 lines each, 2 million lines in all.
FLOOD_TRAIN_PY = r'''
import os
chunk = (b"x" * 99 + b"\n") * 10000
for _ in range(200):
    os.write(1, chunk)
os.write(1, b"WROTE ALL\n")
'''


def _wchan(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/wchan") as f:
            return f.read()
    except OSError:
        return ""


@pytest.mark.timeout(240)
def test_event_queue_is_bounded_and_a_stop_still_gets_through(cluster, tmp_path):
    """The launcher's event queue grew without bound when its output was not read as fast as a trainer wrote.
    Now it holds at most 10000 events: the trainer and its agent are held up waiting to write long before the
    trainer's 2 million lines, the launcher's RSS stays bounded, and Ctrl+C still stops the job everywhere,
    the agent confirming, although the queue is full and the readers wait on it."""
    job = "backpressure"
    ws = make_workspace(tmp_path / "ws")
    (ws / "train.py").write_text(FLOOD_TRAIN_PY)
    conf = write_conf(tmp_path, cluster, hosts=cluster.hosts[:1])
    run = launch(conf, "--job_dispatch_package", str(ws), "--job_name", job, stdout=subprocess.PIPE,
                 stderr=subprocess.PIPE)  # stdout is not read: the launcher's printing stalls
    peak = PeakRSS(run.pid)
    err = []
    reader = threading.Thread(target=lambda: err.append(run.stderr.read()), daemon=True)
    reader.start()
    try:
        procs = cluster.root_dir(0) / job / ".paddle_cluster" / "procs.json"
        log = cluster.root_dir(0) / job / "log" / "train.log"
        trainer = wait_for(lambda: _trainer_pid(procs), 60, "the trainer to start")
        agent = json.loads(procs.read_text())["agent"]["pid"]
        seen = []  # (trainer and agent both waiting to write, log size), every 0.2 s

        def held_up_or_done() -> bool:
            if not log.exists():
                return False
            waiting = "pipe_write" in _wchan(trainer) and any("pipe_write" in _wchan(int(t))
                                                              for t in os.listdir(f"/proc/{agent}/task"))
            seen.append((waiting, log.stat().st_size))
            # Held up: both wait and nothing moved for 5 s. (Without the bound the launcher's reader is the
            # bottleneck: both wait too, in spells while it works off the SSH window, but the log keeps growing
            # at the reader's pace: past 20 MB, or to the end.)
            last = seen[-25:]
            return (len(last) == 25 and all(w for w, _ in last) and len({n for _, n in last}) == 1) \
                or seen[-1][1] > 20 << 20 or b"WROTE ALL" in log.read_bytes()[-100:]
        wait_for(held_up_or_done, 150, "the trainer and its agent to be held up, or the trainer to finish")
        assert b"WROTE ALL" not in log.read_bytes()[-100:], "nothing held the trainer up: 2 million lines queued"
        assert log.stat().st_size < 100 * 50_000, f"back-pressure came only after {log.stat().st_size // 100} lines"
        run.send_signal(signal.SIGINT)
        out = run.stdout.read()  # the terminal is read again: whatever the launcher still prints
        assert run.wait(60) == 130
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
        reader.join(timeout=10)
    stderr = b"".join(err).decode()
    assert "interrupted" in stderr and "no stop confirmation" not in stderr, stderr[-2000:]
    assert b"WROTE ALL" not in out
    assert peak.result() < 250 * 1024, f"launcher peak RSS {peak.kib} KiB"
    assert_nothing_left(cluster)


def _trainer_pid(procs_json) -> int:
    try:
        recs = json.loads(procs_json.read_text())["procs"]
    except (OSError, ValueError, KeyError):
        return 0
    return next((r["pid"] for r in recs if r["name"].startswith("trainer")), 0)

