"""Pserver behaviour over real TCP with real pserver processes: async convergence, barrier timeouts that
name the dead trainer, close() and exit, SIGTERM, declarations that must agree, hyper-parameters."""

from __future__ import annotations

import json
import os
import signal
import threading

import numpy as np
import pytest
import rt_helpers as H
from helpers import wait_for
from rt_helpers import trainer_env

from paddle_cluster.ps import BarrierTimeout, ConfigMismatch, OptimizerSpec, UnknownKey, connect


@pytest.mark.timeout(90)
def test_async_training_converges(tmp_path):
    env = H.make_env(2, 2, tmp_path)
    for out in H.run_job(env, tmp_path, "dense", steps=60, lr=0.5, mode="async"):
        losses = np.load(out)["losses"]
        assert losses[-4:].mean() < 0.5 * losses[:4].mean(), losses


@pytest.mark.timeout(60)
def test_dead_trainer_barrier_timeout_names_it(tmp_path):
    env = H.make_env(2, 2, tmp_path, barrier_timeout=2.0)
    with H.procs(tmp_path) as pr:
        for k in range(2):
            pr.pserver(env, k)
        victim = pr.trainer(env, 1, "die_after_step", os.path.join(tmp_path, "t1.npz"))
        ps = connect(mode="sync", optimizer=OptimizerSpec("sgd", lr=0.1), env=trainer_env(env, 0))
        try:
            p = ps.register_dense(H.dense_init())
            for t in range(2):  # step 0 with the victim; step 1 the victim never pushes
                x, y = H.dense_batch(0, t)
                _, gw, gb, _ = H.softmax_grad(x, y, p["w"], p["b"])
                ps.push({"w": gw, "b": gb})
                if t == 0:
                    assert victim.stdout.readline().strip() == b"STEP0-DONE"
                    os.killpg(victim.pid, signal.SIGKILL)
                    victim.wait(10)
                p = ps.pull() if t == 0 else None
            with pytest.raises(BarrierTimeout) as ei:
                ps.pull()
        finally:
            ps.close()
    e = ei.value
    assert e.missing_trainers == [1]
    assert e.step == 2
    msg = str(e)
    assert "barrier timeout at step 2" in msg and "waiting for trainer 1 (last seen" in msg, msg
    assert "for more than 2 s" in msg, msg  # the job's barrier_timeout, as the pserver measured it


@pytest.mark.timeout(60)
def test_a_trainer_gone_while_its_sync_pull_waits_is_let_go_within_a_poll(tmp_path):
    """A sync pull waits on its connection's own thread; a trainer killed meanwhile ends that wait within a
    poll (about a second), not at the barrier timeout (60 s here)."""
    env = H.make_env(1, 2, tmp_path, barrier_timeout=60.0)
    with H.procs(tmp_path) as pr:
        server = pr.pserver(env, 0)
        a = connect(mode="sync", optimizer=OptimizerSpec("sgd", lr=0.1), env=trainer_env(env, 0))
        try:
            a.register_dense(H.dense_init())
            victim = pr.trainer(env, 1, "wait_in_pull", os.path.join(tmp_path, "t1.npz"))
            assert victim.stdout.readline().strip() == b"PULLING"
            # Its pull is sent once its main thread waits for the reply (blocked in a socket read).
            wchan = f"/proc/{victim.pid}/task/{victim.pid}/wchan"
            wait_for(lambda: open(wchan).read() == "wait_woken", 10, "trainer 1 waiting for its pull's reply")
            os.killpg(victim.pid, signal.SIGKILL)
            victim.wait(10)
            wait_for(lambda: "trainer 1 (127.0.0.1" in pr.log(server) and "during PULL_DENSE" in pr.log(server), 10,
                     "the pserver to let trainer 1's waiting pull go")
            assert server.poll() is None
        finally:
            a.close()


@pytest.mark.timeout(60)
def test_close_releases_barrier_and_pserver_exits_zero(tmp_path):
    env = H.make_env(1, 2, tmp_path, barrier_timeout=20.0)
    with H.procs(tmp_path) as pr:
        server = pr.pserver(env, 0)
        a = connect(mode="sync", optimizer="sgd", env=trainer_env(env, 0))
        b = connect(mode="sync", optimizer="sgd", env=trainer_env(env, 1))
        init = {"v": np.arange(10, dtype=np.float32)}
        a.register_dense(init)
        np.testing.assert_array_equal(b.register_dense({"v": np.zeros(10, np.float32)})["v"], init["v"])
        b.push({"v": np.ones(10, np.float32)})
        result = {}
        th = threading.Thread(target=lambda: result.update(b.pull()), daemon=True)
        th.start()  # waits for trainer 0's gradient of step 0 ...
        # Step 0 stays open while trainer 0 is connected: the value b's pull waits for does not exist yet.
        assert a.status()[0]["blocks"]["0"]["step"] == 0
        a.close()  # ... until trainer 0 says it is gone
        th.join(10)
        assert not th.is_alive()
        # The step-1 value, averaged over the one contributor: only a.close() can have completed step 0.
        np.testing.assert_allclose(result["v"], init["v"] - 0.01)
        b.push({"v": np.ones(10, np.float32)})  # trainer 1 is still served after trainer 0 left
        np.testing.assert_allclose(b.pull()["v"], init["v"] - 0.02)
        assert server.poll() is None
        b.close()
        assert H.wait_all(pr, [server], 10) == [0]


@pytest.mark.timeout(30)
def test_sigterm_exits_cleanly(tmp_path):
    env = H.make_env(1, 1, tmp_path)
    with H.procs(tmp_path) as pr:
        server = pr.pserver(env, 0)
        server.send_signal(signal.SIGTERM)
        assert H.wait_all(pr, [server], 10) == [0]


@pytest.mark.timeout(60)
def test_trainers_must_agree_with_trainer_0(tmp_path):
    env = H.make_env(1, 2, tmp_path, barrier_timeout=3.0)
    with H.procs(tmp_path) as pr:
        pr.pserver(env, 0)
        a = connect(mode="sync", optimizer=OptimizerSpec("adam", lr=0.1), env=trainer_env(env, 0))
        try:
            with pytest.raises(ConfigMismatch, match="mode 'async'.*'sync'"):
                connect(mode="async", optimizer=OptimizerSpec("adam", lr=0.1), env=trainer_env(env, 1))
            with pytest.raises(ConfigMismatch, match="optimizer"):
                connect(mode="sync", optimizer=OptimizerSpec("sgd", lr=0.1), env=trainer_env(env, 1))
            a.register_dense({"w": np.zeros((4, 3), np.float32)})
            b = connect(mode="sync", optimizer=OptimizerSpec("adam", lr=0.1), env=trainer_env(env, 1))
            with pytest.raises(ConfigMismatch, match="shape"):
                b.register_dense({"w": np.zeros((4, 5), np.float32)})
            b.close()
        finally:
            a.close()


@pytest.mark.timeout(30)
def test_trainer_waits_for_trainer_0_and_times_out_naming_it(tmp_path):
    env = H.make_env(1, 2, tmp_path, barrier_timeout=1.5)
    with H.procs(tmp_path) as pr:
        pr.pserver(env, 0)
        with pytest.raises(BarrierTimeout, match="trainer 0 \\(never seen\\)") as ei:
            connect(mode="sync", env=trainer_env(env, 1))
        assert ei.value.missing_trainers == [0]


@pytest.mark.timeout(30)
def test_set_lr_from_trainer_and_local_mode(tmp_path, monkeypatch):
    # No contract in the environment: connect() starts an in-process pserver on 127.0.0.1.
    for k in list(os.environ):
        if k.startswith("PADDLE_"):
            monkeypatch.delenv(k)
    monkeypatch.chdir(tmp_path)
    ps = connect(mode="sync", optimizer=OptimizerSpec("sgd", lr=0.5))
    try:
        ps.register_dense({"x": np.zeros(3, np.float32)})
        ps.push({"x": np.ones(3, np.float32)})
        np.testing.assert_allclose(ps.pull()["x"], -0.5)
        ps.set_lr(0.25)
        # A checkpoint taken right after set_lr records the lr the next update will use.
        info = ps.save_checkpoint()
        with open(os.path.join(info.paths[0], "manifest.json")) as f:
            manifest = json.load(f)
        assert info.step == 1 and manifest["blocks"][0]["spec"]["current"]["lr"] == 0.25
        ps.push({"x": np.ones(3, np.float32)})
        np.testing.assert_allclose(ps.pull()["x"], -0.75)
        assert ps.status()[0]["blocks"]["0"]["lr"] == 0.25
        path = ps.save_dense(str(tmp_path / "output" / "pass-00001"))
        from paddle_cluster.ps import load_dense

        np.testing.assert_allclose(load_dense(path)["x"], -0.75)
    finally:
        ps.close()


def test_set_lr_for_named_parameters_and_tables_only(tmp_path, monkeypatch):
    """``set_lr(lr, names=...)`` changes those optimizers only, e.g. decaying an embedding but not the rest."""
    for k in list(os.environ):
        if k.startswith("PADDLE_"):
            monkeypatch.delenv(k)
    monkeypatch.chdir(tmp_path)
    ps = connect(mode="sync", optimizer=OptimizerSpec("sgd", lr=1.0))
    try:
        ps.register_dense({"x": np.zeros(3, np.float32), "y": np.zeros(2, np.float32)})
        ps.register_sparse("emb", width=2, vocab_size=10, init_scale=0.0)
        ids, ones = np.array([5]), np.ones((1, 2), np.float32)

        def step():
            ps.push_sparse("emb", ids, ones)
            ps.push({"x": np.ones(3, np.float32), "y": np.ones(2, np.float32)})

        step()  # lr 1 everywhere
        ps.set_lr(0.5, names=["emb", "y"])
        step()
        ps.set_lr(0.25, names="x")
        step()
        got = ps.pull()
        np.testing.assert_allclose(got["x"], -(1 + 1 + 0.25))
        np.testing.assert_allclose(got["y"], -(1 + 0.5 + 0.5))
        np.testing.assert_allclose(ps.pull_sparse("emb", ids), -(1 + 0.5 + 0.5))
        with pytest.raises(UnknownKey, match="no registered parameter or table \\['nope'\\]"):
            ps.set_lr(0.1, names=["nope"])
    finally:
        ps.close()


@pytest.mark.timeout(60)
def test_placement_spreads_blocks_over_pservers_and_ports(tmp_path):
    env = H.make_env(2, 1, tmp_path, ports_num=2, sparse_ports=1)
    with H.procs(tmp_path) as pr:
        servers = [pr.pserver(env, k) for k in range(2)]
        ps = connect(mode="sync", optimizer="sgd", env=trainer_env(env, 0), max_block_bytes=64 * 1024)
        try:
            w = np.random.default_rng(0).standard_normal((512, 128)).astype(np.float32)  # 256 KB -> 4 blocks
            np.testing.assert_array_equal(ps.register_dense({"w": w})["w"], w)
            blocks = ps._dense.blocks["w"]
            assert len(blocks) == 4
            assert sorted(b.pserver for b in blocks) == [0, 0, 1, 1]
            assert {(b.pserver, b.conn) for b in blocks} == {(0, 0), (0, 1), (1, 0), (1, 1)}
            st = ps.status()
            assert [len(s["blocks"]) for s in st] == [2, 2]
        finally:
            ps.close()
        assert H.wait_all(pr, servers, 10) == [0, 0]


@pytest.mark.timeout(30)
def test_repeated_push_of_same_step_is_idempotent(tmp_path):
    from paddle_cluster.ps.channel import expect_ok, pipeline
    from paddle_cluster.ps.wire import protocol as P

    env = H.make_env(1, 1, tmp_path)
    with H.procs(tmp_path) as pr:
        server = pr.pserver(env, 0)
        ps = connect(mode="sync", optimizer=OptimizerSpec("sgd", lr=1.0), env=trainer_env(env, 0))
        try:
            ps.register_dense({"v": np.zeros(5, np.float32)})
            g = np.ones(5, np.float32)
            ps.push({"v": g})
            np.testing.assert_allclose(ps.pull()["v"], -1.0)
            # A retransmission of the step-0 push (same trainer, key, step) is acknowledged and ignored.
            ch = ps._dense_ch[0][0]
            frame = P.pack_header(P.Op.PUSH_DENSE, P.dtype_code(np.float32), key=0, step=0, length=g.nbytes)
            ch.submit(pipeline, [(frame, (g,))], [expect_ok]).result()
            np.testing.assert_allclose(ps.pull()["v"], -1.0)
            assert ps.status()[0]["blocks"]["0"]["step"] == 1
        finally:
            ps.close()
        assert H.wait_all(pr, [server], 10) == [0]


@pytest.mark.timeout(30)
def test_async_bounded_staleness_drops_old_gradients(tmp_path):
    env = H.make_env(1, 1, tmp_path)
    with H.procs(tmp_path) as pr:
        pr.pserver(env, 0)
        ps = connect(mode="async", optimizer=OptimizerSpec("sgd", lr=1.0), env=trainer_env(env, 0), staleness=1)
        try:
            ps.register_dense({"v": np.zeros(4, np.float32)})  # pulled at version 0
            for _ in range(3):  # computed on version 0: applied at versions 0 and 1, dropped at 2
                ps.wait(ps.push({"v": np.ones(4, np.float32)}))
            np.testing.assert_allclose(ps.pull()["v"], -2.0)
            assert ps.status()[0]["dropped_stale"] == 1
            ps.wait(ps.push({"v": np.ones(4, np.float32)}))  # fresh again after the pull
            np.testing.assert_allclose(ps.pull()["v"], -3.0)
        finally:
            ps.close()
