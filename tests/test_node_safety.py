"""The node side fails safe, on the SSH test cluster (tests/sshcluster.py) and real processes: job names that
are not plain names are refused by the CLI and by the agent; processes that ``setsid`` away from their group
are still stopped, by the agent's teardown and by ``kill`` after the agent is gone.
"""

from __future__ import annotations

import subprocess

import pytest
from helpers import ROOT, assert_nothing_left, checkout_env, cli, make_workspace, write_conf


def node_cmd(cluster, i: int, *args: str, stdin: str = "") -> subprocess.CompletedProcess:
    """``python -m paddle_cluster.node ARGS`` inside node ``i`` (this checkout's library)."""
    return cluster.exec(i, [cluster.python, "-m", "paddle_cluster.node", *args], env=checkout_env(), input=stdin,
                        check=False, timeout=60)


def _modes(cluster, paths):
    return [cluster.exec(i, ["stat", "-c", "%a", *paths]).stdout.split() for i in range(len(cluster.hosts))]


@pytest.mark.timeout(120)
def test_job_names_are_plain_names(cluster, tmp_path):
    """``--job_name ..`` chmod-700'd ROOT_DIR's parent and a newline crashed the agent: both are refused, by the
    CLI with the rule, and again by the agent on the node."""
    conf = write_conf(tmp_path, cluster)
    ws = make_workspace(tmp_path / "ws")
    before = _modes(cluster, ["/home", ROOT])
    for bad in ("..", "a/b", "a\nb", "x" * 101, ".paddle_cluster"):
        res = cli(conf, "run", "--job_dispatch_package", str(ws), "--job_name", bad)
        assert res.returncode == 2, (bad, res.stderr)
        assert f"Invalid value for '--job_name': job name {bad!r}" in res.stderr, res.stderr
        assert "Traceback" not in res.stderr
    res = cli(conf, "status", "--job_name", "../paddle")
    assert res.returncode == 2 and "Invalid value for '--job_name'" in res.stderr
    res = cli(conf, "run", "--job_dispatch_package", str(ws), "--resume_from", "../x")
    assert res.returncode == 2 and "absolute checkpoint directory" in res.stderr
    # The agent checks again: a job directory whose last part is not a plain name is refused, untouched.
    for bad in (f"{ROOT}/..", f"{ROOT}/a\nb", f"{ROOT}/"):
        for sub in ("kill", "status"):
            out = node_cmd(cluster, 0, sub, "--job-dir", bad)
            assert out.returncode == 2 and '"ok": false' in out.stdout and "job name" in out.stdout, out
        out = node_cmd(cluster, 0, "unpack", "--archive", "/nonexistent.tar", "--dest", bad)
        assert out.returncode == 2 and "refusing job directory" in out.stdout, out
    assert _modes(cluster, ["/home", ROOT]) == before
    assert not (cluster.root_dir(0) / "a\nb").exists()
    assert_nothing_left(cluster)
