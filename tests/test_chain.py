"""The workspace sent down a chain of nodes (node/chain.py, launch/relay.py): the launcher's link carries it
once, every node lands the same tree, a link that cannot be made falls back to the launcher sending directly,
and a connection that cannot prove the dispatch's token gets nothing."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import socket
import tarfile
import threading
from pathlib import Path

import pytest
from helpers import make_workspace, wait_for, write_conf

from paddle_cluster.launch import delta, dispatch
from paddle_cluster.launch.access import make_nodes
from paddle_cluster.launch.backends.ssh import SSHBackend
from paddle_cluster.launch.config import load_config
from paddle_cluster.launch.errors import ClusterError, HostError
from paddle_cluster.launch.plan import JobSpec
from paddle_cluster.node import chain, trees
from paddle_cluster.node.unpack import UnsafeArchive


def _tree_digest(top: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(top.rglob("*")):
        if p.is_file() and p.parts[len(top.parts)] not in ("log", "output", "nodefile", ".paddle_cluster"):
            h.update(str(p.relative_to(top)).encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def _tx_bytes(dev: str) -> int:
    return int(Path(f"/sys/class/net/{dev}/statistics/tx_bytes").read_text())


def _deliver(c, tmp_path, ws, job, sent=None, **over):
    """Deliver ``ws`` as ``job`` with the launcher's own code; what it said. ``sent``: a list that gets the bytes
    the launcher sent into the cluster network for the workspace (the library is installed before); ``over``:
    more conf keys."""
    backend = SSHBackend(load_config(str(write_conf(tmp_path, c, **over))))
    said = []
    try:
        backend.probe_cluster(said.append, check_ports=False)
        before = _tx_bytes(c.bridge)  # node-to-node traffic is forwarded between bridge ports: not counted here
        backend.deliver(JobSpec(backend.cfg, job, dispatch_dir=str(ws)), said.append)
        if sent is not None:
            sent.append(_tx_bytes(c.bridge) - before)
    finally:
        backend.close()
    return said


def test_a_chain_dispatch_sends_the_archive_once_and_lands_identical_trees(make_ssh_cluster, tmp_path):
    c = make_ssh_cluster(3)
    ws = make_workspace(tmp_path / "ws")
    (ws / "data" / "blob.bin").write_bytes(os.urandom(6 << 20))
    sent = []
    said = _deliver(c, tmp_path, ws, "chain1", sent)
    want = _tree_digest(ws)
    assert [_tree_digest(c.root_dir(i) / "chain1") for i in range(3)] == [want] * 3
    assert 6 << 20 < sent[0] < 1.3 * (6 << 20), f"the launcher sent {sent[0]} bytes for a 6 MiB workspace to 3 nodes"
    assert not any("directly" in line for line in said), said


def test_a_refused_chain_link_falls_back_to_the_launcher(make_ssh_cluster, tmp_path):
    c = make_ssh_cluster(3)
    ws = make_workspace(tmp_path / "ws")
    (ws / "data" / "blob.bin").write_bytes(os.urandom(1 << 20))
    # No node may reach another (SSH from the launcher still works): every link down the chain is refused, in
    # whatever order the nodes join it.
    for i in range(3):
        for j in range(3):
            if i != j:
                c.exec(i, ["ip", "route", "add", "prohibit", f"{c.ips[j]}/32"])
    said = _deliver(c, tmp_path, ws, "chain2")
    want = _tree_digest(ws)
    assert [_tree_digest(c.root_dir(i) / "chain2") for i in range(3)] == [want] * 3
    lines = [x for x in said if " the chain link from " in x]
    assert len(lines) == 2, said  # the nodes after the first: each sent the workspace directly
    for line in lines:
        i = int(line[len("node"):line.index(":")])
        assert f"cannot connect to {c.ips[i]}:" in line, said
        assert line.endswith("the launcher sent it the workspace directly"), said
    # No part file, FIFO, spool or listener is left behind.
    for i in range(3):
        assert not list((c.root_dir(i) / ".paddle_cluster" / "packages").iterdir())


class _Orders(chain.Orders):
    """Orders from a pipe: any line stops the receiver; no node follows it."""

    def __init__(self, fd: int) -> None:
        super().__init__(fd)
        self.forward = ""

    def take(self) -> None:
        self.stop = os.read(self.fd, 100).decode() or "ended"


@contextlib.contextmanager
def _receiving(tmp_path, token: bytes, sha: str, size: int):
    """A chain receiver taking ``size`` bytes into ``tmp_path/part`` on a thread; yields it and ``got`` (its
    ``why`` once it returns), and stops and closes it however the test ends."""
    rx = chain.Receiver("127.0.0.1", str(tmp_path / "fifo"))
    r_stop, w_stop = os.pipe()
    got = {}
    out = open(tmp_path / "part", "wb")
    t = threading.Thread(target=lambda: got.update(
        why=rx.receive("chain", token, sha, size, out, _Orders(r_stop), lambda *a, **k: None)))
    t.start()
    try:
        yield rx, got, t, out
    finally:
        os.write(w_stop, b"\n")
        t.join(30)
        rx.close()
        out.close()


def test_a_link_without_the_token_gets_nothing(tmp_path):
    token, data = os.urandom(32), os.urandom(3 << 20)
    sha = hashlib.sha256(data).hexdigest()
    with _receiving(tmp_path, token, sha, len(data)) as (rx, got, t, out):
        with pytest.raises(chain.LinkError):  # the receiver drops a wrong token
            chain.connect(f"127.0.0.1:{rx.port}", os.urandom(32), sha)
        with socket.create_connection(("127.0.0.1", rx.port)) as rogue:  # and a peer that says nothing
            rogue.recv(32)
        with chain.connect(f"127.0.0.1:{rx.port}", token, sha) as link:
            link.sendall(data)
        t.join(30)
        out.close()
        assert got == {"why": ""} and (tmp_path / "part").read_bytes() == data
    assert not os.path.exists(rx.fifo) and not os.path.exists(rx.where)


def test_bytes_altered_on_a_link_are_refused(tmp_path):
    """A link's bytes travel in the clear: a node reached over one (unlike the node the launcher feeds over SSH)
    checks them against the archive's hash, so one byte changed on the way after a proven handshake is refused."""
    token, data = os.urandom(32), bytearray(os.urandom(1 << 20))
    sha = hashlib.sha256(data).hexdigest()
    data[12345] ^= 1
    with _receiving(tmp_path, token, sha, len(data)) as (rx, got, t, _out):
        with chain.connect(f"127.0.0.1:{rx.port}", token, sha) as link:
            link.sendall(data)
        t.join(30)
        assert got == {"why": "checksum mismatch after the transfer"}


def test_idle_strangers_neither_stall_a_link_nor_stay(tmp_path, monkeypatch):
    """Three connections that say nothing (they once held the receiver for 10 s each, and the node before gave up
    its link) and one that sends a wrong proof a byte at a time: the right peer links at once (its link's deadline
    is one HANDSHAKE_TIMEOUT: a stranger served first would take that), and every stranger is dropped within
    HANDSHAKE_TIMEOUT."""
    monkeypatch.setattr(chain, "LINK_TIMEOUT", chain.HANDSHAKE_TIMEOUT)
    token, data = os.urandom(32), os.urandom(1 << 20)
    sha = hashlib.sha256(data).hexdigest()
    rx = chain.Receiver("127.0.0.1", str(tmp_path / "fifo"))
    r_stop, w_stop = os.pipe()
    got = {}
    out = open(tmp_path / "part", "wb")
    t = threading.Thread(target=lambda: got.update(
        why=rx.receive("chain", token, sha, len(data), out, _Orders(r_stop), lambda *a, **k: None)))
    t.start()
    strangers = [socket.create_connection(("127.0.0.1", rx.port)) for _ in range(4)]
    try:
        strangers[3].sendall(b"\0")  # the start of a proof that never completes
        with chain.connect(f"127.0.0.1:{rx.port}", token, sha) as link:
            link.sendall(data)
        t.join(30)
        out.close()
        assert got == {"why": ""} and (tmp_path / "part").read_bytes() == data
        for s in strangers:  # each was sent a nonce, then closed: none holds anything of the receiver
            s.settimeout(chain.HANDSHAKE_TIMEOUT + 5)
            assert len(s.recv(64)) == chain.NONCE and s.recv(64) == b""
    finally:
        for s in strangers:
            s.close()
        os.write(w_stop, b"\n")
        t.join(30)
        rx.close()
        out.close()


def test_a_streamed_archive_is_cached_only_once_its_hash_is_right(tmp_path):
    src = tmp_path / "src"
    (src / "data").mkdir(parents=True)
    (src / "data" / "part-0").write_bytes(os.urandom(3 << 20))
    (src / "train.py").write_text("print(1)\n")
    archive = tmp_path / "ws.tar"
    with tarfile.open(archive, "w") as t:
        t.add(src / "train.py", arcname="train.py")
        t.add(src / "data", arcname="data")
    root, sha, size = str(tmp_path / "root"), "c" * 64, archive.stat().st_size
    with open(archive, "rb") as f, pytest.raises(UnsafeArchive, match="checksum mismatch"):
        trees.store(root, f, sha, 10, size, verified=lambda: False)  # unpacked as it came, then refused
    assert not os.path.exists(trees.tree_dir(root, sha))
    assert os.listdir(os.path.dirname(trees.tree_dir(root, sha))) == []  # nothing half-made is left either
    with open(archive, "rb") as f:
        trees.store(root, f, sha, 10, size, verified=lambda: True)
    assert trees.materialize(root, sha, f"{root}/job")
    assert (Path(root) / "job" / "data" / "part-0").read_bytes() == (src / "data" / "part-0").read_bytes()


def test_a_changed_workspace_sends_only_the_changed_files(make_ssh_cluster, tmp_path):
    c = make_ssh_cluster(3)
    ws = make_workspace(tmp_path / "ws")
    (ws / "data" / "blob.bin").write_bytes(os.urandom(6 << 20))
    (ws / "data" / "old.txt").write_text("to be deleted\n")
    _deliver(c, tmp_path, ws, "v1")
    (ws / "data" / "part-0").write_text("4 5 6\n")  # changed
    (ws / "data" / "new.txt").write_text("added\n")  # new
    (ws / "data" / "old.txt").unlink()  # gone
    sent = []
    said = _deliver(c, tmp_path, ws, "v2", sent)
    assert "node0, node1, node2: sent only the 2 changed file(s)" in " ".join(said), said
    assert sent[0] < 1 << 20, f"the launcher sent {sent[0]} bytes for 2 small changed files"
    want = _tree_digest(ws)
    for i in range(3):
        job1, job2 = c.root_dir(i) / "v1", c.root_dir(i) / "v2"
        assert _tree_digest(job2) == want and not (job2 / "data" / "old.txt").exists()
        assert (job2 / "data" / "blob.bin").stat().st_ino == (job1 / "data" / "blob.bin").stat().st_ino
    again = _deliver(c, tmp_path, ws, "v3")  # the tree made from the delta is the workspace's, like any other
    assert "node0, node1, node2 already held this package: not sent again" in again, again


def test_a_node_that_cannot_use_the_delta_is_sent_the_whole_workspace(make_ssh_cluster, tmp_path, monkeypatch):
    """The launcher's record of the tree a node holds disagrees with that tree (here: the record is edited to
    claim a file the tree lacks; in life, the tree was dropped between the probe and the delta): the node
    refuses the delta, and the launcher sends it the whole workspace, which lands intact."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    c = make_ssh_cluster(2)
    ws = make_workspace(tmp_path / "ws")
    (ws / "data" / "blob.bin").write_bytes(os.urandom(2 << 20))
    _deliver(c, tmp_path, ws, "w1")
    extra = b"claimed by the record only\n"
    for meta in (tmp_path / "cache" / "paddle-cluster" / "workspaces").glob("*.json"):
        doc = json.loads(meta.read_text())  # (a workspace packed as it was sent: its entries read from its archive)
        doc["manifest"] = {**delta.manifest(str(meta.parent), doc["sha256"]),
                           "data/extra.txt": hashlib.sha256(extra).hexdigest()}
        meta.write_text(json.dumps(doc))
    (ws / "data" / "extra.txt").write_bytes(extra)
    (ws / "data" / "part-0").write_text("7 8 9\n")
    said = " ".join(_deliver(c, tmp_path, ws, "w2"))
    assert "sent only the 1 changed file(s)" in said, said
    for i in range(2):
        assert f"node{i}: the changed files could not be put on the tree held here" in said, said
        assert "the launcher sent it the whole workspace" in said, said
        assert _tree_digest(c.root_dir(i) / "w2") == _tree_digest(ws)
    again = _deliver(c, tmp_path, ws, "w3")
    assert "node0, node1 already held this package: not sent again" in again, again


FAILING_SSH = """#!/bin/sh
# An OpenSSH client whose connection drops after the first MiB of an upload.
head -c 1048576 > /dev/null
echo "client_loop: send disconnect: Connection reset by peer" >&2
exit 1
"""


def test_a_failed_upload_stops_every_node_waiting_and_leaves_no_tree(make_ssh_cluster, tmp_path, monkeypatch):
    """The launcher's upload into the head of the chain breaks off: the dispatch fails naming that node (only) and why,
    every node stops waiting (no session is left on any node), none keeps a tree or a job directory, and the
    next dispatch sends the workspace whole and lands it."""
    c = make_ssh_cluster(3)
    ws = make_workspace(tmp_path / "ws")
    (ws / "data" / "blob.bin").write_bytes(os.urandom(6 << 20))
    fake = tmp_path / "bin" / "ssh"
    fake.parent.mkdir()
    fake.write_text(FAILING_SSH)
    fake.chmod(0o755)
    path = os.environ["PATH"]
    monkeypatch.setenv("PATH", f"{fake.parent}:{path}")
    with pytest.raises(ClusterError) as e:
        _deliver(c, tmp_path, ws, "up1")
    # The head of the chain is whichever node was up first: the error names that one alone.
    assert "failed on 1 host(s)" in str(e.value) and "Connection reset by peer" in str(e.value), str(e.value)
    assert sum(f"node{i} (" in str(e.value) for i in range(3)) == 1, str(e.value)
    for i in range(3):
        wait_for(lambda i=i: c.pids(i) == [], 30, f"node{i}'s session to end")
        assert not any((c.root_dir(i) / ".paddle_cluster" / "trees").glob("[0-9a-f]*")), i
        assert not (c.root_dir(i) / "up1").exists()
    monkeypatch.setenv("PATH", path)
    _deliver(c, tmp_path, ws, "up2")
    assert [_tree_digest(c.root_dir(i) / "up2") for i in range(3)] == [_tree_digest(ws)] * 3


LATE_PYTHON = """#!/bin/sh
# This node's session starts only once node0 has unpacked the first MiB of the workspace: it joins the chain
# after the first bytes flowed. (A session without a workspace, the probe before, starts at once.)
case "$*" in *'"job_dir":""'*) exec {python} "$@";; esac
end=$(( $(date +%s) + 60 ))
until find {root0}/.paddle_cluster/trees -path '*.unpacking-*' -name blob.bin -size +1024k 2>/dev/null | grep -q .; do
  [ "$(date +%s)" -lt "$end" ] || {{ echo "node0 unpacked nothing within 60 s" >&2; exit 1; }}
  sleep 0.05
done
touch /home/paddle/joined-late
exec {python} "$@"
"""


def _late_joiners(c, nodes):
    """PYTHON for ``c``: on ``nodes``, a wrapper whose session waits until node0 is receiving (see LATE_PYTHON)."""
    for i in range(c.n):
        wrapper = c.root_dir(i) / "python.sh"
        wrapper.write_text(LATE_PYTHON.format(root0=c.root_dir(0), python=c.python) if i in nodes
                           else f"#!/bin/sh\nexec {c.python} \"$@\"\n")
        wrapper.chmod(0o755)
        c.shape(i, "40mbit")  # 6 MiB take ~1.3 s a hop: the later nodes join while it flows
    return "/home/paddle/python.sh"


def test_later_nodes_join_the_chain_after_the_first_bytes_flowed(make_ssh_cluster, tmp_path):
    """node1 and node2 come up only once node0 is receiving: each is linked in at the end of the chain, gets what
    went by before it from the node before it (its spool) and then the live stream, and the launcher still sends
    the archive once."""
    c = make_ssh_cluster(3)
    ws = make_workspace(tmp_path / "ws")
    (ws / "data" / "blob.bin").write_bytes(os.urandom(6 << 20))
    sent = []
    said = _deliver(c, tmp_path, ws, "late1", sent, PYTHON=_late_joiners(c, {1, 2}))
    assert all((c.root_dir(i) / "joined-late").exists() for i in (1, 2))
    assert [_tree_digest(c.root_dir(i) / "late1") for i in range(3)] == [_tree_digest(ws)] * 3
    assert 6 << 20 < sent[0] < 1.3 * (6 << 20), f"the launcher sent {sent[0]} bytes for a 6 MiB workspace to 3 nodes"
    assert not any("directly" in line for line in said), said
    for i in range(3):  # no FIFO or spool is left
        assert not list((c.root_dir(i) / ".paddle_cluster" / "packages").iterdir())


def test_a_node_that_joins_late_and_fails_stops_the_dispatch_and_leaves_nothing(make_ssh_cluster, tmp_path):
    """node2 joins after node0 is receiving, and cannot unpack (its cache is a 2 MB disk): the dispatch fails
    naming node2 and why, every node stops (no session left), and no node keeps a tree, a job directory, a FIFO or
    a spool -- node0 and node1 had the whole archive, and drop it too. Then, with room again, it lands."""
    c = make_ssh_cluster(3)
    ws = make_workspace(tmp_path / "ws")
    (ws / "data" / "blob.bin").write_bytes(os.urandom(6 << 20))
    python = _late_joiners(c, {1, 2})
    small = c.root_dir(2) / ".paddle_cluster" / "trees"
    small.mkdir(parents=True, exist_ok=True)
    c.exec(2, ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", "/home/paddle/.paddle_cluster/trees"])
    try:
        with pytest.raises(ClusterError) as e:
            _deliver(c, tmp_path, ws, "fail1", PYTHON=python)
        assert "node2" in str(e.value) and "No space left on device" in str(e.value), str(e.value)
        assert "node0" not in str(e.value) and "node1" not in str(e.value), str(e.value)
        for i in range(3):
            wait_for(lambda i=i: c.pids(i) == [], 30, f"node{i}'s session to end")
            assert not any((c.root_dir(i) / ".paddle_cluster" / "trees").iterdir()), i
            assert not (c.root_dir(i) / "fail1").exists()
            assert not list((c.root_dir(i) / ".paddle_cluster" / "packages").iterdir())
    finally:
        c.exec(2, ["umount", "/home/paddle/.paddle_cluster/trees"])
    _deliver(c, tmp_path, ws, "fail2", PYTHON=python)
    assert [_tree_digest(c.root_dir(i) / "fail2") for i in range(3)] == [_tree_digest(ws)] * 3


def test_what_a_session_killed_mid_dispatch_leaves_the_next_session_removes(make_ssh_cluster, tmp_path):
    """node0's session is SIGKILLed while it unpacks the workspace: the dispatch fails at once naming node0 (the
    upload into its FIFO, which nothing reads any more, is stopped rather than left to wait forever); its FIFO
    directory and half-unpacked tree stay behind (nothing of it runs to remove them); the next dispatch to node0
    removes them and lands."""
    c = make_ssh_cluster(1)
    ws = make_workspace(tmp_path / "ws")
    (ws / "data" / "blob.bin").write_bytes(os.urandom(6 << 20))
    c.shape(0, "40mbit")  # ~1.3 s for the workspace: time to kill the session while it unpacks
    root = c.root_dir(0) / ".paddle_cluster"
    failed = []

    def deliver():
        try:
            _deliver(c, tmp_path, ws, "killed1")
        except ClusterError as e:
            failed.append(e)

    th = threading.Thread(target=deliver)
    th.start()
    try:
        wait_for(lambda: any(p.stat().st_size > 1 << 20 for p in root.glob("trees/*.unpacking-*/*/data/blob.bin")),
                 60, "node0 unpacking the workspace", interval=0.05)
        for pid in c.pids(0):
            with contextlib.suppress(ProcessLookupError):  # one of the session's processes ended since the listing
                os.kill(pid, signal.SIGKILL)
    finally:
        th.join(120)
    assert not th.is_alive() and failed, "a dispatch whose node was killed must fail, not wait for it"
    assert "node0" in str(failed[0]) and "session ended while it received the workspace" in str(failed[0]), failed
    left = [p.name for p in root.glob("packages/*")] + [p.name for p in root.glob("trees/*.*-*")]
    assert any(".rx-" in n for n in left) and any(".unpacking-" in n for n in left), left
    c.unshape(0)
    _deliver(c, tmp_path, ws, "killed2")
    assert _tree_digest(c.root_dir(0) / "killed2") == _tree_digest(ws)
    assert not list(root.glob("packages/*")) and not list(root.glob("trees/*.*-*")), \
        [p.name for p in root.glob("*/*")]
    assert not (c.root_dir(0) / "killed1").exists()


def test_a_node_killed_in_the_middle_of_the_chain_fails_the_dispatch_naming_it(make_ssh_cluster, tmp_path):
    """node1's session is SIGKILLed while it receives from node0 and forwards to node2: the dispatch fails at once
    naming node1 alone, every other node stops (no session left anywhere), and the next dispatch lands."""
    c = make_ssh_cluster(3)
    ws = make_workspace(tmp_path / "ws")
    (ws / "data" / "blob.bin").write_bytes(os.urandom(6 << 20))
    for i in range(3):
        c.shape(i, "40mbit")
    root1 = c.root_dir(1) / ".paddle_cluster"
    failed = []

    def deliver():
        try:
            _deliver(c, tmp_path, ws, "mid1")
        except ClusterError as e:
            failed.append(e)

    th = threading.Thread(target=deliver)
    th.start()
    try:
        wait_for(lambda: any(p.stat().st_size > 1 << 20 for p in root1.glob("trees/*.unpacking-*/*/data/blob.bin")),
                 60, "node1 unpacking the workspace", interval=0.05)
        for pid in c.pids(1):
            with contextlib.suppress(ProcessLookupError):  # one of the session's processes ended since the listing
                os.kill(pid, signal.SIGKILL)
    finally:
        th.join(120)
    assert not th.is_alive() and failed, "a dispatch whose node was killed must fail, not wait for it"
    msg = str(failed[0])
    assert "node1" in msg and "node0 (" not in msg and "node2 (" not in msg, msg
    for i in range(3):
        wait_for(lambda i=i: c.pids(i) == [], 30, f"node{i}'s session to end")
        assert not (c.root_dir(i) / "mid1").exists()
    for i in range(3):
        c.unshape(i)
    _deliver(c, tmp_path, ws, "mid2")
    assert [_tree_digest(c.root_dir(i) / "mid2") for i in range(3)] == [_tree_digest(ws)] * 3


def test_an_upload_into_a_fifo_nobody_reads_is_stopped_not_left_waiting(make_ssh_cluster, tmp_path):
    """Opening a FIFO for writing waits for a reader: an upload into the FIFO of a session that died would wait
    forever. ``put(..., until=)`` stops it (a HostError) once ``until()`` says the reader is gone -- over SSH on
    a namespace host and on this machine (``localhost``)."""
    c = make_ssh_cluster(1)
    src = tmp_path / "blob"
    src.write_bytes(os.urandom(1 << 20))
    (c.root_dir(0) / "nobody").mkdir()
    os.mkfifo(c.root_dir(0) / "nobody" / "fifo")
    local = tmp_path / "local"
    local.mkdir()
    os.mkfifo(local / "fifo")
    cfg = load_config(str(write_conf(tmp_path, c)))
    cfg_local = load_config(str(write_conf(tmp_path, c, "local.py", hosts=["localhost"], ROOT_DIR=str(local))))
    for node, fifo in ((make_nodes(cfg)[0], "/home/paddle/nobody/fifo"),
                       (make_nodes(cfg_local)[0], str(local / "fifo"))):
        try:
            with pytest.raises(HostError, match="stopped: nothing reads it any more"):
                node.put(str(src), fifo, until=lambda: True)
        finally:
            node.close()


def test_a_workspace_changed_while_it_is_sent_is_refused_and_nothing_is_placed(make_ssh_cluster, tmp_path,
                                                                                 monkeypatch):
    """A new workspace goes out as it is packed; a file already sent changes before the packer reaches the end.
    The dispatch fails naming the file, no node keeps a tree or a job directory (they received the mixed bytes,
    never a hash to accept them under), and the next dispatch sends the new version whole. The change is made
    from inside the launcher's packer, once 2 MiB went out: the only way to make it at a known point."""
    c = make_ssh_cluster(2)
    ws = make_workspace(tmp_path / "ws")
    (ws / "data" / "blob.bin").write_bytes(os.urandom(4 << 20))
    emit, sent = dispatch.Packing._emit, [0]

    def emit_then_change(self, b):
        emit(self, b)
        sent[0] += len(b)
        if sent[0] > (2 << 20) and sent[0] - len(b) <= (2 << 20):
            (ws / "data" / "part-0").write_text("changed meanwhile\n")  # sorted after blob.bin: not read yet

    monkeypatch.setattr(dispatch.Packing, "_emit", emit_then_change)
    with pytest.raises(ClusterError) as e:
        _deliver(c, tmp_path, ws, "moving1")
    assert "part-0 changed" in str(e.value) and "while the workspace was read" in str(e.value), str(e.value)
    for i in range(2):
        wait_for(lambda i=i: c.pids(i) == [], 30, f"node{i}'s session to end")
        assert not any((c.root_dir(i) / ".paddle_cluster" / "trees").glob("[0-9a-f]*")), i
        assert not (c.root_dir(i) / "moving1").exists()
    monkeypatch.undo()
    _deliver(c, tmp_path, ws, "moving2")
    assert [_tree_digest(c.root_dir(i) / "moving2") for i in range(2)] == [_tree_digest(ws)] * 2
    assert (c.root_dir(1) / "moving2" / "data" / "part-0").read_text() == "changed meanwhile\n"
