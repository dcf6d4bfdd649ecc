"""The same-host lane's setup (docs/architecture.md, "The same-host lane"): a trainer's sealed memfd handed to a
pserver on its node over an abstract Unix socket, then claimed on the authenticated TCP connection.

Trainer side: ``create`` makes the memfd and maps it, ``offer`` hands it to one pserver (``SCM_RIGHTS``) with a
nonce and a MAC under the trainer's key; the nonce then goes in a ``LANE`` frame on the TCP connection. Pserver
side: a ``Desk`` listens on the abstract socket, checks each offer (same user, MAC, seals, size) and keeps it
under its nonce until a connection of the same trainer ``claim``s it. Either side's refusal is a ``LaneRefused``
with the reason; the trainer then stays on TCP.
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import logging
import mmap
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import numpy as np

from .protocol import byte_view
from .stream import SEGMENT

log = logging.getLogger("paddle_cluster.ps")

NONCE_SIZE = 32
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL  # the size the pserver checked holds
_OFFER = struct.Struct("<hQ32s32s")  # trainer, size, nonce, MAC
OFFER_TIMEOUT = 5.0  # seconds an offer's exchange may take, and an unclaimed offer is kept
MAX_PENDING = 64  # offers kept unclaimed at once (each holds a descriptor)
# Lanes one connection may hold, one per registration: a frontend registers once per optimizer group (a handful).
# Each is a mapping in the pserver that its memory budget does not count: 8 x the connection cap (256 by default)
# stays far below Linux's default vm.max_map_count (65530), so a trainer cannot use up the pserver's mappings.
MAX_LANES = 8
_CRED = struct.Struct("3i")  # pid, uid, gid


class LaneRefused(Exception):
    """No lane: the reason, for the one log line that says the trainer stays on TCP."""


def socket_name(job_id: str, pserver: int, port: int) -> bytes:
    """The pserver's abstract socket (a leading NUL: no file). Per network namespace, like its TCP port."""
    job = hashlib.sha256(job_id.encode()).hexdigest()[:16]
    return b"\0paddle-cluster-lane/%s/%d/%d" % (job.encode(), pserver, port)


def _mac(key: bytes, job_id: str, pserver: int, trainer: int, port: int, nonce: bytes, size: int) -> bytes:
    msg = b"lane|%s|%d|%d|%d|%s|%d" % (job_id.encode(), pserver, trainer, port, nonce.hex().encode(), size)
    return hmac.new(key, msg, hashlib.sha256).digest()


def _peer_uid(sock: socket.socket) -> int:
    return _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))[1]


@dataclass
class Lane:
    """A mapped lane of ``size`` bytes. The trainer's, made by ``create``, may be offered to every pserver on its
    node (each claims it on one connection) while ``fd`` is open; a pserver's is one connection's mapping."""

    mem: mmap.mmap
    size: int
    fd: int = -1

    def offered(self) -> None:
        """No more offers: the descriptor is closed, the mapping stays."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def close(self) -> None:
        self.offered()
        try:
            self.mem.close()
        except BufferError:  # an array still views it (a receive buffer the caller holds): it goes with the last
            pass


def create(size: int) -> Lane:
    """Trainer side: a sealed memfd of ``size`` bytes, mapped (``LaneRefused`` if the system cannot)."""
    if not hasattr(os, "memfd_create"):
        raise LaneRefused("this system has no memfd_create")
    try:
        fd = os.memfd_create("paddle-cluster-lane", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError as e:
        raise LaneRefused(f"memfd_create failed: {e.strerror}") from None
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
        return Lane(mmap.mmap(fd, size), size, fd)
    except OSError as e:
        os.close(fd)
        raise LaneRefused(f"lane setup failed: {e.strerror or e}") from None


def offer(lane: Lane, job_id: str, key_hex: str, pserver: int, trainer: int, port: int,
          timeout: float = OFFER_TIMEOUT) -> bytes:
    """Trainer side: hand ``lane`` to pserver ``pserver`` (its first TCP port ``port``) on this node; the nonce to
    claim it with on the TCP connection. ``LaneRefused`` says why not."""
    nonce = os.urandom(NONCE_SIZE)
    msg = _OFFER.pack(trainer, lane.size, nonce,
                      _mac(bytes.fromhex(key_hex), job_id, pserver, trainer, port, nonce, lane.size))
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
            s.settimeout(timeout)
            try:
                s.connect(socket_name(job_id, pserver, port))
            except OSError as e:  # no such name: the pserver is on another host or in another network namespace
                raise LaneRefused(f"no lane socket on this node ({e.strerror})") from None
            uid = _peer_uid(s)
            if uid != os.getuid():
                raise LaneRefused(f"the lane socket belongs to uid {uid}, not this user ({os.getuid()})")
            socket.send_fds(s, [msg], [lane.fd])
            answer = s.recv(512)
    except OSError as e:
        raise LaneRefused(f"lane setup failed: {e.strerror or e}") from None
    if answer != b"\0":
        raise LaneRefused(f"the pserver refused the lane: {answer.decode('utf-8', 'replace') or 'no answer'}")
    return nonce


@dataclass
class _Pending:
    trainer: int
    fd: int
    size: int
    at: float = field(default_factory=time.monotonic)


class Desk:
    """Pserver side: the abstract socket lanes are offered on, and the offers waiting to be claimed."""

    def __init__(self, job_id: str, pserver: int, port: int, key_of: Callable[[int], str], n_trainers: int) -> None:
        self.job_id, self.pserver, self.port = job_id, pserver, port
        self.key_of, self.n_trainers = key_of, n_trainers
        self._pending: Dict[bytes, _Pending] = {}
        self._lock = threading.Lock()
        self._sock: Optional[socket.socket] = None
        self._done = threading.Event()
        self._foreign = 0  # connections from other users refused

    def start(self) -> None:
        """Listen (an ``OSError`` if the name is taken: the pserver then serves without lanes)."""
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            s.bind(socket_name(self.job_id, self.pserver, self.port))
            s.listen(16)
        except OSError:
            s.close()
            raise
        s.settimeout(0.5)
        self._sock = s
        threading.Thread(target=self._accept_loop, daemon=True, name=f"pserver{self.pserver}-lanes").start()

    def stop(self) -> None:
        self._done.set()
        if self._sock is not None:
            self._sock.close()
        with self._lock:
            for p in self._pending.values():
                os.close(p.fd)
            self._pending.clear()

    def _accept_loop(self) -> None:
        assert self._sock is not None
        while not self._done.is_set():
            try:
                c, _ = self._sock.accept()
            except socket.timeout:
                self._expire()
                continue
            except OSError:
                if self._done.is_set():
                    return
                time.sleep(0.05)
                continue
            with c:
                uid = _peer_uid(c)
                if uid != os.getuid():  # closed unanswered at once: another user cannot hold the desk up
                    if not self._foreign:
                        log.warning("pserver %d: refused a lane from uid %d (not this pserver's user; further "
                                    "ones are not logged)", self.pserver, uid)
                    self._foreign += 1
                    continue
                c.settimeout(OFFER_TIMEOUT)
                try:
                    c.send(self._take(c))
                except OSError:
                    pass

    def _take(self, c: socket.socket) -> bytes:
        """One offer on connection ``c`` (of this user): checked and kept (the answer NUL), or why it is refused."""
        msg, fds, _, _ = socket.recv_fds(c, _OFFER.size + 1, 4)
        fd = fds[0] if fds else -1
        for extra in fds[1:]:
            os.close(extra)
        try:
            why = self._check(msg, fd)
        except OSError as e:
            why = f"bad descriptor ({e.strerror})"
        if why:
            if fd >= 0:
                os.close(fd)
            log.warning("pserver %d: refused a lane: %s", self.pserver, why)
            return why.encode()
        return b"\0"

    def _check(self, msg: bytes, fd: int) -> str:
        """Keep the offer (returns ""), or why not."""
        if len(msg) != _OFFER.size or fd < 0:
            return "malformed offer"
        trainer, size, nonce, mac = _OFFER.unpack(msg)
        if not 0 <= trainer < self.n_trainers:
            return f"trainer id {trainer} is outside [0, {self.n_trainers})"
        want = _mac(bytes.fromhex(self.key_of(trainer)), self.job_id, self.pserver, trainer, self.port, nonce, size)
        if not hmac.compare_digest(mac, want):
            return f"trainer {trainer}: the offer's MAC is wrong (not this trainer's key, job or pserver)"
        if size <= 0 or size % 2:  # a gradient area and a value area of the same size
            return f"trainer {trainer}: a lane of {size} bytes"
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        if seals & SEALS != SEALS:
            return f"trainer {trainer}: the memory is not sealed against resizing"
        if os.fstat(fd).st_size != size:
            return f"trainer {trainer}: the memory is {os.fstat(fd).st_size} bytes, the offer says {size}"
        self._expire()
        with self._lock:
            if len(self._pending) >= MAX_PENDING:
                return f"{MAX_PENDING} offers are waiting to be claimed"
            self._pending[nonce] = _Pending(trainer, fd, size)
        return ""

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            for k in [k for k, p in self._pending.items() if now - p.at > OFFER_TIMEOUT]:
                os.close(self._pending.pop(k).fd)

    def claim(self, trainer: int, nonce: bytes) -> Lane:
        """The lane offered under ``nonce``, mapped, if trainer ``trainer`` offered it; else ``LaneRefused``."""
        self._expire()  # an offer kept past its time is gone, whether or not the accept loop dropped it yet
        with self._lock:
            p = self._pending.get(bytes(nonce))
            if p is None or p.trainer != trainer:
                raise LaneRefused(f"trainer {trainer}: no lane offered under that nonce on this node")
            del self._pending[bytes(nonce)]
        try:
            return Lane(mmap.mmap(p.fd, p.size), p.size)
        except OSError as e:
            raise LaneRefused(f"trainer {trainer}: cannot map the lane ({e.strerror})") from None
        finally:
            os.close(p.fd)


class Payload:
    """A push's gradient in a lane, read the way a ``stream.Stream`` reads a frame's payload (``chunks``,
    ``recv_into``, ``discard``), so a block folds it as it folds one received over TCP."""

    def __init__(self, data: np.ndarray) -> None:
        self.data = data.reshape(-1).view(np.uint8)

    def chunks(self, into: Optional[Callable[[int], Any]] = None) -> Iterator[Tuple[int, memoryview]]:
        for off in range(0, len(self.data), SEGMENT):
            piece = self.data[off:off + SEGMENT]
            dest = into(off) if into is not None else None
            if dest is not None:  # a pool slot that becomes the segment's sum: the bytes must be in it
                d = np.frombuffer(dest, np.uint8, len(piece))
                np.copyto(d, piece)
                piece = d
            yield off, memoryview(piece)

    def recv_into(self, *views: Any) -> None:
        off = 0
        for v in views:
            d = np.frombuffer(byte_view(v), np.uint8)
            np.copyto(d, self.data[off:off + len(d)])
            off += len(d)

    def discard(self) -> None:
        pass
