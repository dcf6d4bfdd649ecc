"""Per-shard checkpoints: exact round trip (params + optimizer state + sparse rows), refusal of torn or
corrupt shards, and 'latest' falling back to the previous complete checkpoint."""

from __future__ import annotations

import os

import numpy as np
import pytest
import rt_helpers as H

from paddle_cluster.contract import TRAINER
from paddle_cluster.ps import CheckpointError, OptimizerSpec, connect
from paddle_cluster.ps import checkpoint as ckpt
from paddle_cluster.ps.server.resume import load_shard

ADAM = OptimizerSpec("adam", lr=0.05)


def _train(ps, start, end):
    for t in range(start, end):
        p = ps.pull()
        ids, y = H.sparse_batch(0, t)
        rows = ps.pull_sparse("emb", ids)
        _, gw, gb, grows = H.sparse_grads(rows, y, p["w"], p["b"])
        ps.push_sparse("emb", ids, grows.reshape(-1, H.WIDTH))
        ps.push({"w": gw, "b": gb})


def _state(ps):
    d = {k: v.copy() for k, v in ps.pull().items()}
    d["emb"] = ps.pull_sparse("emb", np.arange(H.V))
    return d


def _client(env):
    ps = connect(mode="sync", optimizer=ADAM, env=env.for_process(TRAINER, 0, "127.0.0.1"))
    ps.register_dense(H.sparse_dense_init())
    ps.register_sparse("emb", H.WIDTH, vocab_size=H.V, init_scale=0.1, seed=5)
    return ps


def _flip_byte(path, offset=None):
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        i = len(data) // 2 if offset is None else offset
        data[i] ^= 0x01
        f.seek(0)
        f.write(data)


@pytest.mark.timeout(30)
def test_shard_roundtrip_exact(tmp_path):
    rng = np.random.default_rng(0)
    adam = {"declared": {"name": "adam"}, "current": {"name": "adam", "lr": 0.5}}  # as a save writes them
    blocks = [ckpt.BlockState(0, "w", 0, 4, "float32", adam, 7, rng.standard_normal((4, 3)).astype(np.float32),
                              {"m": rng.standard_normal((4, 3)).astype(np.float32),
                               "v": rng.random((4, 3)).astype(np.float32), "t": np.array([7], np.int64)})]
    tables = [ckpt.TableState(0, "emb", 2, "float32", 0.1, 1, adam, 7,
                              np.array([1, 3, 9], np.int64), rng.standard_normal((3, 2)).astype(np.float32),
                              {"m": np.zeros((3, 2), np.float32), "v": np.ones((3, 2), np.float32),
                               "t": np.array([1, 2, 3], np.int64)})]
    shard = ckpt.ShardState(7, 1, 2, "sync", {"name": "adam"}, blocks, tables)
    d = ckpt.save_shard(ckpt.step_dir(str(tmp_path), 7), shard)
    assert sorted(os.listdir(d)) == ["manifest.json", "shard.npz"]  # no temporary files left behind
    back = load_shard(ckpt.step_dir(str(tmp_path), 7), 1, 2)
    assert back.step == 7 and back.mode == "sync"
    np.testing.assert_array_equal(back.blocks[0].param, blocks[0].param)
    np.testing.assert_array_equal(back.blocks[0].opt_state["m"], blocks[0].opt_state["m"])
    assert back.blocks[0].opt_state["t"].dtype == np.int64
    np.testing.assert_array_equal(back.tables[0].rows, tables[0].rows)
    np.testing.assert_array_equal(back.tables[0].slots["t"], [1, 2, 3])
    with pytest.raises(CheckpointError, match="pserver 1 of 2, but this is pserver 1 of 3"):
        load_shard(ckpt.step_dir(str(tmp_path), 7), 1, 3)
    with pytest.raises(CheckpointError, match="no shard directory for pserver 0"):
        load_shard(ckpt.step_dir(str(tmp_path), 7), 0, 2)
    _flip_byte(os.path.join(d, "shard.npz"))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        load_shard(ckpt.step_dir(str(tmp_path), 7), 1, 2)


@pytest.mark.timeout(30)
def test_complete_steps_needs_every_named_shard_intact(tmp_path):
    root = str(tmp_path)
    for step in (2, 5, 9, 11):
        for k in (0, 1):
            ckpt.save_shard(ckpt.step_dir(root, step), ckpt.ShardState(step, k, 2, "sync", None))
    os.makedirs(os.path.join(root, "step-x"))  # not a step directory: ignored
    assert ckpt.complete_steps(root, [0, 1]) == [2, 5, 9, 11]
    _flip_byte(os.path.join(root, "step-00000005", "pserver-1", "shard.npz"))  # corrupt
    os.unlink(os.path.join(root, "step-00000009", "pserver-0", "manifest.json"))  # torn: the save never finished
    os.unlink(os.path.join(root, "step-00000011", "pserver-1", "shard.npz"))  # a file the manifest names is gone
    assert ckpt.complete_steps(root, [0, 1]) == [2]
    assert ckpt.complete_steps(root, [0]) == [2, 5, 11]
    assert ckpt.complete_steps(root, [1]) == [2, 9]
    assert ckpt.complete_steps(root, [2]) == []  # no such pserver's shards
    assert ckpt.complete_steps(root, []) == [2, 5, 9, 11]
    assert ckpt.complete_steps(str(tmp_path / "nothing-here"), [0]) == []


@pytest.mark.timeout(120)
def test_resume_exact_then_corrupt_and_torn_checkpoints(tmp_path):
    env = H.make_env(2, 1, tmp_path)
    root = os.path.join(tmp_path, "checkpoints")
    with H.procs(tmp_path) as pr:
        servers = [pr.pserver(env, k) for k in range(2)]
        ps = _client(env)
        _train(ps, 0, 3)
        info3 = ps.save_checkpoint()
        at3 = _state(ps)
        _train(ps, 3, 5)
        info5 = ps.save_checkpoint()
        _train(ps, 5, 7)
        at7 = _state(ps)
        ps.close()
        assert H.wait_all(pr, servers, 10) == [0, 0]
    assert info3.step == 3 and info3.paths == tuple(os.path.join(root, "step-00000003", f"pserver-{k}")
                                                    for k in range(2))
    assert info5.step == 5

    def resumed(resume):
        with H.procs(tmp_path) as pr:
            servers = [pr.pserver(env, k, {"PADDLE_RESUME": resume}) for k in range(2)]
            ps = _client(env)
            try:
                step = ps.step
                got = _state(ps)
                _train(ps, step, 7)
                final = _state(ps)
            finally:
                ps.close()
            assert H.wait_all(pr, servers, 10) == [0, 0]
            return step, got, final, [pr.log(s) for s in servers]

    # Resuming from step 3 and redoing steps 3..6 reproduces the uninterrupted run bit for bit, which needs
    # the parameters, Adam's m/v/t (dense and per row) and the sparse rows all restored exactly.
    step, got, final, _ = resumed("3")
    assert step == 3
    for k in at3:
        np.testing.assert_array_equal(got[k], at3[k])
        np.testing.assert_array_equal(final[k], at7[k])

    # A flipped byte in one shard of step 5: 'latest' falls back to step 3 on every pserver ...
    _flip_byte(os.path.join(root, "step-00000005", "pserver-1", "shard.npz"))
    step, got, final, logs = resumed("latest")
    assert step == 3
    np.testing.assert_array_equal(got["w"], at3["w"])
    np.testing.assert_array_equal(final["emb"], at7["emb"])
    assert all("skipping checkpoint" in log and "checksum mismatch" in log for log in logs), logs

    # ... and asking for step 5 explicitly is refused with a clear message (exit 3), nothing half-loaded.
    with H.procs(tmp_path) as pr:
        p = pr.pserver(env, 1, {"PADDLE_RESUME": "5"}, wait=False)
        assert H.wait_all(pr, [p], 20) == [3]
        assert "shard.npz checksum mismatch" in pr.log(p) and "refusing it" in pr.log(p)

    # A missing manifest (the save never finished) is refused too; with nothing usable left, so is 'latest'.
    os.unlink(os.path.join(root, "step-00000003", "pserver-0", "manifest.json"))
    with H.procs(tmp_path) as pr:
        p = pr.pserver(env, 0, {"PADDLE_RESUME": "3"}, wait=False)
        q = pr.pserver(env, 1, {"PADDLE_RESUME": "latest"}, wait=False)
        assert H.wait_all(pr, [p, q], 20) == [3, 3]
        assert "manifest.json missing" in pr.log(p)
        assert "no usable checkpoint" in pr.log(q)


# Root reads everything whatever the mode bits; without these capabilities it obeys them like any user.
NO_DAC = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--inh-caps",
          "-dac_override,-dac_read_search"] if os.geteuid() == 0 else []


@pytest.mark.timeout(60)
def test_unreadable_checkpoint_fails_the_pserver_instead_of_a_fresh_start(tmp_path):
    """A checkpoint root that cannot be listed was "no checkpoint": the pserver started fresh from step 0 (and
    its next save overwrote progress); an unreadable manifest made it fall back to an older step. Both now
    end the pserver (exit 3) with the path and the cause."""
    import subprocess
    import sys

    env = H.make_env(1, 1, tmp_path)
    root = os.path.join(tmp_path, "checkpoints")
    for step in (3, 5):
        ckpt.save_shard(ckpt.step_dir(root, step), ckpt.ShardState(step, 0, 1, "sync", None))
    manifest = os.path.join(root, "step-00000005", "pserver-0", "manifest.json")

    def pserver(name):
        with H.procs(tmp_path) as pr:
            p = pr.start(NO_DAC + [sys.executable, "-m", "paddle_cluster.ps"],
                         H.proc_env(env, "PSERVER", 0, {"PADDLE_RESUME": "latest"}), name)
            ready = p.stdout.readline().decode()
            if ready:  # the old behaviour: it serves; end it
                p.kill()
            return p.wait(20), ready, pr.log(p)

    for path, cause in ((root, root), (manifest, manifest)):
        os.chmod(path, 0)
        try:
            code, ready, log = pserver(os.path.basename(path))
        finally:
            os.chmod(path, 0o755 if os.path.isdir(path) else 0o644)
        assert (code, ready) == (3, ""), log
        assert f"checkpoint {cause} cannot be read: Permission denied" in log, log
        assert "starting fresh" not in log and "skipping" not in log
    # Readable again: it resumes from the newest step, as before.
    code, ready, log = pserver("ok")
    assert ready.startswith("PSERVER_READY") and "resumed from" in log and "step-00000005" in log, log
    # What a node answers the launcher when it asks which steps are complete: an error, not "none".
    os.chmod(manifest, 0)
    try:
        res = subprocess.run(NO_DAC + [sys.executable, "-c", "import sys; from paddle_cluster.ps import checkpoint; "
                                       "print(checkpoint.complete_steps(sys.argv[1], [0]))", root],
                             capture_output=True, text=True, cwd=H.REPO)
    finally:
        os.chmod(manifest, 0o644)
    assert res.returncode == 1 and res.stdout == "", res.stdout
    assert f"CheckpointUnreadable: checkpoint {manifest} cannot be read" in res.stderr, res.stderr


@pytest.mark.timeout(60)
def test_latest_with_no_checkpoint_refuses_to_start_fresh(tmp_path):
    """Asked to resume and finding no checkpoint at all, a pserver used to log "starting fresh" and serve from
    step 0; it now ends (exit 3) naming where it looked and for which shard."""
    env = H.make_env(1, 1, tmp_path)
    with H.procs(tmp_path) as pr:
        p = pr.pserver(env, 0, {"PADDLE_RESUME": "latest"}, wait=False)
        assert H.wait_all(pr, [p], 20) == [3]
        log = pr.log(p)
    assert f"cannot resume (latest): no checkpoint under {os.path.join(env.job_dir, 'checkpoints')}" in log, log
    assert "pserver-0/manifest.json" in log and "not starting fresh" in log


def test_survey_names_each_pservers_missing_or_unfinished_shard(tmp_path):
    """What a node's probe reports for ``run --resume_from`` (launch/resume.py words it)."""
    root = str(tmp_path / "checkpoints")
    assert ckpt.survey(root, [0]) == {"root": "does not exist", "complete": [], "incomplete": []}
    assert ckpt.survey("/etc/hostname", [0])["root"] == "is not a directory"
    for step in (2, 4):
        for k in (0, 1):
            ckpt.save_shard(ckpt.step_dir(root, step), ckpt.ShardState(step, k, 2, "sync", None))
    os.unlink(os.path.join(ckpt.step_dir(root, 4), "pserver-0", "manifest.json"))
    assert ckpt.survey(root, [0, 1]) == {"root": "", "complete": [2], "incomplete": [
        [4, {"0": "manifest.json missing (save did not finish)"}]]}
    assert ckpt.survey(root, [1, 2]) == {"root": "", "complete": [], "incomplete": [
        [2, {"2": "no pserver-2 shard (directory missing)"}], [4, {"2": "no pserver-2 shard (directory missing)"}]]}
