"""A workspace archive passed down a chain of nodes, so the launcher's uplink carries it once.

Every node that lacks the archive opens a ``Receiver``: a FIFO the launcher writes into over SSH (``cat >``)
and a TCP listener on its PADDLE_NIC address. The launcher feeds the first node; each node forwards every
piece it reads to the next node's listener at once, then hashes it and hands it to its unpacker (a pipe into
``trees.store``: no archive file is kept). A link is authenticated both ways
by the dispatch's one-time token (HMAC-SHA256 over fresh nonces and the archive's hash); the bytes themselves
travel in the clear on the cluster network, and every node checks the archive's SHA-256 before using it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import select
import socket
import time
from typing import BinaryIO, Callable, Optional

CHUNK = 1 << 20
NONCE = 32
LINK_TIMEOUT = 10.0  # connecting to the next node and proving the token, each way
ACCEPT_TIMEOUT = 30.0  # how long a node waits for the node before it to connect (a refused link says so sooner)
IDLE_TIMEOUT = 60.0  # a source that sends nothing for this long is given up
PROGRESS_S = 10.0  # how often a node receiving an archive tells the launcher how far it is
Report = Callable[..., None]  # report(kind, **doc): one line to the launcher (node/session.py)


class LinkError(Exception):
    """A chain link could not be made or broke; the message says which and why."""


def recv_by(sock: socket.socket, n: int, deadline: float) -> bytes:
    """``n`` bytes before ``deadline`` (time.monotonic), else LinkError. (Not ps.auth's: importing paddle_cluster.ps
    imports numpy, ~0.2 s of CPU a node's session does not need.)"""
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


class Receiver:
    """One node's end of the dispatch: its FIFO (``fifo``) and its listener (``port``)."""

    def __init__(self, address: str, fifo: str) -> None:
        self.fifo = fifo
        self.listener = socket.create_server((address, 0))
        self.port = self.listener.getsockname()[1]
        os.mkfifo(self.fifo, 0o600)
        # Opened for reading and writing, so it never reads as ended: the archive's size says when it is whole.
        self._fifo_fd = os.open(self.fifo, os.O_RDWR)

    def receive(self, source: str, forward: str, token: bytes, sha: str, size: int, out: BinaryIO, stop_fd: int,
                report: Report) -> str:
        """Read the archive from ``source`` ("launcher": the FIFO; "chain": the node before) into ``out``,
        forwarding each piece to ``forward`` (``host:port``, or ""); "" when it arrived whole with the right
        hash, else why not. A line on ``stop_fd`` (the launcher) ends the wait. ``report("forward", error=...,
        linked=...)`` says the link to the next node failed: never made (that node still waits), or broken (it
        sees its sender stop); ``report("progress", got=...)`` every PROGRESS_S, so the launcher hears the node
        is alive however long the archive takes."""
        fwd: Optional[socket.socket] = None
        if forward:
            try:
                fwd = connect(forward, token, sha)
            except LinkError as e:
                report("forward", error=str(e), linked=False)
        try:
            if source == "chain":
                sock, why = self._accept(token, sha, stop_fd)
                if sock is None:
                    return why
                with sock:
                    return self._pump(sock.fileno(), size, sha, out, stop_fd, fwd, report)
            return self._pump(self._fifo_fd, size, sha, out, stop_fd, fwd, report)
        finally:
            if fwd is not None:
                fwd.close()

    def _accept(self, token: bytes, sha: str, stop_fd: int):
        deadline = time.monotonic() + ACCEPT_TIMEOUT
        while True:
            left = deadline - time.monotonic()
            r, _, _ = select.select([self.listener, stop_fd], [], [], max(left, 0))
            if stop_fd in r:
                return None, "the link from the node before failed"
            if not r:
                return None, f"the node before did not connect within {ACCEPT_TIMEOUT:g} s"
            sock, _peer = self.listener.accept()
            try:  # a connection that cannot prove the token is dropped; the right one may still come
                mine = secrets.token_bytes(NONCE)
                sock.sendall(mine)
                end = time.monotonic() + LINK_TIMEOUT
                answer, theirs = recv_by(sock, 32, end), recv_by(sock, NONCE, end)
                if hmac.compare_digest(answer, _proof(token, b"send", sha, mine)):
                    sock.sendall(_proof(token, b"recv", sha, theirs))
                    sock.settimeout(None)
                    return sock, ""
            except (OSError, LinkError):
                pass
            sock.close()

    @staticmethod
    def _pump(fd: int, size: int, sha: str, out: BinaryIO, stop_fd: int, fwd: Optional[socket.socket],
              report: Report) -> str:
        h = hashlib.sha256()
        buf = memoryview(bytearray(CHUNK))
        got, said = 0, time.monotonic()
        while got < size:
            if time.monotonic() - said > PROGRESS_S:
                report("progress", got=got)
                said = time.monotonic()
            # A whole chunk is gathered before it is passed on: per piece, forwarding, hashing and the unpacker's
            # wake-up cost far more CPU than the reads (a socket read returns ~64 KiB at a time).
            want, n = min(CHUNK, size - got), 0
            while n < want:
                r, _, _ = select.select([fd, stop_fd], [], [], IDLE_TIMEOUT)
                if stop_fd in r:
                    return f"stopped by the launcher after {got + n} of {size} bytes"
                if not r:
                    return f"nothing arrived for {IDLE_TIMEOUT:g} s after {got + n} of {size} bytes"
                k = os.readv(fd, [buf[n:want]])
                if k == 0:
                    return f"the sender stopped after {got + n} of {size} bytes"
                n += k
            piece = buf[:n]
            got += n
            if fwd is not None:  # first: the next node's link is the chain's critical path
                try:
                    fwd.sendall(piece)
                except OSError as e:
                    why = f"forwarding to the next node broke after {got - n} bytes: {e}"
                    report("forward", error=why, linked=True)
                    fwd.close()
                    fwd = None
            h.update(piece)
            out.write(piece)
        return "" if h.hexdigest() == sha else "checksum mismatch after the transfer"

    def close(self) -> None:
        self.listener.close()
        os.close(self._fifo_fd)
        if os.path.lexists(self.fifo):
            os.unlink(self.fifo)
