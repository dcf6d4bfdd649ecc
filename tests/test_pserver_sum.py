"""Sync dense pushes are summed into one buffer per block, in trainer order: bit-identical to summing the
trainers' gradients in trainer order, whatever the arrival order, for 1-3 trainers and a stateful optimizer."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import numpy as np
import pytest
import rt_helpers as H

from paddle_cluster.contract import Endpoint, JobEnv
from paddle_cluster.ps import OptimizerSpec
from paddle_cluster.ps.client import PSClient
from paddle_cluster.ps.server import PServer


@pytest.mark.timeout(60)
@pytest.mark.parametrize("trainers,opt", [(1, "sgd"), (2, "sgd"), (3, "sgd"), (2, "momentum"), (3, "momentum")])
def test_sync_sum_is_in_trainer_order(tmp_path, trainers, opt):
    env = JobEnv(job_id="sum", pservers=(Endpoint("127.0.0.1", 0),), trainers=trainers, ports_num=1,
                 ports_num_for_sparse=0, secret=H.SECRET, job_dir=str(tmp_path), barrier_timeout=20)
    server = PServer(env, 0).start()
    env = replace(env, pservers=(Endpoint("127.0.0.1", server.ports[0]),))
    rng = np.random.default_rng(7)
    w0 = rng.standard_normal((64, 300)).astype(np.float32)
    steps = 3
    grads = rng.standard_normal((steps, trainers) + w0.shape).astype(np.float32)
    spec = OptimizerSpec(opt, lr=0.1)
    out, errors = {}, []

    def trainer(i: int) -> None:
        try:
            ps = PSClient(env, mode="sync", optimizer=spec, trainer_id=i, max_block_bytes=16 << 10)
            ps.register_dense({"w": w0})
            for s in range(steps):
                time.sleep(0.01 * ((i + s) % trainers))  # vary the arrival order
                ps.push({"w": grads[s, i]})
                out[i] = ps.pull()["w"].copy()
            ps.close()
        except BaseException as e:  # noqa: B036 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=trainer, args=(i,), daemon=True) for i in range(trainers)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(50)
    finally:
        server.stop()
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), "a trainer still waits for its step"
    # reference: the sum in trainer order, mean, then the optimizer's own formula in float32
    w, v = w0.copy(), np.zeros_like(w0)
    lr, mom = np.float32(0.1), np.float32(0.9)
    for s in range(steps):
        g = grads[s, 0].copy()
        for i in range(1, trainers):
            g += grads[s, i]
        if trainers > 1:
            g /= np.float32(trainers)
        if opt == "momentum":
            v = mom * v + g
            g = v
        w -= lr * g
    assert sorted(out) == list(range(trainers))
    for i in range(trainers):
        np.testing.assert_allclose(out[i], w, rtol=1e-6, atol=1e-7)
    if opt == "sgd":
        assert all(np.array_equal(out[i], w) for i in range(trainers))


@pytest.mark.timeout(90)
@pytest.mark.parametrize("trainers,weight_decay", [(2, 0.0), (3, 0.0), (3, 0.01)])
def test_segment_folding_under_a_tiny_pool_is_exact_and_never_deadlocks(tmp_path, monkeypatch, trainers,
                                                                        weight_decay):
    """Sync SGD folds pushes 256 KiB at a time into a bounded pool of accumulators. With two slots for the
    whole pserver, several blocks per connection, two connections per trainer and trainers arriving in any
    order, every trainer waits its turn and the result is bit-identical to summing in trainer order."""
    from paddle_cluster.ps import fold
    from paddle_cluster.ps.stream import SEGMENT

    monkeypatch.setattr(fold, "POOL_BYTES", 2 * SEGMENT)
    env = JobEnv(job_id="fold", pservers=(Endpoint("127.0.0.1", H.free_port_range(2)),), trainers=trainers,
                 ports_num=2, ports_num_for_sparse=0, secret=H.SECRET, job_dir=str(tmp_path), barrier_timeout=30)
    server = PServer(env, 0).start()
    rng = np.random.default_rng(11)
    w0 = rng.standard_normal((1536, 1024)).astype(np.float32)  # 6 MiB: 6 blocks of 1 MiB, 4 segments each
    steps = 3
    grads = rng.standard_normal((steps, trainers) + w0.shape).astype(np.float32)
    spec = OptimizerSpec("sgd", lr=0.1, weight_decay=weight_decay)
    out, errors = {}, []

    def trainer(i: int) -> None:
        try:
            ps = PSClient(env, mode="sync", optimizer=spec, trainer_id=i, max_block_bytes=1 << 20)
            ps.register_dense({"w": w0})
            for s in range(steps):
                time.sleep(0.02 * ((i + s) % trainers))  # vary the arrival order
                ps.push({"w": grads[s, i]})
                out[i] = ps.pull()["w"].copy()
            ps.close()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=trainer, args=(i,)) for i in range(trainers)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(80)
    finally:
        server.stop()
    assert not errors, errors
    w = w0.copy()
    for s in range(steps):
        g = grads[s, 0].copy()
        for i in range(1, trainers):
            g += grads[s, i]
        g /= np.float32(trainers)
        if weight_decay:
            g = w * np.float32(weight_decay) + g
        w -= np.float32(0.1) * g
    for i in range(trainers):
        assert np.array_equal(out[i], w), i
