"""The same-host lane's setup (docs/architecture.md, "The same-host lane"): a trainer's sealed memfd handed to a
pserver on its node over an abstract Unix socket, then claimed on the authenticated TCP connection.

Trainer side: ``create`` makes the memfd and maps it, ``offer`` hands it to one pserver: its trainer id and a
fresh nonce first, then, only once the listener proved it knows the trainer's key (its answer is a MAC under
it over both nonces: a process that merely bound the socket name cannot make it), the descriptor
(``SCM_RIGHTS``) with a MAC of its size; the trainer's nonce then goes in a ``LANE`` frame on the TCP
connection. Pserver side: a ``Desk`` answers every connection on the abstract socket without ever blocking on
one (a silent peer holds nothing), checks each offer (same user, MAC, seals, size, its memory budget) and keeps
it under its nonce until a connection of the same trainer ``claim``s it with a layout of exactly its size.
Either side's refusal is a ``LaneRefused`` with the reason; the trainer then stays on TCP.
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import logging
import mmap
import os
import secrets
import selectors
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple

import numpy as np

from .protocol import byte_view
from .stream import SEGMENT

log = logging.getLogger("paddle_cluster.ps")

NONCE_SIZE = 32
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL  # the size the pserver checked holds
_HELLO = struct.Struct("<h32s")  # trainer, its nonce
_PROOF = struct.Struct("<c32s32s")  # b"\1", the desk's nonce, the desk's MAC (it knows the trainer's key)
_OFFER = struct.Struct("<Q32s")  # size, the trainer's MAC; the descriptor attached
OFFER_TIMEOUT = 5.0  # seconds an offer's exchange may take, and an unclaimed offer is kept
MAX_PENDING = 64  # offers kept unclaimed at once (each holds a descriptor, its memory charged to the budget)
MAX_PENDING_PER_TRAINER = 16  # of them one trainer's (it offers one per dense connection at a registration)
MAX_TALKS = 64  # connections in their exchange at the desk at once; past it the oldest is dropped
# Lanes one connection may hold, one per registration: a frontend registers once per optimizer group (a handful).
# Each is a mapping in the pserver: 8 x the connection cap (256 by default) stays far below Linux's default
# vm.max_map_count (65530), so a trainer cannot use up the pserver's mappings.
MAX_LANES = 8
ALIGN = 64  # a parameter's place in a lane: cache-line aligned
_CRED = struct.Struct("3i")  # pid, uid, gid
_PAGE = mmap.PAGESIZE


class LaneRefused(Exception):
    """No lane: the reason, for the one log line that says the trainer stays on TCP."""


def socket_name(job_id: str, pserver: int, port: int, token: str) -> bytes:
    """The pserver's abstract socket (a leading NUL: no file). Per network namespace, like its TCP port. Its
    ``token`` is drawn at random when the pserver starts and told to its trainers only on their authenticated
    connections (``DECLARE``'s answer): no other process can take the name before the pserver does."""
    job = hashlib.sha256(job_id.encode()).hexdigest()[:16]
    return b"\0paddle-cluster-lane/%s/%d/%d/%s" % (job.encode(), pserver, port, token.encode())


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def mapped_bytes(size: int) -> int:
    """What mapping a lane of ``size`` bytes costs: whole pages."""
    return -(-size // _PAGE) * _PAGE


def _mac(key: bytes, label: bytes, job_id: str, pserver: int, trainer: int, port: int, mine: bytes, desk: bytes,
         size: int) -> bytes:
    msg = b"%s|%s|%d|%d|%d|%s|%s|%d" % (label, job_id.encode(), pserver, trainer, port, mine.hex().encode(),
                                        desk.hex().encode(), size)
    return hmac.new(key, msg, hashlib.sha256).digest()


def _peer_uid(sock: socket.socket) -> int:
    return _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))[1]


@dataclass
class Lane:
    """A mapped lane of ``size`` bytes. The trainer's, made by ``create``, is offered to one pserver (its
    connection claims it) while ``fd`` is open; a pserver's is one connection's mapping, ``on_close`` giving
    back what it holds (its budget, its blocks' places)."""

    mem: mmap.mmap
    size: int
    fd: int = -1
    on_close: Optional[Callable[[], None]] = None

    def offered(self) -> None:
        """No more offers: the descriptor is closed, the mapping stays."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def close(self) -> None:
        self.offered()
        done, self.on_close = self.on_close, None
        if done is not None:
            done()
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


def offer(lane: Lane, job_id: str, key_hex: str, pserver: int, trainer: int, port: int, token: str,
          timeout: float = OFFER_TIMEOUT) -> bytes:
    """Trainer side: hand ``lane`` to pserver ``pserver`` (its first TCP port ``port``, its desk's ``token``) on
    this node; the nonce to
    claim it with on the TCP connection. ``LaneRefused`` says why not. The descriptor goes only to a listener
    that proved it knows this trainer's key: one that did not (another process of this user holding the socket
    name) gets nothing, and that is logged."""
    key, mine = bytes.fromhex(key_hex), os.urandom(NONCE_SIZE)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
            s.settimeout(timeout)
            try:
                s.connect(socket_name(job_id, pserver, port, token))
            except OSError as e:  # no such name: the pserver is on another host or in another network namespace
                raise LaneRefused(f"no lane socket on this node ({e.strerror})") from None
            uid = _peer_uid(s)
            if uid != os.getuid():
                raise LaneRefused(f"the lane socket belongs to uid {uid}, not this user ({os.getuid()})")
            s.send(_HELLO.pack(trainer, mine))
            answer = s.recv(512)
            if len(answer) != _PROOF.size or answer[:1] != b"\1":
                raise LaneRefused(f"the pserver refused the lane: {answer.decode('utf-8', 'replace') or 'no answer'}")
            _, desk, proof = _PROOF.unpack(answer)
            if not hmac.compare_digest(proof, _mac(key, b"desk", job_id, pserver, trainer, port, mine, desk, 0)):
                log.warning("trainer %d: the lane socket of pserver %d did not prove it knows this trainer's key: "
                            "another process of this user holds its name; no memory handed to it", trainer, pserver)
                raise LaneRefused(f"the lane socket of pserver {pserver} did not prove it knows this trainer's key "
                                  "(another process holds its name)")
            mac = _mac(key, b"lane", job_id, pserver, trainer, port, mine, desk, lane.size)
            socket.send_fds(s, [_OFFER.pack(lane.size, mac)], [lane.fd])
            answer = s.recv(512)
    except OSError as e:
        raise LaneRefused(f"lane setup failed: {e.strerror or e}") from None
    if answer != b"\0":
        raise LaneRefused(f"the pserver refused the lane: {answer.decode('utf-8', 'replace') or 'no answer'}")
    return mine


@dataclass
class _Pending:
    trainer: int
    fd: int
    size: int
    charged: int
    at: float = field(default_factory=time.monotonic)


@dataclass
class _Talk:
    """One connection's exchange at the desk: its hello, then its offer, each within ``until``."""

    until: float
    trainer: int = -1
    mine: bytes = b""
    desk: bytes = b""


class Desk:
    """Pserver side: the abstract socket lanes are offered on, and the offers waiting to be claimed.

    ``charge(nbytes, what)`` / ``release(nbytes)``: the pserver's memory budget. An offer's memfd is charged
    whole when the desk keeps its descriptor (it keeps that memory alive, whatever the trainer does with its own
    descriptor), and the charge goes with the lane to the connection that claims it, until that lane closes."""

    def __init__(self, job_id: str, pserver: int, port: int, key_of: Callable[[int], str], n_trainers: int,
                 charge: Optional[Callable[[int, str], None]] = None,
                 release: Optional[Callable[[int], None]] = None) -> None:
        self.job_id, self.pserver, self.port = job_id, pserver, port
        self.key_of, self.n_trainers = key_of, n_trainers
        self._charge = charge or (lambda n, what: None)
        self._release = release or (lambda n: None)
        self._pending: Dict[bytes, _Pending] = {}
        self._placed: Dict[int, Set[int]] = {}  # trainer -> the blocks in its lanes here, on all its connections
        self._lock = threading.Lock()
        self._sock: Optional[socket.socket] = None
        self._done = threading.Event()
        self._foreign = 0  # connections from other users refused
        self.token = secrets.token_hex(16)  # in the socket's name (``socket_name``)

    def start(self) -> None:
        """Listen (an ``OSError`` if the name is taken: the pserver then serves without lanes)."""
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            s.bind(socket_name(self.job_id, self.pserver, self.port, self.token))
            s.listen(64)
        except OSError:
            s.close()
            raise
        s.setblocking(False)
        self._sock = s
        threading.Thread(target=self._loop, daemon=True, name=f"pserver{self.pserver}-lanes").start()

    def stop(self) -> None:
        self._done.set()
        if self._sock is not None:
            self._sock.close()
        with self._lock:
            for p in self._pending.values():
                os.close(p.fd)
                self._release(p.charged)
            self._pending.clear()

    def _loop(self) -> None:
        """Every connection answered as its message arrives, none waited for: a peer that says nothing is dropped
        after ``OFFER_TIMEOUT``, or sooner when ``MAX_TALKS`` others talk (the oldest goes)."""
        assert self._sock is not None
        sel = selectors.DefaultSelector()
        sel.register(self._sock, selectors.EVENT_READ)
        talks: Dict[socket.socket, _Talk] = {}
        try:
            while not self._done.is_set():
                try:
                    ready = sel.select(0.25)
                except (OSError, ValueError):  # the listener closed by ``stop``
                    return
                for k, _ in ready:
                    if k.fileobj is self._sock:
                        self._greet(sel, talks)
                    elif k.fileobj in talks:
                        self._step(sel, talks, k.fileobj)  # type: ignore[arg-type]
                now = time.monotonic()
                for c in [c for c, t in talks.items() if t.until <= now]:
                    self._end(sel, talks, c)
                self._expire()
        finally:
            for c in list(talks):
                self._end(sel, talks, c)
            sel.close()

    def _greet(self, sel: selectors.BaseSelector, talks: Dict[socket.socket, _Talk]) -> None:
        assert self._sock is not None
        try:
            c, _ = self._sock.accept()
        except OSError:
            return
        uid = _peer_uid(c)
        if uid != os.getuid():  # closed unanswered at once: another user cannot hold the desk up
            if not self._foreign:
                log.warning("pserver %d: refused a lane from uid %d (not this pserver's user; further ones are not "
                            "logged)", self.pserver, uid)
            self._foreign += 1
            c.close()
            return
        c.setblocking(False)
        if len(talks) >= MAX_TALKS:
            self._end(sel, talks, min(talks, key=lambda s: talks[s].until))
        talks[c] = _Talk(time.monotonic() + OFFER_TIMEOUT)
        sel.register(c, selectors.EVENT_READ)

    @staticmethod
    def _end(sel: selectors.BaseSelector, talks: Dict[socket.socket, _Talk], c: socket.socket) -> None:
        talks.pop(c, None)
        try:
            sel.unregister(c)
        except (KeyError, ValueError):
            pass
        c.close()

    def _step(self, sel: selectors.BaseSelector, talks: Dict[socket.socket, _Talk], c: socket.socket) -> None:
        """The connection's next message: its hello (answered with the desk's proof) or its offer (answered with
        NUL or why not, and the end of the exchange)."""
        t, done = talks[c], True
        fds: List[int] = []
        try:
            msg, fds, _, _ = socket.recv_fds(c, 512, 4)
            if not msg:
                return
            if t.trainer < 0:
                answer, done = self._hello(t, msg)
            else:
                answer = self._take(t, msg, fds[0] if fds else -1)
                fds = fds[1:]
            c.send(answer)
        except BlockingIOError:  # a spurious wake-up, or a peer that does not read its answers: it waits on
            done = False
        except OSError:
            pass
        finally:
            for fd in fds:
                os.close(fd)
            if done:
                self._end(sel, talks, c)

    def _hello(self, t: _Talk, msg: bytes) -> Tuple[bytes, bool]:
        """(the answer to a hello, whether the exchange ends with it)."""
        if len(msg) != _HELLO.size:
            return b"malformed hello", True
        t.trainer, t.mine = _HELLO.unpack(msg)
        if not 0 <= t.trainer < self.n_trainers:
            return f"trainer id {t.trainer} is outside [0, {self.n_trainers})".encode(), True
        t.desk = os.urandom(NONCE_SIZE)
        proof = _mac(bytes.fromhex(self.key_of(t.trainer)), b"desk", self.job_id, self.pserver, t.trainer, self.port,
                     t.mine, t.desk, 0)
        return _PROOF.pack(b"\1", t.desk, proof), False

    def _take(self, t: _Talk, msg: bytes, fd: int) -> bytes:
        """An offer (of this user, after the desk's proof): checked and kept (the answer NUL), or why not."""
        try:
            why = self._check(t, msg, fd)
        except OSError as e:
            why = f"bad descriptor ({e.strerror})"
        if why:
            if fd >= 0:
                os.close(fd)
            log.warning("pserver %d: refused a lane: %s", self.pserver, why)
            return why.encode()
        return b"\0"

    def _check(self, t: _Talk, msg: bytes, fd: int) -> str:
        """Keep the offer (returns ""), or why not."""
        if len(msg) != _OFFER.size or fd < 0:
            return "malformed offer"
        size, mac = _OFFER.unpack(msg)
        want = _mac(bytes.fromhex(self.key_of(t.trainer)), b"lane", self.job_id, self.pserver, t.trainer, self.port,
                    t.mine, t.desk, size)
        if not hmac.compare_digest(mac, want):
            return f"trainer {t.trainer}: the offer's MAC is wrong (not this trainer's key, job or pserver)"
        if size <= 0 or size % (2 * ALIGN):  # a gradient area and a value area of the same size, aligned
            return f"trainer {t.trainer}: a lane of {size} bytes"
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        if seals & SEALS != SEALS:
            return f"trainer {t.trainer}: the memory is not sealed against resizing"
        if os.fstat(fd).st_size != size:
            return f"trainer {t.trainer}: the memory is {os.fstat(fd).st_size} bytes, the offer says {size}"
        self._expire()
        with self._lock:
            if len(self._pending) >= MAX_PENDING:
                return f"{MAX_PENDING} offers are waiting to be claimed"
            if t.mine in self._pending:
                return f"trainer {t.trainer}: an offer under that nonce is waiting already"
            if sum(p.trainer == t.trainer for p in self._pending.values()) >= MAX_PENDING_PER_TRAINER:
                return f"trainer {t.trainer}: {MAX_PENDING_PER_TRAINER} of its offers are waiting to be claimed"
        charged = mapped_bytes(size)
        try:
            self._charge(charged, f"trainer {t.trainer}'s same-host lane offered ({size} bytes of shared memory)")
        except Exception as e:  # noqa: BLE001 - the budget's LimitExceeded, told to the trainer
            return str(e)
        with self._lock:
            self._pending[t.mine] = _Pending(t.trainer, fd, size, charged)
        return ""

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            for k in [k for k, p in self._pending.items() if now - p.at > OFFER_TIMEOUT]:
                p = self._pending.pop(k)
                os.close(p.fd)
                self._release(p.charged)

    def drop(self, trainer: int, nonce: bytes) -> None:
        """Let go of trainer ``trainer``'s offer under ``nonce``, if the desk still keeps it."""
        with self._lock:
            p = self._pending.get(bytes(nonce))
            if p is None or p.trainer != trainer:
                return
            del self._pending[bytes(nonce)]
        os.close(p.fd)
        self._release(p.charged)

    def claim(self, trainer: int, nonce: bytes, size: int, blocks: Set[int]) -> Lane:
        """The lane offered under ``nonce``, mapped, if trainer ``trainer`` offered it and it is ``size`` bytes
        (what its layout, ``blocks``, needs: no more); else ``LaneRefused``. A block is in one lane of a trainer
        on all its connections here, so what a trainer has mapped here is at most its blocks' bytes twice."""
        self._expire()  # an offer kept past its time is gone, whether or not the desk dropped it yet
        with self._lock:
            p = self._pending.get(bytes(nonce))
            if p is None or p.trainer != trainer:
                raise LaneRefused(f"trainer {trainer}: no lane offered under that nonce on this node")
            del self._pending[bytes(nonce)]
            placed = self._placed.setdefault(trainer, set())
            why = ""
            if p.size != size:
                why = (f"trainer {trainer}: the lane offered is {p.size} bytes, its layout needs {size}: a lane is "
                       "exactly its blocks")
            elif not placed.isdisjoint(blocks):
                why = f"trainer {trainer}: block {min(placed & blocks)} is in another of its lanes here already"
            else:
                placed.update(blocks)
        try:
            if why:
                raise LaneRefused(why)
            try:
                mem = mmap.mmap(p.fd, p.size)
            except OSError as e:
                with self._lock:
                    placed.difference_update(blocks)
                raise LaneRefused(f"trainer {trainer}: cannot map the lane ({e.strerror})") from None
        except LaneRefused:
            self._release(p.charged)
            raise
        finally:
            os.close(p.fd)

        def gone() -> None:
            with self._lock:
                placed.difference_update(blocks)
            self._release(p.charged)
        return Lane(mem, p.size, on_close=gone)


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
