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

Frame MAC: HMAC-SHA256 truncated to 16 bytes, chosen by measurement (docs/reliability.md): with the CPU's
SHA extensions hashlib's SHA-256 is the fastest sound MAC the standard library has -- faster than keyed
BLAKE2 -- and an HMAC built from two SHA-256 states hashed once per key and ``copy()``-ed per frame runs at
SHA-256 speed and can be fed chunk by chunk as bytes arrive (``hmac.new`` per frame cannot be reused).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

from . import protocol as P
from .errors import AuthError, ConnectionLost, ProtocolError

NONCE_SIZE = 32
MAC_SIZE = 32  # handshake answers: full HMAC-SHA256
TAG_SIZE = 16  # frame tags: HMAC-SHA256-128
HANDSHAKE_TIMEOUT = 10.0  # seconds for the whole handshake, however the peer trickles its bytes
_SEQ = struct.Struct("<Q")


class Mac:
    """HMAC-SHA256 under one key; ``start`` a frame, feed it as bytes arrive, ``tag`` any prefix of it."""

    def __init__(self, key: bytes) -> None:
        k = (hashlib.sha256(key).digest() if len(key) > 64 else key).ljust(64, b"\0")
        self._inner = hashlib.sha256(bytes(b ^ 0x36 for b in k))
        self._outer = hashlib.sha256(bytes(b ^ 0x5C for b in k))

    def start(self, seq: int, header: Any) -> Any:
        """A running MAC of frame number ``seq`` (never sent: both ends count) starting with its header."""
        h = self._inner.copy()
        h.update(_SEQ.pack(seq))
        h.update(header)
        return h

    def tag(self, running: Any) -> bytes:
        """The tag of everything fed to ``running`` so far (it can be fed on)."""
        o = self._outer.copy()
        o.update(running.copy().digest())
        return o.digest()[:TAG_SIZE]


@dataclass(frozen=True)
class Keys:
    """One connection's frame keys: what this side sends with, what it expects."""

    send: Mac
    recv: Mac


def _context(job_id: str, pserver: int, trainer: int, integrity: bool, version: int) -> bytes:
    jid = job_id.encode("utf-8")
    return b"|v%d|%d:%s|ps%d|t%d|mac%d" % (version, len(jid), jid, pserver, trainer, int(integrity))


def _answer(key: bytes, label: bytes, first: bytes, second: bytes, context: bytes) -> bytes:
    return hmac.new(key, label + first + second + context, hashlib.sha256).digest()


def _session(key: bytes, sn: bytes, cn: bytes, context: bytes) -> Tuple[Mac, Mac]:
    """(trainer -> pserver, pserver -> trainer) frame keys."""
    base = hmac.new(key, b"session" + sn + cn + context, hashlib.sha256).digest()
    return (Mac(hmac.new(base, b"c2s frames", hashlib.sha256).digest()),
            Mac(hmac.new(base, b"s2c frames", hashlib.sha256).digest()))


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
                     n_trainers: int, integrity: bool, timeout: float = HANDSHAKE_TIMEOUT
                     ) -> Tuple[int, Optional[Keys]]:
    """Authenticate a new connection within ``timeout`` s: (the trainer id it proved, its frame keys or None
    without integrity). Raises AuthError / ProtocolError / ConnectionLost."""
    deadline = time.monotonic() + timeout
    sn = os.urandom(NONCE_SIZE)
    sock.settimeout(timeout)
    sock.sendall(P.pack_header(P.Op.AUTH_CHALLENGE, length=NONCE_SIZE) + sn)
    h, body = _recv_frame(sock, P.Op.AUTH_RESPONSE, MAC_SIZE + NONCE_SIZE, deadline)
    if not 0 <= h.trainer < n_trainers:
        raise AuthError(f"trainer id {h.trainer} is outside [0, {n_trainers})")
    key = bytes.fromhex(key_of(h.trainer))
    context = _context(job_id, pserver, h.trainer, integrity, P.VERSION)
    answer, cn = body[:MAC_SIZE], body[MAC_SIZE:]
    if not hmac.compare_digest(answer, _answer(key, b"c2s", sn, cn, context)):
        raise AuthError(f"trainer {h.trainer}: wrong answer to the challenge (not this trainer's key, another "
                        f"job or pserver, integrity {'on' if integrity else 'off'} here, or a replay)")
    sock.sendall(P.pack_header(P.Op.AUTH_OK, trainer=h.trainer, length=MAC_SIZE)
                 + _answer(key, b"s2c", cn, sn, context))
    c2s, s2c = _session(key, sn, cn, context)
    return h.trainer, (Keys(send=s2c, recv=c2s) if integrity else None)


def client_handshake(sock: socket.socket, key_hex: str, job_id: str, pserver: int, trainer: int,
                     integrity: bool, timeout: float = HANDSHAKE_TIMEOUT) -> Optional[Keys]:
    """Answer pserver ``pserver``'s challenge as ``trainer`` and check that it, too, knows the key."""
    deadline = time.monotonic() + timeout
    key = bytes.fromhex(key_hex)
    context = _context(job_id, pserver, trainer, integrity, P.VERSION)
    _, sn = _recv_frame(sock, P.Op.AUTH_CHALLENGE, NONCE_SIZE, deadline)
    cn = os.urandom(NONCE_SIZE)
    sock.settimeout(timeout)
    sock.sendall(P.pack_header(P.Op.AUTH_RESPONSE, trainer=trainer, length=MAC_SIZE + NONCE_SIZE)
                 + _answer(key, b"c2s", sn, cn, context) + cn)
    try:
        _, proof = _recv_frame(sock, P.Op.AUTH_OK, MAC_SIZE, deadline)
    except ConnectionLost:
        raise AuthError("the pserver refused our answer (same PADDLE_JOB_SECRET / PADDLE_TRAINER_KEY, job id, "
                        "pserver and INTEGRITY setting on both sides?)") from None
    except ProtocolError as e:
        raise AuthError(f"bad answer from the pserver: {e}") from None
    if not hmac.compare_digest(proof, _answer(key, b"s2c", cn, sn, context)):
        raise AuthError("the pserver failed to prove it knows the job secret")
    c2s, s2c = _session(key, sn, cn, context)
    return Keys(send=c2s, recv=s2c) if integrity else None
