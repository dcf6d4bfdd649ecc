"""Peers on the same work: a pyzmq PS, a Ray-actor PS and torch.distributed gloo all-reduce.

All optional: each returns ``None`` (with the reason) when its package is not installed. The PS peers
hold the same model (``size`` bytes of float32 over 2 servers, SGD applied on the server) and run the
same loop as the dense benchmark's single trainer: push the gradient, pull the parameters. The check:
the parameters pulled after the run equal ``-lr * value * steps``.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import time
from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np

from .common import Stats, enter_netns, free_port_range
from .cpu import Cpu, Meter, descendants, machine_cpu, run_delay

LR = np.float32(0.5)
_CTX = mp.get_context("fork")


def _missing(mod: str) -> Optional[str]:
    import importlib.util

    return None if importlib.util.find_spec(mod) else f"{mod} is not installed (pip install {mod})"


# -- pyzmq ---------------------------------------------------------------------------------------------------


def _zmq_server(port: int, n: int) -> None:
    import zmq

    ctx = zmq.Context(io_threads=1)
    s = ctx.socket(zmq.REP)
    s.bind(f"tcp://127.0.0.1:{port}")
    param = np.zeros(n, dtype=np.float32)
    buf = np.empty_like(param)
    while True:
        op, *rest = s.recv_multipart(copy=False)
        op = op.bytes
        if op == b"push":
            g = np.frombuffer(rest[0].buffer, dtype=np.float32)
            np.multiply(g, LR, out=buf)
            param -= buf
            s.send(b"ok")
        elif op == b"pull":
            s.send(param, copy=False)
        else:
            s.send(b"bye")
            return


def zmq_ps(size: int, warmup: int, reps: int, n_servers: int = 2) -> Tuple[Optional[Stats], str, Optional[Cpu]]:
    why = _missing("zmq")
    if why:
        return None, why, None
    import zmq

    n = size // 4 // n_servers
    base = free_port_range(n_servers)
    procs = [_CTX.Process(target=_zmq_server, args=(base + k, n), daemon=True) for k in range(n_servers)]
    for p in procs:
        p.start()
    ctx = zmq.Context(io_threads=2)
    socks = []
    try:
        for k in range(n_servers):
            s = ctx.socket(zmq.REQ)
            s.connect(f"tcp://127.0.0.1:{base + k}")
            socks.append(s)
        g = np.full(n * n_servers, 1.0, dtype=np.float32)
        shards = [g[k * n:(k + 1) * n] for k in range(n_servers)]
        pulled = [None] * n_servers

        def step() -> None:
            for s, sh in zip(socks, shards):
                s.send_multipart([b"push", sh], copy=False)
            for s in socks:
                s.recv()
            for s in socks:
                s.send(b"pull")
            for k, s in enumerate(socks):
                pulled[k] = np.frombuffer(s.recv(copy=False).buffer, dtype=np.float32)

        meter = Meter(lambda: {p.pid: f"server {k}" for k, p in enumerate(procs)})
        times = []
        for i in range(warmup + reps):
            if i == warmup:
                meter.start()
            t0 = time.perf_counter()
            step()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        cpu = meter.stop(reps)
        want = -LR * np.float32(warmup + reps)
        ok = all(np.all(p == want) for p in pulled)
        for s in socks:
            s.send(b"stop")
            s.recv()
    finally:
        for s in socks:
            s.close(linger=0)
        ctx.term()
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
    return Stats(times), "ok" if ok else "FAILED: parameters differ from -lr * steps", cpu


# -- Ray actors ---------------------------------------------------------------------------------------------


RAY_WARMUP = 8  # Ray's object stores reach their pace only after several steps (below)


def ray_ps(size: int, warmup: int, reps: int, n_servers: int = 2) -> Tuple[Optional[Stats], str, Optional[Cpu]]:
    """Ray actors as pservers on a Ray node of their own (``ray.cluster_utils.Cluster``: its own raylet and
    object store), the trainer on the head node: every array crosses between object stores over TCP, as between
    machines (on one node Ray hands arrays over in shared memory, which no PS across machines can). Its CPU
    counts every process Ray started (all below this one: gcs, raylets, workers)."""
    why = _missing("ray")
    if why:
        return None, why, None
    import ray
    from ray.cluster_utils import Cluster

    @ray.remote(resources={"pserver": 1}, num_cpus=0)
    class Shard:
        def __init__(self, n: int) -> None:
            self.param = np.zeros(n, dtype=np.float32)
            self.buf = np.empty_like(self.param)

        def push(self, g: np.ndarray) -> bool:
            np.multiply(g, LR, out=self.buf)
            self.param -= self.buf
            return True

        def pull(self) -> np.ndarray:
            return self.param

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    store = max(1 << 30, 8 * size)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": store,
                                                            "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=os.cpu_count() or 2, resources={"pserver": n_servers}, object_store_memory=store)
        ray.init(address=cluster.address, log_to_driver=False, logging_level="ERROR")
        cluster.wait_for_nodes()
        n = size // 4 // n_servers
        actors = [Shard.remote(n) for _ in range(n_servers)]
        g = np.full(n * n_servers, 1.0, dtype=np.float32)
        shards = [g[k * n:(k + 1) * n] for k in range(n_servers)]
        pulled = []
        times = []
        meter = Meter(_ray_procs)
        # The first steps run at a third of the pace of later ones (seen: 180-510 ms for the first 6, then
        # 180-220): fewer warm-up steps would measure Ray's start, not Ray.
        warmup = max(warmup, RAY_WARMUP)
        for i in range(warmup + reps):
            if i == warmup:
                meter.start()
            t0 = time.perf_counter()
            ray.get([a.push.remote(sh) for a, sh in zip(actors, shards)])
            pulled = ray.get([a.pull.remote() for a in actors])
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        cpu = meter.stop(reps)
        want = -LR * np.float32(warmup + reps)
        ok = all(np.all(p == want) for p in pulled)
    finally:
        ray.shutdown()
        cluster.shutdown()
    return Stats(times), "ok" if ok else "FAILED: parameters differ from -lr * steps", cpu


def _ray_procs() -> Dict[int, str]:
    """Every process below this one, named by its command (Ray's gcs_server, raylet, workers, ...)."""
    out = {}
    for pid in descendants(os.getpid()):
        try:
            name = open(f"/proc/{pid}/comm").read().strip()
        except OSError:
            continue
        out[pid] = name
    return out


# -- torch.distributed gloo ---------------------------------------------------------------------------------


def _gloo_worker(rank: int, world: int, master: str, port: int, size: int, warmup: int, reps: int, q,
                 netns: Optional[str]) -> None:
    try:
        if netns:  # first thing, while this (spawned) process has one thread: its sockets live in the namespace
            enter_netns(netns)
            os.environ["GLOO_SOCKET_IFNAME"] = "eth0"
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=120))
        t = torch.empty(size // 4, dtype=torch.float32)
        times, ok, cpu, machine, wait = [], True, 0.0, 0.0, 0.0
        for i in range(warmup + reps):
            t.fill_(rank + 1)
            dist.barrier()
            m0, w0, c0, t0 = machine_cpu(), run_delay(os.getpid()), time.process_time(), time.perf_counter()
            dist.all_reduce(t)
            dt, dc = time.perf_counter() - t0, time.process_time() - c0  # the process: gloo's threads too
            if i >= warmup:
                cpu += dc
                machine += machine_cpu() - m0
                wait += run_delay(os.getpid()) - w0
            ok = ok and float(t[0]) == world * (world + 1) / 2 and float(t[-1]) == world * (world + 1) / 2
            if i >= warmup:
                times.append(dt)
        dist.destroy_process_group()
        q.put((rank, times, (ok, cpu, machine, wait)))
    except Exception as e:  # said by the parent as the reason the all-reduce was not measured
        q.put((rank, None, f"gloo rank {rank}{f' in {netns}' if netns else ''}: {e!r}"[:300]))


def gloo_allreduce(size: int, warmup: int, reps: int, world: int = 2, ips: Optional[Sequence[str]] = None,
                   netns: Optional[Sequence[str]] = None) -> Tuple[Optional[Stats], str, Optional[Cpu]]:
    """``world`` workers all-reducing ``size`` bytes of float32 (gloo's ring); rank ``r`` in namespace
    ``netns[r]`` at ``ips[r]`` when given, else all on loopback. Per step: the slowest rank. CPU: every rank's
    own over its timed all-reduces (the machine's as rank 0 saw it)."""
    why = _missing("torch")
    if why:
        return None, why, None
    port = free_port_range(1)
    master = ips[0] if ips else "127.0.0.1"
    ctx = mp.get_context("spawn")  # torch must not be forked with threads running
    q = ctx.Queue()
    procs = [ctx.Process(target=_gloo_worker, args=(r, world, master, port, size, warmup, reps, q,
                                                    netns[r] if netns else None)) for r in range(world)]
    for p in procs:
        p.start()
    res: Dict[int, Any] = {}
    try:
        deadline = time.monotonic() + 300
        while len(res) < world:
            try:
                r, times, ok = q.get(timeout=1.0)
            except queue.Empty:
                dead = [f"gloo rank {r} exited with code {p.exitcode} before reporting"
                        for r, p in enumerate(procs) if p.exitcode is not None and r not in res]
                if dead or time.monotonic() > deadline:
                    return None, dead[0] if dead else "gloo all-reduce did not finish within 300 s", None
                continue
            if times is None:
                return None, ok, None  # the rank's error
            res[r] = (times, ok)
    finally:
        for p in procs:
            p.join(30 if len(res) == world else 1)
            if p.is_alive():
                p.kill()
    per_step = [max(ts) for ts in zip(*(res[r][0] for r in range(world)))]
    ok = all(res[r][1][0] for r in range(world))
    procs = {f"rank {r}": res[r][1][1] for r in range(world)}
    cpu = Cpu(sum(procs.values()), sum(per_step), reps, res[0][1][2], procs, sum(res[r][1][3] for r in range(world)))
    return Stats(per_step), "ok" if ok else "FAILED: all-reduce sum is wrong", cpu


# -- PS vs all-reduce: bytes per worker and per step ------------------------------------------------------


def ring_bytes(size: int, world: int) -> float:
    """What each worker of a ring all-reduce sends (and receives) per step: reduce-scatter + all-gather."""
    return 2 * (world - 1) / world * size


def ps_sync(size: int, warmup: int, reps: int, workers: int, pservers: int, cluster: Any = None
            ) -> Tuple[Stats, str, Cpu]:
    """Our sync PS (integrity off, the same work as gloo: no MACs) with ``workers`` trainers and ``pservers``
    pservers; per step: push + pull of the slowest trainer. On ``cluster`` (tests/sshcluster.py) trainer
    ``i`` runs on node ``i`` and pserver ``k`` on node ``k``: with as many pservers as workers each node is
    a worker and a pserver, as a ring all-reduce's nodes are."""
    from . import dense

    kw: Dict[str, Any] = {}
    if cluster is not None:
        kw = dict(hosts=[cluster.ips[k] for k in range(pservers)], prefix_ps=cluster._enter,
                  prefix_tr=cluster._enter, trainer_ip=lambda i: cluster.ips[i])
    res = dense.run(size, workers, warmup=warmup, reps=reps, n_pservers=pservers, integrity=False, **kw)
    return dense.step_stats(res, "pushpull"), dense.check(res), dense.cpu_stats(res, "pushpull")
