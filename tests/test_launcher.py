"""The launcher against real sshd hosts (network namespaces, see sshcluster.py): run, logs, status, check,
kill, Ctrl+C, a killed launcher, and the errors for unreachable hosts and wrong NICs. A crashing trainer and
one job killed beside another are the conformance suite's fail_fast[ssh] and concurrent[ssh]."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from helpers import (
    ROOT,
    assert_nothing_left,
    checkout_env,
    cli,
    local_conf,
    make_workspace,
    no_traceback,
    start_cli,
    wait_for,
    write_conf,
)


def test_run_dispatch_three_hosts(cluster, tmp_path):
    ws = make_workspace(tmp_path / "ws")
    conf = write_conf(tmp_path, cluster)
    res = cli(conf, "run", "--job_dispatch_package", str(ws), "--job_name", "disp1", "--", "--epochs", "2")
    assert res.returncode == 0, res.stdout + res.stderr
    for i in range(3):
        assert f"[trainer.{i}@node{i}] ENV OK trainer {i} of 3 on node {i} args ['--epochs', '2']" in res.stdout
        assert f"[pserver.{i}@node{i}] pserver {i} listening on {cluster.ips[i]}" in res.stdout
        job = cluster.root_dir(i) / "disp1"
        assert (job / "nodefile").read_text().strip() == str(i)
        assert "ENV OK" in (job / "log" / "train.log").read_text()
        assert "listening" in (job / "log" / "server.log").read_text()
        assert (job / "data" / "part-0").read_text() == "1 2 3\n"
        assert not (job / "log" / "old.log").exists(), "log/ of the workspace must not be shipped"
        assert not (job / ".paddle_cluster" / "env").exists()  # only pservers get the secret, in their environ
    # The package is cached by hash: an unchanged workspace is not sent again.
    again = cli(conf, "run", "--job_dispatch_package", str(ws), "--job_name", "disp2")
    assert again.returncode == 0, again.stderr
    assert "node0, node1, node2 already held this package: not sent again" in again.stderr
    assert_nothing_left(cluster)


def test_run_job_workspace(cluster, tmp_path):
    ws = make_workspace(tmp_path / "ws")
    for i in range(3):
        shutil.copytree(ws, cluster.root_dir(i) / "wsA", dirs_exist_ok=True)
    conf = write_conf(tmp_path, cluster)
    res = cli(conf, "run", "--job_workspace", f"{ROOT}/wsA", "--job_name", "wsjob")
    assert res.returncode == 0, res.stdout + res.stderr
    assert all(f"ENV OK trainer {i} of 3" in res.stdout for i in range(3))
    assert (cluster.root_dir(1) / "wsjob" / "log" / "train.log").exists()
    # Missing on one node: named, nothing started.
    shutil.rmtree(cluster.root_dir(2) / "wsA")
    res = cli(conf, "run", "--job_workspace", f"{ROOT}/wsA", "--job_name", "wsjob2")
    assert res.returncode == 2, res.stderr  # a configuration error (docs/configuration.md), found on the host
    assert f"node2 ({cluster.hosts[2]}): --job_workspace {ROOT}/wsA: no such directory there" in res.stderr
    assert "node0" not in res.stderr.split("failed on")[1]
    no_traceback(res)
    assert_nothing_left(cluster)


def test_status_logs_and_ctrl_c(cluster, tmp_path):
    ws = make_workspace(tmp_path / "ws")
    conf = write_conf(tmp_path, cluster, ENV={"MY_SETTING": "42", "SLEEP_FOREVER": "1"})
    chk = cli(conf, "check")
    assert chk.returncode == 0, chk.stdout + chk.stderr
    for i in range(3):
        assert f"eth0={cluster.ips[i]}" in chk.stdout
    proc = start_cli(conf, "run", "--job_dispatch_package", str(ws), "--job_name", "live")
    try:
        wait_for(lambda: all(b"sleeping" in _read(cluster.root_dir(i) / "live/log/train.log") for i in range(3)),
                 60, "trainers to start")
        st = cli(conf, "status")  # default: the latest job of this config
        assert st.returncode == 0, st.stderr
        for i in range(3):
            assert f"trainer.{i}" in st.stdout and f"pserver.{i}" in st.stdout
        assert st.stdout.count("running") == 6
        lg = cli(conf, "logs", "node1", "--role", "trainer")
        assert lg.returncode == 0 and "ENV OK trainer 1 of 3 on node 1" in lg.stdout
        lg = cli(conf, "logs", cluster.hosts[2], "--role", "pserver", "-n", "1")
        assert "pserver 2 listening" in lg.stdout
        busy = cli(conf, "check")
        assert busy.returncode == 1, busy.stdout + busy.stderr
        for i in range(3):  # the same line as run's preflight: host, port, address and the fix
            assert re.search(rf"node{i} \({re.escape(cluster.hosts[i])}\): port\(s\) 7164(, \d+)* on "
                             rf"{re.escape(cluster.ips[i])} are already in use \(another job\?\); choose another "
                             r"PADDLE_PORT \(or run --port N\) or stop that job", busy.stderr), busy.stderr
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "interrupted" in err
    assert_nothing_left(cluster, within=5)
    st = cli(conf, "status")
    assert "running" not in st.stdout


def _read(p: Path) -> bytes:
    try:
        return p.read_bytes()
    except OSError:
        return b""


def test_sigkill_of_the_launcher_leaves_nothing(cluster, tmp_path):
    ws = make_workspace(tmp_path / "ws")
    conf = write_conf(tmp_path, cluster, ENV={"MY_SETTING": "42", "SLEEP_FOREVER": "1"})
    proc = start_cli(conf, "run", "--job_dispatch_package", str(ws), "--job_name", "orphan")
    wait_for(lambda: all(b"sleeping" in _read(cluster.root_dir(i) / "orphan/log/train.log") for i in range(3)),
             60, "trainers to start")
    proc.kill()
    proc.wait()
    t0 = time.monotonic()
    assert_nothing_left(cluster, within=6 + 2 + 10)  # ORPHAN_TIMEOUT + KILL_GRACE + margin
    print(f"remote processes gone {time.monotonic() - t0:.1f} s after SIGKILL of the launcher")


def test_unreachable_host_is_named_within_the_timeout(cluster, tmp_path):
    conf = write_conf(tmp_path, cluster, SSH_CONNECT_TIMEOUT=3.0)
    cluster.link_down(2)
    try:
        # The run ends, naming the host, long before a TCP connect to a silent host gives up on its own.
        res = cli(conf, "run", "--job_dispatch_package", str(make_workspace(tmp_path / "ws")), timeout=20)
    finally:
        cluster.link_up(2)
    assert res.returncode == 1
    assert f"node2 ({cluster.hosts[2]})" in res.stderr and "within 3 s" in res.stderr, res.stderr
    no_traceback(res)
    assert_nothing_left(cluster)


def test_wrong_nic_lists_the_interfaces(cluster, tmp_path):
    conf = write_conf(tmp_path, cluster, PADDLE_NIC="eth7")
    res = cli(conf, "run", "--job_dispatch_package", str(make_workspace(tmp_path / "ws")))
    assert res.returncode == 1
    for i in range(3):
        assert f"node{i} ({cluster.hosts[i]}): PADDLE_NIC = 'eth7'" in res.stderr
    assert "(no such interface)" in res.stderr and f"eth0 ({cluster.ips[0]})" in res.stderr
    assert "lo (127.0.0.1)" in res.stderr
    no_traceback(res)


def test_port_in_use_is_named(cluster, tmp_path):
    # SO_REUSEADDR, as the pservers bind: an earlier test's job on this session's cluster can leave connections
    # to 7165 in TIME_WAIT, where a plain bind fails and the blocker never listens.
    blocker = cluster.popen(0, [cluster.python, "-c", textwrap.dedent(f"""
        import socket, time
        s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("{cluster.ips[0]}", 7165)); s.listen(); time.sleep(60)""")])
    try:
        wait_for(lambda: cluster.exec(0, ["ss", "-ltn"]).stdout.count(":7165") > 0, 10, "blocker")
        conf = write_conf(tmp_path, cluster)
        res = cli(conf, "run", "--job_dispatch_package", str(make_workspace(tmp_path / "ws")))
    finally:
        blocker.kill()
        blocker.wait()
    assert res.returncode == 1
    assert f"node0 ({cluster.hosts[0]}): port(s) 7165 on {cluster.ips[0]} are already in use" in res.stderr
    no_traceback(res)


def test_unknown_host_keys_are_refused_unless_accepted(cluster, tmp_path):
    known = tmp_path / "known_hosts"
    known.write_text("")
    conf = write_conf(tmp_path, cluster, SSH_KNOWN_HOSTS=str(known))
    res = cli(conf, "check", timeout=60)
    assert res.returncode == 1
    assert "host key of" in res.stdout + res.stderr and "--accept-new-host-keys" in res.stdout + res.stderr
    assert known.read_text() == ""
    ok = cli(conf, "--accept-new-host-keys", "check", timeout=60)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert all(ip in known.read_text() for ip in cluster.ips)
    again = cli(conf, "check")  # now known: accepted without the flag
    assert again.returncode == 0, again.stderr


def test_local_host_runs_without_ssh(tmp_path):
    """``localhost`` needs no sshd: the same agent runs as a subprocess."""
    ws = make_workspace(tmp_path / "ws")
    root = tmp_path / "root"
    # PSERVER_COMMAND: make_workspace's ps.py only listens; the test is about the processes, not training.
    conf = local_conf(tmp_path, PSERVERS_PER_NODE=2, TRAINERS_PER_NODE=2, PSERVER_COMMAND="{python} ps.py",
                      LD_LIBRARY_PATH="/extra/lib", ENV={"MY_SETTING": "42"}, KILL_GRACE=2.0)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    env = dict(os.environ, HOME=str(tmp_path), TMPDIR=str(scratch))
    res = cli(conf, "run", "--job_dispatch_package", str(ws), "--job_name", "loc", env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert list(scratch.iterdir()) == [], "the launcher must not leave temporary files behind"
    assert "[trainer.1@node0] ENV OK trainer 1 of 2 on node 0" in res.stdout
    assert sorted(p.name for p in (root / "loc" / "log").iterdir()) == [
        "paddle_pserver2.0.INFO", "paddle_pserver2.1.INFO", "paddle_trainer.0.INFO", "paddle_trainer.1.INFO",
        "server.0.log", "server.1.log", "train.0.log", "train.1.log"]


def test_ssh_config_aliases_and_proxyjump(cluster, tmp_path):
    """Hosts given as ~/.ssh/config aliases: user, key and a ProxyJump hop come from that file."""
    cfg = tmp_path / "ssh_config"
    cfg.write_text(Path(cluster.ssh_config).read_text()
                   + f"Host behind2\n    HostName {cluster.ips[2]}\n    User root\n"
                   f"    IdentityFile {cluster.key_path}\n    ProxyJump node0\n")
    conf = write_conf(tmp_path, cluster, hosts=["node0", "node1", "behind2"], SSH_CONFIG_FILE=str(cfg),
                      SSH_IDENTITY_FILE=None)
    res = cli(conf, "check")
    assert res.returncode == 0, res.stdout + res.stderr
    for i, name in enumerate(["node0", "node1", "behind2"]):
        assert name in res.stdout and f"eth0={cluster.ips[i]}" in res.stdout


def test_kill_says_which_config_and_what_it_stopped(cluster, tmp_path):
    """Issue 24, items 5 and 8: run from a directory without conf.py, ``kill`` says in its first line that it
    uses the built-in local cluster (and stops nothing of the 3-host job); with the job's conf.py it names that
    file first, then what it did to each process on each node."""
    ws = make_workspace(tmp_path / "ws")
    conf = write_conf(tmp_path, cluster, ENV={"MY_SETTING": "42", "SLEEP_FOREVER": "1"})
    run = start_cli(conf, "run", "--job_dispatch_package", str(ws), "--job_name", "killme")
    try:
        wait_for(lambda: all(b"sleeping" in _read(cluster.root_dir(i) / "killme/log/train.log") for i in range(3)),
                 60, "trainers to start")
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        stray = subprocess.run([sys.executable, "-m", "paddle_cluster", "kill"], cwd=elsewhere, capture_output=True,
                               text=True, timeout=60, env=checkout_env(HOME=str(tmp_path / "home")))
        first = stray.stderr.splitlines()[0]
        assert first.startswith(f"paddle-cluster: no conf.py or cluster.yaml in {elsewhere}: using the built-in "
                                "local cluster (2 pservers and 2 trainers on this machine"), stray.stderr
        st = cli(conf, "status", "--job_name", "killme")
        assert st.stderr.splitlines()[0] == f"paddle-cluster: config {conf}", st.stderr
        assert st.stdout.count("running") == 6, st.stdout  # the stray kill stopped nothing of this job
        k = cli(conf, "kill")
        assert k.returncode == 0, k.stderr
        assert k.stderr.splitlines()[0] == f"paddle-cluster: config {conf}", k.stderr
        for i in range(3):
            assert re.search(rf"^node{i} \({re.escape(cluster.hosts[i])}\): pserver\.{i} \(pid \d+\) killed by "
                             rf"SIGTERM; trainer\.{i} \(pid \d+\) killed by SIGTERM$", k.stdout, re.M), k.stdout
        assert "job killme: stopped 6 process(es) on 3 node(s) (SIGTERM, SIGKILL after KILL_GRACE=" in k.stderr
        run.communicate(timeout=30)
        assert run.returncode == 3
    finally:
        if run.poll() is None:
            run.send_signal(signal.SIGINT)
            run.communicate(timeout=60)
    again = cli(conf, "kill", "--job_name", "killme")
    for i in range(3):
        assert f"node{i} ({cluster.hosts[i]}): nothing of job killme was running" in again.stdout, again.stdout
    assert "job killme: nothing was running on any of its 3 node(s); nothing stopped" in again.stderr
    assert_nothing_left(cluster)


def test_status_logs_plot_name_their_config_first(tmp_path):
    """``status``, ``logs`` and ``plot`` say first which config they read: the file, or the built-in cluster."""
    ws = make_workspace(tmp_path / "ws")
    # PSERVER_COMMAND: make_workspace's ps.py only listens; its train.py checks the environment and exits.
    conf = local_conf(tmp_path, ENV={"MY_SETTING": "42"}, PSERVER_COMMAND="{python} ps.py",
                      LD_LIBRARY_PATH="/extra/lib")
    env = dict(os.environ, HOME=str(tmp_path), XDG_STATE_HOME=str(tmp_path / "state"))
    assert cli(conf, "run", "--job_dispatch_package", str(ws), "--job_name", "named", env=env).returncode == 0
    for args in (["status"], ["logs", "node0"], ["plot", "-o", str(tmp_path / "p.png")]):
        res = cli(conf, *args, env=env)
        assert res.stderr.splitlines()[0] == f"paddle-cluster: config {conf}", (args, res.stderr)
        builtin = subprocess.run([sys.executable, "-m", "paddle_cluster", *args], cwd=ws, capture_output=True,
                                 text=True, timeout=60, env=checkout_env(env))
        assert builtin.stderr.splitlines()[0].startswith(
            f"paddle-cluster: no conf.py or cluster.yaml in {ws}: using the built-in local cluster"), builtin.stderr


def test_logs_of_a_node_the_cluster_lacks_is_a_usage_error(tmp_path):
    """``logs node5`` on a one-node cluster names the nodes there are and exits 2, as click's usage errors do
    (it exited 1, the status of a failed job)."""
    ws = make_workspace(tmp_path / "ws")
    # PSERVER_COMMAND: make_workspace's ps.py only listens; its train.py checks the environment (these ENV and
    # LD_LIBRARY_PATH) and exits.
    conf = local_conf(tmp_path, ENV={"MY_SETTING": "42"}, PSERVER_COMMAND="{python} ps.py",
                      LD_LIBRARY_PATH="/extra/lib")
    env = dict(os.environ, HOME=str(tmp_path), XDG_STATE_HOME=str(tmp_path / "state"))
    assert cli(conf, "run", "--job_dispatch_package", str(ws), env=env).returncode == 0
    res = cli(conf, "logs", "node5", env=env)
    assert res.returncode == 2, res.stderr
    assert "unknown node 'node5'; this cluster has node0 (localhost)" in res.stderr and "Traceback" not in res.stderr
