"""Ctrl+C while a node hangs before it answers: ``run`` stops every node's session (the hung one's included) and
ends within seconds naming the node, instead of waiting out the 300 s reply timeout; a second Ctrl+C while a stop
waits on a silent node ends the launcher at once, naming it and the ``kill`` that cleans it up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from helpers import assert_nothing_left, checkout_env, make_workspace, wait_for, write_conf


def _launch(conf: Path, *args: str) -> subprocess.Popen:
    """``run`` in a process group of its own, which a test signals as a terminal signals its foreground group."""
    return subprocess.Popen([sys.executable, "-m", "paddle_cluster", "--conf", str(conf), "run", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=checkout_env(),
                            stdin=subprocess.DEVNULL, start_new_session=True)


def _hanging_python(tmp: Path, python: str, host: str) -> Path:
    """A PYTHON that on ``host`` (its hostname: each namespace host has its own) hangs before the interpreter
    runs, as a login script or a wrapper that waits would; elsewhere it is the interpreter."""
    wrapper = tmp / "python"
    wrapper.write_text(f'#!/bin/sh\nif [ "$(hostname)" = {host} ]; then touch {tmp}/hung; sleep 600; fi\n'
                       f'exec {python} "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def test_ctrl_c_while_a_node_hangs_at_start(cluster, tmp_path):
    ws = make_workspace(tmp_path / "ws")
    # PYTHON is pinned to a wrapper: the hang under test is the node's interpreter never starting (the only key
    # that runs something of the user's on a node before its session answers); PSERVER_COMMAND is write_conf's.
    conf = write_conf(tmp_path, cluster, PYTHON=str(_hanging_python(tmp_path, cluster.python, "node1")))
    proc = _launch(conf, "--job_dispatch_package", str(ws), "--job_name", "hung")
    try:
        wait_for(lambda: (tmp_path / "hung").exists() or proc.poll() is not None, 60, "node1's PYTHON to hang")
        assert proc.poll() is None, proc.communicate()
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=30)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 130, out + err
    assert took < 15, f"{took:.1f} s to end after Ctrl+C (the reply timeout is 300 s)\n{err}"
    assert "Traceback" not in err and "unexpected error" not in err, err
    # (node0 and node2 may be named too, with what was awaited of them, when Ctrl+C came before their answers)
    assert f"node1 ({cluster.hosts[1]}) had not answered (starting the node session)" in err, err
    assert_nothing_left(cluster, within=5)
