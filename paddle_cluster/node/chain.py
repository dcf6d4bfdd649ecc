"""A workspace archive passed down a chain of nodes, so the launcher's uplink carries it once.

Every node that lacks the archive opens a ``Receiver``: a FIFO the launcher writes into over SSH (``cat >``)
and a TCP listener on its PADDLE_NIC address. The chain starts as soon as the first node is ready: the launcher
feeds it, and each later node joins at the end as its session comes up. A node keeps what it receives in a
spool file (no name: it is gone when the node closes it, however the node ends) until the launcher says
which node comes next (``Forward``); it then sends the spool and, caught up, every piece as it arrives, and
drops the spool. Each piece is also handed to the node's unpacker (a pipe into ``trees.store``).
A link is authenticated both ways by the dispatch's one-time token (HMAC-SHA256 over fresh nonces and the
archive's hash); the bytes themselves travel in the clear on the cluster network, so every node that received
them over a link checks the archive's SHA-256 before using it. The node the launcher feeds does not: SSH
already protects what it reads from its FIFO, and the launcher names the hash of exactly those bytes.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import select
import socket
import tempfile
import time
from typing import BinaryIO, Callable, Dict, Optional

CHUNK = 1 << 20
NONCE = 32
LINK_TIMEOUT = 10.0  # connecting to the next node and proving the token, each way
# A connection to a receiver must prove the token within this (the node before does in one round trip); a peer
# that does not is dropped, and never delays the others (each is answered as its proof arrives).
HANDSHAKE_TIMEOUT = 2.0
MAX_PENDING = 64  # connections proving the token at once; past it the oldest is dropped
ACCEPT_TIMEOUT = 30.0  # how long a node waits for the node before it to connect (a refused link says so sooner)
IDLE_TIMEOUT = 60.0  # a source that sends nothing for this long is given up
PROGRESS_S = 10.0  # how often a node receiving an archive tells the launcher how far it is
Report = Callable[..., None]  # report(kind, **doc): one line to the launcher (node/session.py)


class LinkError(Exception):
    """A chain link could not be made or broke; the message says which and why."""


def recv_by(sock: socket.socket, n: int, deadline: float) -> bytes:
    """``n`` bytes before ``deadline`` (time.monotonic), else LinkError. (Not ps.wire.auth's: importing
    paddle_cluster.ps imports numpy, ~0.2 s of CPU a node's session does not need.)"""
    buf = bytearray()
    while len(buf) < n:
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            got = sock.recv(n - len(buf))
        except socket.timeout:
            raise LinkError("the other end did not answer in time") from None
        if not got:
            raise LinkError(f"the other end closed the link after {len(buf)} of {n} bytes")
        buf += got
    return bytes(buf)


def _proof(token: bytes, label: bytes, sha: str, nonce: bytes) -> bytes:
    return hmac.new(token, label + sha.encode() + nonce, hashlib.sha256).digest()


def connect(address: str, token: bytes, sha: str) -> socket.socket:
    """A link to the next node's listener at ``host:port``, both ends proven to hold ``token``."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + LINK_TIMEOUT
    try:
        sock = socket.create_connection((host, int(port)), timeout=LINK_TIMEOUT)
    except OSError as e:
        raise LinkError(f"cannot connect to {address}: {e.strerror or e}") from None
    try:
        theirs = recv_by(sock, NONCE, deadline)
        mine = secrets.token_bytes(NONCE)
        sock.sendall(_proof(token, b"send", sha, theirs) + mine)
        if not hmac.compare_digest(recv_by(sock, 32, deadline), _proof(token, b"recv", sha, mine)):
            raise LinkError(f"{address} did not prove it holds this dispatch's token")
        sock.settimeout(IDLE_TIMEOUT)
        return sock
    except (OSError, LinkError) as e:
        sock.close()
        raise LinkError(e if isinstance(e, LinkError) else f"link to {address}: {e}") from None


class Orders:
    """What the launcher says while a node receives, read off ``fd`` one order per ``take()`` (the session's
    stdin, ``node/session.py``): the next node (``forward``: None not said yet, "" none), ``stop`` (why) and, for an
    archive sent while it was made, its hash once the launcher knows it (``sealed``)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.forward: Optional[str] = None
        self.stop = ""
        self.sealed = ""

    def take(self) -> None:
        raise NotImplementedError


class _Onward:
    """The way on to the next node: every piece spooled until the launcher names that node (or says there is
    none), then the spool sent (``sendfile``, as the link takes it), then, caught up, each piece as it arrives."""

    def __init__(self, spool_dir: str, token: bytes, sha: str, report: Report) -> None:
        self.token, self.sha, self.report = token, sha, report
        self.sock: Optional[socket.socket] = None
        self.spool: Optional[BinaryIO] = tempfile.TemporaryFile(dir=spool_dir, prefix="spool-", buffering=0)
        self.spooled = self.sent = 0
        self.decided = False

    def decide(self, to: str) -> None:
        self.decided = True
        if to:
            try:
                self.sock = connect(to, self.token, self.sha)
                self.sock.settimeout(0)  # while it catches up: sent only when select says the link takes more
            except LinkError as e:
                self.report("forward", error=str(e), linked=False)
        if self.sock is None or self.sent == self.spooled:
            self._caught_up()

    def behind(self) -> bool:
        return self.sock is not None and self.spool is not None

    def done(self) -> bool:
        return self.decided and not self.behind()

    def feed(self, piece: memoryview) -> None:
        if self.spool is not None:
            self.spool.write(piece)
            self.spooled += len(piece)
        elif self.sock is not None:
            try:
                self.sock.sendall(piece)
                self.sent += len(piece)
            except OSError as e:
                self._broken(e)

    def send_spooled(self) -> None:
        assert self.sock is not None and self.spool is not None
        try:
            self.sent += os.sendfile(self.sock.fileno(), self.spool.fileno(), self.sent, self.spooled - self.sent)
        except BlockingIOError:
            return
        except OSError as e:
            self._broken(e)
            return
        if self.sent == self.spooled:
            self._caught_up()

    def stalled(self) -> None:
        self._broken(OSError(f"the next node took nothing for {IDLE_TIMEOUT:g} s"))

    def _caught_up(self) -> None:
        if self.spool is not None:
            self.spool.close()
            self.spool = None
        if self.sock is not None:
            self.sock.settimeout(IDLE_TIMEOUT)

    def _broken(self, e: OSError) -> None:
        self.report("forward", error=f"forwarding to the next node broke after {self.sent} bytes: {e}", linked=True)
        self.close()

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.spool is not None:
            self.spool.close()
            self.spool = None


class _Pending:
    """A connection to a receiver that has not proven the token yet: the nonce it was sent, what it said so far,
    when it is dropped."""

    def __init__(self, mine: bytes, until: float) -> None:
        self.mine, self.until, self.got = mine, until, b""

    def read(self, sock: socket.socket, token: bytes, sha: str) -> bool:
        """Take what arrived; True once a right proof is in and answered. A wrong one, or a closed or broken
        connection, ends it at once (``until`` set to now)."""
        try:
            more = sock.recv(32 + NONCE - len(self.got))
        except BlockingIOError:
            return False
        except OSError:
            more = b""
        self.got += more
        if not more or len(self.got) == 32 + NONCE and not hmac.compare_digest(
                self.got[:32], _proof(token, b"send", sha, self.mine)):
            self.until = 0.0
            return False
        if len(self.got) < 32 + NONCE:
            return False
        try:
            sock.sendall(_proof(token, b"recv", sha, self.got[32:]))  # 32 bytes into an empty buffer
        except OSError:
            self.until = 0.0
            return False
        return True


class Receiver:
    """One node's end of the dispatch: its FIFO (``fifo``, alone in a directory of its own, ``where``) and its
    listener (``port``). The spool goes into ``where`` too."""

    def __init__(self, address: str, where: str) -> None:
        self.where, self.fifo = where, os.path.join(where, "fifo")
        self.listener = socket.create_server((address, 0))
        self.port = self.listener.getsockname()[1]
        self._fifo_fd: Optional[int] = None
        self._make_fifo()

    def _make_fifo(self) -> None:
        os.mkdir(self.where, 0o700)
        os.mkfifo(self.fifo, 0o600)

    def _drop_fifo(self) -> None:
        """Make any upload into the FIFO fail rather than wait: one writing (EPIPE), one blocked opening it (it
        opens, then gets EPIPE), one yet to come (the directory is gone: ENOENT, never a file made in its place)."""
        if self._fifo_fd is not None:
            os.close(self._fifo_fd)
            self._fifo_fd = None
        if os.path.lexists(self.fifo):
            try:
                os.close(os.open(self.fifo, os.O_RDONLY | os.O_NONBLOCK))
            except OSError:
                pass
            os.unlink(self.fifo)
        if os.path.isdir(self.where):
            os.rmdir(self.where)

    def receive(self, source: str, token: bytes, sha: str, size: int, out: BinaryIO, orders: Orders,
                report: Report) -> str:
        """Read the archive from ``source`` ("launcher": the FIFO; "chain": the node before) into ``out``,
        passing it on as ``orders`` say; ``sha`` "": an archive sent while it is made, whose hash ``orders.sealed``
        gives at the end; "" when it arrived whole (from the node before: with the right hash) and went on whole,
        or the link on failed; else why not. ``report("forward", error=..., linked=...)`` says the link to the
        next node failed: never made (that node still waits), or broken (it sees its sender stop);
        ``report("progress", got=...)`` every PROGRESS_S, so the launcher hears the node is alive however long
        the archive takes. ``orders.forward`` is used up once acted on: after a failed try, no node follows."""
        if not os.path.isdir(self.where):  # a try from the launcher failed before: the launcher's upload ended
            self._make_fifo()
        onward = _Onward(self.where, token, sha, report)
        why = "unfinished"
        try:
            if source == "chain":
                sock, why = self._accept(token, sha, orders)
                if sock is None:
                    return why
                with sock:
                    why = self._pump(sock.fileno(), size, sha, out, orders, onward, report, check=True)
                    return why
            if self._fifo_fd is None:
                # Opened for reading and writing, so it never reads as ended: the archive's size says when it is whole.
                self._fifo_fd = os.open(self.fifo, os.O_RDWR)
            why = self._pump(self._fifo_fd, size, sha, out, orders, onward, report, check=False)
            return why
        finally:
            onward.close()
            if why:
                if source != "chain":
                    self._drop_fifo()
                if onward.decided:
                    orders.forward = ""  # that node saw this one stop (or never heard from it): it is sent it otherwise

    def _accept(self, token: bytes, sha: str, orders: Orders):
        """The node before, proven to hold ``token``. Every connection gets its nonce at once and is answered in
        turn as its proof arrives, so a peer that says nothing holds nothing the right one needs: it is dropped
        after HANDSHAKE_TIMEOUT, or sooner when MAX_PENDING others wait (the oldest goes)."""
        deadline = time.monotonic() + ACCEPT_TIMEOUT
        pending: Dict[socket.socket, _Pending] = {}
        try:
            while True:
                now = time.monotonic()
                if now >= deadline:
                    return None, f"the node before did not connect within {ACCEPT_TIMEOUT:g} s"
                for sock in [s for s, p in pending.items() if p.until <= now]:
                    del pending[sock]
                    sock.close()
                wake = min([deadline, *(p.until for p in pending.values())])
                r, _, _ = select.select([self.listener, orders.fd, *pending], [], [], max(wake - now, 0))
                if orders.fd in r:
                    orders.take()
                    if orders.stop:
                        return None, f"the link from the node before failed ({orders.stop})"
                    continue
                if self.listener in r:
                    self._greet(pending)
                for sock in (s for s in r if s in pending):
                    if pending[sock].read(sock, token, sha):
                        del pending[sock]
                        sock.setblocking(True)
                        return sock, ""
        finally:
            for sock in pending:
                sock.close()

    def _greet(self, pending: Dict[socket.socket, _Pending]) -> None:
        """A new connection: our nonce sent, its proof awaited (never blocking: a full send buffer is a stranger)."""
        try:
            sock, _peer = self.listener.accept()
        except OSError:
            return
        sock.setblocking(False)
        mine = secrets.token_bytes(NONCE)
        try:
            if sock.send(mine) != NONCE:
                raise OSError("short send")
        except OSError:
            sock.close()
            return
        if len(pending) >= MAX_PENDING:
            oldest = min(pending, key=lambda s: pending[s].until)
            del pending[oldest]
            oldest.close()
        pending[sock] = _Pending(mine, time.monotonic() + HANDSHAKE_TIMEOUT)

    @staticmethod
    def _pump(fd: int, size: int, sha: str, out: BinaryIO, orders: Orders, onward: _Onward, report: Report,
              check: bool) -> str:
        """``check``: hash what arrives and compare it with ``sha`` (or the sealed one) at the end (a chain link);
        else (the launcher's SSH upload) the launcher's hash names the bytes as they came."""
        h = hashlib.sha256() if check else None
        buf = memoryview(bytearray(CHUNK))
        got, n, said = 0, 0, time.monotonic()  # n: bytes in buf not yet hashed and unpacked
        while got < size or not onward.done() or not (sha or orders.sealed):
            if orders.forward is not None and not onward.decided:
                onward.decide(orders.forward)
                continue
            if time.monotonic() - said > PROGRESS_S:
                report("progress", got=got)
                said = time.monotonic()
            reading, sending = got < size, onward.behind()
            r, w, _ = select.select([orders.fd] + ([fd] if reading else []), [onward.sock] if sending else [], [],
                                    IDLE_TIMEOUT if reading or sending else PROGRESS_S)
            if orders.fd in r:
                orders.take()
                if orders.stop:
                    return f"stopped by the launcher after {got} of {size} bytes ({orders.stop})"
                continue
            if not r and not w:
                if reading:
                    return f"nothing arrived for {IDLE_TIMEOUT:g} s after {got} of {size} bytes"
                if sending:
                    onward.stalled()
                continue
            if w:
                onward.send_spooled()
            if fd in r:
                k = os.readv(fd, [buf[n:min(CHUNK, n + size - got)]])
                if k == 0:
                    return f"the sender stopped after {got} of {size} bytes"
                # Each piece goes on at once (the next node's link is the chain's critical path: a hop adds only
                # the time of one read), while hashing and the unpacker take whole chunks: per piece their CPU
                # and the unpacker's wake-ups would cost far more than the reads.
                onward.feed(buf[n:n + k])
                got, n = got + k, n + k
                if n == CHUNK or got == size:
                    if h is not None:
                        h.update(buf[:n])
                    out.write(buf[:n])
                    n = 0
        return "" if h is None or h.hexdigest() == (sha or orders.sealed) else "checksum mismatch after the transfer"

    def close(self) -> None:
        self.listener.close()
        self._drop_fifo()
