"""The CPU bounds of the benchmark's data-path goals (bench/targets.py), from given CPU figures."""

from __future__ import annotations

import os

import pytest

from bench import targets
from bench.cpu import Cpu

MB = 1 << 20
CORES = os.cpu_count() or 1


def _cpu(per_step: float, busy: float) -> Cpu:
    """A side that spent ``per_step`` CPU seconds per step keeping ``busy`` of the cores busy, over 5 steps."""
    return Cpu(5 * per_step, 5 * per_step / (busy * CORES), 5, 5 * per_step, {})


def _goal(m, name):
    return next(t for t in targets.targets(m, {}, {"dispatch_counts": (1,)}) if t.name.startswith(name))


def test_bound_is_raw_over_raw_plus_sgd_when_both_are_cpu_bound():
    # raw TCP: 60 ms for 128 MB; the SGD path 20 ms per 64 MB; ours 100 ms per push+pull of 64 MB
    m = {"size": 64 * MB, "raw2": 3.0e9, "dense1_pushpull_off": 2.0e9,
         "cpu": {"raw2": _cpu(0.060, 0.95), "sgd1": _cpu(0.020, 0.5), "dense1_off": _cpu(0.100, 0.9)}}
    t = _goal(m, "dense push+pull / raw TCP")
    assert t.bound == pytest.approx(0.060 / 0.080)
    assert t.verdict == "MISS (CPU bound 0.75, measured far from it: ours to fix)"  # 0.67 < 0.9 * 0.75
    assert "ours 100 ms where 80 would do (raw TCP 60 + SGD 20)" in t.detail
    m["dense1_pushpull_off"] = 2.1e9  # 0.70: near the bound, the goal out of reach
    assert _goal(m, "dense push+pull / raw TCP").verdict == "MISS (CPU bound 0.75)"
    m["cpu"]["sgd1"] = _cpu(0.002, 0.5)  # a bound above the goal, the measured value far below it
    assert _goal(m, "dense push+pull / raw TCP").verdict == "MISS (below the CPU bound 0.97: ours to fix)"


def test_no_bound_unless_both_sides_are_cpu_bound():
    m = {"size": 64 * MB, "dense1_pushpull_off": 2.0e9, "zmq": 1.0e9,
         "cpu": {"raw2": _cpu(0.060, 0.95), "sgd1": _cpu(0.020, 0.5), "dense1_off": _cpu(0.100, 0.9),
                 "zmq": _cpu(0.150, 0.5)}}
    t = _goal(m, "ours / pyzmq PS")
    assert t.bound is None and t.verdict == "MISS (no CPU bound)"
    assert t.detail.startswith(f"no CPU bound: not CPU-bound, cores busy dense1_off {0.9 * CORES:.2f}, "
                               f"zmq {0.5 * CORES:.2f} of {CORES} (a bound needs >= {0.8 * CORES:.1f});")
    m["cpu"]["zmq"] = _cpu(0.150, 0.9)
    t = _goal(m, "ours / pyzmq PS")
    assert t.bound == pytest.approx(0.150 / 0.080) and t.verdict.startswith("MISS (CPU bound 1.88")


def test_step_time_goals_bound_from_below():
    # 2 trainers: 4 x 64 MB moved per step; gloo spends 80 ms of CPU per step
    m = {"size": 64 * MB, "dense2_sync_step_off": 0.200, "gloo": 0.100,
         "cpu": {"raw2": _cpu(0.060, 0.95), "sgd2": _cpu(0.030, 0.5), "dense2_off": _cpu(0.200, 0.9),
                 "gloo2": _cpu(0.080, 0.9)}}
    t = _goal(m, "2-trainer sync step / gloo")
    assert t.bound == pytest.approx((0.120 + 0.030) / 0.080)
    assert t.verdict == "MISS (CPU bound 1.88)"  # 2.0 is within 1 / 0.9 of it
