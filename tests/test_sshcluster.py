"""The test cluster itself: real sshd per host, strict host keys, isolation, links, clean tear-down."""

from __future__ import annotations

import shlex
import socket
import subprocess
from pathlib import Path

import paramiko
import pytest
from helpers import wait_for
from sshcluster import STATE_DIR


def test_login_and_hostname_with_strict_host_keys(ssh_cluster):
    assert len(ssh_cluster.hosts) == 3
    for i, host in enumerate(ssh_cluster.hosts):
        assert host == f"root@{ssh_cluster.ips[i]}"
        with ssh_cluster.connection(i) as c:
            assert c.run("hostname", hide=True).stdout.strip() == f"node{i}"
            # The non-interactive PATH may differ; the cluster's interpreter is reachable by absolute path.
            out = c.run(f"{ssh_cluster.python} -c 'import sys; print(sys.executable)'", hide=True).stdout
            assert out.strip() == ssh_cluster.python
    # OpenSSH through the generated ssh_config alias, BatchMode and strict checking included.
    res = subprocess.run(["ssh", "-F", ssh_cluster.ssh_config, "node2", "hostname"],
                         capture_output=True, text=True, timeout=20, stdin=subprocess.DEVNULL)
    assert (res.returncode, res.stdout.strip()) == (0, "node2"), res.stderr


def test_unknown_host_key_is_rejected(ssh_cluster, tmp_path):
    client = paramiko.SSHClient()
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    client.load_host_keys(str(empty))
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    with pytest.raises(paramiko.SSHException, match="not found in known_hosts"):
        client.connect(ssh_cluster.ips[0], username="root", key_filename=ssh_cluster.key_path,
                       look_for_keys=False, allow_agent=False, timeout=10)
    client.close()


def test_home_is_per_host(ssh_cluster):
    with ssh_cluster.connection(0) as c0, ssh_cluster.connection(1) as c1:
        c0.run("echo hello-from-node0 > /home/paddle/marker", hide=True)
        assert (ssh_cluster.root_dir(0) / "marker").read_text() == "hello-from-node0\n"
        assert not (ssh_cluster.root_dir(1) / "marker").exists()
        assert c1.run("test -e /home/paddle/marker", hide=True, warn=True).exited == 1
        # SFTP works (Fabric's put) and lands in the right host's directory.
        c1.put(str(ssh_cluster.root_dir(0) / "marker"), "/home/paddle/copied")
    assert (ssh_cluster.root_dir(1) / "copied").read_text() == "hello-from-node0\n"
    assert ssh_cluster.exec(1, ["cat", "/home/paddle/copied"]).stdout == "hello-from-node0\n"
    assert ssh_cluster.exec(1, ["hostname"]).stdout.strip() == "node1"
    for name in ("marker", "copied"):
        for i in (0, 1):
            (ssh_cluster.root_dir(i) / name).unlink(missing_ok=True)


ECHO_SERVER = """
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 9009)); s.listen(1)
print("listening", flush=True)
c, _ = s.accept()
c.sendall(c.recv(100).upper())
"""


def test_hosts_reach_each_other_over_tcp(ssh_cluster):
    server = ssh_cluster.popen(1, [ssh_cluster.python, "-c", ECHO_SERVER, ssh_cluster.ips[1]],
                               stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "listening"
        client = (f"import socket; c = socket.create_connection(('{ssh_cluster.ips[1]}', 9009), timeout=5); "
                  "c.sendall(b'ping'); print(c.recv(100).decode(), c.getsockname()[0])")
        with ssh_cluster.connection(0) as c0:
            out = c0.run(f'{ssh_cluster.python} -c "{client}"', hide=True).stdout.split()
        assert out == ["PING", ssh_cluster.ips[0]]  # answered by node1, sent from node0's own address
        assert server.wait(timeout=5) == 0
    finally:
        server.kill()
        server.wait()


def test_pids_empty_at_rest_and_sees_remote_processes(ssh_cluster):
    for i in range(3):
        assert ssh_cluster.pids(i) == [], f"node{i} not at rest"
    with ssh_cluster.connection(0) as c0:
        c0.run("setsid sleep 60 </dev/null >/dev/null 2>&1 &", hide=True)
        # setsid shows its own command line until it has exec'd sleep: wait for that, not just for a pid.
        def sleeping():
            pids = ssh_cluster.pids(0)
            return pids if [Path(f"/proc/{p}/cmdline").read_bytes() for p in pids] == [b"sleep\x0060\x00"] else None
        pids = wait_for(sleeping, 5, "the sleep on node0", interval=0.02)
        # The open connection's sshd session processes are not counted unless asked for.
        assert len(ssh_cluster.pids(0, include_ssh_sessions=True)) > len(pids)
    assert ssh_cluster.pids(1) == [] and ssh_cluster.pids(2) == []
    assert ssh_cluster.kill_all(0) == pids
    wait_for(lambda: ssh_cluster.pids(0) == [], 5, "node0 to be empty", interval=0.02)


def _ssh_connect(cluster, i, timeout):
    client = paramiko.SSHClient()
    client.load_host_keys(cluster.known_hosts)
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    try:
        client.connect(cluster.ips[i], username="root", key_filename=cluster.key_path,
                       look_for_keys=False, allow_agent=False, timeout=timeout, banner_timeout=timeout)
        _, out, _ = client.exec_command("hostname", timeout=timeout)
        return out.read().decode().strip()
    finally:
        client.close()


def test_link_down_times_out_and_link_up_restores(make_ssh_cluster):
    cluster = make_ssh_cluster(2)
    assert _ssh_connect(cluster, 1, timeout=5) == "node1"
    cluster.link_down(1)
    with pytest.raises((socket.timeout, TimeoutError)):  # a timeout, not a refusal: packets are dropped
        _ssh_connect(cluster, 1, timeout=1.5)
    assert _ssh_connect(cluster, 0, timeout=5) == "node0"  # the others are unaffected
    cluster.link_up(1)
    assert wait_for(lambda: _try(lambda: _ssh_connect(cluster, 1, timeout=2)), 15, "node1 after link_up",
                    interval=0.02) == "node1"


def _try(fn):
    try:
        return fn()
    except (OSError, paramiko.SSHException):
        return None


def test_shape_installs_tbf_on_both_ends(ssh_cluster):
    ssh_cluster.shape(2, rate="100mbit")
    try:
        host = subprocess.run(["tc", "qdisc", "show", "dev", ssh_cluster.veth(2)],
                              capture_output=True, text=True, check=True).stdout
        inside = ssh_cluster.exec(2, ["tc", "qdisc", "show", "dev", "eth0"]).stdout
        assert "tbf" in host and "100Mbit" in host
        assert "tbf" in inside and "100Mbit" in inside
    finally:
        ssh_cluster.unshape(2)
    assert "tbf" not in ssh_cluster.exec(2, ["tc", "qdisc", "show", "dev", "eth0"]).stdout


def test_close_leaves_nothing_behind(make_ssh_cluster):
    cluster = make_ssh_cluster(2)
    sleeper = cluster.popen(1, ["sleep", "60"])  # a stray process close() must kill
    sshd = [cluster.sshd_pid(i) for i in range(2)]
    names = [cluster.netns(i) for i in range(2)]
    links = [cluster.veth(i) for i in range(2)] + [cluster.bridge]
    cluster.close()
    cluster.close()  # idempotent
    assert sleeper.wait(timeout=5) is not None
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert not any(n in netns for n in names), netns
    for link in links:
        assert subprocess.run(["ip", "link", "show", link], capture_output=True).returncode != 0, link
    for pid in sshd:
        assert not Path(f"/proc/{pid}").exists()
    assert not (STATE_DIR / f"{cluster.token}.json").exists()
    assert f" {cluster.gateway}/" not in subprocess.run(
        ["ip", "-o", "-4", "addr"], capture_output=True, text=True, check=True).stdout


def test_arp_limits_are_raised_for_a_large_cluster_and_put_back_after(make_ssh_cluster):
    """12 hosts need more than the default 1024 ARP entries; once that cluster closes, the limits are what the
    clusters still open need (the session's 3-host ones: the machine's own); they used to stay raised."""
    limit = Path("/proc/sys/net/ipv4/neigh/default/gc_thresh3")
    before = int(limit.read_text())
    big = make_ssh_cluster(12)
    assert int(limit.read_text()) >= 8 * 12 * 12
    big.close()
    assert int(limit.read_text()) == before


def test_cpu_seconds_counts_one_host_and_its_exited_processes(ssh_cluster):
    if ssh_cluster.cpu_seconds(0) is None:
        pytest.skip("no writable cgroup v2 mount: CPU accounting is unavailable here")
    before = [ssh_cluster.cpu_seconds(i) for i in range(3)]
    burn = "import time\nwhile time.process_time() < 0.3: pass"  # 0.3 s of CPU, in a process that then exits
    with ssh_cluster.connection(1) as c:
        c.run(f"{ssh_cluster.python} -c {shlex.quote(burn)}", hide=True)
    wait_for(lambda: ssh_cluster.pids(1, include_ssh_sessions=True) == [], 10, "node1's session to end", interval=0.02)
    after = [ssh_cluster.cpu_seconds(i) for i in range(3)]
    assert after[1] - before[1] >= 0.3
    assert after[0] == before[0] and after[2] == before[2]  # nothing ran there


def test_plain_shell_hides_root_rc_on_every_host_and_back(ssh_cluster):
    rc = Path("~root/.bashrc").expanduser()
    if not rc.is_file():
        pytest.skip(f"{rc} does not exist here: nothing to hide")

    def remote_rc(i):
        with ssh_cluster.connection(i) as c:
            return c.run(f"cat {rc}", hide=True).stdout

    try:
        ssh_cluster.set_plain_shell(True)
        assert [remote_rc(i) for i in range(3)] == ["", "", ""]
        assert rc.read_text() != "" or rc.stat().st_size == 0  # the machine's own file is untouched
    finally:
        ssh_cluster.set_plain_shell(False)
    assert remote_rc(2) == rc.read_text()
