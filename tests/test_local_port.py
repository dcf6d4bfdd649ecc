"""The built-in local cluster (no conf.py) moves off its default ports with ``run --port N`` (issue 37 point 8),
and a script refusing the arguments after -- is told so, with the option to use instead: the README's first
command, as a user whose port 7164 is taken runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from helpers import REPO, checkout_env, free_port_range, no_traceback

# The built-in cluster's ports from N: each of its two pservers takes N and N+1 on its own loopback address, then
# MASTER_PORT and the two trainers' ports follow the pservers' (contract.trainer_ports).
PORTS = 2 * 2 + 1 + 2


def _run(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    """``paddle-cluster ARGS`` in a directory with no conf.py (the built-in local cluster), HOME there too."""
    (tmp / "examples").symlink_to(REPO / "examples")
    env = checkout_env(HOME=str(tmp), XDG_STATE_HOME=str(tmp / "state"))
    env.pop("PADDLE_CLUSTER_CONF", None)
    return subprocess.run([sys.executable, "-m", "paddle_cluster", *args], cwd=tmp, env=env, capture_output=True,
                          text=True, timeout=150, stdin=subprocess.DEVNULL)


def test_run_port_moves_the_builtin_local_cluster(tmp_path):
    port = free_port_range(PORTS)
    res = _run(tmp_path, "run", "--port", str(port), "--job_name", "moved", "--job_dispatch_package",
               "examples/fit_a_line")
    no_traceback(res)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "final test_mse=" in res.stdout
    assert "no conf.py or cluster.yaml" in res.stderr  # the built-in cluster it is
    log = (tmp_path / "paddle_cluster_jobs" / "moved" / "log" / "server.0.log").read_text()
    assert f"listening on 127.0.0.1 ports {port},{port + 1}" in log, log


def test_a_port_option_the_script_refuses_points_at_run_port(tmp_path):
    # fit_a_line's train.py handles the PSERVER role and does not accept --port: its pservers exit 2 first.
    port = free_port_range(PORTS)
    res = _run(tmp_path, "run", "--job_name", "refused", "--job_dispatch_package", "examples/fit_a_line", "--",
               "--port", str(port))
    no_traceback(res)
    assert res.returncode == 1, res.stdout[-2000:] + res.stderr[-2000:]
    assert "unrecognized arguments: --port" in res.stderr
    assert (f"train.py exited 2, a usage error: the arguments after -- (--port {port}) reach every process that "
            "runs train.py, pservers too when they run it; to move the job's ports, give run --port N") in res.stderr
    assert "run --pserver builtin" not in res.stderr.split("error:", 1)[1]  # the builtin pserver would not help


def test_run_port_out_of_range_names_the_option(tmp_path):
    res = _run(tmp_path, "run", "--port", "80", "--job_dispatch_package", "examples/fit_a_line")
    assert res.returncode == 2 and res.stderr.strip().splitlines()[-1].startswith("paddle-cluster: error: --port 80: "
                                                                                  "a node's pservers"), res.stderr


def test_a_taken_port_says_how_to_move_off_it(tmp_path):
    import socket

    port = free_port_range(PORTS)
    with socket.socket() as held:  # another program on the built-in cluster's first port
        held.bind(("127.0.0.1", port))
        held.listen()
        res = _run(tmp_path, "run", "--port", str(port), "--job_dispatch_package", "examples/fit_a_line")
    no_traceback(res)
    assert res.returncode == 1, res.stderr[-2000:]  # preparing the nodes failed: nothing started
    assert f"port(s) {port} on 127.0.0.1 are already in use (another job?); choose another PADDLE_PORT (or run " \
           "--port N) or stop that job" in res.stderr, res.stderr[-2000:]
