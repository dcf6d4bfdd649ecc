"""Wire format, handshake, placement and row initialisation (no pserver process needed)."""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest

from paddle_cluster.ps import errors as E
from paddle_cluster.ps import protocol as P
from paddle_cluster.ps.placement import init_rows, place_dense, shard_of, split_rows

pytestmark = pytest.mark.timeout(30)


def test_header_roundtrip_and_checks():
    raw = P.pack_header(P.Op.PUSH_DENSE, P.dtype_code(np.float32), 0, 3, 17, -5, 4096, 9)
    assert len(raw) == P.HEADER_SIZE == 40
    h = P.unpack_header(raw)
    assert (h.op, h.dtype, h.trainer, h.key, h.step, h.length, h.aux) == (P.Op.PUSH_DENSE, 1, 3, 17, -5, 4096, 9)
    assert h.pack() == raw
    with pytest.raises(E.ProtocolError, match="bad magic"):
        P.unpack_header(b"XXXX" + raw[4:])
    with pytest.raises(E.ProtocolError, match="unsupported protocol version 2"):
        P.unpack_header(raw[:4] + (2).to_bytes(2, "little") + raw[6:])
    with pytest.raises(E.ProtocolError, match="exceeds the 100-byte cap"):
        P.unpack_header(raw, max_frame=100)
    with pytest.raises(ValueError, match="not supported on the wire"):
        P.dtype_code(np.complex64)


def test_big_array_goes_through_one_frame_unchanged():
    a, b = socket.socketpair()
    src = np.random.default_rng(0).standard_normal((1 << 20) + 3).astype(np.float32)
    dst = np.empty_like(src)
    t = threading.Thread(target=P.send_frame, args=(a, P.pack_header(P.Op.DATA, length=src.nbytes), src))
    t.start()
    h = P.recv_header(b, bytearray(P.HEADER_SIZE))
    P.recv_into(b, P.byte_view(dst))
    t.join()
    assert h.length == src.nbytes
    np.testing.assert_array_equal(dst, src)
    a.close()
    with pytest.raises(E.ConnectionLost):
        P.recv_into(b, P.byte_view(dst))
    b.close()


def _handshake(server_secret, client_secret):
    a, b = socket.socketpair()
    result = {}

    def server():
        try:
            result["trainer"] = P.server_handshake(b, server_secret, "job", 2)
        except E.PSError as e:
            result["error"] = e
            b.close()

    t = threading.Thread(target=server)
    t.start()
    try:
        P.client_handshake(a, client_secret, "job", 1)
    finally:
        t.join()
        a.close()
        b.close()
    return result


def test_handshake_accepts_the_secret_and_refuses_others():
    assert _handshake("s3cret", "s3cret") == {"trainer": 1}
    with pytest.raises(E.AuthError, match="refused our answer"):
        _handshake("s3cret", "guess")


def test_error_round_trip_keeps_type_and_missing_trainers():
    e = E.BarrierTimeout("barrier timeout at step 3", 3, 1, [E.MissingTrainer(2, 31.2), E.MissingTrainer(4, None)])
    back = E.from_wire(e.code, e.to_wire())
    assert isinstance(back, E.BarrierTimeout) and back.missing_trainers == [2, 4] and back.step == 3
    assert E.MissingTrainer(2, 31.2).describe() == "trainer 2 (last seen 31.2 s ago)"
    assert isinstance(E.from_wire(E.UnknownKey.code, {"message": "x"}), E.UnknownKey)


def test_split_rows_limits():
    # tiny parameter: one block
    assert split_rows((10, 10), np.float32) == [(0, 10)]
    # 64 MB float32 vector with 4 MB blocks: 16 blocks of 1M elements
    blocks = split_rows((16 << 20,), np.float32, 4 << 20)
    assert len(blocks) == 16 and all(hi - lo == 1 << 20 for lo, hi in blocks)
    # never below 8192 elements per block, even with a tiny byte cap
    blocks = split_rows((100, 200), np.float32, 1024)
    assert all((hi - lo) * 200 >= 8192 for lo, hi in blocks) and blocks[-1][1] == 100
    # blocks are row aligned and cover the parameter exactly
    blocks = split_rows((1001, 300), np.float64, 100_000)
    assert blocks[0][0] == 0 and blocks[-1][1] == 1001
    assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))
    assert all((hi - lo) * 300 * 8 <= 100_000 for lo, hi in blocks)


def test_placement_is_deterministic_and_balanced_by_bytes():
    params = {"emb_proj": ((4096, 256), np.float32), "b": ((256,), np.float32), "fc": ((1024, 1024), np.float32),
              "head": ((512, 10), np.float32)}
    p1 = place_dense(params, 3, 2, max_block_bytes=1 << 20)
    p2 = place_dense(dict(reversed(list(params.items()))), 3, 2, max_block_bytes=1 << 20)
    assert p1 == p2  # dict order does not matter: every trainer computes the same placement
    assert max(p1.loads) - min(p1.loads) <= 1 << 20  # within one block of each other
    assert sum(p1.loads) == sum(4 * np.prod(s) for s, _ in params.values())
    assert len({b.key for b in p1.blocks}) == len(p1.blocks)
    for name, blocks in p1.by_name().items():
        assert blocks[0].lo == 0 and blocks[-1].hi == params[name][0][0]


def test_sparse_rows_are_deterministic_whatever_the_order_or_shard():
    ids = np.array([5, 17, 3, 1 << 40, -7], dtype=np.int64)
    a = init_rows(ids, 8, 0.05, seed=9)
    b = init_rows(ids[::-1], 8, 0.05, seed=9)[::-1]
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(init_rows(ids[1:2], 8, 0.05, seed=9), a[1:2])
    assert np.abs(a).max() <= 0.05 and a.dtype == np.float32 and a.std() > 0.01
    assert not np.array_equal(init_rows(ids, 8, 0.05, seed=10), a)
    assert len(np.unique(a[:, 0])) == len(ids)
    np.testing.assert_array_equal(shard_of(np.array([0, 1, 2, 3, -1]), 2), [0, 1, 0, 1, 1])
