"""The pserver's sockets: listening on every port, accepting, authenticating and reading frames.

One accept thread per port and one handler thread per connection; a connection serves one request at a
time, so per-connection state needs no locks. Its replies go out in request order, written by the handler
thread itself; a sync pull that must wait for other trainers waits there too, while the kernel keeps taking
in the trainer's next requests. Malformed input from any peer costs that peer its connection and nothing
else: the reason is logged in one line, and everyone else keeps being served. After the handshake a
connection is bounded in time too (``STALL_BARRIERS``, ``IDLE_BARRIERS``); ending it for that is one log line.
"""

from __future__ import annotations

import errno
import logging
import math
import select
import socket
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import numpy as np

from ...contract import DEFAULT_MAX_CONNECTIONS, JobEnv
from ..errors import AuthError, ConnectionLost, LimitExceeded, ProtocolError, PSError
from ..wire import auth
from ..wire import protocol as P
from ..wire.lane import Lane
from ..wire.stream import Scratch, Stalled, Stream
from .budget import CONN_OVERHEAD, Budget

log = logging.getLogger("paddle_cluster.ps")
_HUNG_UP = getattr(select, "POLLRDHUP", 0) | select.POLLHUP | select.POLLERR  # the peer sent its FIN (Linux), or worse
# Connections waiting for a peer's answer to the challenge at once; past it the oldest idle one is dropped (a peer
# that says nothing holds no slot a trainer needs), and at most twice as many handshake threads run.
MAX_PENDING_HANDSHAKES = 64
# A trainer silent this many barrier timeouts on every connection is gone (a live one in sync mode never is:
# its peers' barriers would have failed first).
IDLE_BARRIERS = 3
# A frame (or a reply) that stops moving for this many barrier timeouts ends its connection. More than one: a
# trainer stalled in the middle of its push while its peers wait at the barrier is that barrier's timeout to
# report (it names the missing trainers); a stall bound equal to it raced with it.
STALL_BARRIERS = 2


class RateLog:
    """At most one line per ``every`` seconds per kind of event; the next one says how many were left out."""

    def __init__(self, logger: logging.Logger, every: float = 10.0) -> None:
        self.logger, self.every = logger, every
        self._lock = threading.Lock()
        self._last: Dict[str, float] = {}
        self._skipped: Dict[str, int] = {}

    def warning(self, kind: str, msg: str, *args: Any) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(kind, -self.every) < self.every:
                self._skipped[kind] = self._skipped.get(kind, 0) + 1
                return
            self._last[kind] = now
            skipped = self._skipped.pop(kind, 0)
        text = msg % args
        if skipped:
            text += f" ({skipped} more like it in the last {self.every:g} s not logged)"
        self.logger.warning("%s", text)


class Conn:
    """One authenticated connection's state (touched only by its handler thread, which also writes every
    reply, in request order)."""

    def __init__(self, sock: socket.socket, peer: str, port: int, pserver_id: int,
                 budget: Optional[Budget] = None) -> None:
        self.sock = sock
        self.budget = budget
        self.peer = peer
        self.port = port
        self.pserver_id = pserver_id
        self.trainer = -1
        self.stream = Stream(sock, None)  # replaced by the authenticated one after the handshake
        self.rbuf = np.empty(0, dtype=np.uint8)  # receive buffer for dense pushes, grown to the largest block
        self.lanes: List[Lane] = []  # the same-host lanes this connection claimed (``LANE``), one per registration
        self.lane_at: Dict[int, Tuple[np.ndarray, np.ndarray]] = {}  # block key -> its gradient, values in its lane

    @property
    def gone(self) -> bool:
        """The trainer closed or reset the connection: a reply still waiting for a step need not. Asked of
        the kernel (POLLRDHUP: its FIN arrived), as requests it sent before going may still be unread."""
        p = select.poll()
        p.register(self.sock, _HUNG_UP)
        try:
            return bool(p.poll(0))
        except OSError:
            return True

    def buffer(self, shape: Tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """This connection's receive buffer as an array of ``shape`` (reused by every push)."""
        nbytes = math.prod(shape) * dtype.itemsize
        if self.rbuf.nbytes < nbytes:
            if self.budget is not None:  # given back when the connection ends (``Listener._serve_conn``)
                self.budget.charge(nbytes - self.rbuf.nbytes, f"a receive buffer for trainer {self.trainer}")
            self.rbuf = np.empty(0, dtype=np.uint8)
            self.rbuf = np.empty(nbytes, dtype=np.uint8)
        return self.rbuf[:nbytes].view(dtype).reshape(shape)

    def reply_ok(self, body: Optional[Dict[str, Any]] = None, *, key: int = 0, step: int = 0) -> None:
        if body is None:
            header = P.pack_header(P.Op.OK, key=key, step=step)
            self.stream.send(header)
        else:
            self.stream.send_json(P.Op.OK, body, key=key, step=step)

    def reply_error(self, e: PSError) -> None:
        body = e.to_wire()
        msg = str(body.get("message", ""))
        if not msg.startswith(("pserver", "barrier")):
            body["message"] = f"pserver {self.pserver_id}: {msg}"
        self.stream.send_json(P.Op.ERROR, body, status=e.code)

    def drop(self, why: str, err: Optional[PSError] = None) -> None:
        """Log why this connection ends; tell an authenticated trainer too, if it still listens."""
        who = f"trainer {self.trainer}" if self.trainer >= 0 else "unauthenticated peer"
        log.warning("pserver %d: dropped connection from %s (%s, port %d): %s", self.pserver_id, self.peer, who,
                    self.port, why)
        if err is not None and self.trainer >= 0:
            try:
                self.sock.settimeout(1.0)
                self.reply_error(err)
                # Closing with unread input would reset the connection and could destroy the reply in
                # flight: half-close and drain what the trainer still sends, for a second at most.
                self.sock.shutdown(socket.SHUT_WR)
                deadline = time.monotonic() + 1.0
                while time.monotonic() < deadline and self.sock.recv(1 << 16):
                    pass
            except (OSError, PSError):
                pass


# Serves one request; False when the connection must be dropped.
Handler = Callable[[Conn, P.Header], bool]


class Listener:
    """Binds every port of one pserver (all or nothing) and runs its connections through ``handle``."""

    def __init__(self, env: JobEnv, pserver_id: int, host: str, ports: Tuple[int, ...], max_frame: int,
                 handle: Handler, touch: Callable[[int], None], done: threading.Event,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS, budget: Optional[Budget] = None) -> None:
        self.env = env
        self.budget = budget
        self.stall_after = STALL_BARRIERS * float(env.barrier_timeout)  # no byte of a started frame/reply moves
        self.idle_after = IDLE_BARRIERS * float(env.barrier_timeout)  # nothing from the trainer at all
        self._heard: Dict[int, float] = {}  # trainer -> when a request of it last arrived, on any connection
        self.max_connections = max_connections
        self.max_pending = min(MAX_PENDING_HANDSHAKES, max_connections)
        self._waiting: Dict[socket.socket, float] = {}  # connections waiting for the peer's answer, oldest first
        self._pending = 0  # handshake threads running (the waiting ones, those answered, those dropped and ending)
        self.rated = RateLog(log)
        self.pserver_id = pserver_id
        self.host = host
        self.want_ports = ports
        self.ports: Tuple[int, ...] = ()
        self.max_frame = max_frame
        self.handle = handle
        self.touch = touch
        self.done = done
        self._lock = threading.Lock()
        self._listeners: List[socket.socket] = []
        self._conns: Set[socket.socket] = set()

    def start(self) -> None:
        try:
            for port in self.want_ports:
                s = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                self._listeners.append(s)
                s.bind((self.host, port))
                s.listen(128)
                s.settimeout(0.5)
        except OSError as e:
            self._close_listeners()
            raise OSError(e.errno, f"pserver {self.pserver_id} cannot listen on {self.host}:{port}: "
                                   f"{e.strerror}") from None
        self.ports = tuple(s.getsockname()[1] for s in self._listeners)
        for s in self._listeners:
            threading.Thread(target=self._accept_loop, args=(s,), daemon=True,
                             name=f"pserver{self.pserver_id}-accept-{s.getsockname()[1]}").start()
        log.info("pserver %d listening on %s ports %s", self.pserver_id, self.host, ",".join(map(str, self.ports)))

    def stop(self) -> None:
        """Stop accepting and break every open connection (their threads then end)."""
        self._close_listeners()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _close_listeners(self) -> None:
        for s in self._listeners:
            try:
                s.close()
            except OSError:
                pass

    def _accept_loop(self, lsock: socket.socket) -> None:
        """Accept until the pserver stops. A failing accept (out of descriptors, memory, ...) is retried with
        a growing pause, never the end of listening; the connection waits in the backlog meanwhile."""
        port = lsock.getsockname()[1]
        pause = 0.0
        while not self.done.is_set():
            try:
                sock, addr = lsock.accept()
            except socket.timeout:
                continue
            except OSError as e:
                if self.done.is_set() or lsock.fileno() < 0 or e.errno in (errno.EBADF, errno.EINVAL):
                    return  # closed by stop()
                pause = min(1.0, 2 * pause or 0.05)
                self.rated.warning("accept", "pserver %d: accept on port %d failed: %s; retrying (every %.2f s at "
                                   "most)", self.pserver_id, port, e.strerror or e, pause)
                self.done.wait(pause)
                continue
            pause = 0.0
            peer = f"{addr[0]}:{addr[1]}"
            with self._lock:
                evicted = self._make_room()
                n, pending = len(self._conns), len(self._waiting)
                ok = n < self.max_connections and pending < self.max_pending and self._pending < 2 * self.max_pending
                if ok:
                    self._conns.add(sock)
                    self._waiting[sock] = time.monotonic()
                    self._pending += 1
            if evicted is not None:
                self._evict(evicted)
            if not ok:
                self._refuse(sock, peer, port, n, pending)
                continue
            try:
                threading.Thread(target=self._serve_conn, args=(sock, peer, port), daemon=True,
                                 name=f"pserver{self.pserver_id}-conn-{addr[1]}").start()
            except RuntimeError as e:  # no thread to be had: as good as full
                self._forget(sock, pending=True)
                self._refuse(sock, peer, port, n, pending, str(e))

    def _make_room(self) -> Optional[Tuple[socket.socket, float]]:
        """(Under the lock.) When the connections or the handshakes are at their cap, take the oldest connection
        still waiting for its peer's answer with nothing to read (an idle stranger: a trainer's answer is there
        within a round trip) out of them, and return it with its age: the new one takes its place."""
        if len(self._conns) < self.max_connections and len(self._waiting) < self.max_pending:
            return None
        now = time.monotonic()
        for sock, since in self._waiting.items():
            p = select.poll()
            p.register(sock, select.POLLIN)
            try:
                if p.poll(0):
                    continue  # its answer arrived: its thread is about to read it
            except OSError:
                pass
            del self._waiting[sock]
            self._conns.discard(sock)
            return sock, now - since
        return None

    def _evict(self, evicted: Tuple[socket.socket, float]) -> None:
        sock, age = evicted
        try:
            host, port = sock.getpeername()[:2]
            peer = f"{host}:{port}"
        except OSError:
            peer = "a peer"
        self.rated.warning("evicted", "pserver %d: dropped the connection from %s (unauthenticated peer): it said "
                           "nothing for %.1f s while %d others waited to authenticate (the oldest goes)",
                           self.pserver_id, peer, age, self.max_pending)
        try:
            sock.shutdown(socket.SHUT_RDWR)  # its thread's read returns at once; the thread closes it
        except OSError:
            pass

    def _answered(self, sock: socket.socket) -> None:
        """The peer's answer is read: the connection is no longer one to drop for room (ConnectionLost if it was
        dropped already)."""
        with self._lock:
            if self._waiting.pop(sock, None) is None:
                raise ConnectionLost("dropped for a newer connection while it said nothing")

    def _refuse(self, sock: socket.socket, peer: str, port: int, n: int, pending: int, why: str = "") -> None:
        """Say why in one frame, without waiting for the peer, and close."""
        why = why or (f"{n} connections open ({pending} authenticating), cap {self.max_connections} "
                      f"({self.max_pending} authenticating)")
        self.rated.warning("refused", "pserver %d: refused connection from %s (port %d): %s (PADDLE_MAX_CONNECTIONS)",
                           self.pserver_id, peer, port, why)
        body = P.encode_json({"message": f"pserver {self.pserver_id}: too many connections: {why}"})
        try:
            sock.setblocking(False)
            sock.send(P.pack_header(P.Op.ERROR, P.DTYPE_JSON, status=ConnectionLost.code, length=len(body)) + body)
        except OSError:
            pass
        finally:
            sock.close()

    def _forget(self, sock: socket.socket, pending: bool) -> None:
        with self._lock:
            self._conns.discard(sock)
            if pending:
                self._waiting.pop(sock, None)
                self._pending -= 1

    def _silent(self, trainer: int) -> float:
        return time.monotonic() - self._heard.get(trainer, 0.0)

    def _next_request(self, conn: Conn, poller: Any) -> bool:
        """Wait for the next request's first byte; False (logged) once the trainer has been silent on every
        connection for ``idle_after`` seconds. One poll per request, none per byte."""
        while not self.done.is_set():
            left = self.idle_after - self._silent(conn.trainer)
            if left <= 0:
                why = (f"nothing from this trainer on any connection for {self._silent(conn.trainer):.0f} s "
                       f"({IDLE_BARRIERS} x BARRIER_TIMEOUT)")
                # Said to the trainer too: its next request then fails with this line, not a bare broken pipe.
                conn.drop(why, ConnectionLost(f"pserver {self.pserver_id} closed trainer {conn.trainer}'s connection: "
                                              f"{why}; the other trainers' barriers gave up on it"))
                return False
            if poller.poll(min(left, 0.5) * 1000):
                return True
        return False

    def _serve_conn(self, sock: socket.socket, peer: str, port: int) -> None:
        conn = Conn(sock, peer, port, self.pserver_id, self.budget)
        pending = True
        held = 0  # charged to the budget for this connection besides its buffers
        try:
            P.tune_socket(sock)
            try:
                # One deadline for the whole handshake: a peer that trickles bytes cannot pin a thread.
                conn.trainer, keys = auth.server_handshake(sock, self.env.key_of, self.env.job_id, self.pserver_id,
                                                           self.env.trainers, self.env.integrity,
                                                           answered=lambda: self._answered(sock))
            except ConnectionLost as e:
                # Closed before answering the challenge: a port probe (the launcher's readiness check), not news.
                log.debug("pserver %d: %s closed before authenticating: %s", self.pserver_id, peer, e)
                return
            except (AuthError, ProtocolError, OSError) as e:
                self.rated.warning("auth", "pserver %d: dropped connection from %s (unauthenticated peer, port %d): "
                                   "authentication failed: %s", self.pserver_id, peer, port, e)
                return
            with self._lock:
                self._pending -= 1
            pending = False
            P.set_io_timeout(sock, self.stall_after)
            scratch = None
            if self.budget is not None:
                who = f"trainer {conn.trainer}'s connection from {peer}"
                try:
                    self.budget.charge(CONN_OVERHEAD, who)
                except LimitExceeded as e:
                    conn.stream = Stream(sock, keys, self.max_frame)
                    conn.drop(str(e), e)
                    return
                held += CONN_OVERHEAD
                scratch = Scratch(self.budget.charge, who)
            conn.stream = Stream(sock, keys, self.max_frame, self.stall_after, scratch)
            self.touch(conn.trainer)
            self._heard[conn.trainer] = time.monotonic()
            poller = select.poll()
            poller.register(sock, select.POLLIN | _HUNG_UP)
            while self._next_request(conn, poller):
                try:
                    h = conn.stream.recv_header()
                    self._heard[conn.trainer] = time.monotonic()
                except ConnectionLost:
                    return  # orderly close by the trainer
                except ProtocolError as e:
                    conn.drop(f"bad frame header: {e}", e)
                    return
                if not self.handle(conn, h):
                    return
        except Stalled:
            log.warning("pserver %d: closed connection from %s (trainer %d, port %d): stalled for %.0f s in the "
                        "middle of a frame (it did not arrive whole within %d x BARRIER_TIMEOUT, whatever its pace)",
                        self.pserver_id, peer, conn.trainer, port, self.stall_after, STALL_BARRIERS)
        except BlockingIOError:  # SO_SNDTIMEO: no byte of a reply moved for stall_after seconds
            log.warning("pserver %d: closed connection from %s (trainer %d, port %d): stalled for %.0f s in the "
                        "middle of a frame or of a reply it does not read (BARRIER_TIMEOUT)", self.pserver_id, peer,
                        conn.trainer, port, self.stall_after)
        except OSError as e:
            if not self.done.is_set():
                log.info("pserver %d: connection from %s ended: %s", self.pserver_id, peer, e)
        finally:
            if self.budget is not None:
                self.budget.release(conn.rbuf.nbytes + conn.stream.held + held)
            self._forget(sock, pending)
            conn.lane_at.clear()  # the views first: a mapping with views cannot be closed
            for lane in conn.lanes:
                lane.close()  # gives back its budget
            try:
                sock.close()
            except OSError:
                pass
