"""Who may talk to a pserver, and the keys every frame is authenticated with.

Keys. The launcher makes one random job secret. Each trainer gets only its own key ``K_t``
(``contract.derive_trainer_key``); a pserver holds the secret and derives any trainer's key. So a trainer can
prove only its own id, never another's.

Handshake (first thing on every connection; no key ever travels):

1. pserver -> trainer ``AUTH_CHALLENGE``: a fresh 32-byte nonce ``sn``;
2. trainer -> pserver ``AUTH_RESPONSE`` (header's trainer field = its id):
   ``HMAC(K_t, "c2s" | sn | cn | context)`` and its own fresh nonce ``cn``;
3. pserver -> trainer ``AUTH_OK``: ``HMAC(K_t, "s2c" | cn | sn | context)``.

The context binds the protocol version, the job id, the pserver id, the trainer id and whether frames carry
MACs (so an on-path relay cannot downgrade integrity). Both sides then derive one key per direction from
``K_t``, both nonces and the same context: a frame recorded on one connection, in one direction, or to
another pserver verifies nowhere else.

Frame MAC: negotiated. The trainer offers the MACs it has (``AUTH_RESPONSE``'s aux field, a bit mask), the
pserver picks the fastest both have (``AUTH_OK``'s aux); the offer is inside the trainer's answer and the choice
inside the pserver's proof and the session keys, so a relay cannot change either. Chosen by measurement
(docs/reliability.md, ``python -m bench.macs``):

- ``HmacSha256`` (always there: nodes need only Python and numpy): HMAC-SHA256 truncated to 16 bytes, built
  from two SHA-256 states hashed once per key and ``copy()``-ed per frame -- with the CPU's SHA extensions
  the fastest sound MAC of the standard library, and fed chunk by chunk as bytes arrive;
- ``Poly1305Mac`` (when both ends have OpenSSL 3 or ``cryptography``, ``ps.wire.poly1305``): Poly1305, ~3.5x faster, for
  frames of 64 KiB and more (HMAC-SHA256 costs less per small frame). It is a one-time MAC, so every tag
  has its own key, keyed BLAKE2b(frame number | piece number): the header's tag and each segment's tag
  authenticate exactly that piece at exactly that place of that frame.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

from ..errors import AuthError, ConnectionLost, ProtocolError
from . import protocol as P
from .poly1305 import Poly1305 as _Poly1305

NONCE_SIZE = 32
MAC_SIZE = 32  # handshake answers: full HMAC-SHA256
TAG_SIZE = 16  # frame tags: HMAC-SHA256-128
HANDSHAKE_TIMEOUT = 10.0  # seconds for the whole handshake, however the peer trickles its bytes
_SEQ = struct.Struct("<Q")


class HmacSha256:
    """Frame MAC: HMAC-SHA256-128 of the frame number, the header and the payload so far, at every tag."""

    CODE = 1

    def __init__(self, key: bytes) -> None:
        k = (hashlib.sha256(key).digest() if len(key) > 64 else key).ljust(64, b"\0")
        self._inner = hashlib.sha256(bytes(b ^ 0x36 for b in k))
        self._outer = hashlib.sha256(bytes(b ^ 0x5C for b in k))

    def start(self, seq: int, header: Any) -> _HmacFrame:
        """A running MAC of frame number ``seq`` (never sent: both ends count) starting with its header."""
        run = self._inner.copy()
        run.update(_SEQ.pack(seq))
        run.update(header)
        return _HmacFrame(self._outer, run)


class _HmacFrame:
    def __init__(self, outer: Any, run: Any) -> None:
        self._outer, self._run = outer, run
        self.update = run.update

    def tag(self) -> bytes:
        """The tag of everything fed so far (it can be fed on)."""
        o = self._outer.copy()
        o.update(self._run.copy().digest())
        return o.digest()[:TAG_SIZE]


class Poly1305Mac:
    """Frame MAC: Poly1305 of each piece (the header, then each segment) under its own one-time key, for frames
    of at least ``BIG`` payload bytes; smaller ones (requests, replies, sparse rows) take HMAC-SHA256, which
    costs less per frame. Which one follows from the header's length field: a changed length selects the
    other MAC, under another key, and fails."""

    CODE = 2
    BIG = 64 << 10

    def __init__(self, key: bytes) -> None:
        self._small = HmacSha256(hmac.new(key, b"small frames", hashlib.sha256).digest())
        # Keyed BLAKE2b as the PRF of the one-time keys: one hash per piece.
        self._prf = hashlib.blake2b(key=hmac.new(key, b"poly1305 keys", hashlib.sha256).digest(), digest_size=32)

    def start(self, seq: int, header: Any) -> Any:
        if P.HEADER.unpack_from(header)[8] < self.BIG:
            return self._small.start(seq, header)
        f = _PolyFrame(self._prf, seq)
        f.update(header)
        return f


class _PolyFrame:
    """One frame's pieces; piece ``n``'s key is PRF(frame number | n)."""

    def __init__(self, prf: Any, seq: int) -> None:
        self._prf, self._seq, self._n, self._p = prf, seq, 0, None

    def update(self, data: Any) -> None:
        if self._p is None:
            h = self._prf.copy()
            h.update(_PIECE.pack(self._seq, self._n))
            self._p = _Poly1305(h.digest())  # type: ignore[misc]
        self._p.update(data)

    def tag(self) -> bytes:
        """The tag of what was fed since the last tag; the next piece gets the next key."""
        if self._p is None:
            self.update(b"")
        t = self._p.finalize()
        self._p, self._n = None, self._n + 1
        return t


_PIECE = struct.Struct("<QI")

SUITES: Dict[int, Any] = {HmacSha256.CODE: HmacSha256}
if _Poly1305 is not None:
    SUITES[Poly1305Mac.CODE] = Poly1305Mac
OFFER = sum(SUITES)  # what this side offers and accepts (a bit mask of the CODEs)


def choose(offer: int, have: int) -> int:
    """The fastest frame MAC in both masks (0: none in common)."""
    common = offer & have
    return max((c for c in SUITES if c & common), default=0)


@dataclass(frozen=True)
class Keys:
    """One connection's frame keys: what this side sends with, what it expects."""

    send: Any  # HmacSha256 or Poly1305Mac
    recv: Any


def _context(job_id: str, pserver: int, trainer: int, integrity: bool, version: int) -> bytes:
    jid = job_id.encode("utf-8")
    return b"|v%d|%d:%s|ps%d|t%d|mac%d" % (version, len(jid), jid, pserver, trainer, int(integrity))


def _answer(key: bytes, label: bytes, first: bytes, second: bytes, context: bytes) -> bytes:
    return hmac.new(key, label + first + second + context, hashlib.sha256).digest()


def _session(key: bytes, sn: bytes, cn: bytes, context: bytes, suite: int) -> Tuple[Any, Any]:
    """(trainer -> pserver, pserver -> trainer) frame MACs of the chosen ``suite``."""
    base = hmac.new(key, b"session" + sn + cn + context, hashlib.sha256).digest()
    mac = SUITES[suite]
    return (mac(hmac.new(base, b"c2s frames", hashlib.sha256).digest()),
            mac(hmac.new(base, b"s2c frames", hashlib.sha256).digest()))


# -- raw socket reads with one deadline --------------------------------------------------------------------


def recv_by(sock: socket.socket, n: int, deadline: float) -> bytes:
    """``n`` bytes, all before ``deadline`` (time.monotonic): a peer that trickles bytes gains nothing."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    try:
        while got < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AuthError(f"handshake not completed within {HANDSHAKE_TIMEOUT:g} s")
            sock.settimeout(left)
            try:
                r = sock.recv_into(view[got:], n - got)
            except socket.timeout:
                raise AuthError(f"handshake not completed within {HANDSHAKE_TIMEOUT:g} s") from None
            if r == 0:
                raise ConnectionLost(f"connection closed after {got} of {n} bytes")
            got += r
    except ConnectionResetError as e:
        raise ConnectionLost(f"connection reset: {e}") from None
    return bytes(buf)


def _recv_frame(sock: socket.socket, want_op: int, want_len: int, deadline: float) -> Tuple[P.Header, bytes]:
    h = P.unpack_header(recv_by(sock, P.HEADER_SIZE, deadline), max_frame=max(want_len, P.MAX_JSON_BYTES))
    if h.op == P.Op.ERROR and want_op == P.Op.AUTH_CHALLENGE:
        body = P.decode_json(recv_by(sock, h.length, deadline))
        raise ConnectionLost(f"the pserver refused the connection: {body.get('message', '')}")
    if h.op != want_op or h.length != want_len:
        raise AuthError(f"expected {P.Op(want_op).name} of {want_len} bytes, got {h.op_name()} of {h.length} bytes")
    return h, recv_by(sock, want_len, deadline)


def server_handshake(sock: socket.socket, key_of: Callable[[int], str], job_id: str, pserver: int,
                     n_trainers: int, integrity: bool, timeout: float = HANDSHAKE_TIMEOUT,
                     answered: Optional[Callable[[], None]] = None) -> Tuple[int, Optional[Keys]]:
    """Authenticate a new connection within ``timeout`` s: (the trainer id it proved, its frame keys or None
    without integrity). ``answered`` is called once the peer's answer is read, before it is checked. Raises
    AuthError / ProtocolError / ConnectionLost."""
    deadline = time.monotonic() + timeout
    sn = os.urandom(NONCE_SIZE)
    sock.settimeout(timeout)
    sock.sendall(P.pack_header(P.Op.AUTH_CHALLENGE, length=NONCE_SIZE) + sn)
    h, body = _recv_frame(sock, P.Op.AUTH_RESPONSE, MAC_SIZE + NONCE_SIZE, deadline)
    if answered is not None:
        answered()
    if not 0 <= h.trainer < n_trainers:
        raise AuthError(f"trainer id {h.trainer} is outside [0, {n_trainers})")
    key = bytes.fromhex(key_of(h.trainer))
    context = _context(job_id, pserver, h.trainer, integrity, P.VERSION) + b"|offer%d" % h.aux
    answer, cn = body[:MAC_SIZE], body[MAC_SIZE:]
    if not hmac.compare_digest(answer, _answer(key, b"c2s", sn, cn, context)):
        raise AuthError(f"trainer {h.trainer}: wrong answer to the challenge (not this trainer's key, another "
                        f"job or pserver, integrity {'on' if integrity else 'off'} here, or a replay)")
    suite = choose(h.aux, OFFER)
    if not suite:
        raise AuthError(f"trainer {h.trainer} offers frame MACs {h.aux:#x}, this pserver has {OFFER:#x}: none in "
                        "common (a different paddle_cluster version?)")
    context += b"|suite%d" % suite
    sock.sendall(P.pack_header(P.Op.AUTH_OK, trainer=h.trainer, length=MAC_SIZE, aux=suite)
                 + _answer(key, b"s2c", cn, sn, context))
    c2s, s2c = _session(key, sn, cn, context, suite)
    return h.trainer, (Keys(send=s2c, recv=c2s) if integrity else None)


def client_handshake(sock: socket.socket, key_hex: str, job_id: str, pserver: int, trainer: int,
                     integrity: bool, timeout: float = HANDSHAKE_TIMEOUT, offer: Optional[int] = None
                     ) -> Optional[Keys]:
    """Answer pserver ``pserver``'s challenge as ``trainer`` and check that it, too, knows the key.
    ``offer``: the frame MACs to offer (default: every one this side has)."""
    offer = OFFER if offer is None else offer
    deadline = time.monotonic() + timeout
    key = bytes.fromhex(key_hex)
    context = _context(job_id, pserver, trainer, integrity, P.VERSION) + b"|offer%d" % offer
    _, sn = _recv_frame(sock, P.Op.AUTH_CHALLENGE, NONCE_SIZE, deadline)
    cn = os.urandom(NONCE_SIZE)
    sock.settimeout(timeout)
    sock.sendall(P.pack_header(P.Op.AUTH_RESPONSE, trainer=trainer, length=MAC_SIZE + NONCE_SIZE, aux=offer)
                 + _answer(key, b"c2s", sn, cn, context) + cn)
    try:
        ok, proof = _recv_frame(sock, P.Op.AUTH_OK, MAC_SIZE, deadline)
    except ConnectionLost:
        raise AuthError("the pserver refused our answer (same PADDLE_JOB_SECRET / PADDLE_TRAINER_KEY, job id, "
                        "pserver and INTEGRITY setting on both sides?)") from None
    except ProtocolError as e:
        raise AuthError(f"bad answer from the pserver: {e}") from None
    context += b"|suite%d" % ok.aux
    if not hmac.compare_digest(proof, _answer(key, b"s2c", cn, sn, context)):
        raise AuthError("the pserver failed to prove it knows the job secret")
    if not ok.aux & offer or ok.aux not in SUITES:
        raise AuthError(f"the pserver chose frame MAC {ok.aux}, which this trainer did not offer")
    c2s, s2c = _session(key, sn, cn, context, ok.aux)
    return Keys(send=c2s, recv=s2c) if integrity else None
