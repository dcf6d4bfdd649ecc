"""Wire format, frame MACs, handshake, placement and row initialisation (no pserver process needed)."""

from __future__ import annotations

import hashlib
import hmac
import socket
import threading

import numpy as np
import pytest

from paddle_cluster.contract import Endpoint, JobEnv, derive_trainer_key
from paddle_cluster.ps import errors as E
from paddle_cluster.ps.placement import init_rows, place_dense, shard_of, split_rows
from paddle_cluster.ps.wire import auth as A
from paddle_cluster.ps.wire import protocol as P
from paddle_cluster.ps.wire.stream import SEGMENT, Stream

SECRET = "53c7e1f8a3b9e2d5c7b4f1a6d0c8e3b9f4"  # as a job secret must be: not guessable (jobsecret.estimate)

pytestmark = pytest.mark.timeout(30)


def test_header_roundtrip_and_checks():
    raw = P.pack_header(P.Op.PUSH_DENSE, P.dtype_code(np.float32), 0, 3, 17, -5, 4096, 9)
    assert len(raw) == P.HEADER_SIZE == 40
    h = P.unpack_header(raw)
    assert (h.op, h.dtype, h.trainer, h.key, h.step, h.length, h.aux) == (P.Op.PUSH_DENSE, 1, 3, 17, -5, 4096, 9)
    with pytest.raises(E.ProtocolError, match="bad magic"):
        P.unpack_header(b"XXXX" + raw[4:])
    with pytest.raises(E.ProtocolError, match="unsupported protocol version 3"):
        P.unpack_header(raw[:4] + (3).to_bytes(2, "little") + raw[6:])
    with pytest.raises(E.ProtocolError, match="exceeds the 100-byte cap"):
        P.unpack_header(raw, max_frame=100)
    with pytest.raises(ValueError, match="not supported on the wire"):
        P.dtype_code(np.complex64)


SUITES = sorted(A.SUITES.values(), key=lambda m: m.CODE)


def _keys(mac=A.HmacSha256):
    """Both ends' keys of one connection, as the handshake would derive them."""
    c2s, s2c = mac(b"k" * 32), mac(b"j" * 32)
    return A.Keys(send=c2s, recv=s2c), A.Keys(send=s2c, recv=c2s)


@pytest.mark.parametrize("mac", [None, *SUITES])
def test_big_array_goes_through_one_frame_unchanged(mac):
    a, b = socket.socketpair()
    ka, kb = _keys(mac) if mac else (None, None)
    src = np.random.default_rng(0).standard_normal((1 << 20) + 3).astype(np.float32)
    dst = np.empty_like(src)
    sa, sb = Stream(a, ka), Stream(b, kb)
    t = threading.Thread(target=sa.send, args=(P.pack_header(P.Op.DATA, length=src.nbytes), src[:5], src[5:]))
    t.start()
    h = sb.recv_header()
    sb.recv_into(dst)
    t.join()
    assert h.length == src.nbytes and sb.left == 0
    np.testing.assert_array_equal(dst, src)
    a.close()
    with pytest.raises(E.ConnectionLost):
        sb.recv_header()
    b.close()


def test_mac_is_hmac_sha256_and_streams():
    key, data = b"secret key" * 3, np.arange(100_000, dtype=np.uint8).tobytes()
    prefix = (7).to_bytes(8, "little") + b"H" * 40
    run = A.HmacSha256(key).start(7, b"H" * 40)
    assert run.tag() == hmac.new(key, prefix, hashlib.sha256).digest()[: A.TAG_SIZE]
    run.update(data[:1000])
    run.update(data[1000:])
    assert run.tag() == hmac.new(key, prefix + data, hashlib.sha256).digest()[: A.TAG_SIZE]


@pytest.mark.skipif(A.Poly1305Mac.CODE not in A.SUITES, reason="cryptography is not installed")
def test_poly1305_tags_each_piece_under_its_own_key_and_small_frames_take_hmac():
    from cryptography.hazmat.primitives.poly1305 import Poly1305

    key, data = b"secret key" * 3, np.arange(100_000, dtype=np.uint8).tobytes()
    big = P.pack_header(P.Op.DATA, length=A.Poly1305Mac.BIG)
    small = P.pack_header(P.Op.DATA, length=A.Poly1305Mac.BIG - 1)

    def sub(label):
        return hmac.new(key, label, hashlib.sha256).digest()

    def one_time_key(seq, n):
        return hashlib.blake2b((seq).to_bytes(8, "little") + n.to_bytes(4, "little"), key=sub(b"poly1305 keys"),
                               digest_size=32).digest()

    run = A.Poly1305Mac(key).start(7, big)
    assert run.tag() == Poly1305.generate_tag(one_time_key(7, 0), big)
    run.update(data[:1000])
    run.update(data[1000:])
    assert run.tag() == Poly1305.generate_tag(one_time_key(7, 1), data)
    # The same bytes in another frame get another tag.
    assert A.Poly1305Mac(key).start(8, big).tag() != Poly1305.generate_tag(one_time_key(7, 0), big)
    # A frame under 64 KiB is HMAC-SHA256 under a key of its own.
    run = A.Poly1305Mac(key).start(7, small)
    assert run.tag() == hmac.new(sub(b"small frames"), (7).to_bytes(8, "little") + small,
                                 hashlib.sha256).digest()[:A.TAG_SIZE]


@pytest.mark.parametrize("mac", SUITES)
def test_payload_is_verified_segment_by_segment_as_it_arrives(mac):
    """The receiver hands out the first segment, verified, while the rest of the frame is not even sent; a
    flipped byte in a later segment still fails at that segment's tag."""
    ka, kb = _keys(mac)
    payload = np.arange(3 * SEGMENT, dtype=np.uint8)
    tap = _Tap()
    Stream(tap, ka).send(P.pack_header(P.Op.DATA, length=payload.nbytes), payload)
    wire = bytearray(b"".join(tap.out))
    first = P.HEADER_SIZE + A.TAG_SIZE + SEGMENT + A.TAG_SIZE
    wire[first + 5] ^= 1  # in the second segment
    a, b = socket.socketpair()
    got_first = threading.Event()

    def sender():
        _send_quietly(a, bytes(wire[:first]))  # the header and the first segment only
        if got_first.wait(10):
            _send_quietly(a, bytes(wire[first:]))

    t = threading.Thread(target=sender)
    t.start()
    sb = Stream(b, kb)
    sb.recv_header()
    chunks = sb.chunks()
    off, seg = next(chunks)
    assert off == 0 and bytes(seg) == payload[:SEGMENT].tobytes()
    got_first.set()
    with pytest.raises(E.IntegrityError, match="payload failed its MAC"):
        next(chunks)
    b.close()
    t.join()
    a.close()


class _Tap:
    """A socket stand-in that records what a Stream sends."""

    def __init__(self):
        self.out = []

    def sendmsg(self, views):
        self.out.append(b"".join(bytes(v) for v in views))
        return sum(len(v) for v in views)


def _send_quietly(sock, data):
    try:
        sock.sendall(data)
    except OSError:
        pass  # the reader gave up at the bad tag


@pytest.mark.parametrize("mac", SUITES)
@pytest.mark.parametrize("where", [0, 41, P.HEADER_SIZE + A.TAG_SIZE + SEGMENT + 3])
def test_a_flipped_bit_anywhere_fails_its_mac(where, mac):
    """Header, first segment or a later one: the frame fails before its bytes are used."""
    ka, kb = _keys(mac)
    payload = np.zeros(SEGMENT + 100, np.uint8)
    tap = _Tap()
    Stream(tap, ka).send(P.pack_header(P.Op.DATA, length=payload.nbytes), payload)
    wire = bytearray(b"".join(tap.out))
    assert len(wire) == P.HEADER_SIZE + payload.nbytes + 3 * A.TAG_SIZE  # header, 2 segments: 3 tags
    wire[where] ^= 1
    a, b = socket.socketpair()
    t = threading.Thread(target=_send_quietly, args=(a, bytes(wire)))
    t.start()
    sb = Stream(b, kb)
    with pytest.raises(E.IntegrityError):
        sb.recv_header()
        sb.recv_into(np.empty_like(payload))
    b.close()
    t.join()
    a.close()


def _handshake(server_secret, client_key, *, trainer=1, client_ps=0, integrity=(True, True), offer=None):
    env = JobEnv("job", (Endpoint("h", 1),), 2, secret=server_secret)
    a, b = socket.socketpair()
    result = {}

    def server():
        try:
            result["trainer"], result["keys"] = A.server_handshake(b, env.key_of, "job", 0, 2, integrity[0])
        except E.PSError as e:
            result["error"] = e
            b.close()

    t = threading.Thread(target=server)
    t.start()
    try:
        keys = A.client_handshake(a, client_key, "job", client_ps, trainer, integrity[1], offer=offer)
    finally:
        t.join()
        a.close()
        b.close()
    return result, keys


def test_handshake_proves_the_trainer_key_and_binds_pserver_and_integrity():
    secret = SECRET
    res, keys = _handshake(secret, derive_trainer_key(secret, "job", 1))
    assert res["trainer"] == 1
    # The two ends agree on the keys, and each direction has its own.
    tag = lambda m: m.start(0, P.pack_header(P.Op.OK)).tag()  # noqa: E731
    assert tag(keys.send) == tag(res["keys"].recv) and tag(keys.recv) == tag(res["keys"].send)
    assert tag(keys.send) != tag(keys.recv)
    # The fastest frame MAC both ends have; a trainer that has only the standard library gets HMAC-SHA256.
    assert type(keys.send) is A.SUITES[max(A.SUITES)] is type(res["keys"].recv)
    res, keys = _handshake(secret, derive_trainer_key(secret, "job", 1), offer=A.HmacSha256.CODE)
    assert type(keys.send) is A.HmacSha256 is type(res["keys"].recv)
    with pytest.raises(E.AuthError, match="refused our answer"):
        _handshake(secret, derive_trainer_key(secret, "job", 1), offer=8)  # nothing in common
    bad = [dict(client_key=derive_trainer_key("guess" * 8, "job", 1)),  # another secret
           dict(client_key=derive_trainer_key(secret, "job", 0)),  # trainer 0's key claiming id 1
           dict(client_key=derive_trainer_key(secret, "job", 1), client_ps=1),  # meant for another pserver
           dict(client_key=derive_trainer_key(secret, "job", 1), integrity=(True, False))]  # a downgrade
    for kw in bad:
        with pytest.raises(E.AuthError, match="refused our answer"):
            _handshake(secret, **kw)


def test_error_round_trip_keeps_type_and_missing_trainers():
    e = E.BarrierTimeout("barrier timeout at step 3", 3, 1, [E.MissingTrainer(2, 31.2), E.MissingTrainer(4, None)])
    back = E.from_wire(e.code, e.to_wire())
    assert isinstance(back, E.BarrierTimeout) and back.missing_trainers == [2, 4] and back.step == 3
    assert E.MissingTrainer(2, 31.2).label() == "trainer 2 (last seen 31.2 s ago)"
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


def test_placement_gives_every_pserver_its_share():
    # One pserver per node: a node's link carries its pserver's share, so shares must be equal, not within a
    # block (a 64 MB parameter in 4 MB blocks on 3 pservers was 6 + 5 + 5 blocks: one node 12 % over its share).
    params = {"w1": ((2896, 2896), np.float32), "w2": ((2896, 2896), np.float32), "b": ((2896,), np.float32)}
    for n, conns in ((3, 1), (4, 1), (3, 2), (5, 1)):
        p = place_dense(params, n, conns)
        row = 2896 * 4
        assert max(p.loads) - min(p.loads) <= 4 * row, (n, conns, p.loads)
        assert all(b.nbytes <= 4 << 20 for b in p.blocks)
    assert len(split_rows((16 << 20,), np.float32, 4 << 20, parts=3)) == 18
    assert split_rows((10, 10), np.float32, parts=3) == [(0, 10)]  # too small to share: one block


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


def test_poly1305_implementations_agree_with_each_other_and_rfc8439():
    """Whichever Poly1305 is used (the system's libcrypto through ctypes, or ``cryptography``), the tags are
    the same: fed whole or in pieces, from read-only or writable buffers."""
    from paddle_cluster.ps.wire import poly1305

    impls = []
    for make in (poly1305._libcrypto, poly1305._cryptography):
        try:
            impls.append(make())
        # Absent here (no libcrypto 3, no EVP_MAC symbol, no cryptography): only that; any other error fails.
        except (OSError, AttributeError, ImportError):
            pass
    if not impls:
        pytest.skip("neither libcrypto 3 nor cryptography here")
    rng = np.random.default_rng(5)
    key, data = rng.bytes(32), rng.bytes(3 * SEGMENT + 7)
    tags = set()
    for cls in impls:
        p = cls(poly1305._KEY)
        p.update(poly1305._MSG)
        assert p.finalize() == poly1305._TAG
        whole = cls(key)
        whole.update(memoryview(data))
        pieces = cls(key)
        for off in range(0, len(data), 100_003):
            pieces.update(memoryview(bytearray(data))[off:off + 100_003])
        tags |= {whole.finalize(), pieces.finalize()}
    assert len(tags) == 1


def test_a_pserver_that_stops_answering_costs_the_trainer_its_io_timeout():
    """Trainer sockets time out by SO_RCVTIMEO (no poll before every call): a pserver that authenticates and then
    never answers is a ConnectionLost that names the wait, and the channel stays broken."""
    from paddle_cluster.ps.channel import Channel

    ls = socket.create_server(("127.0.0.1", 0))
    env = JobEnv("job", (Endpoint("127.0.0.1", ls.getsockname()[1]),), 1, secret=SECRET)
    done = threading.Event()

    def server():
        s, _ = ls.accept()
        A.server_handshake(s, env.key_of, "job", 0, 1, True)
        done.wait(20)
        s.close()

    t = threading.Thread(target=server)
    t.start()
    ch = Channel(env, env.key_of(0), 0, 0, ls.getsockname()[1], 5.0, io_timeout=0.3)
    try:
        for _ in range(2):
            with pytest.raises(E.ConnectionLost, match="no answer in 0.3 s"):
                ch.submit(Channel.call_json, P.Op.STATUS, {}).result(10)
    finally:
        done.set()
        ch.close()
        t.join()
        ls.close()
