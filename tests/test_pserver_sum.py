"""Sync dense pushes are summed in trainer order: bit-identical to summing the trainers' gradients in trainer
order, whatever the arrival order, for 1-3 trainers, a stateful optimizer, and SGD folded segment by segment
through a tiny accumulator pool."""

from __future__ import annotations

import threading
import time
from typing import Dict

import numpy as np
import pytest
import rt_helpers as H

from paddle_cluster.contract import Endpoint, JobEnv
from paddle_cluster.ps import OptimizerSpec
from paddle_cluster.ps.client import PSClient
from paddle_cluster.ps.server.pserver import PServer


def _train(env: JobEnv, spec: OptimizerSpec, w0: np.ndarray, grads: np.ndarray, max_block: int, delay: float,
           timeout: float) -> Dict[int, np.ndarray]:
    """Every trainer (a thread, a real client over TCP to the in-process pserver) pushes ``grads[step, i]``,
    arriving in a different order every step; each one's last pull."""
    server = PServer(env, 0).start()
    steps, trainers = grads.shape[:2]
    out, errors = {}, []

    def trainer(i: int) -> None:
        try:
            ps = PSClient(env, mode="sync", optimizer=spec, trainer_id=i, max_block_bytes=max_block)
            ps.register_dense({"w": w0})
            for s in range(steps):
                time.sleep(delay * ((i + s) % trainers))  # vary the arrival order
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
            t.join(timeout)
    finally:
        server.stop()
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), "a trainer still waits for its step"
    assert sorted(out) == list(range(trainers))
    return out


def _reference(w0: np.ndarray, grads: np.ndarray, spec: OptimizerSpec) -> np.ndarray:
    """The sum in trainer order, the mean, then the optimizer's own formula in float32."""
    w, v = w0.copy(), np.zeros_like(w0)
    f = np.float32
    for step in grads:
        g = step[0].copy()
        for gi in step[1:]:
            g += gi
        if len(step) > 1:
            g /= f(len(step))
        if spec.weight_decay:
            g = w * f(spec.weight_decay) + g
        if spec.name == "momentum":
            v = f(spec.momentum) * v + g
            g = v
        w -= f(spec.lr) * g
    return w


@pytest.mark.timeout(60)
@pytest.mark.parametrize("trainers,opt", [(1, "sgd"), (2, "sgd"), (3, "sgd"), (2, "momentum"), (3, "momentum")])
def test_sync_sum_is_in_trainer_order(tmp_path, trainers, opt):
    env = JobEnv(job_id="sum", pservers=(Endpoint("127.0.0.1", H.free_port_range(1)),), trainers=trainers,
                 ports_num=1, ports_num_for_sparse=0, secret=H.SECRET, job_dir=str(tmp_path), barrier_timeout=20)
    rng = np.random.default_rng(7)
    w0 = rng.standard_normal((64, 300)).astype(np.float32)
    grads = rng.standard_normal((3, trainers) + w0.shape).astype(np.float32)
    spec = OptimizerSpec(opt, lr=0.1)
    out = _train(env, spec, w0, grads, 16 << 10, 0.01, 50)
    w = _reference(w0, grads, spec)
    for i in range(trainers):
        np.testing.assert_allclose(out[i], w, rtol=1e-6, atol=1e-7)
    if opt == "sgd":
        assert all(np.array_equal(out[i], w) for i in range(trainers))


@pytest.mark.timeout(90)
@pytest.mark.parametrize("trainers,weight_decay", [(2, 0.0), (3, 0.0), (3, 0.01), (4, 0.0)])
def test_segment_folding_under_a_tiny_pool_is_exact_and_never_deadlocks(tmp_path, monkeypatch, trainers,
                                                                        weight_decay):
    """Sync SGD folds pushes a segment at a time into a bounded pool of accumulators. With two slots for the
    whole pserver, several blocks per connection, two connections per trainer and trainers arriving in any
    order, every trainer waits its turn and the result is bit-identical to summing in trainer order. Every
    wait is woken by the change it waits for: with the waits' periodic look made longer than the barrier
    timeout, a missed wake-up would end in a BarrierTimeout."""
    from paddle_cluster.ps.server import dense, sync
    from paddle_cluster.ps.wire.stream import SEGMENT

    monkeypatch.setattr(dense, "POOL_BYTES", 2 * SEGMENT)
    monkeypatch.setattr(sync, "POLL", 3600.0)
    env = JobEnv(job_id="fold", pservers=(Endpoint("127.0.0.1", H.free_port_range(2)),), trainers=trainers,
                 ports_num=2, ports_num_for_sparse=0, secret=H.SECRET, job_dir=str(tmp_path), barrier_timeout=30)
    rng = np.random.default_rng(11)
    w0 = rng.standard_normal((1536, 1024)).astype(np.float32)  # 6 MiB: 3 blocks of 2 segments
    grads = rng.standard_normal((3, trainers) + w0.shape).astype(np.float32)
    spec = OptimizerSpec("sgd", lr=0.1, weight_decay=weight_decay)
    out = _train(env, spec, w0, grads, 2 * SEGMENT, 0.02, 80)
    w = _reference(w0, grads, spec)
    for i in range(trainers):
        assert np.array_equal(out[i], w), i


@pytest.mark.timeout(60)
def test_sync_sparse_fold_in_bounded_chunks_is_the_trainer_order_sum(monkeypatch, tmp_path):
    """A sync step's row gradients are merged and applied a chunk at a time (``table.APPLY_BYTES``, made tiny here
    so a step takes dozens of chunks): every row is still ``0 + g0 + g1 + g2`` in trainer order, averaged, applied
    -- bit-identical to summing the whole step at once."""
    from paddle_cluster.ps.placement import init_rows
    from paddle_cluster.ps.server import table

    monkeypatch.setattr(table, "APPLY_BYTES", 256)  # 2 rows of width 8 per trainer and chunk
    env = H.make_env(1, 3, tmp_path)
    rng = np.random.default_rng(3)
    steps, width, vocab, lr = 3, 8, 200, 0.5
    ids = [[np.unique(rng.integers(0, vocab, 60 + 20 * i)) for i in range(3)] for _ in range(steps)]
    grads = [[rng.standard_normal((len(ids[s][i]), width)).astype(np.float32) for i in range(3)] for s in range(steps)]
    server = PServer(env, 0).start()
    out, errors = {}, []

    def trainer(i: int) -> None:
        try:
            ps = PSClient(env, mode="sync", optimizer=OptimizerSpec("sgd", lr=lr), trainer_id=i)
            ps.register_sparse("emb", width, vocab_size=vocab, init_scale=0.1, seed=4)
            for s in range(steps):
                ps.pull_sparse("emb", ids[s][i])
                ps.push_sparse("emb", ids[s][i], grads[s][i])
                ps.push()
            out[i] = ps.pull_sparse("emb", np.arange(vocab)).copy()
            ps.close()
        except BaseException as e:  # noqa: B036 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=trainer, args=(i,), daemon=True) for i in range(3)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(40)
    finally:
        server.stop()
    assert not errors, errors
    want = init_rows(np.arange(vocab), width, 0.1, 4)
    for s in range(steps):
        g = np.zeros((vocab, width), np.float32)
        for i in range(3):
            np.add.at(g, ids[s][i], grads[s][i])
        seen = np.unique(np.concatenate(ids[s]))
        g = g[seen] / np.float32(3)
        want[seen] -= g * np.float32(lr)
    for i in range(3):
        np.testing.assert_array_equal(out[i], want)
