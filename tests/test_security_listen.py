"""A pserver that cannot be made deaf, on real processes: out of descriptors (a real RLIMIT_NOFILE) it backs
off and accepts again; a peer that trickles its handshake is cut at the one deadline; a flood of idle
connections holds no handshake slot (the oldest idle one goes for each new one), the job going on and a starting
job getting in; evictions are logged at a bounded rate."""

from __future__ import annotations

import os
import resource
import socket

import numpy as np
import pytest
import rt_helpers as H
from helpers import wait_for
from rt_helpers import trainer_env

from paddle_cluster.ps import OptimizerSpec, connect
from paddle_cluster.ps.wire import auth as A
from paddle_cluster.ps.wire import protocol as P


def _addr(env):
    return env.pservers[0].host, env.dense_ports(0)[0]


def _threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.timeout(120)
def test_pserver_keeps_accepting_after_running_out_of_descriptors(tmp_path):
    """test_pserver_keeps_accepting_after_running_out_of_descriptors: ``ulimit -n`` low, then idle peers take
    every descriptor; accept fails with EMFILE, is retried, and a trainer gets in once they are gone."""
    env = H.make_env(1, 1, tmp_path)
    limit = 40

    def low_nofile():
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

    with H.procs(tmp_path) as pr:
        server = pr.pserver(env, 0, {"PADDLE_MAX_CONNECTIONS": "1000"}, preexec_fn=low_nofile)
        idle = []
        try:
            for _ in range(limit + 10):  # the last ones wait in the backlog: the pserver has no descriptor left
                idle.append(socket.create_connection(_addr(env), timeout=5))
            wait_for(lambda: "Too many open files" in pr.log(server), 20, "accept to fail with EMFILE")
            assert server.poll() is None
        finally:
            for s in idle:
                s.close()
        # The idle peers are gone: the pserver accepts again, and a trainer trains.
        out = tmp_path / "out.npz"
        tr = pr.trainer(env, 0, "ones", str(out), steps=3, n=1024, block=4096)
        assert H.wait_all(pr, [tr, server], 60) == [0, 0], pr.log(tr) + pr.log(server)
        np.testing.assert_array_equal(np.load(out)["w0"], -1.5)
        log = pr.log(server)
        assert sum("accept on port" in line for line in log.splitlines()) <= 3, log  # rate-limited
        assert "Traceback" not in log


@pytest.mark.timeout(60)
def test_slow_loris_handshake_is_cut_at_one_deadline(tmp_path):
    """A peer that answers the challenge one byte every 2 s (each recv well inside any per-read timeout) is
    dropped once the whole handshake has taken HANDSHAKE_TIMEOUT."""
    env = H.make_env(1, 1, tmp_path)
    with H.procs(tmp_path) as pr:
        server = pr.pserver(env, 0)
        s = socket.create_connection(_addr(env), timeout=5)
        P.recv_into(s, memoryview(bytearray(P.HEADER_SIZE + A.NONCE_SIZE)))
        answer = P.pack_header(P.Op.AUTH_RESPONSE, trainer=0, length=A.MAC_SIZE + A.NONCE_SIZE) + bytes(64)
        closed, sent = False, 0
        for byte in answer:  # 104 bytes at one per 2 s would take 208 s: the pserver must cut it short
            try:
                s.sendall(bytes([byte]))
                sent += 1
                s.settimeout(2.0)
                if s.recv(1) == b"":
                    closed = True
                    break
            except socket.timeout:
                continue
            except OSError:
                closed = True
                break
        s.close()
        assert closed and sent < len(answer)
        assert f"handshake not completed within {A.HANDSHAKE_TIMEOUT:g} s" in pr.log(server)
        ps = connect(mode="sync", optimizer=OptimizerSpec("sgd", lr=0.5), env=trainer_env(env, 0))
        ps.register_dense({"w": np.zeros(4, np.float32)})
        ps.close()
        assert H.wait_all(pr, [server], 10) == [0]


def _flood(endpoints, n: int) -> list:
    """``n`` idle TCP connections (never a byte sent) to each endpoint."""
    out = []
    for addr in endpoints:
        for _ in range(n):
            out.append(socket.create_connection(addr, timeout=5))
    return out


def _closed_by_peer(s: socket.socket) -> bool:
    """Whether the pserver closed ``s`` (its challenge, if any, read first)."""
    s.settimeout(0)
    try:
        while True:
            if not s.recv(1 << 16):
                return True
    except BlockingIOError:
        return False
    except OSError:
        return True


@pytest.mark.timeout(90)
def test_idle_connection_flood_evicts_the_oldest_and_the_job_goes_on(tmp_path):
    """300 idle connections against a running job: at most 64 wait in a handshake (one thread each), each new one
    taking the place of the oldest idle one, which is closed; the trainer keeps training; evictions are logged a
    few times, not 236."""
    env = H.make_env(1, 1, tmp_path)
    with H.procs(tmp_path) as pr:
        server = pr.pserver(env, 0)
        ps = connect(mode="sync", optimizer=OptimizerSpec("sgd", lr=0.5), env=trainer_env(env, 0))
        ps.register_dense({"w": np.zeros(4, np.float32)})
        base_threads = _threads(server.pid)
        flood = _flood([_addr(env)], 300)
        try:
            wait_for(lambda: sum(_closed_by_peer(s) for s in flood[:236]) == 236, 20,
                     "the pserver to close the 236 oldest idle connections")
            assert not any(_closed_by_peer(s) for s in flood[-60:])  # the newest wait their turn
            assert _threads(server.pid) <= base_threads + 2 * 64
            for _ in range(3):  # the job is unaffected
                ps.pull()
                ps.push({"w": np.ones(4, np.float32)})
            np.testing.assert_allclose(ps.pull()["w"], -1.5)
        finally:
            for s in flood:
                s.close()
        wait_for(lambda: _fds(server.pid) < 20, 20, "the pserver to close the flood's connections")
        st = connect(mode="sync", optimizer=OptimizerSpec("sgd", lr=0.5), env=trainer_env(env, 0))
        st.close()
        ps.close()
        assert H.wait_all(pr, [server], 10) == [0]
        said = [line for line in pr.log(server).splitlines() if "dropped the connection from" in line]
        assert 1 <= len(said) <= 3 and "(the oldest goes)" in said[0], said


@pytest.mark.timeout(120)
def test_idle_strangers_on_every_endpoint_leave_a_starting_job_untouched(tmp_path):
    """200 idle connections (no secret, never a byte) to every port of both pservers before the job's trainers
    connect: each trainer's handshakes take the place of the oldest strangers (or are tried again), and the job
    trains to the exact result."""
    env = H.make_env(2, 2, tmp_path, ports_num=2)
    with H.procs(tmp_path) as pr:
        servers = [pr.pserver(env, k) for k in range(2)]
        flood = _flood([(env.pservers[k].host, p) for k in range(2) for p in env.all_ports(k)], 200)
        try:
            outs = [tmp_path / f"out{i}.npz" for i in range(2)]
            trainers = [pr.trainer(env, i, "ones", str(outs[i]), steps=3, n=1024, block=4096) for i in range(2)]
            assert H.wait_all(pr, trainers, 60) == [0, 0], "".join(pr.log(t) for t in trainers)
        finally:
            for s in flood:
                s.close()
        assert H.wait_all(pr, servers, 10) == [0, 0]
        for out in outs:
            np.testing.assert_array_equal(np.load(out)["w0"], -1.5)  # 3 sync steps of the mean gradient 1 at lr 0.5
