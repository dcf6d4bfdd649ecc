"""Launches from one machine at the same moment: the launcher's caches (workspace and library archives), its
journal and the default job name stay consistent, and no archive a launch is sending is evicted under it.
First the cache functions raced directly in several processes, then several real ``paddle-cluster run``."""

from __future__ import annotations

import contextlib
import hashlib
import json
import multiprocessing as mp
import os
import re
import subprocess
from pathlib import Path

from helpers import assert_nothing_left, checkout_env, make_workspace, no_traceback, start_cli, write_conf

from paddle_cluster.launch import journal
from paddle_cluster.launch.config import load_config
from paddle_cluster.launch.dispatch import pack_workspace
from paddle_cluster.launch.journal import default_job_name
from paddle_cluster.node import trees

WORKERS = 6


def _workspace(path: Path, tag: str) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "train.py").write_text(f"print({tag!r})\n")
    (path / "data.bin").write_bytes(hashlib.sha256(tag.encode()).digest() * 40000)  # 1.3 MB: a slow-ish tar
    return path


def _sha(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _pack_worker(k: int, workspaces: list, cache: str, rounds: int, start, errors) -> None:
    """Pack a workspace (the same as another worker's, or one of its own) and, while holding it, read the whole
    archive back as a launch sends it: it must be there, complete, and the archive of that hash."""
    try:
        for r in range(rounds):
            start.wait()  # a worker that failed breaks it for the others (BrokenBarrierError), never hangs them
            ws = workspaces[(k + r) % len(workspaces)]
            with contextlib.ExitStack() as hold:
                pkg = pack_workspace(ws, cache, keep=2, hold=hold)
                start.wait()  # every worker holds its archive at once; the slower ones published and evicted meanwhile
                assert _sha(pkg.path) == pkg.sha256, f"{pkg.path} changed while held"
    except BaseException as e:  # noqa: BLE001 - reported to the test, which fails on it
        errors.put(f"worker {k}: {type(e).__name__}: {e}")


def test_racing_cache_functions_keep_the_cache_consistent(tmp_path):
    """Six processes pack five workspaces at once, round after round, into one cache that keeps two: no error,
    every held archive stays whole, and afterwards every entry is complete and no temporary is left."""
    workspaces = [str(_workspace(tmp_path / f"ws{i}", f"ws{i}")) for i in range(5)]
    cache = tmp_path / "cache"
    ctx = mp.get_context("fork")
    start, errors = ctx.Barrier(WORKERS, timeout=60), ctx.Queue()
    procs = [ctx.Process(target=_pack_worker, args=(k, workspaces, str(cache), 6, start, errors))
             for k in range(WORKERS)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    found = []
    while not errors.empty():
        found.append(errors.get())
    assert not found, "\n".join(found)
    assert all(p.exitcode == 0 for p in procs)
    metas = sorted(cache.glob("*.json"))
    assert 1 <= len(metas) <= WORKERS  # held entries outlive eviction; nothing beyond what was in use
    for meta in metas:
        doc = json.loads(meta.read_text())
        tar = meta.with_suffix(".tar")
        assert tar.stat().st_size == doc["size"] and _sha(str(tar)) == doc["sha256"], meta.name
    assert not [p.name for p in cache.iterdir() if p.name.endswith(".part") or ".tmp" in p.name]
    assert len(list(cache.glob("*.tar"))) == len(metas)
    pack_workspace(workspaces[0], str(cache), keep=2)  # nothing held now: back to two
    assert len(list(cache.glob("*.json"))) == len(list(cache.glob("*.tar"))) == 2


def _journal_worker(k: int, conf: str, start, names) -> None:
    cfg = load_config(conf)
    start.wait()
    try:
        name = default_job_name(cfg)
        journal.remember(cfg, name, None)
        journal.record_outcome(cfg, name, 0, "finished", f"job {name} finished")
        names.put(name)
    except BaseException as e:  # noqa: BLE001 - reported to the test, which fails on it
        names.put(f"worker {k}: {type(e).__name__}: {e}")


def test_racing_launches_get_distinct_default_names_and_keep_every_outcome(tmp_path, monkeypatch):
    """Launches started in the same second get different default job names (one name would be one job directory
    for two), and no launch's outcome is lost to another's write of the journal."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    conf = tmp_path / "conf.py"
    conf.write_text("HOSTS = ['localhost']\nROOT_DIR = '/tmp/paddle-race'\nPADDLE_NIC = 'lo'\n")
    ctx = mp.get_context("fork")
    start, names = ctx.Barrier(WORKERS, timeout=60), ctx.Queue()
    procs = [ctx.Process(target=_journal_worker, args=(k, str(conf), start, names)) for k in range(WORKERS)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert all(p.exitcode == 0 for p in procs)
    got = [names.get(timeout=5) for _ in procs]
    assert len(set(got)) == WORKERS, got
    cfg = load_config(str(conf))
    assert all(journal.outcome(cfg, n) == {"exit_code": 0, "outcome": "finished", "message": f"job {n} finished"}
               for n in got)
    assert not [p.name for p in (tmp_path / "state" / "paddle-cluster").iterdir() if p.suffix not in (".json", "")
                and p.name != ".lock"]


def _pinning_session(root: str, sha: str, job: str, ready, go) -> None:
    """A node session of one launch: it found the tree (pinned), then links the job directory from it."""
    trees.pin(root, sha)
    ready.set()
    go.wait(60)
    os._exit(0 if trees.materialize(root, sha, job) else 1)


def test_a_node_never_prunes_a_tree_a_session_uses(tmp_path):
    """Node side: while one launch's session holds a cached workspace tree, other launches' sessions store more
    trees than a node keeps; the held one survives (it was pruned under it before) and is linked from; once
    released it is pruned like any other."""
    root = str(tmp_path / "root")
    pkgs = [pack_workspace(str(_workspace(tmp_path / f"w{i}", f"w{i}")), str(tmp_path / "cache"), keep=100)
            for i in range(trees.KEEP + 3)]
    first = pkgs[0]
    trees.store(root, first.path, first.sha256, first.files + 1)
    ctx = mp.get_context("fork")
    ready, go = ctx.Event(), ctx.Event()
    session = ctx.Process(target=_pinning_session, args=(root, first.sha256, str(tmp_path / "job"), ready, go))
    session.start()
    try:
        assert ready.wait(30)
        for p in pkgs[1:-1]:  # KEEP + 1 newer trees: the first is the oldest, beyond KEEP
            trees.store(root, p.path, p.sha256, p.files + 1)
        assert trees.holds(root, first.sha256)
    finally:
        go.set()
        session.join(60)
    assert session.exitcode == 0  # its job directory was linked from the tree
    assert (tmp_path / "job" / "train.py").read_text() == "print('w0')\n"
    os.utime(trees.tree_dir(root, first.sha256), (1, 1))  # the oldest again (linking marked it used)
    trees.store(root, pkgs[-1].path, pkgs[-1].sha256, pkgs[-1].files + 1)
    assert not trees.holds(root, first.sha256)
    assert len([n for n in os.listdir(os.path.dirname(trees.tree_dir(root, "x"))) if "." not in n]) == trees.KEEP


def test_launches_started_together_all_succeed(cluster, tmp_path):
    """Six ``run``s at once on the three test hosts: two of one workspace, four of others (five archives, more
    than the cache keeps, so eviction runs while archives are being sent), default job names. Each finishes with
    its own workspace in its own job directory; the caches are complete afterwards."""
    env = checkout_env(XDG_CACHE_HOME=str(tmp_path / "cache"), XDG_STATE_HOME=str(tmp_path / "state"))
    spaces = []
    for i in range(5):
        ws = make_workspace(tmp_path / f"ws{i}")
        (ws / "data" / "part-0").write_text(f"workspace {i}\n")
        spaces.append(ws)
    spaces.insert(1, spaces[0])  # two launches of one workspace
    procs = []
    for k, ws in enumerate(spaces):
        # A conf per launch for its own ports: the jobs run side by side on the same hosts.
        conf = write_conf(tmp_path, cluster, f"conf{k}.py", PADDLE_PORT=7164 + 10 * k)
        procs.append(start_cli(conf, "run", "--job_dispatch_package", str(ws), env=env))
    outs = [p.communicate(timeout=240) for p in procs]
    names = []
    for ws, p, (out, err) in zip(spaces, procs, outs):
        assert p.returncode == 0, out + err
        no_traceback(subprocess.CompletedProcess(p.args, p.returncode, out, err))
        assert all(f"ENV OK trainer {i} of 3 on node {i}" in out for i in range(3)), out
        name = re.search(r"job (JOB\S+): ", err).group(1)
        names.append(name)
        for i in range(3):
            got = (cluster.root_dir(i) / name / "data" / "part-0").read_text()
            assert got == (ws / "data" / "part-0").read_text(), (name, i)
    assert len(set(names)) == len(spaces), names
    for directory in [tmp_path / "cache" / "paddle-cluster" / "workspaces",
                      *(tmp_path / "cache" / "paddle-cluster" / "lib").iterdir()]:
        metas = sorted(directory.glob("*.json"))
        assert metas and len(list(directory.glob("*.tar"))) == len(metas), directory
        for meta in metas:
            doc = json.loads(meta.read_text())
            assert _sha(str(meta.with_suffix(".tar"))) == doc["sha256"], meta
        assert not [p.name for p in directory.iterdir() if p.name.endswith(".part")], directory
    assert_nothing_left(cluster)
