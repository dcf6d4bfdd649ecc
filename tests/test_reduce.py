"""``PSClient.sum_over_trainers`` (the ``REDUCE`` op on pserver 0, what the frontends' ``average`` and buffer
sharing use): the trainers' sum in trainer order, the same bits on every trainer, NaN kept; a closed trainer no
longer counts; a trainer that never calls is named after the barrier timeout; trainers disagreeing on the width
are refused in one line."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
import rt_helpers as H
from rt_helpers import trainer_env

from paddle_cluster.ps import BarrierTimeout, ConfigMismatch, connect


def _both(a, b, va, vb):
    """Trainer 0 and 1 call at once; each one's answer (or its exception)."""
    out = [None, None]

    def call(i, c, v):
        try:
            out[i] = c.sum_over_trainers(v)
        except Exception as e:  # noqa: BLE001  (the test looks at it)
            out[i] = e

    ts = [threading.Thread(target=call, args=(i, c, v)) for i, (c, v) in enumerate(((a, va), (b, vb)))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    return out


@pytest.mark.timeout(60)
def test_sum_over_trainers(tmp_path):
    env = H.make_env(2, 2, tmp_path, barrier_timeout=2.0)
    with H.procs(tmp_path) as pr:
        for k in range(2):
            pr.pserver(env, k)
        a, b = [connect(mode="sync", env=trainer_env(env, i)) for i in range(2)]
        try:
            (s0, n0), (s1, n1) = _both(a, b, [0.1, 2.0, float("nan")], np.array([0.2, -2.0, 1.0], np.float32))
            assert n0 == n1 == 2 and s0.tobytes() == s1.tobytes()  # the same bits on both
            assert s0[0] == 0.1 + float(np.float32(0.2)) and s0[1] == 0.0 and math.isnan(s0[2])
            big = np.arange(40000, dtype=np.float64)  # several REDUCE calls of at most 16384 values
            (s0, _), (s1, _) = _both(a, b, big, 2 * big)
            assert np.array_equal(s0, 3 * big) and np.array_equal(s1, 3 * big)
            e0, e1 = _both(a, b, [1.0], [1.0, 2.0])
            bad = e0 if isinstance(e0, ConfigMismatch) else e1
            assert isinstance(bad, ConfigMismatch) and "every trainer averages the same things in the same " \
                "order" in str(bad), (e0, e1)
            with pytest.raises(BarrierTimeout) as ei:  # trainer 1 never calls
                a.sum_over_trainers([5.0])
            assert ei.value.missing_trainers == [1] and "averaging" in str(ei.value)
        finally:
            b.close()
        try:
            assert a.sum_over_trainers([7.0])[1] == 1  # trainer 1 closed: it no longer counts
        finally:
            a.close()
