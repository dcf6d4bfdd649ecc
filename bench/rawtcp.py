"""The limit: raw TCP with plain Python sockets (``sendall`` / ``recv_into`` a preallocated buffer).

``streams`` sender processes each send ``reps`` messages of ``size`` bytes to their own receiver
process, which acknowledges every complete message with one byte. A repetition's aggregate rate is
``streams * size`` over the time from the first send starting to the last acknowledgement arriving.
The check: each receiver verifies the first and last 8 bytes of every message (a per-message counter).
Each process also records its own CPU time over the timed messages (``cpu``), sender 0 the machine's.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import struct
import time
from typing import List, Optional, Tuple

import numpy as np

from .common import Stats, enter_netns
from .cpu import Cpu, machine_cpu, run_delay

_CTX = mp.get_context("fork")


def _receiver(host: str, port_q, size: int, total: int, netns: Optional[str], bad, cpu, wait, slot: int,
              warmup: int) -> None:
    if netns:
        enter_netns(netns)
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind((host, 0))
    ls.listen(1)
    port_q.put(ls.getsockname()[1])
    s, _ = ls.accept()
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray(size)
    view = memoryview(buf)
    for i in range(total):
        if i == warmup:  # blocked until the message comes: what it spent so far is the warm-up's
            cpu[slot], wait[slot] = time.process_time(), run_delay(os.getpid())
        got = 0
        while got < size:
            r = s.recv_into(view[got:], size - got)
            if r == 0:
                return
            got += r
        if struct.unpack_from("<q", buf, 0)[0] != i or struct.unpack_from("<q", buf, size - 8)[0] != i:
            bad.value += 1
        s.sendall(b"k")
    cpu[slot + 1], wait[slot + 1] = time.process_time(), run_delay(os.getpid())
    s.close()


def _sender(host: str, port: int, size: int, total: int, barrier, times, slot: int, netns: Optional[str], cpu,
            wait, cslot: int, warmup: int) -> None:
    if netns:
        enter_netns(netns)
    s = socket.create_connection((host, port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = np.zeros(size, dtype=np.uint8)
    view = memoryview(buf)
    ack = bytearray(1)
    for i in range(total):
        struct.pack_into("<q", buf, 0, i)
        struct.pack_into("<q", buf, size - 8, i)
        barrier.wait()
        if i == warmup:
            cpu[cslot], wait[cslot] = time.process_time(), run_delay(os.getpid())
            if slot == 0:
                cpu[-2] = machine_cpu()
        t0 = time.perf_counter()
        s.sendall(view)
        s.recv_into(ack, 1)
        t1 = time.perf_counter()
        times[2 * (slot * total + i)] = t0
        times[2 * (slot * total + i) + 1] = t1
    cpu[cslot + 1], wait[cslot + 1] = time.process_time(), run_delay(os.getpid())
    barrier.wait()
    if slot == 0:  # the machine's CPU once every stream is done
        cpu[-1] = machine_cpu()
    s.close()


def measure(streams: int, size: int, reps: int, warmup: int = 1, host: str = "127.0.0.1",
            recv_ns: Optional[str] = None, send_ns: Optional[str] = None) -> Tuple[Stats, bool, Cpu]:
    """Aggregate bytes/s of ``streams`` parallel streams; returns (stats of rates, check passed, the CPU of
    every sender and receiver over the timed messages)."""
    total = warmup + reps
    bad = _CTX.Value("i", 0)
    times = _CTX.Array("d", 2 * streams * total, lock=False)
    barrier = _CTX.Barrier(streams)
    cpu = _CTX.Array("d", 4 * streams + 2, lock=False)  # start, end per process; the machine's at the end
    wait = _CTX.Array("d", 4 * streams, lock=False)  # run-queue wait so far, at the same points
    procs: List[mp.Process] = []
    try:
        ports = []
        for k in range(streams):
            q = _CTX.Queue()
            p = _CTX.Process(target=_receiver, args=(host, q, size, total, recv_ns, bad, cpu, wait, 2 * k, warmup),
                             daemon=True)
            p.start()
            procs.append(p)
            ports.append(q.get(timeout=20))
        for k in range(streams):
            p = _CTX.Process(target=_sender, args=(host, ports[k], size, total, barrier, times, k, send_ns, cpu,
                                                                wait, 2 * (streams + k), warmup),
                             daemon=True)
            p.start()
            procs.append(p)
        for p in procs:
            p.join(600)
        ok = all(p.exitcode == 0 for p in procs) and bad.value == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    rates = []
    for i in range(warmup, total):
        t0 = min(times[2 * (k * total + i)] for k in range(streams))
        t1 = max(times[2 * (k * total + i) + 1] for k in range(streams))
        rates.append(streams * size / (t1 - t0))
    wall = sum(streams * size / r for r in rates)
    procs = {f"{'receiver' if j < streams else 'sender'} {j % streams}": cpu[2 * j + 1] - cpu[2 * j]
             for j in range(2 * streams)}
    waited = sum(wait[2 * j + 1] - wait[2 * j] for j in range(2 * streams))
    return Stats(rates), ok, Cpu(sum(procs.values()), wall, reps, cpu[-1] - cpu[-2], procs, waited)
