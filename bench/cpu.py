"""CPU accounting of the data-path rows, and the pserver's SGD measured alone.

A row's ``Cpu`` is the CPU seconds (user + system, every thread) of every process doing its work over the
timed repetitions, read from ``/proc/<pid>/stat`` at the repetitions' first start and last end, and the time
their threads waited in a run queue for a core (``schedstat``), beside the whole machine's CPU
(``/proc/stat``) over the same wall time: CPU per step, cores busy, and cores wanted (busy + waiting for a
core: what tells a CPU-bound side from one that waits on something else, even while other processes take
cores). ``targets`` turns them into the CPU bound of each data-path goal (docs/benchmarks.md, "CPU bounds").
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

_HZ = os.sysconf("SC_CLK_TCK")
MB = 1 << 20


def proc_times(pid: int) -> Tuple[float, float]:
    """(user, system) CPU seconds of process ``pid`` so far (all its threads); (0, 0) once it is gone."""
    try:
        f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0, 0.0
    return int(f[11]) / _HZ, int(f[12]) / _HZ


def proc_cpu(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (all its threads); 0 once it is gone."""
    return sum(proc_times(pid))


def schedstat(pid: int) -> Tuple[int, int, int]:
    """Summed over the threads of ``pid`` now alive (``/proc/<pid>/task/*/schedstat``): nanoseconds on a core,
    nanoseconds waiting in a run queue for one, and times put on a core (a wake-up or a preemption each);
    zeros once it is gone."""
    run = wait = slices = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0, 0, 0
    for tid in tids:
        try:
            f = open(f"/proc/{pid}/task/{tid}/schedstat").read().split()
            run, wait, slices = run + int(f[0]), wait + int(f[1]), slices + int(f[2])
        except (OSError, IndexError, ValueError):  # a thread that just ended
            pass
    return run, wait, slices


def threads(pid: int) -> Tuple[float, float]:
    """(seconds on a core, seconds waiting in a run queue for one) of the threads of ``pid`` now alive, to the
    nanosecond (``schedstat``); (0, 0) once it is gone."""
    run, wait, _ = schedstat(pid)
    return run / 1e9, wait / 1e9


def run_delay(pid: int) -> float:
    """Seconds the threads of ``pid`` now alive have waited in a run queue for a core."""
    return threads(pid)[1]


def machine_cpu() -> float:
    """CPU seconds every core of the machine spent not idle (nor waiting for I/O) since boot."""
    f = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    return (sum(f[:8]) - f[3] - f[4]) / _HZ


def descendants(root: int) -> List[int]:
    """Every process below ``root`` (children, theirs, ...), by their parent pid."""
    kids: Dict[int, List[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d))
    out, todo = [], [root]
    while todo:
        for k in kids.get(todo.pop(), []):
            out.append(k)
            todo.append(k)
    return out


def snapshot(pids: Iterable[int]) -> Dict[str, float]:
    """CPU so far of each of ``pids`` (keys are the pids as strings: JSON) and its run-queue wait (``pid:wait``),
    the machine's, and the time."""
    out = {str(p): proc_cpu(p) for p in pids}
    for p in pids:
        out[f"{p}:run"], out[f"{p}:wait"] = threads(p)
    out["machine"] = machine_cpu()
    out["t"] = time.perf_counter()
    return out


@dataclass
class Cpu:
    """What the processes doing one row's work spent over its timed repetitions."""

    seconds: float  # CPU of those processes
    wall: float  # wall time of the repetitions, first start to last end
    steps: int
    machine: float  # every process's CPU on the machine over that wall time (ours and anyone else's)
    procs: Dict[str, float] = field(default_factory=dict)  # seconds per process (or kind of process)
    wait: float = 0.0  # seconds their threads waited in a run queue for a core

    @property
    def per_step(self) -> float:
        return self.seconds / self.steps

    @property
    def busy(self) -> float:
        """Cores these processes kept busy."""
        return self.seconds / self.wall if self.wall > 0 else 0.0

    @property
    def wanted(self) -> float:
        """Cores these processes wanted: busy, or ready to run and waiting for a core."""
        return (self.seconds + self.wait) / self.wall if self.wall > 0 else 0.0

    @property
    def machine_busy(self) -> float:
        return self.machine / self.wall if self.wall > 0 else 0.0

    def note(self) -> str:
        return (f"CPU {1e3 * self.per_step:.1f} ms/step, {self.busy:.2f} cores busy, {self.wanted:.2f} wanted "
                f"(machine {self.machine_busy:.2f})")

    def to_dict(self) -> Dict[str, Any]:
        return {**asdict(self), "per_step": self.per_step, "busy": self.busy, "wanted": self.wanted,
                "machine_busy": self.machine_busy}

    @staticmethod
    def between(a: Dict[str, float], b: Dict[str, float], steps: int, names: Optional[Dict[str, str]] = None
                ) -> Cpu:
        """From two ``snapshot``s: every process in both (a process started between them counts from 0)."""
        names = names or {}
        procs: Dict[str, float] = {}
        wait = 0.0
        for k in b:
            if k.endswith(":wait"):
                wait += b[k] - a.get(k, 0.0)
            elif k not in ("machine", "t") and not k.endswith(":run"):
                n = names.get(k, k)
                ticks, run = b[k] - a.get(k, 0.0), b[f"{k}:run"] - a.get(f"{k}:run", 0.0)
                # /proc/<pid>/stat counts every thread, dead ones too, in 10 ms ticks; schedstat the live ones
                # to the ns: take the exact one unless a thread died meanwhile (they then differ by > 2 ticks)
                procs[n] = procs.get(n, 0.0) + (run if abs(run - ticks) <= 2 / _HZ else ticks)
        return Cpu(sum(procs.values()), b["t"] - a["t"], steps, b["machine"] - a["machine"], procs, wait)


def combine(parts: Iterable[Cpu], steps: int) -> Cpu:
    """Processes measured separately over the same repetitions (one ``Cpu`` each): summed; the wall time and
    the machine's CPU are the longest part's."""
    parts = list(parts)
    longest = max(parts, key=lambda c: c.wall)
    procs: Dict[str, float] = {}
    for c in parts:
        for k, v in c.procs.items():
            procs[k] = procs.get(k, 0.0) + v
    return Cpu(sum(c.seconds for c in parts), longest.wall, steps, longest.machine, procs, sum(c.wait for c in parts))


class Meter:
    """The CPU of ``pids()`` (re-read at ``stop``: processes that appeared meanwhile count from 0) and of this
    process between ``start`` and ``stop``."""

    def __init__(self, pids: Callable[[], Dict[int, str]]) -> None:
        self.pids = pids
        self.a: Dict[str, float] = {}
        self.names: Dict[str, str] = {}

    def _snap(self) -> Dict[str, float]:
        named = {os.getpid(): "driver", **self.pids()}
        self.names.update({str(p): n for p, n in named.items()})
        return snapshot(named)

    def start(self) -> None:
        self.a = self._snap()

    def stop(self, steps: int) -> Cpu:
        return Cpu.between(self.a, self._snap(), steps, self.names)


# -- the pserver's SGD path alone ---------------------------------------------------------------------------


def _fold_steps(size: int, trainers: int, steps: int, warmup: int, max_block: int, no_sgd: bool) -> Dict[str, Any]:
    """(In a fresh process.) ``DenseBlock.push_segments``, the pserver's own sync SGD path, for ``trainers``
    trainers (one thread each, as a pserver has one connection thread per trainer) over ``size`` bytes of
    float32 in blocks of ``max_block``, segments handed over from memory instead of a socket; returns the
    process's CPU."""
    import numpy as np

    from paddle_cluster.ps.optim import OptimizerSpec
    from paddle_cluster.ps.server import dense
    from paddle_cluster.ps.server.dense import DenseBlock, DenseShared
    from paddle_cluster.ps.server.sync import Sync
    from paddle_cluster.ps.wire.stream import SEGMENT

    if no_sgd:  # bench-only: the same loop with the update removed, to see what the rest of it costs
        dense._sgd = lambda *a, **k: None
    block = min(max_block, size)
    rows = block // 4 // 1024
    nblk = size // block
    sync = Sync(0, trainers, 60.0, threading.Event())
    sync.mode = "sync"
    shared = DenseShared.make(sync)
    blocks = []
    for k in range(nblk):
        meta = {"name": "w", "dtype": "float32", "shape": [rows, 1024], "lo": k * rows, "hi": (k + 1) * rows}
        spec = OptimizerSpec("sgd", lr=1.0)  # SGD overwrites its gradient with lr * g: 1.0 keeps it as it came
        b = DenseBlock(k, meta, spec, spec.to_dict(), 0, shared)
        b.initialized = True
        blocks.append(b)
    filled = set()
    grads = [np.full(block // 4, np.float32(t + 1)) for t in range(trainers)]

    def chunks_of(g: np.ndarray):
        raw = memoryview(g).cast("B")

        def chunks(into):
            for off in range(0, len(raw), SEGMENT):
                n = min(SEGMENT, len(raw) - off)
                dest = into(off)
                if dest is None:
                    yield off, raw[off:off + n]
                    continue
                if id(dest) not in filled:  # a new pool slot: the socket would have written it; once is enough
                    np.frombuffer(dest, dtype=np.uint8)[:n] = np.frombuffer(raw[off:off + n], dtype=np.uint8)
                    filled.add(id(dest))
                yield off, memoryview(dest)[:n]
        return chunks

    def trainer(t: int, first: int, last: int) -> None:
        for step in range(first, last):
            for b in blocks:
                with b.cv:
                    b.step.wait(step, "push")
                    b.graded_at = step  # as DenseBlock.push marks a push that carries a gradient
                b.push_segments(t, step, chunks_of(grads[t]))

    def run(first: int, last: int) -> None:
        ths = [threading.Thread(target=trainer, args=(t, first, last)) for t in range(trainers)]
        for th in ths:
            th.start()
        for th in ths:
            th.join()

    run(0, warmup)
    c0, t0, m0 = time.process_time(), time.perf_counter(), machine_cpu()
    run(warmup, warmup + steps)
    cpu, wall, machine = time.process_time() - c0, time.perf_counter() - t0, machine_cpu() - m0
    done = all(b.step.n == warmup + steps for b in blocks)
    ok = done
    if trainers == 1 and not no_sgd:  # the values too: every element took every update
        want = -np.float32(warmup + steps)
        ok = ok and all(np.all(b.param == want) for b in blocks)
    shared.applier.shutdown()
    check = "ok" if ok else f"FAILED: {'values wrong' if done else 'not every step was applied'}"
    return {"cpu": cpu, "wall": wall, "machine": machine, "check": check}


def _child(q, *args: Any) -> None:
    try:
        q.put(_fold_steps(*args))
    except BaseException as e:  # said by the parent
        q.put({"error": repr(e)})


def sgd_alone(size: int, trainers: int, steps: int, warmup: int = 1, max_block: int = 4 * MB,
              no_sgd: bool = False) -> tuple:
    """(Cpu of the SGD path alone over ``steps`` steps, its check) -- in a fresh forked process, so nothing else
    of the benchmark runs in it."""
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(q, size, trainers, steps, warmup, max_block, no_sgd), daemon=True)
    p.start()
    try:
        out = q.get(timeout=600)
    finally:
        p.join(10)
        if p.is_alive():
            p.kill()
    if "error" in out:
        raise RuntimeError(f"SGD alone ({trainers} trainers): {out['error']}")
    what = "fold without SGD" if no_sgd else "SGD path"
    return (Cpu(out["cpu"], out["wall"], steps, out["machine"], {what: out["cpu"]}), out["check"])


__all__ = ["Cpu", "Meter", "combine", "descendants", "machine_cpu", "proc_cpu", "run_delay", "sgd_alone",
           "snapshot", "threads"]
