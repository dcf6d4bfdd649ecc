"""The CPU bounds of the benchmark's data-path goals (bench/targets.py), from given CPU figures."""

from __future__ import annotations

import os

import pytest

from bench import targets
from bench.cpu import Cpu

MB = 1 << 20
CORES = os.cpu_count() or 1


def _cpu(per_step: float, busy: float, wanted: float = 0.0, machine: float = 0.0) -> Cpu:
    """A side that spent ``per_step`` CPU seconds per step keeping ``busy`` of the cores busy and wanting
    ``wanted`` of them (busy or waiting for one) while the machine's cores were ``machine`` busy, over 5 steps."""
    wall = 5 * per_step / (busy * CORES)
    return Cpu(5 * per_step, wall, 5, max(busy, machine) * CORES * wall, {}, max(0.0, wanted - busy) * CORES * wall)


def _goal(m, name):
    return next(t for t in targets.targets(m, {}, {"dispatch_counts": (1,)}) if t.name.startswith(name))


def test_bound_is_raw_over_raw_plus_sgd_when_both_are_cpu_bound():
    # raw TCP: 60 ms for 128 MB; the SGD path 20 ms per 64 MB; ours 100 ms per push+pull of 64 MB
    m = {"size": 64 * MB, "raw2": 3.0e9, "dense1_pushpull_off": 2.0e9,
         "cpu": {"raw2": _cpu(0.060, 0.95), "sgd1": _cpu(0.020, 0.5), "dense1_off": _cpu(0.100, 0.9)}}
    t = _goal(m, "dense push+pull / raw TCP")
    assert t.bound == pytest.approx(0.060 / 0.080)
    assert t.verdict == "MISS (CPU bound 0.75; ours spends 1.25x its least CPU: ours to fix)"
    assert "ours 100 ms where 80 would do (raw TCP 60 + SGD 20)" in t.detail
    m["cpu"]["dense1_off"] = _cpu(0.085, 0.9)  # near its least: the goal is out of this machine's reach
    assert _goal(m, "dense push+pull / raw TCP").verdict == "MISS (CPU bound 0.75)"
    m["cpu"]["sgd1"] = _cpu(0.002, 0.5)  # a bound above the goal, ours far above its least CPU
    assert _goal(m, "dense push+pull / raw TCP").verdict == "MISS (below the CPU bound 0.97: ours to fix)"


def test_no_bound_unless_both_sides_want_the_cores():
    m = {"size": 64 * MB, "dense1_pushpull_off": 2.0e9, "zmq": 1.0e9,
         "cpu": {"raw2": _cpu(0.060, 0.95), "sgd1": _cpu(0.020, 0.5), "dense1_off": _cpu(0.100, 0.9),
                 "zmq": _cpu(0.150, 0.5)}}
    t = _goal(m, "ours / pyzmq PS")
    assert t.bound is None and t.verdict == "MISS (no CPU bound)"
    assert t.detail.startswith(f"no CPU bound (a side wanted < {0.8 * CORES:.1f} cores, or the machine had them")
    assert f"zmq {0.5 * CORES:.2f} busy / {0.5 * CORES:.2f} wanted" in t.detail
    # wanting the cores while some were idle: not CPU-bound
    m["cpu"]["zmq"] = _cpu(0.150, 0.5, wanted=0.9, machine=0.6)
    assert _goal(m, "ours / pyzmq PS").bound is None
    # the same CPU, but half the cores were taken by other processes while pyzmq waited for them: CPU-bound
    m["cpu"]["zmq"] = _cpu(0.150, 0.5, wanted=0.9, machine=1.0)
    t = _goal(m, "ours / pyzmq PS")
    assert t.bound == pytest.approx(0.150 / 0.080)
    assert t.verdict == "MISS (beyond its CPU bound 1.88: uneven load, see the CPU figures)"  # measured 2.0
    m["zmq"] = 1.1e9
    assert _goal(m, "ours / pyzmq PS").verdict.startswith("MISS (CPU bound 1.88; ours spends 1.25x")


def test_step_time_goals_bound_from_below():
    # 2 trainers: 4 x 64 MB moved per step; gloo spends 80 ms of CPU per step
    m = {"size": 64 * MB, "dense2_sync_step_off": 0.200, "gloo": 0.100,
         "cpu": {"raw2": _cpu(0.060, 0.95), "sgd2": _cpu(0.030, 0.5), "dense2_off": _cpu(0.160, 0.9),
                 "gloo2": _cpu(0.080, 0.9)}}
    t = _goal(m, "2-trainer sync step / gloo")
    assert t.bound == pytest.approx((0.120 + 0.030) / 0.080)
    assert t.verdict == "MISS (CPU bound 1.88)"


def test_no_bound_when_ours_spent_less_than_its_least():
    # raw TCP measured under heavier load than ours: its CPU per byte is no floor for ours then
    m = {"size": 64 * MB, "raw2": 3.0e9, "dense1_pushpull_off": 2.0e9,
         "cpu": {"raw2": _cpu(0.120, 0.95), "sgd1": _cpu(0.020, 0.5), "dense1_off": _cpu(0.100, 0.9)}}
    t = _goal(m, "dense push+pull / raw TCP")
    assert t.bound is None and t.verdict == "MISS (no CPU bound)"
    assert t.detail.startswith("no CPU bound: ours spent 0.71x the least its work needs")


def test_frames_tell_the_pattern_from_ours():
    # ours 1.25x its least; plain sockets sending the same frames spend 95 ms of ours' 100
    m = {"size": 64 * MB, "raw2": 3.0e9, "dense1_pushpull_off": 2.0e9,
         "cpu": {"raw2": _cpu(0.060, 0.95), "sgd1": _cpu(0.020, 0.5), "dense1_off": _cpu(0.100, 0.9),
                 "frames1_2": _cpu(0.095, 0.9)}}
    t = _goal(m, "dense push+pull / raw TCP")
    assert t.verdict == ("MISS (CPU bound 0.75; ours 1.05x plain sockets sending the same frames, which need 1.19x "
                         "the least: the PS's frame pattern)")
    assert "the same frames with the same SGD 95 ms (1.19x the least; ours 1.05x them)" in t.detail
    m["cpu"]["frames1_2"] = _cpu(0.080, 0.9)  # the pattern costs no more than the least: the rest is ours
    assert _goal(m, "dense push+pull / raw TCP").verdict.endswith("ours spends 1.25x its least CPU: ours to fix)")


def test_framework_and_placement_goals_read_their_rows():
    # The torch rows' ratios (pservers / DDP step) and the numpy rows across nodes with the default placement:
    # a pserver per worker's node, whatever step the other pserver counts took.
    m = {"size": 64 * MB, "cpu": {},
         ("torch", "dense", "one machine", 2, "defaults"): 0.9, ("torch", "dense", "one machine", 4, "tcp"): 1.3,
         ("torch", "dense", "3 hosts, 1 Gbit/s", 4, "defaults"): 1.12,
         ("torch", "embedding", "one machine", 2, "defaults"): 0.08,
         "ps_vs_ring_shaped": {("gloo", 4): 1.0, ("ps", 4, 2): 2.0, ("ps", 4, 4): 1.14}}
    assert _goal(m, "PyTorch MLP on the pservers (defaults) / DDP gloo, step, 2 trainers, one machine").met
    assert not _goal(m, "PyTorch MLP on the pservers (over TCP) / DDP gloo, step, 4 trainers, one machine").met
    hosts = _goal(m, "PyTorch MLP on the pservers (defaults) / DDP gloo, step, 4 trainers, 3 hosts")
    assert hosts.value == 1.12 and hosts.goal == "<= 1.1" and not hosts.met
    emb = _goal(m, "embedding 1 % touched: DDP gloo / pservers (defaults), step, 2 trainers, one machine")
    assert emb.value == pytest.approx(12.5) and emb.met
    placed = _goal(m, "sync PS step, default placement (4 pservers) / gloo, 4 workers")
    assert placed.value == pytest.approx(1.14) and placed.goal == "<= 1.15" and placed.met


def test_time_to_target_is_the_first_step_at_the_target():
    from bench.common import Stats
    from bench.frameworks import Side

    side = Side(Stats([0.1]), _cpu(0.1, 0.5), {}, [10.0, 8.0, 7.4, 7.6, 7.0], [0.2, 0.35, 0.5, 0.6, 0.7])
    assert side.to_target(7.5) == (3, 0.5)
    assert side.to_target(1.0) is None
