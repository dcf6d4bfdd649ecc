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
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import struct
import threading
import time
from typing import List, Tuple

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


def _server(ports, trainers: int, n_blocks: int, block: int, done) -> None:
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(trainers)
    ports.put(ls.getsockname()[1])
    conns = [ls.accept()[0] for _ in range(trainers)]
    elems, seg = block // 4, SEGMENT // 4
    param = [np.zeros(elems, np.float32) for _ in range(n_blocks)]
    acc = [np.zeros(elems, np.float32) for _ in range(n_blocks)]
    seen = [[0] * -(-elems // seg) for _ in range(n_blocks)]  # contributions to each segment this step
    applied = [0] * n_blocks  # steps applied to each block
    left = [len(s) for s in seen]  # segments of the block's current step still to apply
    cv = threading.Condition()

    def serve(c: socket.socket) -> None:
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        hdr = memoryview(bytearray(HEADER_SIZE))
        g = np.empty(seg, np.float32)
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
                    _recv(c, memoryview(g[:n]).cast("B"))
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
                v = memoryview(param[k]).cast("B")
                c.sendall(_frame(0, k, step))
                for lo in range(0, len(v), SEGMENT):
                    c.sendall(v[lo:lo + SEGMENT])

    th = [threading.Thread(target=serve, args=(c,), daemon=True) for c in conns]
    for t in th:
        t.start()
    done.wait()


def _client(ports: List[int], n_blocks: int, block: int, steps: int, barrier, done, bad) -> None:
    socks = [socket.create_connection(("127.0.0.1", p)) for p in ports]
    for s in socks:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    grad = memoryview(np.ones(n_blocks * block // 4, np.float32)).cast("B")
    values = [np.zeros(n_blocks * block // 4, np.float32) for _ in socks]

    def one(j: int, step: int) -> None:
        s, out = socks[j], memoryview(values[j]).cast("B")

        def replies() -> None:
            h = memoryview(bytearray(HEADER_SIZE))
            for k in range(n_blocks):
                _recv(s, h)  # OK to the push
                _recv(s, h)  # the pull's header
                _recv(s, out[k * block:(k + 1) * block])

        r = threading.Thread(target=replies)
        r.start()
        for k in range(n_blocks):
            s.sendmsg([_frame(PUSH, k, step), grad[k * block:(k + 1) * block]])
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


def measure(trainers: int, size: int, reps: int, block: int = 4 << 20, servers: int = 2, warmup: int = 2
            ) -> Tuple[Stats, bool, Cpu]:
    """Step times of ``trainers`` plain-socket clients on ``servers`` plain-socket servers (module doc); the
    check passed; the CPU of every client and server over the timed steps."""
    block = min(block, size // servers)
    n_blocks = size // servers // block
    steps = warmup + reps
    done, bad = _CTX.Event(), _CTX.Value("i", 0)
    port_q = _CTX.Queue()
    procs: List[mp.Process] = []
    try:
        for _ in range(servers):
            procs.append(_CTX.Process(target=_server, args=(port_q, trainers, n_blocks, block, done), daemon=True))
            procs[-1].start()
        ports = [port_q.get(timeout=20) for _ in range(servers)]
        barrier = _CTX.Barrier(trainers + 1)
        for _ in range(trainers):
            procs.append(_CTX.Process(target=_client, args=(ports, n_blocks, block, steps, barrier, done, bad),
                                      daemon=True))
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
