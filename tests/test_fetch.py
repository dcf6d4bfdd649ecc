"""``paddle-cluster fetch`` and ``run --fetch``: a job's outputs brought to this machine, one folder per node.

Over SSH with the README's conf.py on the three test hosts (the real node connections and node library), from
a Slurm-style node directory read here, and against a node that lies in its listing: nothing lands outside
``DEST/nodeN`` whatever the node says, and nothing is read through a link on the node."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

from helpers import FIT_A_LINE, OMIT, checkout_env, cli, no_traceback, write_conf

from paddle_cluster.launch import fetch
from paddle_cluster.launch.errors import ClusterError
from paddle_cluster.node import files


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _tree(top: Path) -> dict:
    return {str(p.relative_to(top)): _sha(p) for p in sorted(top.rglob("*")) if p.is_file() and not p.is_symlink()}


def test_run_fetch_then_fetch_every_node_over_ssh(cluster, tmp_path):
    # The README's conf.py (HOSTS, ROOT_DIR, PADDLE_NIC, ports, LD_LIBRARY_PATH) plus what reaching these test
    # hosts takes (their key, known_hosts, their interpreter with numpy: PYTHON); no PSERVER_COMMAND, no ENV.
    conf = write_conf(tmp_path, cluster, PSERVER_COMMAND=OMIT, ENV=OMIT)
    res = subprocess.run([sys.executable, "-m", "paddle_cluster", "--conf", str(conf), "run", "--job_name", "fj",
                          "--job_dispatch_package", str(FIT_A_LINE), "--fetch", "--", "--passes", "1"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=240, env=checkout_env(),
                         stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    no_traceback(res)
    on_node0 = cluster.root_dir(0) / "fj" / "output"
    want = _tree(on_node0)
    assert "metrics.json" in want and any(k.endswith("params.npz") for k in want), want
    assert _tree(tmp_path / "fj" / "node0" / "output") == want  # trainer 0's output/, byte for byte
    assert "node0: 2 file(s) copied" in res.stderr and "-> fj/node0" in res.stderr, res.stderr

    # Every node, into --to: node0's files already here are skipped by hash; node1's and node2's output/ are empty.
    dest = tmp_path / "got"
    (dest / "node0" / "output").mkdir(parents=True)
    (dest / "node0" / "output" / "metrics.json").write_bytes((on_node0 / "metrics.json").read_bytes())
    big = next(k for k in want if k.endswith("params.npz"))
    data = (on_node0 / big).read_bytes()
    part = dest / "node0" / "output" / Path(big).parent / f".params.npz{fetch.PART}"
    part.parent.mkdir(parents=True)
    part.write_bytes(data[: len(data) // 2])  # an interrupted earlier fetch: it resumes from there
    res = cli(conf, "fetch", "--job_name", "fj", "--to", str(dest))
    assert res.returncode == 0, res.stderr
    assert f"node0: 1 file(s) copied ({fetch._size(len(data) - len(data) // 2)}), 1 already here" in res.stderr
    assert "node1: nothing to copy (no files there)" in res.stderr and "node2: nothing to copy" in res.stderr
    assert _tree(dest / "node0" / "output") == want and not part.exists()

    # Any path of the job directory, on every node that has it.
    res = cli(conf, "fetch", "--job_name", "fj", "--to", str(dest), "nodefile", "log")
    assert res.returncode == 0, res.stderr
    for i in range(3):
        assert (dest / f"node{i}" / "nodefile").read_bytes() == (cluster.root_dir(i) / "fj" / "nodefile").read_bytes()
        assert (dest / f"node{i}" / "log" / "train.log").is_file()  # trainer i's (one per node: train.log)

    # A path nowhere, a job nowhere: exit 1 with the names that exist.
    res = cli(conf, "fetch", "--job_name", "fj", "outptu")
    assert res.returncode == 1 and "outptu: on no node of job fj; its job directory holds:" in res.stderr
    assert "output" in res.stderr.splitlines()[-1] and "nodefile" in res.stderr, res.stderr
    res = cli(conf, "fetch", "--job_name", "jf")
    assert res.returncode == 1 and "job jf is on no node" in res.stderr, res.stderr
    # The session's hosts also hold other tests' jobs: fj is among the names given.
    assert "fj" in res.stderr.split("jobs there: ")[1].splitlines()[0].split(", "), res.stderr
    no_traceback(res)


class _Lying(fetch.DirFiles):
    """A node whose listing names paths outside its folder here (a hostile or broken node)."""

    def listing(self, paths):
        doc = super().listing(paths)
        good = doc["files"][0]
        for bad in ("../../escaped", "/tmp/abs", "output/../../up", "output/a\nb/../../../x"):
            doc["files"].append({**good, "path": bad})
        return doc


def test_nothing_is_written_outside_the_node_folder(tmp_path):
    job = tmp_path / "root" / "j" / "node0"
    (job / "output").mkdir(parents=True)
    (job / "output" / "model.bin").write_bytes(b"weights" * 1000)
    (job / "output" / "secret-link").symlink_to("/etc/hostname")  # on the node: listed as left alone, never read
    os.mkfifo(job / "output" / "fifo")  # would block a reader: left alone
    said = []
    dest = tmp_path / "dest"
    got = fetch.fetch(fetch.Outputs([_Lying(0, str(job))]), "j", str(dest), ["output"], said.append,
                      lambda name, total: None)
    assert got[0].copied == ["output/model.bin"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dest", "root"]  # nothing escaped beside them
    assert [str(p.relative_to(dest)) for p in dest.rglob("*")] == ["node0", "node0/output", "node0/output/model.bin"]
    text = "\n".join(said)
    assert "output/secret-link: a symbolic link (not followed)" in text and "output/fifo: not a regular file" in text
    assert "leaves the job directory" in text and "\\n" in text and "\nb" not in text  # a newline shown escaped

    # A link here where a folder goes (DEST/node0/output -> elsewhere): refused, nothing written through it.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (dest / "node0" / "output" / "model.bin").unlink()
    (dest / "node0" / "output").rmdir()
    (dest / "node0" / "output").symlink_to(elsewhere)
    said.clear()
    fetch.fetch(fetch.Outputs([fetch.DirFiles(0, str(job))]), "j", str(dest), ["output"], said.append,
                lambda name, total: None)
    assert list(elsewhere.iterdir()) == []
    assert any("node0/output is a symbolic link" in s for s in said), said


def test_a_file_changed_since_its_part_was_fetched_is_fetched_again(tmp_path):
    job = tmp_path / "root" / "j" / "node0"
    (job / "output").mkdir(parents=True)
    (job / "output" / "m").write_bytes(b"new content " * 100)
    dest = tmp_path / "dest"
    (dest / "node0" / "output").mkdir(parents=True)
    (dest / "node0" / "output" / f".m{fetch.PART}").write_bytes(b"OLD content " * 50)  # a part of another version
    fetch.fetch(fetch.Outputs([fetch.DirFiles(0, str(job))]), "j", str(dest), ["output"], lambda s: None,
                lambda name, total: None)
    assert (dest / "node0" / "output" / "m").read_bytes() == b"new content " * 100


def test_listing_and_send_stay_in_the_job_directory(tmp_path):
    job = tmp_path / "j"
    (job / "output").mkdir(parents=True)
    (job / "out-link").symlink_to(tmp_path)  # a link to a directory above: not entered
    doc = files.listing(str(job), ["output", "out-link", "nothing"])
    assert doc["missing"] == ["nothing"] and doc["skipped"] == [{"path": "out-link",
                                                                 "why": "a symbolic link (not followed)"}]
    for bad in ("../x", "/etc/passwd", "output/../../x", ""):
        try:
            files.parts(bad)
        except files.UnsafePath:
            continue
        raise AssertionError(f"{bad!r} was taken")
    (tmp_path / "outside").write_text("no")
    try:
        files.copy(str(job), "out-link/outside", 0, open(os.devnull, "wb"))
    except OSError:
        pass
    else:
        raise AssertionError("read through a link")
    try:
        fetch.fetch(fetch.Outputs([fetch.DirFiles(0, str(job))]), "j", str(tmp_path / "d"), ["../.."],
                    lambda s: None, lambda n, t: None)
    except ClusterError as e:
        assert "give paths relative to the job directory" in str(e)
    else:
        raise AssertionError("../.. was taken")
