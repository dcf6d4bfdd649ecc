"""SSH failures against real sshd hosts (sshcluster.py): each is one line naming host, address, port, what
failed and the command that fixes it; ``check`` prints its table and nothing above it; the message is in
docs/troubleshooting.md; the traceback only with ``--debug``."""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import no_traceback, wait_for, write_conf, write_settings

pytestmark = pytest.mark.cluster
REPO = Path(__file__).resolve().parent.parent
TROUBLESHOOTING = (REPO / "docs" / "troubleshooting.md").read_text()


def paddle(conf: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "paddle_cluster", "--conf", str(conf), *args], capture_output=True,
                          text=True, timeout=120, env=env, stdin=subprocess.DEVNULL)


def host_line(res: subprocess.CompletedProcess, label: str) -> str:
    """The one line of the final message about ``label``."""
    lines = [ln for ln in res.stderr.splitlines() if ln.strip().startswith(label)]
    assert len(lines) == 1, res.stderr
    return lines[0]


def assert_table_only(res: subprocess.CompletedProcess) -> None:
    """stdout is the table from its first line; stderr is the one summary message, no paramiko log."""
    assert res.returncode == 1, res.stdout + res.stderr
    assert res.stdout.splitlines()[0].split()[:2] == ["node", "host"], res.stdout
    assert res.stderr.startswith("paddle-cluster: error: "), res.stderr
    assert "paramiko" not in res.stderr and "Exception" not in res.stderr, res.stderr
    no_traceback(res)


def _refused(ip: str) -> bool:
    try:
        socket.create_connection((ip, 22), timeout=1).close()
    except ConnectionRefusedError:
        return True
    except OSError:
        pass
    return False


def test_each_ssh_failure_is_one_documented_line(make_ssh_cluster, tmp_path):
    cluster = make_ssh_cluster(2)
    ip = cluster.ips[1]
    label = f"node1 ({cluster.hosts[1]})"
    cases = []

    # a key the host does not accept
    wrong = tmp_path / "wrong_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(wrong)], check=True)
    conf = write_conf(tmp_path, cluster, "wrongkey.py", hosts=cluster.hosts[:2], SSH_IDENTITY_FILE=str(wrong))
    # node0 fails the same way: only node1's line is looked at
    cases.append((conf, label, f"{ip}:22: login as root refused (tried {wrong}", "passwords are never prompted for",
                  f"ssh-copy-id -p 22 -i {wrong} root@{ip}"))

    # a host key not in known_hosts
    known = tmp_path / "known_hosts"
    known.write_text("".join(ln + "\n" for ln in Path(cluster.known_hosts).read_text().splitlines()
                             if not ln.startswith(ip + ",")))
    conf = write_conf(tmp_path, cluster, "unknown.py", hosts=cluster.hosts[:2], SSH_KNOWN_HOSTS=str(known))
    cases.append((conf, label, f"{ip}:22: host key of {ip} is unknown", "is unknown (not in",
                   f"ssh-keyscan -p 22 {ip} >> {known}"))

    # a host key that changed
    changed = tmp_path / "changed_hosts"
    other = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    pub = (tmp_path / "other_key.pub").read_text().split()[:2]
    changed.write_text("".join(ln + "\n" for ln in Path(cluster.known_hosts).read_text().splitlines()
                               if not ln.startswith(ip + ",")) + f"{ip} {pub[0]} {pub[1]}\n")
    conf = write_conf(tmp_path, cluster, "changed.py", hosts=cluster.hosts[:2], SSH_KNOWN_HOSTS=str(changed))
    cases.append((conf, label, f"{ip}:22: host key CHANGED", "host key CHANGED", f"ssh-keygen -R {ip}"))

    # an address where nothing answers
    net = ipaddress.ip_network(cluster.subnet)
    nobody = str(net[-2])
    conf = write_conf(tmp_path, cluster, "nobody.py", hosts=[cluster.hosts[0], f"root@{nobody}"],
                      SSH_CONNECT_TIMEOUT=2.0)
    cases.append((conf, f"node1 (root@{nobody})", f"{nobody}:22: ", None, f"ping -c 1 {nobody}"))

    for conf, who, what, documented, fix in cases:
        res = paddle(conf, "check")
        assert_table_only(res)
        line = host_line(res, who)
        assert what in line and fix in line, line
        phrase = documented or ("no route to host" if "no route to host" in line else "SSH_CONNECT_TIMEOUT; host")
        assert phrase in line and phrase in TROUBLESHOOTING, (phrase, line)

    # sshd stopped: connection refused, also for a command that installs the library first
    os.kill(cluster.sshd_pid(1), signal.SIGTERM)
    wait_for(lambda: _refused(ip), 10, "sshd to stop")
    conf = write_conf(tmp_path, cluster, "stopped.py", hosts=cluster.hosts[:2])
    res = paddle(conf, "check")
    assert_table_only(res)
    phrase = "connection refused (no SSH server listening on that port)"
    line = host_line(res, label)
    assert f"{ip}:22: {phrase}" in line and f"ssh -o BatchMode=yes -p 22 -i {cluster.key_path} root@{ip}" in line
    assert phrase in TROUBLESHOOTING
    res = paddle(conf, "status", "--job_name", "nothing")
    config, error = res.stderr.split("\n", 1)  # the first line names the config it read
    assert config == f"paddle-cluster: config {conf}", res.stderr
    assert error.startswith("paddle-cluster: error: cannot reach 1 host(s) over SSH:"), res.stderr
    assert f"{label}: {ip}:22: {phrase}" in res.stderr
    no_traceback(res)
    dbg = paddle(conf, "--debug", "status", "--job_name", "nothing")
    assert "Traceback" in dbg.stderr and "NoValidConnectionsError" in dbg.stderr
    # run names the host and the cause, not "installing paddle_cluster on the nodes failed"
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "train.py").write_text("print('never started')\n")
    res = paddle(conf, "run", "--job_dispatch_package", str(ws), "--job_name", "never")
    assert res.returncode == 1, res.stderr
    assert f"{label}: {ip}:22: {phrase}" in res.stderr, res.stderr
    assert "installing paddle_cluster" not in res.stderr, res.stderr
    no_traceback(res)


def test_no_key_at_all_says_to_make_one(cluster, tmp_path):
    """A new user who skipped the quick start's ssh-keygen: no agent, no ~/.ssh/id_*, no SSH_IDENTITY_FILE. Once
    'SSH failed: SSHException: No authentication methods available'. The README's conf.py, with the test hosts'
    known_hosts (its own key is what this test leaves out)."""
    conf = write_settings(tmp_path / "conf.py", {"HOSTS": cluster.hosts[:1], "ROOT_DIR": "/home/paddle",
                                                 "PADDLE_NIC": "eth0", "SSH_KNOWN_HOSTS": cluster.known_hosts})
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "SSH_AUTH_SOCK"}
    res = subprocess.run([sys.executable, "-m", "paddle_cluster", "--conf", str(conf), "check"], capture_output=True,
                         text=True, timeout=120, env={**env, "HOME": str(home), "PYTHONPATH": str(REPO)},
                         stdin=subprocess.DEVNULL)
    assert_table_only(res)
    ip = cluster.ips[0]
    line = host_line(res, f"node0 ({cluster.hosts[0]})")
    assert f"{ip}:22: no SSH key to log in as root with" in line, line
    assert f"ssh-keygen -t ed25519 && ssh-copy-id -p 22 root@{ip}" in line, line
    assert "no SSH key to log in as USER with" in TROUBLESHOOTING


def test_a_key_with_a_passphrase_and_no_agent_or_a_pub_file_is_named(cluster, tmp_path):
    """SSH_IDENTITY_FILE that is the hosts' own key behind a passphrase, with no ssh-agent: once 'login refused ...
    install the key: ssh-copy-id' (it was installed). And the .pub given for the key: once 'SSH failed:
    SSHException: not a valid OPENSSH private key file'."""
    locked = tmp_path / "id_locked"
    locked.write_bytes(Path(cluster.key_path).read_bytes())
    locked.chmod(0o600)
    subprocess.run(["ssh-keygen", "-q", "-p", "-P", "", "-N", "a passphrase", "-f", str(locked)], check=True,
                   capture_output=True)
    pub = tmp_path / "id.pub"
    pub.write_text(subprocess.run(["ssh-keygen", "-y", "-f", cluster.key_path], capture_output=True, text=True,
                                  check=True).stdout)
    env = {k: v for k, v in os.environ.items() if k != "SSH_AUTH_SOCK"}
    ip = cluster.ips[0]
    for key, said, fix in ((locked, f"login as root refused: {locked} has a passphrase and no ssh-agent holds it",
                            f'eval "$(ssh-agent)" && ssh-add {locked}'),
                           (pub, f"SSH_IDENTITY_FILE {pub} is not a private key", "not its .pub")):
        conf = write_conf(tmp_path, cluster, hosts=cluster.hosts[:1], SSH_IDENTITY_FILE=str(key))
        res = subprocess.run([sys.executable, "-m", "paddle_cluster", "--conf", str(conf), "check"],
                             capture_output=True, text=True, timeout=120, env={**env, "PYTHONPATH": str(REPO)},
                             stdin=subprocess.DEVNULL)
        assert_table_only(res)
        line = host_line(res, f"node0 ({cluster.hosts[0]})")
        assert f"{ip}:22: {said}" in line and fix in line, line
    assert "has a passphrase and no ssh-agent holds it" in TROUBLESHOOTING
    assert "is not a private key" in TROUBLESHOOTING
