"""The benchmark's pserver memory goal: a pserver's growth over what the design says it holds (bench.dense.Holds),
which means the same at every model size; the raw growth over the model's part is still reported."""

from __future__ import annotations

import dataclasses

import pytest

from bench import dense, targets
from paddle_cluster.ps.server.dense import POOL_BYTES
from paddle_cluster.ps.wire.stream import SEGMENT

MB = 1 << 20


def _targets(mems):
    return {t.name: t for t in targets.targets({"size": 16 * MB, "cpu": {}, "mem": mems}, {}, {"dispatch_counts": (1,)})
            if "memory" in t.name}


def test_holds_follow_the_placement_and_the_runtime_constants():
    pool = max(1, POOL_BYTES // SEGMENT) * SEGMENT
    for size in (16 * MB, 64 * MB):  # 4 MB blocks, half of them on each pserver
        one, two = dense.holds(size, 1), dense.holds(size, 2)
        assert [h.params for h in one] == [size // 2] * 2 and [h.held for h in two] == [size // 2] * 2
        assert all(h.pool == 0 and h.scratch == SEGMENT for h in one)  # one trainer: applied from its scratch
        assert all(h.pool == pool and h.scratch == 2 * SEGMENT for h in two)
    small = dense.holds(32 << 10, 2)  # too small to split: pserver 1 holds nothing, so no pool or scratch either
    assert small[0] == dense.Holds(32 << 10, 0, pool, 2 * SEGMENT) and small[1] == dense.Holds(0, 0, 0, 0)
    assert dense.holds(16 * MB, 2, mode="async")[0].pool == 0
    assert dense.holds(16 * MB, 1, optimizer="adam")[0].state == 2 * 8 * MB  # m and v


def test_memory_goal_means_the_same_at_both_sizes():
    # what the sync pserver measured with 2 trainers: 4.5 MB beyond its parameters at both sizes
    quick = dense.Memory("2 trainers sync", 0, int(12.46 * MB), 47 * MB, 35 * MB, dense.holds(16 * MB, 2)[0])
    full = dense.Memory("2 trainers sync", 0, int(36.57 * MB), 71 * MB, 35 * MB, dense.holds(64 * MB, 2)[0])
    assert quick.raw == pytest.approx(1.56, abs=0.01) and full.raw == pytest.approx(1.14, abs=0.01)
    t = _targets([quick])["pserver 0 memory / design, 2 trainers sync"]
    assert t.met and t.value == pytest.approx(12.46 / 12) and t.verdict == "PASS"
    assert "growth / model's part 1.56x" in t.detail and "sync pool 2.0 + receive scratch 2.0" in t.detail
    assert _targets([full])["pserver 0 memory / design, 2 trainers sync"].value == pytest.approx(36.57 / 36)
    # a pserver keeping a whole-block gradient per trainer and a sum (the design before the pool) misses at both
    for m in (quick, full):
        old = dataclasses.replace(m, growth=m.holds.params * 4 + m.holds.scratch)
        assert not _targets([old])["pserver 0 memory / design, 2 trainers sync"].met


@pytest.mark.timeout(120)
def test_a_real_pserver_holds_what_the_design_says(tmp_path):
    res = dense.run(16 * MB, 2, warmup=1, reps=2, workdir=str(tmp_path))
    assert dense.check(res) == "ok"
    for idle, end, h in zip(res["idle_mem"], res["end_mem"], res["holds"]):
        growth = end["VmHWM"] - idle["VmRSS"]
        assert h.params <= growth <= 1.2 * h.total, (growth / MB, h)
