"""Trainer ids are identities, on real processes: an impostor cannot claim another trainer's id; only trainer 0
may initialise, set hyper-parameters and save, and only under the job's checkpoint directory; CLOSE answers
once the pserver counts the trainer as closed; the hyper-parameter history stays bounded; an empty or short
secret is refused where a pserver or trainer starts."""

from __future__ import annotations

import dataclasses
import sys
import threading

import numpy as np
import pytest
import rt_helpers as H
from rt_helpers import trainer_env

from paddle_cluster.contract import TRAINER, ContractError
from paddle_cluster.ps import ConfigMismatch, OptimizerSpec, PServer, connect
from paddle_cluster.ps.errors import Forbidden
from paddle_cluster.ps.wire import protocol as P


@pytest.mark.timeout(90)
def test_impostor_cannot_push_or_close_as_another_trainer(tmp_path):
    """Trainer 1's key claiming id 0 is refused at the handshake; the real trainers train to the exact result."""
    env = H.make_env(2, 2, tmp_path)
    with H.procs(tmp_path) as pr:
        servers = [pr.pserver(env, k) for k in range(2)]
        impostor_env = H.proc_env(env, TRAINER, 1, {"PADDLE_TRAINER_ID": "0", "PADDLE_INIT_TRAINER_ID": "0"})
        impostor = pr.start([sys.executable, H.__file__, "ones", str(tmp_path / "imp.npz")], impostor_env, "impostor")
        assert H.wait_all(pr, [impostor], 30) == [3]
        assert impostor.stdout.read().decode().startswith("TRAINER_FAILED AuthError"), pr.log(impostor)
        assert any("trainer 0: wrong answer to the challenge" in pr.log(s) for s in servers)
        outs = [tmp_path / f"t{i}.npz" for i in range(2)]
        trainers = [pr.trainer(env, i, "dense", str(outs[i]), steps=4, lr=0.5) for i in range(2)]
        assert H.wait_all(pr, trainers + servers, 60) == [0, 0, 0, 0]
        ref = H.reference_dense(4, 2, 0.5)
        for out in outs:
            np.testing.assert_allclose(np.load(out)["w"], ref["w"], rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(60)
def test_only_trainer_0_may_save_or_set_hyper_and_save_names_a_directory(tmp_path):
    env = H.make_env(1, 2, tmp_path)
    with H.procs(tmp_path) as pr:
        server = pr.pserver(env, 0)
        ps = [None, None]
        boot = [lambda i=i: ps.__setitem__(i, connect(mode="sync", optimizer=OptimizerSpec("sgd", lr=1.0),
                                                      env=trainer_env(env, i))) for i in range(2)]
        threads = [threading.Thread(target=f) for f in boot]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        t0, t1 = ps
        try:
            t0.register_dense({"w": np.zeros(8, np.float32)})
            t1.register_dense({"w": np.zeros(8, np.float32)})
            with pytest.raises(Forbidden, match="trainer 1 may not SET_HYPER: only trainer 0"):
                t1.set_lr(1000.0)
            with pytest.raises(Forbidden, match="trainer 1 may not SAVE"):
                t1.save_checkpoint()
            # A name, never a location: refused by the client, and by the pserver whoever asks.
            outside = tmp_path / "outside"
            for bad in (str(outside), "../outside", "a/b", ".."):
                with pytest.raises(ValueError, match="plain directory name"):
                    t0.save_checkpoint(bad)
                with pytest.raises(Forbidden, match="a checkpoint is named, not placed"):
                    t0._broadcast(P.Op.SAVE, {"step": t0.step, "path": bad})
            assert not outside.exists() and not (tmp_path / "a").exists()
            info = t0.save_checkpoint("best")
            assert info.paths == (str(tmp_path / "checkpoints" / "best" / "pserver-0"),)
            assert all(b["lr"] == 1.0 for b in t0.status()[0]["blocks"].values())
            # The refused requests cost nothing: both trainers still train.
            for t in (t0, t1):
                t.push({"w": np.ones(8, np.float32)})
            np.testing.assert_allclose(t0.pull()["w"], -1.0)
            # CLOSE answers once the pserver counts the trainer as closed.
            t1.close()
            assert t0.status()[0]["closed"] == [1]
        finally:
            for t in (t1, t0):
                t.close()
        assert H.wait_all(pr, [server], 10) == [0]


@pytest.mark.timeout(90)
def test_hyper_parameter_history_stays_bounded(tmp_path):
    env = H.make_env(1, 1, tmp_path)
    with H.procs(tmp_path) as pr:
        server = pr.pserver(env, 0)
        # Async: a parameter may be registered late (a sync pull would wait for its step to catch up).
        ps = connect(mode="async", optimizer=OptimizerSpec("sgd", lr=1.0), env=trainer_env(env, 0))
        try:
            ps.register_dense({"w": np.zeros(4, np.float32)})
            g = {"w": np.ones(4, np.float32)}
            for step in range(600):  # a schedule that changes the rate every step
                ps.set_lr(1.0 / (step + 1))
                ps.push(g).futures[0].result()
            st = ps.status()[0]
            assert st["hyper_pending"] <= 1 and st["blocks"]["0"]["lr"] == pytest.approx(1 / 600)
            np.testing.assert_allclose(ps.pull()["w"], -sum(1.0 / (s + 1) for s in range(600)), rtol=1e-4)
            # A parameter registered after the history was folded starts from the current rate.
            ps.set_lr(0.125)
            ps.push(g).futures[0].result()  # every change so far is folded now
            ps.register_dense({"late": np.zeros(4, np.float32)})
            assert {b["name"]: b["lr"] for b in ps.status()[0]["blocks"].values()}["late"] == 0.125
            # Changes that cannot take effect (all for a step not reached) are capped, not stored forever.
            with pytest.raises(ConfigMismatch, match="hyper-parameter changes are waiting"):
                for _ in range(2000):
                    ps.set_hyper(momentum=0.0)
            assert ps.status()[0]["hyper_pending"] <= 1024
        finally:
            ps.close()
        assert H.wait_all(pr, [server], 10) == [0]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("secret", ["", "too-short"])
def test_empty_or_short_secret_is_refused(tmp_path, secret):
    env = dataclasses.replace(H.make_env(1, 1, tmp_path), secret=secret)
    with H.procs(tmp_path) as pr:
        server = pr.pserver(env, 0, wait=False)
        assert H.wait_all(pr, [server], 20) == [2]
        log = pr.log(server)
        want = "is not set" if not secret else "has 9 characters, fewer than 32"
        assert f"PADDLE_JOB_SECRET {want}" in log and "paddle-cluster run" in log and "token_hex" in log, log
        # A trainer started by hand with that secret (and no key of its own) refuses before connecting.
        tr_env = H.proc_env(env, TRAINER, 0)
        tr_env.pop("PADDLE_TRAINER_KEY", None)
        tr_env["PADDLE_JOB_SECRET"] = secret
        trainer = pr.start([sys.executable, "-c", "from paddle_cluster.ps import connect; connect()"], tr_env,
                           "trainer-no-key")
        assert H.wait_all(pr, [trainer], 20) == [1]
        want = "PADDLE_TRAINER_KEY (or PADDLE_JOB_SECRET) is not set" if not secret else f"PADDLE_JOB_SECRET {want}"
        assert want in pr.log(trainer), pr.log(trainer)
    with pytest.raises(ContractError, match="PADDLE_JOB_SECRET"):
        PServer(env, 0)  # the in-process entry point refuses it too
