"""``run --backend mpi``: the real CLI, real ``mpirun`` over the namespace hosts' sshd, one rank per host running the
node bootstrap. fit_a_line trains to its target with 3 pservers x 3 trainers on 3 hosts; Ctrl+C, ``kill`` and a
killed launcher leave no process on any host (setsid grandchildren included); a failing trainer fails the job
fast with its last lines."""

from __future__ import annotations

import re
import signal
import subprocess
import textwrap
from pathlib import Path

import pytest
from helpers import LISTEN_PS_PY as PS_PY
from helpers import assert_nothing_left, cli, no_traceback, start_cli, wait_for, write_conf

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "fit_a_line"
FINAL = re.compile(r"^\[trainer\.0@node0\] final test_mse=(\S+)$", re.M)

# A trainer that holds (with a setsid grandchild, which escapes every process group) until stopped.
HOLD_PY = textwrap.dedent('''
    import os, subprocess, sys, time
    tid = os.environ["PADDLE_TRAINER_ID"]
    if os.path.exists("crash-" + tid):
        print("about to crash", flush=True)
        sys.exit(3)
    subprocess.Popen(["sleep", "300"], start_new_session=True)
    print("holding", tid, flush=True)
    time.sleep(300)
''')


@pytest.fixture
def hosts(mpi_env):
    cluster = mpi_env.cluster
    yield cluster
    for i in range(cluster.n):
        cluster.kill_all(i)


def _hold_workspace(tmp: Path) -> Path:
    ws = tmp / "ws"
    ws.mkdir()
    (ws / "train.py").write_text(HOLD_PY)
    (ws / "ps.py").write_text(PS_PY)
    return ws


def _conf(tmp: Path, cluster, **over) -> Path:
    return write_conf(tmp, cluster, BACKEND="mpi", LD_LIBRARY_PATH="", ENV={}, **over)


def test_fit_a_line_trains_to_target_under_mpirun(hosts, tmp_path):
    conf = _conf(tmp_path, hosts, PSERVER_COMMAND="{python} -m paddle_cluster.ps", START_TIMEOUT=60.0)
    res = cli(conf, "run", "--job_dispatch_package", str(EXAMPLE), "--job_name", "fitmpi", timeout=600)
    no_traceback(res)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    mse = float(FINAL.search(res.stdout).group(1))
    assert mse < 30, res.stdout[-2000:]
    assert "all 3 trainer(s) exited 0" in res.stderr
    for i in range(3):  # every trainer ran on its own host and wrote its metrics there
        assert (hosts.root_dir(i) / "fitmpi" / "log" / f"metrics.trainer{i}.jsonl").stat().st_size > 0
    print(f"\nfit_a_line, 3 pservers x 3 trainers over mpirun: test MSE {mse:.2f}")
    assert_nothing_left(hosts)


def _start_holding(conf: Path, ws: Path, job: str) -> subprocess.Popen:
    p = start_cli(conf, "run", "--job_workspace", str(ws), "--job_name", job)
    lines = []

    def holding() -> bool:
        lines.append(p.stdout.readline())
        return sum("holding" in x for x in lines) == 3

    try:
        wait_for(holding, 120, "3 trainers holding")
    except AssertionError:
        p.kill()
        raise AssertionError("".join(lines) + p.communicate()[1]) from None
    return p


def test_ctrl_c_stops_every_rank_and_setsid_grandchild(hosts, tmp_path):
    ws = _hold_workspace(tmp_path)
    p = _start_holding(_conf(tmp_path, hosts, PSERVER_COMMAND="{python} ps.py"), ws, "mpictrlc")
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    assert "interrupted" in err
    assert_nothing_left(hosts)


def test_kill_command_stops_the_job_everywhere(hosts, tmp_path):
    ws = _hold_workspace(tmp_path)
    conf = _conf(tmp_path, hosts, PSERVER_COMMAND="{python} ps.py")
    p = _start_holding(conf, ws, "mpikill")
    res = cli(conf, "kill", "--job_name", "mpikill")
    assert res.returncode == 0, res.stderr
    p.communicate(timeout=60)
    assert p.returncode != 0
    assert_nothing_left(hosts)


def test_killed_launcher_leaves_nothing(hosts, tmp_path):
    ws = _hold_workspace(tmp_path)
    p = _start_holding(_conf(tmp_path, hosts, PSERVER_COMMAND="{python} ps.py"), ws, "mpidead")
    p.kill()
    p.wait(timeout=10)
    assert_nothing_left(hosts, within=30)


def test_failing_trainer_fails_the_job_fast_with_its_last_lines(hosts, tmp_path):
    ws = _hold_workspace(tmp_path)
    (ws / "crash-1").touch()
    res = cli(_conf(tmp_path, hosts, PSERVER_COMMAND="{python} ps.py"), "run", "--job_workspace", str(ws),
              "--job_name", "mpifail", timeout=120)
    no_traceback(res)
    assert res.returncode == 1, res.stderr
    assert "trainer.1 on node1" in res.stderr and "exited with code 3" in res.stderr
    assert "| about to crash" in res.stderr
    assert_nothing_left(hosts)
