"""2 trainers x 2 pservers in sync mode (every one its own OS process, real TCP) == one process on the
concatenated batches."""

from __future__ import annotations

import numpy as np
import pytest
import rt_helpers as H

STEPS, LR = 6, 0.5


@pytest.mark.timeout(90)
def test_dense_sync_matches_single_process(tmp_path):
    env = H.make_env(2, 2, tmp_path, ports_num=2, sparse_ports=1)
    outs = H.run_job(env, tmp_path, "dense", steps=STEPS, lr=LR)  # each pserver exits 0 after both close()
    ref = H.reference_dense(STEPS, 2, LR)
    init = H.dense_init()
    for out in outs:
        r = np.load(out)
        # trainer 0's initial values won (trainer 1 offered 9.0 everywhere)
        np.testing.assert_array_equal(r["start_w"], init["w"])
        np.testing.assert_array_equal(r["start_b"], init["b"])
        assert int(r["step"]) == STEPS
        np.testing.assert_allclose(r["w"], ref["w"], atol=1e-5, rtol=0)
        np.testing.assert_allclose(r["b"], ref["b"], atol=1e-5, rtol=0)
        assert np.abs(r["w"] - init["w"]).max() > 1e-3  # it actually trained
    r0, r1 = np.load(outs[0]), np.load(outs[1])
    np.testing.assert_array_equal(r0["w"], r1["w"])


@pytest.mark.timeout(90)
def test_sparse_sync_matches_single_process(tmp_path):
    env = H.make_env(2, 2, tmp_path, ports_num=1, sparse_ports=2)
    outs = H.run_job(env, tmp_path, "sparse", steps=STEPS, lr=LR, seed=3, scale=0.1)
    ref, ref_table = H.reference_sparse(STEPS, 2, LR, seed=3, scale=0.1)
    for out in outs:
        r = np.load(out)
        np.testing.assert_allclose(r["w"], ref["w"], atol=1e-5, rtol=0)
        np.testing.assert_allclose(r["b"], ref["b"], atol=1e-5, rtol=0)
        np.testing.assert_allclose(r["table"], ref_table, atol=1e-5, rtol=0)
    from paddle_cluster.ps import init_rows

    assert np.abs(ref_table - init_rows(np.arange(H.V), H.WIDTH, 0.1, 3)).max() > 1e-3
