"""The parameter server's own traffic with nothing of ours: plain sockets sending the same frames.

Raw TCP (``rawtcp``) moves a step's bytes as whole messages; a parameter server cannot: it answers each
block's pull after that block's push, and folds and sends by segment so that values flow back while
gradients still arrive. This measures what that pattern costs with plain Python sockets and the project's
SGD kernel, so the dense rows can be read as "the pattern" plus "ours above it".

``servers`` server processes each hold ``size / servers`` bytes of float32 in blocks of ``block`` bytes;
``trainers`` client processes each run ``reps`` steps. Per block a client sends a push frame (a
``HEADER_SIZE`` header and the block) and a pull frame (a header); a server receives the push in
``SEGMENT`` pieces, sums the trainers' segments and applies SGD to each segment as its last one lands
(``optim.sgd``, as the pserver does), replies OK, and answers the pull once every trainer's push of the block
is applied, sending header and block in ``SEGMENT`` pieces. Sockets are blocking with ``TCP_NODELAY``; a
client reads its replies on a thread per server while it sends. No authentication, MACs, step checks or
error paths. The check: every value pulled after the last step is ``-lr * steps``.

``shm=True`` measures the same pattern through shared memory instead (what the runtime's same-host lane
costs at least, docs/architecture.md): each client has two shared-memory areas of the model's size mapped
by every server, one it copies its gradients into, one the servers copy the values into; the socket carries
only the headers. A push is the client's copy plus the server's SGD straight from the shared gradient; a pull is the
server's copy into the shared values (the client's receive buffers): one copy per byte each way where TCP
makes two kernel copies.
"""

from __future__ import annotations

import mmap
import multiprocessing as mp
import socket
import struct
import threading
import time
from typing import List, Optional, Tuple

import numpy as np

from paddle_cluster.ps.optim import sgd
from paddle_cluster.ps.wire.protocol import HEADER_SIZE
from paddle_cluster.ps.wire.stream import SEGMENT

from .common import Stats
from .cpu import Cpu, Meter

_CTX = mp.get_context("fork")
_HDR = struct.Struct("<BIq")  # op, block, step
PUSH, PULL = 1, 2
LR = 0.5


def _frame(op: int, block: int, step: int) -> bytes:
    return _HDR.pack(op, block, step).ljust(HEADER_SIZE, b"\0")


def _recv(s: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        r = s.recv_into(view[got:], len(view) - got, socket.MSG_WAITALL)
        if r == 0:
            raise EOFError
        got += r


def _lane(buf: mmap.mmap, server: int, shard: int) -> np.ndarray:
    """The part of a client's shared area (``shm``) that holds server ``server``'s shard, as float32."""
    return np.frombuffer(buf, np.float32, shard // 4, server * shard)


def _server(ports, trainers: int, n_blocks: int, block: int, done, index: int = 0,
            lanes: Optional[List[Tuple[mmap.mmap, mmap.mmap]]] = None) -> None:
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(trainers)
    ports.put((index, ls.getsockname()[1]))
    conns = []
    for _ in range(trainers):  # each client says which it is (its shared areas)
        c = ls.accept()[0]
        who = bytearray(1)
        _recv(c, memoryview(who))
        conns.append((c, who[0]))
    elems, seg = block // 4, SEGMENT // 4
    shared = [(_lane(gb, index, n_blocks * block), _lane(vb, index, n_blocks * block)) for gb, vb in lanes or []]
    param = [np.zeros(elems, np.float32) for _ in range(n_blocks)]
    acc = [np.zeros(elems, np.float32) for _ in range(n_blocks)]
    seen = [[0] * -(-elems // seg) for _ in range(n_blocks)]  # contributions to each segment this step
    applied = [0] * n_blocks  # steps applied to each block
    left = [len(s) for s in seen]  # segments of the block's current step still to apply
    cv = threading.Condition()

    def serve(c: socket.socket, j: int) -> None:
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        hdr = memoryview(bytearray(HEADER_SIZE))
        g = np.empty(seg, np.float32)
        sg, sv = shared[j] if shared else (None, None)
        ok = _frame(0, 0, 0)
        while True:
            try:
                _recv(c, hdr)
            except (EOFError, OSError):
                return
            op, k, step = _HDR.unpack_from(hdr)
            if op == PUSH:
                for i, lo in enumerate(range(0, elems, seg)):
                    n = min(seg, elems - lo)
                    if sg is None:
                        _recv(c, memoryview(g[:n]).cast("B"))
                    else:  # the gradient is already in the shared area (the client's copy; SGD may overwrite it)
                        g = sg[k * elems + lo:k * elems + lo + n]
                    with cv:
                        a, p = acc[k][lo:lo + n], param[k][lo:lo + n]
                        if seen[k][i] + 1 == trainers:  # the last one: sum, average, apply
                            sgd(p, g[:n], LR, plus=a if trainers > 1 else None, n=trainers)
                            seen[k][i], left[k] = 0, left[k] - 1
                            if not left[k]:
                                applied[k], left[k] = applied[k] + 1, len(seen[k])
                                cv.notify_all()
                        else:
                            if seen[k][i]:
                                a += g[:n]
                            else:
                                a[:] = g[:n]
                            seen[k][i] += 1
                c.sendall(ok)
            else:
                with cv:
                    while applied[k] < step:
                        cv.wait()
                if sv is not None:
                    np.copyto(sv[k * elems:(k + 1) * elems], param[k])
                    c.sendall(_frame(0, k, step))
                    continue
                v = memoryview(param[k]).cast("B")
                c.sendall(_frame(0, k, step))
                for lo in range(0, len(v), SEGMENT):
                    c.sendall(v[lo:lo + SEGMENT])

    th = [threading.Thread(target=serve, args=c, daemon=True) for c in conns]
    for t in th:
        t.start()
    done.wait()


def _client(ports: List[int], n_blocks: int, block: int, steps: int, barrier, done, bad, index: int = 0,
            lane: Optional[Tuple[mmap.mmap, mmap.mmap]] = None) -> None:
    socks = [socket.create_connection(("127.0.0.1", p)) for p in ports]
    for s in socks:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.sendall(bytes([index]))
    shard = n_blocks * block
    grad = np.ones(shard // 4, np.float32)
    if lane is None:
        values = [np.zeros(shard // 4, np.float32) for _ in socks]
    else:  # the servers copy the values straight into the shared area: the client's receive buffers
        values = [_lane(lane[1], j, shard) for j in range(len(socks))]
    gview = memoryview(grad).cast("B")

    def one(j: int, step: int) -> None:
        s, out = socks[j], memoryview(values[j]).cast("B")
        stage = None if lane is None else _lane(lane[0], j, shard)

        def replies() -> None:
            h = memoryview(bytearray(HEADER_SIZE))
            for k in range(n_blocks):
                _recv(s, h)  # OK to the push
                _recv(s, h)  # the pull's header
                if lane is None:
                    _recv(s, out[k * block:(k + 1) * block])

        r = threading.Thread(target=replies)
        r.start()
        for k in range(n_blocks):
            if stage is None:
                s.sendmsg([_frame(PUSH, k, step), gview[k * block:(k + 1) * block]])
            else:
                lo, hi = k * block // 4, (k + 1) * block // 4
                np.copyto(stage[lo:hi], grad[lo:hi])
                s.sendall(_frame(PUSH, k, step))
            s.sendall(_frame(PULL, k, step + 1))
        r.join()

    for step in range(steps):
        barrier.wait()
        th = [threading.Thread(target=one, args=(j, step)) for j in range(1, len(socks))]
        for t in th:
            t.start()
        one(0, step)
        for t in th:
            t.join()
    if any(not np.all(v == np.float32(-LR * steps)) for v in values):
        bad.value += 1
    barrier.wait()
    done.wait()
    for s in socks:
        s.close()


def measure(trainers: int, size: int, reps: int, block: int = 4 << 20, servers: int = 2, warmup: int = 2,
            shm: bool = False) -> Tuple[Stats, bool, Cpu]:
    """Step times of ``trainers`` plain-socket clients on ``servers`` plain-socket servers (module doc; ``shm``:
    the arrays through shared memory); the check passed; the CPU of every client and server over the timed
    steps."""
    block = min(block, size // servers)
    n_blocks = size // servers // block
    # Anonymous shared mappings, inherited by the forked processes: nothing is left behind however they end.
    lanes = [(mmap.mmap(-1, size), mmap.mmap(-1, size)) for _ in range(trainers)] if shm else None
    steps = warmup + reps
    done, bad = _CTX.Event(), _CTX.Value("i", 0)
    port_q = _CTX.Queue()
    procs: List[mp.Process] = []
    try:
        for k in range(servers):
            procs.append(_CTX.Process(target=_server, args=(port_q, trainers, n_blocks, block, done, k, lanes),
                                      daemon=True))
            procs[-1].start()
        ports = [p for _, p in sorted(port_q.get(timeout=20) for _ in range(servers))]  # server k's port k
        barrier = _CTX.Barrier(trainers + 1)
        for i in range(trainers):
            procs.append(_CTX.Process(target=_client, args=(ports, n_blocks, block, steps, barrier, done, bad, i,
                                                            lanes[i] if lanes else None), daemon=True))
            procs[-1].start()
        names = {p.pid: f"{'server' if i < servers else 'client'} {i % servers if i < servers else i - servers}"
                 for i, p in enumerate(procs)}
        meter = Meter(lambda: names)
        times: List[float] = []
        t0 = 0.0
        for i in range(steps + 1):  # each wait starts a step; the last one ends the last step
            barrier.wait(timeout=120)
            now = time.perf_counter()
            if i == warmup:
                meter.start()
            elif i > warmup:
                times.append(now - t0)
            t0 = now
        cpu = meter.stop(reps)
        done.set()
        for p in procs:
            p.join(30)
        ok = bad.value == 0 and all(p.exitcode == 0 for p in procs)
    finally:
        done.set()
        for p in procs:
            if p.is_alive():
                p.kill()
    cpu.procs.pop("driver", None)
    cpu.seconds = sum(cpu.procs.values())
    return Stats(times), ok, cpu
