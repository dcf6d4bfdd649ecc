"""The wire is authenticated and robust: no secret, no access; replays fail; the pserver must prove itself
too; a stream of malformed frames (property-based) never crashes the pserver or changes a parameter."""

from __future__ import annotations

import os
import socket
import struct
import threading

import numpy as np
import pytest
import rt_helpers as H
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paddle_cluster.contract import TRAINER
from paddle_cluster.ps import AuthError, OptimizerSpec, connect
from paddle_cluster.ps import protocol as P

MAX_FRAME = 64 * 1024
W = np.linspace(-1, 1, 1000, dtype=np.float32)
W_BYTES = W.nbytes
ROW_BYTES = 4 * 4  # sparse table width 4, float32
DATA_OPS = [P.Op.PUSH_DENSE, P.Op.PULL_DENSE, P.Op.INIT_DENSE, P.Op.PUSH_SPARSE, P.Op.PULL_SPARSE]
JSON_OPS = [P.Op.DECLARE, P.Op.DEF_DENSE, P.Op.DEF_SPARSE, P.Op.SET_HYPER]


@pytest.fixture
def served(tmp_path):
    """One pserver process (small frame cap, short barrier timeout) and a legitimate trainer 0."""
    env = H.make_env(1, 1, tmp_path, barrier_timeout=2.0)
    with H.procs(tmp_path) as pr:
        server = pr.pserver(env, 0, {"PADDLE_MAX_FRAME_BYTES": str(MAX_FRAME)})
        ps = connect(mode="sync", optimizer=OptimizerSpec("sgd", lr=1.0), env=env.for_process(TRAINER, 0, "127.0.0.1"))
        ps.register_dense({"w": W})
        ps.register_sparse("emb", 4, init_scale=0.5, seed=1)
        ps.pull_sparse("emb", [1, 2, 3])
        try:
            yield env, pr, server, ps
        finally:
            ps.close()


def _addr(env):
    return env.pservers[0].host, env.dense_ports(0)[0]


def _recv_all(s: socket.socket) -> bytes:
    chunks = []
    while True:
        try:
            b = s.recv(65536)
        except ConnectionResetError:
            break
        if not b:
            break
        chunks.append(b)
    return b"".join(chunks)


def _exchange(env, frame: bytes, authed: bool) -> bytes:
    """Open a connection (authenticated or not), send ``frame``, half-close, return all the pserver sent
    back after the handshake; the pserver must close the connection (5 s socket timeout)."""
    s = socket.create_connection(_addr(env), timeout=5)
    try:
        if authed:
            P.client_handshake(s, env.secret, env.job_id, 0)
        else:
            P.recv_exact(s, P.HEADER_SIZE + P.NONCE_SIZE)  # the challenge
        try:
            s.sendall(frame)
            s.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the pserver already dropped us
        return _recv_all(s)
    finally:
        s.close()


def _ops(data: bytes):
    ops = []
    while len(data) >= P.HEADER_SIZE:
        h = P.unpack_header(data[: P.HEADER_SIZE])
        ops.append(h.op)
        data = data[P.HEADER_SIZE + h.length:]
    return ops


def _assert_still_serving(ps, server, before):
    assert server.poll() is None
    now = ps.pull()
    np.testing.assert_array_equal(now["w"], before)
    step = ps.step
    ps.push({"w": np.ones_like(W)})
    np.testing.assert_allclose(ps.pull()["w"], before - 1.0)
    assert ps.step == step + 1


@pytest.mark.timeout(60)
def test_wrong_secret_cannot_connect_and_unauthenticated_frames_are_ignored(served):
    env, pr, server, ps = served
    before = ps.pull()["w"].copy()
    import dataclasses

    bad = dataclasses.replace(env, secret="not-the-secret")
    with pytest.raises(AuthError, match="refused our answer"):
        connect(mode="sync", env=bad.for_process(TRAINER, 0, "127.0.0.1"), connect_timeout=5)
    # Skipping authentication: a pull gets nothing back, a well-formed push changes nothing.
    assert _exchange(env, P.pack_header(P.Op.PULL_DENSE, P.dtype_code(np.float32), key=0, step=ps.step), False) == b""
    push = P.pack_header(P.Op.PUSH_DENSE, P.dtype_code(np.float32), key=0, step=ps.step, length=W_BYTES)
    assert _exchange(env, push + np.full_like(W, 100.0).tobytes(), False) == b""
    _assert_still_serving(ps, server, before)
    assert "authentication failed" in pr.log(server)


@pytest.mark.timeout(60)
def test_replayed_answer_is_refused_and_server_must_prove_itself(served):
    env, pr, server, ps = served
    # Record a genuine handshake's answer ...
    s = socket.create_connection(_addr(env), timeout=5)
    sent = []
    real_send = P.send_frame

    def spy(sock, header, *payload):
        sent.append(header + b"".join(bytes(p) for p in payload))
        real_send(sock, header, *payload)

    P.send_frame = spy
    try:
        P.client_handshake(s, env.secret, env.job_id, 0)
    finally:
        P.send_frame = real_send
        s.close()
    answer = sent[0]
    assert len(answer) == P.HEADER_SIZE + P.MAC_SIZE + P.NONCE_SIZE
    assert env.secret.encode() not in answer  # the secret itself never travels
    # ... and replay it on a new connection: the nonce is fresh, so it fails and nothing comes back.
    assert _exchange(env, answer, False) == b""
    assert "wrong answer to the challenge" in pr.log(server)

    # Mutual: a fake pserver that does not know the secret cannot pass itself off as one.
    a, b = socket.socketpair()

    def fake_server():
        P.send_frame(b, P.pack_header(P.Op.AUTH_CHALLENGE, length=P.NONCE_SIZE), os.urandom(P.NONCE_SIZE))
        P.recv_exact(b, P.HEADER_SIZE + P.MAC_SIZE + P.NONCE_SIZE)
        P.send_frame(b, P.pack_header(P.Op.AUTH_OK, length=P.MAC_SIZE), os.urandom(P.MAC_SIZE))

    t = threading.Thread(target=fake_server)
    t.start()
    with pytest.raises(AuthError, match="failed to prove"):
        P.client_handshake(a, env.secret, env.job_id, 0)
    t.join()
    a.close()
    b.close()


def _expected_len(op: int, aux: int) -> int:
    return {P.Op.PUSH_DENSE: W_BYTES, P.Op.INIT_DENSE: W_BYTES, P.Op.PULL_DENSE: 0,
            P.Op.PUSH_SPARSE: aux * (8 + ROW_BYTES), P.Op.PULL_SPARSE: aux * 8}[op]


@st.composite
def frames(draw, authed: bool):
    kinds = ["garbage", "bad_magic", "bad_version", "unknown_key", "bad_length", "bad_op", "bad_json", "oversize"]
    if not authed:
        kinds += ["valid_push", "fake_auth"]
    kind = draw(st.sampled_from(kinds))
    if kind == "garbage":
        return draw(st.binary(min_size=1, max_size=100).filter(lambda b: b[:4] != P.MAGIC))
    magic, version = P.MAGIC, P.VERSION
    op = draw(st.sampled_from(DATA_OPS))
    dtype = draw(st.sampled_from([0, 1, 2, 3, 6, 255]))
    trainer = draw(st.integers(-(2**15), 2**15 - 1))
    key = draw(st.sampled_from([0, 1]))
    step = draw(st.integers(-(2**63), 2**63 - 1))
    aux = draw(st.one_of(st.integers(0, 16), st.integers(0, 2**64 - 1)))
    length = draw(st.one_of(st.integers(0, 300), st.integers(0, 2**64 - 1)))
    payload = draw(st.binary(max_size=300))
    if kind == "bad_magic":
        magic = draw(st.binary(min_size=4, max_size=4).filter(lambda m: m != P.MAGIC))
    elif kind == "bad_version":
        version = draw(st.integers(0, 2**16 - 1).filter(lambda v: v != P.VERSION))
    elif kind == "unknown_key":
        key = draw(st.integers(1000, 2**32 - 1))
    elif kind == "bad_length":
        length = draw(st.integers(0, 3 * W_BYTES).filter(lambda n: n != _expected_len(op, aux)))
    elif kind == "bad_op":
        op = draw(st.integers(0, 255).filter(lambda o: o not in P.REQUEST_OPS))
    elif kind == "bad_json":
        op = draw(st.sampled_from(JSON_OPS))
        length = len(payload)
    elif kind == "oversize":
        length = draw(st.integers(MAX_FRAME + 1, 2**64 - 1))
    elif kind == "valid_push":
        op, key, dtype, length = P.Op.PUSH_DENSE, 0, P.dtype_code(np.float32), W_BYTES
        payload = np.full(W.shape, 1e6, np.float32).tobytes()
        step = draw(st.integers(0, 10))
    elif kind == "fake_auth":
        op, length, trainer = P.Op.AUTH_RESPONSE, P.MAC_SIZE + P.NONCE_SIZE, 0
        payload = draw(st.binary(min_size=length, max_size=length))
    cut = draw(st.integers(0, len(payload)))  # truncation
    header = struct.pack("<4sHBBHhIqQQ", magic, version, op, dtype, 0, trainer, key, step, length, aux)
    return header + payload[:cut]


@pytest.mark.timeout(150)
def test_malformed_frames_never_crash_or_change_anything(served):
    env, pr, server, ps = served
    before = ps.pull()["w"].copy()
    rows_before = ps.pull_sparse("emb", [1, 2, 3]).copy()

    @settings(max_examples=100, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(frame=frames(authed=False))
    def unauthenticated(frame):
        assert _exchange(env, frame, False) == b""  # not one byte besides the challenge

    @settings(max_examples=100, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(frame=frames(authed=True))
    def authenticated(frame):
        # A trainer that sends garbage gets at most an ERROR frame, then loses its connection.
        assert set(_ops(_exchange(env, frame, True))) <= {P.Op.ERROR}

    unauthenticated()
    authenticated()
    assert server.poll() is None
    np.testing.assert_array_equal(ps.pull_sparse("emb", [1, 2, 3]), rows_before)
    _assert_still_serving(ps, server, before)
    log = pr.log(server)
    assert "exceeds the 65536-byte cap" in log and "bad magic" in log and "unsupported protocol version" in log
    assert "Traceback" not in log
