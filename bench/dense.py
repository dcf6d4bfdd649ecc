"""Dense push/pull (and the pserver memory it takes): pservers and trainers as separate processes."""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from paddle_cluster.ps import optim
from paddle_cluster.ps.placement import place_dense
from paddle_cluster.ps.server import dense
from paddle_cluster.ps.wire.stream import SEGMENT

from .common import MB, Procs, Stats, make_env, proc_mem, read_json_line, wait_json
from .cpu import Cpu, combine
from .worker import model_shape


@dataclass(frozen=True)
class Holds:
    """What the design says one pserver of a dense run holds beyond an idle pserver, in bytes: its blocks of
    the model, their optimizer state, the sync pool's accumulator slots (``dense.AccPool``, with several sync
    trainers) and one receive scratch segment (``Stream.chunks``) per trainer connection carrying its blocks."""

    params: int
    state: int
    pool: int
    scratch: int

    @property
    def held(self) -> int:
        """The model's part: what grows with the model (parameters and optimizer state)."""
        return self.params + self.state

    @property
    def total(self) -> int:
        return self.held + self.pool + self.scratch

    def note(self) -> str:
        return (f"design {self.total / MB:.1f} MB = params {self.params / MB:.1f} + optimizer state "
                f"{self.state / MB:.1f} + sync pool {self.pool / MB:.1f} + receive scratch {self.scratch / MB:.1f}")


@dataclass(frozen=True)
class Memory:
    """One pserver's memory in a run: ``growth``, its peak resident set (``VmHWM``) at the end over its resident
    set idle before anything was registered, against ``holds``."""

    what: str
    pserver: int
    growth: int
    peak: int
    idle: int
    holds: Holds

    @property
    def ratio(self) -> float:
        """Growth over what the design says it holds: the target, the same meaning at every model size."""
        return self.growth / self.holds.total

    @property
    def raw(self) -> float:
        """Growth over the model's part alone (parameters and optimizer state): the fixed pool and scratch
        weigh more the smaller the model."""
        return self.growth / self.holds.held

    def note(self) -> str:
        return (f"growth / model's part {self.raw:.2f}x; peak {self.peak / MB:.1f} MB, idle {self.idle / MB:.1f} MB, "
                f"growth {self.growth / MB:.2f} MB; {self.holds.note()}")


def holds(size: int, trainers: int, mode: str = "sync", max_block: int = 4 * MB, n_pservers: int = 2,
          ports_num: int = 1, optimizer: str = "sgd") -> List[Holds]:
    """``Holds`` of every pserver of ``run(size, trainers, mode, max_block)``, from the placement the trainers
    compute and the runtime's own constants (so a change to the pool or the segment size moves it too)."""
    placed = place_dense({"w": (model_shape(size), np.float32)}, n_pservers, ports_num, max_block_bytes=max_block)
    state_copies = len(optim.slots(optim.OptimizerSpec(optimizer))[0])  # SGD none; its scratch buffer is never touched
    slots = dense.AccPool(dense.POOL_BYTES).left  # how many segments the pool may allocate
    out = []
    for k in range(n_pservers):
        mine = [b for b in placed.blocks if b.pserver == k]
        params = sum(b.nbytes for b in mine)
        pool = slots * SEGMENT if mine and mode == "sync" and trainers > 1 else 0
        scratch = len({b.conn for b in mine}) * trainers * SEGMENT
        out.append(Holds(params, params * state_copies, pool, scratch))
    return out


def run(size: int, trainers: int = 1, mode: str = "sync", max_block: int = 4 * MB, warmup: int = 2, reps: int = 5,
        phases: Sequence[str] = ("pushpull",), n_pservers: int = 2, hosts: Optional[List[str]] = None,
        prefix_ps=None, prefix_tr=None, trainer_ip: Any = "127.0.0.1", workdir: Optional[str] = None,
        integrity: bool = True, stdlib_mac: bool = False, lane: bool = False) -> Dict[str, Any]:
    """Start ``n_pservers`` pservers and ``trainers`` trainers, run the worker, return its timings.

    ``prefix_ps(k)`` / ``prefix_tr(i)``: command prefixes (e.g. entering a namespace) per process; ``trainer_ip``:
    the trainers' address, or ``trainer_ip(i)`` for each.
    ``integrity``: frames carry MACs (the default) or not (``INTEGRITY = False``); ``stdlib_mac``: the trainers
    offer only HMAC-SHA256, as on a node with neither OpenSSL 3 nor the ``cryptography`` package; ``lane``: dense
    data through same-host lanes (docs/architecture.md) instead of TCP.
    Also returns every pserver's memory (idle before registration, and at the end) and what the design says
    it holds (``holds``).
    """
    hosts = hosts or ["127.0.0.1"] * n_pservers
    tmp = workdir or tempfile.mkdtemp(prefix="bench-dense-")
    env = make_env(hosts, trainers, tmp, integrity=integrity, lane=lane)
    procs = Procs(os.path.join(tmp, "logs"))
    try:
        ps = [procs.pserver(env, k, prefix_ps(k) if prefix_ps else ()) for k in range(len(hosts))]
        time.sleep(0.2)
        idle = [proc_mem(p.pid) for p in ps]
        done = os.path.join(tmp, "done")
        os.makedirs(done, exist_ok=True)
        args = {"mode": mode, "size": size, "max_block": max_block, "warmup": warmup, "reps": reps,
                "phases": list(phases), "done_dir": done, "hold": True, "stdlib_mac": stdlib_mac}
        names = {str(p.pid): f"pserver {k}" for k, p in enumerate(ps)}
        tr = [procs.trainer(env, i, ["dense", json.dumps({**args, "cpu_pids": [p.pid for p in ps] if i == 0 else []})],
                            trainer_ip(i) if callable(trainer_ip) else trainer_ip, prefix_tr(i) if prefix_tr else ())
              for i in range(trainers)]
        names.update({str(p.pid): f"trainer {i}" for i, p in enumerate(tr)})
        results = [read_json_line(p) for p in tr]
        end = [proc_mem(p.pid) for p in ps]
        for p in tr:
            wait_json(p)
        for p in ps:
            p.wait(20)
    finally:
        procs.close()
    return {"trainers": results, "idle_mem": idle, "end_mem": end, "names": names,
            "holds": holds(size, trainers, mode, max_block, len(hosts))}


def step_stats(res: Dict[str, Any], phase: str) -> Stats:
    """Per-step time: the slowest trainer of each step (steps are lock-step in sync mode)."""
    per = [r["times"][phase] for r in res["trainers"]]
    return Stats([max(ts) for ts in zip(*per)])


def cpu_stats(res: Dict[str, Any], phase: str) -> Cpu:
    """The CPU of every pserver and trainer over the timed repetitions of ``phase`` (each trainer read its own
    at its first start and last end, trainer 0 the pservers' too)."""
    reps = len(res["trainers"][0]["times"][phase])
    return combine([Cpu.between(*r["cpu"][phase], reps, res["names"]) for r in res["trainers"]], reps)


def check(res: Dict[str, Any]) -> str:
    bad = [r["check"] for r in res["trainers"] if r["check"] != "ok"]
    return "ok" if not bad else bad[0]
