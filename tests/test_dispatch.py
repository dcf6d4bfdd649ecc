"""Getting a job onto the nodes: one session per node (library, probe, workspace, agent), the per-node cache of
unpacked workspaces (node/trees.py), and a job on 16 hosts."""

from __future__ import annotations

import os
import subprocess
import tarfile

import pytest
from helpers import assert_nothing_left, cli, make_workspace, no_traceback, write_conf

from paddle_cluster.launch import sshnode
from paddle_cluster.launch.access import make_nodes
from paddle_cluster.launch.config import load_config
from paddle_cluster.node import trees
from paddle_cluster.node.unpack import UnsafeArchive

# Reads its workspace file, says who its agent is, then changes the file: replaced by rename (allowed), or in
# place when its job's name ends in "inplace" (root ignores the read-only mode: the node must notice).
WRITER_PY = r'''
import os
before = open("data/part-0").read().strip()
agent = open(f"/proc/{os.getppid()}/cmdline", "rb").read().replace(b"\0", b" ").decode()
print(f"BEFORE {before!r} SESSION-AGENT {'paddle_cluster.node.session' in agent}", flush=True)
if os.getcwd().endswith("inplace"):
    with open("data/part-0", "r+") as f:
        f.write("changed in place\n")
else:
    with open("data/part-0.new", "w") as f:
        f.write("replaced by the job\n")
    os.replace("data/part-0.new", "data/part-0")
'''


# -- the cache, on this machine ----------------------------------------------------------------------------
def _archive(tmp_path, files):
    src = tmp_path / "src"
    for name, data in files.items():
        p = src / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    out = tmp_path / "ws.tar"
    with tarfile.open(out, "w") as t:
        for name in files:
            t.add(src / name, arcname=name)
    return str(out)


def test_a_job_directory_is_hard_links_to_the_read_only_cache(tmp_path):
    root = str(tmp_path / "root")
    archive = _archive(tmp_path, {"train.py": b"print(1)\n", "data/part-0": b"1 2 3\n", "data/part-1": b"4\n"})
    assert not trees.materialize(root, "a" * 64, f"{root}/job1")  # nothing cached yet: nothing done
    assert not os.path.exists(f"{root}/job1")
    trees.store(root, archive, "a" * 64, max_members=10)
    assert trees.materialize(root, "a" * 64, f"{root}/job1")
    cached = os.path.join(trees.tree_dir(root, "a" * 64), "tree", "data", "part-0")
    job_file = f"{root}/job1/data/part-0"
    assert os.stat(job_file).st_ino == os.stat(cached).st_ino  # linked, not copied
    assert os.stat(job_file).st_mode & 0o222 == 0  # read-only
    assert not os.path.islink(f"{root}/job1/data") and os.stat(f"{root}/job1").st_mode & 0o777 == 0o700
    # What a job may do: new files, a workspace file replaced by rename, one deleted -- its own directory only.
    with open(f"{root}/job1/data/new", "w") as f:
        f.write("out")
    with open(f"{root}/job1/data/part-0.tmp", "w") as f:
        f.write("replaced")
    os.replace(f"{root}/job1/data/part-0.tmp", job_file)
    os.unlink(f"{root}/job1/data/part-1")
    assert trees.materialize(root, "a" * 64, f"{root}/job2")  # the same tree, still intact
    assert os.stat(f"{root}/job2/data/part-0").st_ino == os.stat(cached).st_ino
    assert sorted(os.listdir(f"{root}/job2/data")) == ["part-0", "part-1"]
    assert open(f"{root}/job2/data/part-0").read() == "1 2 3\n"
    with pytest.raises(UnsafeArchive, match="not empty"):
        trees.materialize(root, "a" * 64, f"{root}/job1")


def test_a_tree_written_into_in_place_is_dropped_not_reused(tmp_path):
    root = str(tmp_path / "root")
    archive = _archive(tmp_path, {"train.py": b"print(1)\n", "data/part-0": b"1 2 3\n"})
    trees.store(root, archive, "a" * 64, max_members=10)
    assert trees.materialize(root, "a" * 64, f"{root}/job1")
    if os.geteuid() != 0:  # root writes in place without asking
        os.chmod(f"{root}/job1/data/part-0", 0o644)
    with open(f"{root}/job1/data/part-0", "r+") as f:
        f.write("XXXXX")
    assert not trees.materialize(root, "a" * 64, f"{root}/job2")  # the next job is not given the damage
    assert not os.path.exists(f"{root}/job2") and not os.path.exists(trees.tree_dir(root, "a" * 64))
    trees.store(root, archive, "a" * 64, max_members=10)  # sent again
    assert trees.materialize(root, "a" * 64, f"{root}/job2")
    assert open(f"{root}/job2/data/part-0").read() == "1 2 3\n"
    assert open(f"{root}/job1/data/part-0").read() == "XXXXX\n"  # the job's own damage stays its own


def test_the_cache_keeps_the_most_recent_trees(tmp_path):
    root = str(tmp_path / "root")
    for k in range(trees.KEEP + 2):
        trees.store(root, _archive(tmp_path / str(k), {"f": str(k).encode()}), f"{k}" * 64, max_members=5)
    kept = sorted(os.listdir(os.path.dirname(trees.tree_dir(root, "0" * 64))))
    assert len(kept) == trees.KEEP and "0" * 64 not in kept and f"{trees.KEEP + 1}" * 64 in kept


def test_an_unsafe_archive_is_not_cached(tmp_path):
    root = str(tmp_path / "root")
    bad = tmp_path / "bad.tar"
    with tarfile.open(bad, "w") as t:
        info = tarfile.TarInfo("../escape")
        t.addfile(info)
    with pytest.raises(UnsafeArchive):
        trees.store(root, str(bad), "b" * 64, max_members=5)
    assert not os.path.exists(trees.tree_dir(root, "b" * 64))


# -- on the SSH cluster ------------------------------------------------------------------------------------------
def test_one_session_per_node_and_an_unchanged_workspace_is_not_sent(cluster, tmp_path):
    ws = make_workspace(tmp_path / "ws")
    (ws / "train.py").write_text(WRITER_PY)
    conf = write_conf(tmp_path, cluster)
    first = cli(conf, "run", "--job_dispatch_package", str(ws), "--job_name", "cache1")
    assert first.returncode == 0, first.stdout + first.stderr
    for i in range(3):  # the agent that started the trainer is the session that probed and placed the workspace
        assert f"[trainer.{i}@node{i}] BEFORE '1 2 3' SESSION-AGENT True" in first.stdout, first.stdout
    lib = cluster.root_dir(0) / ".paddle_cluster" / "lib"
    installed = {p.name: p.stat().st_ino for p in lib.iterdir()}

    again = cli(conf, "run", "--job_dispatch_package", str(ws), "--job_name", "cache2-inplace")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "node0, node1, node2 already held this package: not sent again" in again.stderr
    for i in range(3):  # the first job replaced its file by rename; the cache and this job did not see it
        assert f"[trainer.{i}@node{i}] BEFORE '1 2 3' SESSION-AGENT True" in again.stdout, again.stdout
        assert (cluster.root_dir(i) / "cache1" / "data" / "part-0").read_text() == "replaced by the job\n"
    assert {p.name: p.stat().st_ino for p in lib.iterdir()} == installed  # the library was not sent again

    # The second job wrote in place into the files it shares with the cache: the next job is not given that.
    third = cli(conf, "run", "--job_dispatch_package", str(ws), "--job_name", "cache3")
    assert third.returncode == 0, third.stdout + third.stderr
    assert ("node0, node1, node2: a job wrote into its cached copy of this workspace in place (the workspace is "
            "read-only input; write outputs to new files): dropped and sent again") in third.stderr
    for i in range(3):
        assert f"[trainer.{i}@node{i}] BEFORE '1 2 3'" in third.stdout, third.stdout

    (ws / "data" / "part-0").write_text("4 5 6\n")
    changed = cli(conf, "run", "--job_dispatch_package", str(ws), "--job_name", "cache4")
    assert changed.returncode == 0, changed.stdout + changed.stderr
    assert "not sent again" not in changed.stderr
    assert "[trainer.1@node1] BEFORE '4 5 6'" in changed.stdout
    no_traceback(changed)
    assert_nothing_left(cluster)


@pytest.mark.timeout(300)
def test_a_job_on_16_hosts(make_ssh_cluster, tmp_path):
    c = make_ssh_cluster(16)
    ws = make_workspace(tmp_path / "ws")
    conf = write_conf(tmp_path, c, PADDLE_PORTS_NUM=1, START_TIMEOUT=120.0, ORPHAN_TIMEOUT=30.0,
                      SSH_CONNECT_TIMEOUT=20.0)
    res = cli(conf, "run", "--job_dispatch_package", str(ws), "--job_name", "wide", timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    for i in range(16):
        assert f"[trainer.{i}@node{i}] ENV OK trainer {i} of 16 on node {i}" in res.stdout
        assert f"[pserver.{i}@node{i}] pserver {i} listening on {c.ips[i]}" in res.stdout
        assert (c.root_dir(i) / "wide" / "data" / "part-0").read_text() == "1 2 3\n"
    assert "job wide finished: all 16 trainer(s) exited 0" in res.stderr
    assert_nothing_left(c)


@pytest.mark.timeout(200)
def test_prepared_agents_wait_for_a_slow_upload_to_another_node(make_ssh_cluster, tmp_path):
    c = make_ssh_cluster(2)
    ws = make_workspace(tmp_path / "ws")
    (ws / "data" / "big.bin").write_bytes(os.urandom(4 << 20))
    one = write_conf(tmp_path, c, "one.py", hosts=c.hosts[:1])
    first = cli(one, "run", "--job_dispatch_package", str(ws), "--job_name", "slow1")  # node0 caches it
    assert first.returncode == 0, first.stdout + first.stderr
    c.shape(1, "4mbit")  # 4 MB to node1 take ~8 s, longer than ORPHAN_TIMEOUT: node0's agent must not give up
    res = cli(write_conf(tmp_path, c, ORPHAN_TIMEOUT=5.0), "run", "--job_dispatch_package", str(ws),
              "--job_name", "slow2", timeout=150)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "node0 already held this package: not sent again" in res.stderr
    assert "[trainer.0@node0] ENV OK trainer 0 of 2" in res.stdout and "[trainer.1@node1] ENV OK" in res.stdout
    assert (c.root_dir(1) / "slow2" / "data" / "big.bin").read_bytes() == (ws / "data" / "big.bin").read_bytes()
    assert_nothing_left(c)


def test_an_upload_uses_aes_gcm_unless_an_ssh_config_chose_the_ciphers(cluster, tmp_path):
    """The workspace's upload (OpenSSH's ``ssh``) negotiates AES-GCM, about half the CPU of the default
    chacha20-poly1305 at each end, when no ssh config chose the ciphers; a config that did is kept (here
    SSH_CONFIG_FILE's ``Ciphers aes256-ctr``). The upload's own command line, run with ``-v`` on a real host."""
    if not sshnode._has_aes():
        pytest.skip("this CPU has no AES instructions: OpenSSH's default stays")
    chosen = tmp_path / "ssh_config"
    chosen.write_text("Host *\n    Ciphers aes256-ctr\n")
    for name, over, want in (("conf.py", {}, "aes128-gcm@openssh.com"),
                             ("chosen.py", {"SSH_CONFIG_FILE": str(chosen)}, "aes256-ctr")):
        node = make_nodes(load_config(str(write_conf(tmp_path, cluster, name, hosts=cluster.hosts[:1], **over))))[0]
        argv = node._openssh_argv("true")
        assert argv is not None
        res = subprocess.run([argv[0], "-v", *argv[1:]], capture_output=True, text=True, timeout=60,
                             stdin=subprocess.DEVNULL)
        assert res.returncode == 0, res.stderr
        assert f"kex: client->server cipher: {want} " in res.stderr, res.stderr
