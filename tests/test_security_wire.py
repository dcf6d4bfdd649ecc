"""The wire is authenticated end to end, on real processes.

Handshake: no key, no access; a recorded answer fails on a new connection; the pserver must prove itself too.
Frames: an on-path relay process (tests/relay.py) that knows no key flips gradient bytes, injects SET_HYPER
and SAVE, replays, reorders, reflects and splices frames across pservers -- each is detected at the first
tag, the connection dropped with one log line naming the peer, the trainer fails naming the cause, and the
pserver's state is what the honest frames made it. A stream of malformed frames (property-based) never
crashes the pserver or changes a parameter.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import threading

import numpy as np
import pytest
import rt_helpers as H
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rt_helpers import trainer_env

from paddle_cluster.contract import Endpoint
from paddle_cluster.ps import AuthError, OptimizerSpec, connect
from paddle_cluster.ps.errors import IntegrityError, PSError
from paddle_cluster.ps.wire import auth as A
from paddle_cluster.ps.wire import protocol as P
from paddle_cluster.ps.wire.stream import Stream

MAX_FRAME = 64 * 1024
W = np.linspace(-1, 1, 1000, dtype=np.float32)
W_BYTES = W.nbytes
ROW_BYTES = 4 * 4  # sparse table width 4, float32
DATA_OPS = [P.Op.PUSH_DENSE, P.Op.PULL_DENSE, P.Op.INIT_DENSE, P.Op.PUSH_SPARSE, P.Op.PULL_SPARSE, P.Op.ROWS_SPARSE]
JSON_OPS = [P.Op.DECLARE, P.Op.DEF_DENSE, P.Op.DEF_SPARSE, P.Op.SET_HYPER]
RELAY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "relay.py")



@pytest.fixture
def served(tmp_path):
    """One pserver process (small frame cap, short barrier timeout) and a legitimate trainer 0."""
    env = H.make_env(1, 1, tmp_path, barrier_timeout=2.0)
    with H.procs(tmp_path) as pr:
        server = pr.pserver(env, 0, {"PADDLE_MAX_FRAME_BYTES": str(MAX_FRAME)})
        ps = connect(mode="sync", optimizer=OptimizerSpec("sgd", lr=1.0), env=trainer_env(env, 0))
        ps.register_dense({"w": W})
        ps.register_sparse("emb", 4, max_rows=1 << 20, init_scale=0.5, seed=1)
        ps.pull_sparse("emb", [1, 2, 3])
        try:
            yield env, pr, server, ps
        finally:
            ps.close()


def _addr(env, k=0):
    return env.pservers[k].host, env.dense_ports(k)[0]


def _recv_all(s: socket.socket) -> bytes:
    chunks = []
    while True:
        try:
            b = s.recv(65536)
        except (ConnectionResetError, socket.timeout):
            break
        if not b:
            break
        chunks.append(b)
    return b"".join(chunks)


def _exchange_raw(env, frame: bytes) -> bytes:
    """Send ``frame`` without authenticating; all the pserver sent back after its challenge (it must close)."""
    s = socket.create_connection(_addr(env), timeout=5)
    try:
        P.recv_into(s, memoryview(bytearray(P.HEADER_SIZE + A.NONCE_SIZE)))  # the challenge
        try:
            s.sendall(frame)
            s.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the pserver already dropped us
        return _recv_all(s)
    finally:
        s.close()


def _exchange_authed(env, header: bytes, payload: bytes):
    """As trainer 0 with its real key, send a frame with valid MACs but whatever header and payload; the ops
    of every frame the pserver answered with before closing."""
    s = socket.create_connection(_addr(env), timeout=5)
    try:
        keys = A.client_handshake(s, env.key_of(0), env.job_id, 0, 0, True)
        stream = Stream(s, keys)
        ops = []
        try:
            stream.send(header, payload)
            s.shutdown(socket.SHUT_WR)
            while True:
                h = stream.recv_header()
                ops.append(h.op)
                stream.discard()
        except (PSError, OSError):
            pass
        return ops
    finally:
        s.close()


def _assert_still_serving(ps, server, before):
    assert server.poll() is None
    now = ps.pull()
    np.testing.assert_array_equal(now["w"], before)
    step = ps.step
    ps.push({"w": np.ones_like(W)})
    np.testing.assert_allclose(ps.pull()["w"], before - 1.0)
    assert ps.step == step + 1


class _Recorder:
    """A socket that keeps a copy of what is sent through it."""

    def __init__(self, sock):
        self.sock, self.sent = sock, []

    def sendall(self, data):
        self.sent.append(bytes(data))
        self.sock.sendall(data)

    def __getattr__(self, name):
        return getattr(self.sock, name)


@pytest.mark.timeout(60)
def test_wrong_secret_cannot_connect_and_unauthenticated_frames_are_ignored(served):
    env, pr, server, ps = served
    before = ps.pull()["w"].copy()
    bad = dataclasses.replace(env, secret="0e7d1c4b9a2f5e8d3c6b1a4f7e0d9c2b5a")
    with pytest.raises(AuthError, match="refused our answer"):
        connect(mode="sync", env=trainer_env(bad, 0), connect_timeout=5)
    # Skipping authentication: a pull gets nothing back, a well-formed push changes nothing.
    assert _exchange_raw(env, P.pack_header(P.Op.PULL_DENSE, P.dtype_code(np.float32), key=0, step=ps.step)) == b""
    push = P.pack_header(P.Op.PUSH_DENSE, P.dtype_code(np.float32), key=0, step=ps.step, length=W_BYTES)
    assert _exchange_raw(env, push + np.full_like(W, 100.0).tobytes()) == b""
    _assert_still_serving(ps, server, before)
    assert "authentication failed" in pr.log(server)


@pytest.mark.timeout(60)
def test_replayed_answer_is_refused_and_server_must_prove_itself(served):
    env, pr, server, ps = served
    # Record a genuine handshake's answer ...
    s = socket.create_connection(_addr(env), timeout=5)
    rec = _Recorder(s)
    try:
        A.client_handshake(rec, env.key_of(0), env.job_id, 0, 0, True)
    finally:
        s.close()
    answer = rec.sent[0]
    assert len(answer) == P.HEADER_SIZE + A.MAC_SIZE + A.NONCE_SIZE
    assert env.secret.encode() not in answer and env.key_of(0).encode() not in answer  # no key travels
    # ... and replay it on a new connection: the nonce is fresh, so it fails and nothing comes back.
    assert _exchange_raw(env, answer) == b""
    assert "wrong answer to the challenge" in pr.log(server)

    # Mutual: a fake pserver that does not know the secret cannot pass itself off as one.
    a, b = socket.socketpair()

    def fake_server():
        b.sendall(P.pack_header(P.Op.AUTH_CHALLENGE, length=A.NONCE_SIZE) + os.urandom(A.NONCE_SIZE))
        P.recv_into(b, memoryview(bytearray(P.HEADER_SIZE + A.MAC_SIZE + A.NONCE_SIZE)))
        b.sendall(P.pack_header(P.Op.AUTH_OK, length=A.MAC_SIZE) + os.urandom(A.MAC_SIZE))

    t = threading.Thread(target=fake_server)
    t.start()
    with pytest.raises(AuthError, match="failed to prove"):
        A.client_handshake(a, env.key_of(0), env.job_id, 0, 0, True)
    t.join()
    a.close()
    b.close()


# -- an on-path relay ---------------------------------------------------------------------------------------


def _relay(pr, mode, env):
    targets = [f"{e.host}:{env.dense_ports(k)[0]}" for k, e in enumerate(env.pservers)]
    p = pr.start([sys.executable, RELAY, mode, *targets], dict(os.environ), f"relay-{mode.split(':')[0]}")
    line = p.stdout.readline().decode()
    assert line.startswith("RELAY_READY"), pr.log(p)
    ports = [int(x) for x in line.split()[1].split(",")]
    return p, dataclasses.replace(env, pservers=tuple(Endpoint("127.0.0.1", port) for port in ports))


def _relay_did(relay):
    """What the relay reports having done (it is killed by then)."""
    relay.kill()
    relay.wait(5)
    return relay.stdout.read().decode()


ATTACKS = {
    # mode: (what the relay did, trainer mode, pserver whose log names the failure)
    "flip": ("flip", "sync", "payload failed its MAC"),
    "hyper": ("hyper", "sync", "header failed its MAC"),
    "save": ("save", "sync", "header failed its MAC"),
    "replay": ("replay", "async", "header failed its MAC"),
    "reorder": ("reorder", "sync", "header failed its MAC"),
    "reflect": ("reflect", "sync", "header failed its MAC"),
    "splice": ("splice", "sync", "header failed its MAC"),
}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_on_path_relay_is_detected(tmp_path, attack):
    """test_on_path_relay_is_detected[flip|hyper|save|replay|reorder|reflect|splice]"""
    what, mode, logged = ATTACKS[attack]
    env = H.make_env(2, 1, tmp_path, ports_num=1, sparse_ports=0, barrier_timeout=5.0)
    evil = tmp_path / "evil-checkpoint"
    relay_mode = f"save:{evil}" if attack == "save" else attack
    with H.procs(tmp_path) as pr:
        servers = [pr.pserver(env, k) for k in range(2)]
        relay, via = _relay(pr, relay_mode, env)
        tr = pr.trainer(via, 0, "ones", str(tmp_path / "out.npz"), steps=3, mode=mode)
        assert H.wait_all(pr, [tr], 40) == [3], pr.log(tr)
        out = tr.stdout.read().decode()
        assert out.startswith("TRAINER_FAILED"), out
        assert f"RELAY_DID {what}" in _relay_did(relay)
        logs = "".join(pr.log(s) for s in servers)
        drops = [ln for ln in logs.splitlines() if "dropped connection" in ln]
        assert len(drops) == 1 and logged in drops[0] and "127.0.0.1:" in drops[0] and "trainer 0" in drops[0], logs
        # The trainer was told why, by the pserver (flip, inject, replay, reorder, reflect, splice).
        assert "IntegrityError" in out and "failed its MAC" in out, out
        assert not evil.exists()
        # The pservers hold exactly what the honest frames made (seen by an honest reconnect): the attacked
        # push never applied, a replayed one applied once, each other push at most once; lr untouched.
        ps = connect(mode=mode, optimizer=OptimizerSpec("sgd", lr=0.5), env=trainer_env(env, 0),
                     max_block_bytes=32768)
        zeros = np.zeros(16384, np.float32)
        got = ps.register_dense({"w0": zeros, "w1": zeros})
        vals = {float(v) for w in got.values() for v in np.unique(w)}
        assert vals <= {0.0, -0.5}, vals
        assert (-0.5 if attack == "replay" else 0.0) in vals, vals
        assert all(b["lr"] == 0.5 for s in ps.status() for b in s["blocks"].values())
        ps.close()
        assert H.wait_all(pr, servers, 20) == [0, 0]  # nothing left: both pservers end with the job


@pytest.mark.timeout(60)
def test_trainer_without_cryptography_gets_hmac_sha256_and_is_protected_alike(tmp_path, monkeypatch):
    """A trainer with only the standard library offers HMAC-SHA256 alone (``auth.OFFER``): the pserver agrees
    to it, and a relay's flipped gradient byte is detected the same way."""
    monkeypatch.setattr(A, "OFFER", A.HmacSha256.CODE)
    env = H.make_env(2, 1, tmp_path, ports_num=1, sparse_ports=0, barrier_timeout=5.0)
    zeros = np.zeros(16384, np.float32)
    with H.procs(tmp_path) as pr:
        servers = [pr.pserver(env, k) for k in range(2)]
        relay, via = _relay(pr, "flip", env)
        ps = connect(mode="sync", optimizer=OptimizerSpec("sgd", lr=0.5), env=trainer_env(via, 0),
                     max_block_bytes=32768)
        assert {type(ch.stream.keys.send) for ch in ps._all} == {A.HmacSha256}
        ps.register_dense({"w0": zeros, "w1": zeros})
        with pytest.raises(IntegrityError, match="payload failed its MAC"):
            ps.wait(ps.push({"w0": np.ones_like(zeros), "w1": np.ones_like(zeros)}))
        ps._shutdown_channels()  # like a trainer process that fails: no CLOSE
        assert "RELAY_DID flip" in _relay_did(relay)
        honest = connect(mode="sync", optimizer=OptimizerSpec("sgd", lr=0.5), env=trainer_env(env, 0),
                         max_block_bytes=32768)
        got = honest.register_dense({"w0": zeros, "w1": zeros})
        assert {float(v) for w in got.values() for v in np.unique(w)} <= {0.0, -0.5}
        honest.close()
        assert H.wait_all(pr, servers, 20) == [0, 0]


@pytest.mark.timeout(60)
def test_relay_that_only_forwards_changes_nothing(tmp_path):
    """The same relay in pass-through mode: the job runs to the exact result (the attacks above are real)."""
    env = H.make_env(2, 1, tmp_path, ports_num=1, sparse_ports=0)
    with H.procs(tmp_path) as pr:
        servers = [pr.pserver(env, k) for k in range(2)]
        _, via = _relay(pr, "pass", env)
        out = tmp_path / "out.npz"
        tr = pr.trainer(via, 0, "ones", str(out), steps=3)
        assert H.wait_all(pr, [tr, *servers], 40) == [0, 0, 0], pr.log(tr)
        np.testing.assert_array_equal(np.load(out)["w0"], -1.5)
        np.testing.assert_array_equal(np.load(out)["w1"], -1.5)


# -- malformed frames ----------------------------------------------------------------------------------------


def _expected_len(op: int, aux: int) -> int:
    return {P.Op.PUSH_DENSE: W_BYTES, P.Op.INIT_DENSE: W_BYTES, P.Op.PULL_DENSE: 0,
            P.Op.PUSH_SPARSE: aux * (8 + ROW_BYTES), P.Op.PULL_SPARSE: aux * 8, P.Op.ROWS_SPARSE: 8}[op]


@st.composite
def frames(draw, authed: bool):
    """(header, payload): sent raw without authentication, or with valid MACs by trainer 0."""
    kinds = ["bad_magic", "bad_version", "unknown_key", "bad_length", "bad_op", "bad_json", "oversize"]
    kinds += ["valid_push", "fake_auth", "garbage"] if not authed else []
    kind = draw(st.sampled_from(kinds))
    if kind == "garbage":
        return draw(st.binary(min_size=1, max_size=100).filter(lambda b: b[:4] != P.MAGIC)), b""
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
        op, length, trainer = P.Op.AUTH_RESPONSE, A.MAC_SIZE + A.NONCE_SIZE, 0
        payload = draw(st.binary(min_size=length, max_size=length))
    cut = draw(st.integers(0, len(payload)))  # truncation
    header = P.HEADER.pack(magic, version, op, dtype, 0, trainer, key, step, length, aux)
    return header, payload[:cut]


@pytest.mark.timeout(150)
def test_malformed_frames_never_crash_or_change_anything(served):
    env, pr, server, ps = served
    before = ps.pull()["w"].copy()
    rows_before = ps.pull_sparse("emb", [1, 2, 3]).copy()

    @settings(max_examples=100, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(frame=frames(authed=False))
    def unauthenticated(frame):
        assert _exchange_raw(env, frame[0] + frame[1]) == b""  # not one byte besides the challenge

    @settings(max_examples=100, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(frame=frames(authed=True))
    def authenticated(frame):
        # A trainer that sends garbage (with valid MACs) gets at most an ERROR frame, then loses its connection.
        assert set(_exchange_authed(env, *frame)) <= {P.Op.ERROR}

    unauthenticated()
    authenticated()
    assert server.poll() is None
    np.testing.assert_array_equal(ps.pull_sparse("emb", [1, 2, 3]), rows_before)
    _assert_still_serving(ps, server, before)
    log = pr.log(server)
    assert "exceeds the 65536-byte cap" in log and "bad magic" in log and "unsupported protocol version" in log
    assert "Traceback" not in log


def test_pserver_and_client_refuse_a_frame_cut_short(served):
    """A frame whose payload never completes costs only its own connection."""
    env, pr, server, ps = served
    before = ps.pull()["w"].copy()
    header = P.pack_header(P.Op.PUSH_DENSE, P.dtype_code(np.float32), key=0, step=ps.step, length=W_BYTES)
    assert _exchange_authed(env, header, W.tobytes()[:100]) == []
    _assert_still_serving(ps, server, before)
    assert "connection closed in the middle of a frame" in pr.log(server)


@pytest.mark.timeout(180)
def test_integrity_off_job_says_so_once_and_trains(tmp_path):
    """``INTEGRITY = False`` through the real CLI: one line says so, the processes get PADDLE_INTEGRITY=0 and the
    example reaches the same result as with integrity on."""
    from test_example_fit_a_line import run_example

    res, _, mse_off = run_example(tmp_path / "off", "noint", "--passes", "2", INTEGRITY=False)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stderr.count("INTEGRITY = False: frames between trainers and pservers carry no MAC") == 1
    res_on, _, mse_on = run_example(tmp_path / "on", "int", "--passes", "2")
    assert res_on.returncode == 0 and "INTEGRITY = False" not in res_on.stderr
    assert mse_off == mse_on
