"""The same-host lane's setup (docs/architecture.md, "The same-host lane"), on a real pserver process.

A trainer on the pserver's node gets a lane: one memfd mapped by both processes. Refused, with the reason, and
the connection left on TCP: an offer under another key, a nonce nobody offered, another user at either end, a
pserver with no lane socket on this node (another host or network namespace).
"""

from __future__ import annotations

import os
import signal
import sys

import numpy as np
import pytest
import rt_helpers as H
from rt_helpers import trainer_env

from paddle_cluster.contract import derive_trainer_key
from paddle_cluster.ps import OptimizerSpec, connect
from paddle_cluster.ps.channel import Channel
from paddle_cluster.ps.wire import lane as L

NOBODY = 65534
W = np.ones(1000, np.float32)


@pytest.fixture
def served(tmp_path):
    """One pserver process and trainer 0 of a 1-trainer job, on this node."""
    env = H.make_env(1, 1, tmp_path)
    with H.procs(tmp_path) as pr:
        server = pr.pserver(env, 0)
        ps = connect(mode="sync", optimizer=OptimizerSpec("sgd", lr=0.5), env=trainer_env(env, 0))
        ps.register_dense({"w": W})
        try:
            yield env, pr, server, ps
        finally:
            ps.close()


def _maps_lane(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return "memfd:paddle-cluster-lane" in f.read()


def _still_trains(ps) -> None:
    """The connection still serves dense traffic over TCP, with the values SGD makes."""
    step = ps.step
    out = ps.push_pull({"w": np.ones_like(W)})
    assert np.array_equal(out["w"], np.full_like(W, 1 - 0.5 * (step + 1)))


def test_same_host_trainer_gets_a_lane_both_processes_map(served):
    env, pr, server, ps = served
    ch = ps._ctl(0)
    assert not _maps_lane(server.pid)
    assert ch.submit(Channel.open_lane, 1 << 20).result(timeout=10) is None
    assert ch.lane is not None and ch.lane.size == 1 << 20
    assert _maps_lane(os.getpid()) and _maps_lane(server.pid)
    _still_trains(ps)
    ps.close()
    ch.lane = None  # closed with the channel
    assert not _maps_lane(os.getpid())


def test_offer_under_another_key_is_refused_and_tcp_stays(served):
    env, pr, server, ps = served
    port = env.all_ports(0)[0]
    wrong = derive_trainer_key("another job secret of enough length, 32+", env.job_id, 0)
    with pytest.raises(L.LaneRefused, match="MAC is wrong"):
        L.offer(env.job_id, wrong, 0, 0, port, 1 << 16)
    assert "refused a lane: trainer 0: the offer's MAC is wrong" in pr.log(server)
    # A LANE frame with a nonce nobody offered binds nothing.
    ch = ps._ctl(0)
    ch._lane_of = (env.job_id, wrong, 0, 0, port)
    assert "MAC is wrong" in ch.submit(Channel.open_lane, 1 << 16).result(timeout=10)
    assert ch.lane is None and not _maps_lane(server.pid)
    _still_trains(ps)


def test_no_lane_socket_on_this_node_means_tcp(served):
    env, pr, server, ps = served
    with pytest.raises(L.LaneRefused, match="no lane socket on this node"):
        L.offer(env.job_id, env.key_of(0), 1, 0, env.all_ports(0)[0], 1 << 16)  # pserver 1: not here


def _as_nobody_in_child(fn):
    """Fork a child that runs ``fn`` as user nobody: its pid and a file of the line ``fn`` returns."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 0
        try:
            os.close(r)
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            os.write(w, (fn() + "\n").encode())
        except BaseException as e:  # noqa: BLE001 - told to the parent
            os.write(w, f"error {e!r}\n".encode())
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    return pid, os.fdopen(r)


@pytest.mark.skipif(os.geteuid() != 0 or sys.platform != "linux", reason="needs root to become another user")
def test_another_user_cannot_offer_a_lane(served):
    env, pr, server, ps = served

    def offer() -> str:
        """What ``L.offer`` sends, without its own check of the listener's user (which would stop it first)."""
        import socket

        fd = os.memfd_create("x", os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, 1 << 16)
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
            s.connect(L.socket_name(env.job_id, 0, env.all_ports(0)[0]))
            socket.send_fds(s, [bytes(L._OFFER.size)], [fd])
            return s.recv(512).decode()

    pid, out = _as_nobody_in_child(offer)
    assert out.readline() == "another user\n"
    os.waitpid(pid, 0)
    assert f"refused a lane from uid {NOBODY}" in pr.log(server)
    _still_trains(ps)


@pytest.mark.skipif(os.geteuid() != 0 or sys.platform != "linux", reason="needs root to become another user")
def test_trainer_refuses_a_lane_socket_of_another_user(tmp_path):
    env = H.make_env(1, 1, tmp_path)
    port = env.all_ports(0)[0]

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(r)
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            L.Desk(env.job_id, 0, port, env.key_of, 1, 1 << 20).start()
            os.write(w, b"listening\n")
            signal.pause()
        finally:
            os._exit(0)
    os.close(w)
    try:
        assert os.fdopen(r).readline() == "listening\n"
        with pytest.raises(L.LaneRefused, match=f"belongs to uid {NOBODY}, not this user"):
            L.offer(env.job_id, env.key_of(0), 0, 0, port, 1 << 16)
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
