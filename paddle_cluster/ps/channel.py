"""The trainer's connections: one authenticated ``Channel`` per (pserver, port), each driven by one worker
thread, and the helpers that pipeline requests over a channel and gather results across channels.

Within one channel requests are pipelined: all frames sent, then all replies read (``pipeline``), or, when
the replies may not fit the socket buffers, read by the channel's reader thread while they are sent
(``exchange``); array bytes go straight between numpy buffers and the socket.
"""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..contract import JobEnv
from .errors import AuthError, ConnectionLost, PSError, from_wire
from .wire import auth
from .wire import lane as L
from .wire import protocol as P
from .wire.stream import Stream

HANDSHAKE_TRIES = 3  # a handshake closed on our answer, at most this many times (see ``Channel._authenticated``)


class Channel:
    """One authenticated connection to one pserver port, driven by one worker thread."""

    def __init__(self, env: JobEnv, key: str, trainer: int, pserver: int, port: int, connect_timeout: float,
                 io_timeout: float) -> None:
        self.pserver = pserver
        self.where = f"pserver {pserver} at {env.pservers[pserver].host}:{port}"
        self.sock, keys = self._authenticated(env, key, trainer, pserver, port, connect_timeout)
        P.set_io_timeout(self.sock, io_timeout)
        self.io_timeout = io_timeout
        self._lane_of = (env.job_id, key, pserver, trainer, env.all_ports(pserver)[0])
        self.lane_token: Optional[str] = None  # the pserver's lane socket's (``DECLARE``'s answer); None: no lanes
        self.stream = Stream(self.sock, keys)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"ps{pserver}-{port}")
        # Reads replies while the worker sends (``exchange``); its thread starts on first use.
        self.reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"ps{pserver}-{port}-rx")
        self.broken: Optional[str] = None
        self._mu = threading.Lock()
        self._queued = 0  # jobs submitted or running here and not finished: ``run_here`` must queue behind them

    def _authenticated(self, env: JobEnv, key: str, trainer: int, pserver: int, port: int, timeout: float
                       ) -> Tuple[socket.socket, Optional[auth.Keys]]:
        """A connection and its keys. A handshake the pserver refused before our answer (its handshakes full) or
        that was cut (reset, closed: a pserver dropping idle strangers may drop us) is tried again until
        ``timeout``; one closed on our answer, a few times (a wrong key is that too, and must fail soon)."""
        deadline = time.monotonic() + timeout
        delay, answered_tries = 0.05, 0
        while True:
            sock = open_socket(env.pservers[pserver].host, port, max(0.5, deadline - time.monotonic()), self.where)
            try:
                P.tune_socket(sock)
                return sock, auth.client_handshake(sock, key, env.job_id, pserver, trainer, env.integrity)
            except AuthError as e:
                sock.close()
                answered_tries += 1
                if answered_tries >= HANDSHAKE_TRIES or time.monotonic() + delay > deadline:
                    raise AuthError(f"{self.where}: {e}") from None
            except (OSError, PSError) as e:
                sock.close()
                if time.monotonic() + delay > deadline:
                    raise ConnectionLost(f"{self.where}: handshake failed: {e} (gave up after {timeout:g} s)") from None
            time.sleep(delay)
            delay = min(delay * 2, 0.5)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        with self._mu:
            self._queued += 1
        return self.pool.submit(self._counted, fn, *args)

    def run_here(self, fn: Callable[..., Any], *args: Any) -> Future:
        """``submit``, but run on the calling thread when nothing is queued here: the caller waits for it
        anyway, and two thread hand-offs per request are a fifth of a small round trip."""
        with self._mu:
            idle = not self._queued
            self._queued += idle
        if not idle:
            return self.submit(fn, *args)
        done: Future = Future()
        try:
            done.set_result(self._guard(fn, *args))
        except Exception as e:  # noqa: BLE001 - handed over as the pool would
            done.set_exception(e)
        except BaseException:  # interrupted mid-frame: the stream is out of step
            self.broken = "interrupted in the middle of a request"
            self.abort()
            raise
        finally:
            with self._mu:
                self._queued -= 1
        return done

    def _counted(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return self._guard(fn, *args)
        finally:
            with self._mu:
                self._queued -= 1

    def abort(self) -> None:
        """Break the connection both ways, so a send or a read blocked on it returns at once."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _guard(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self.broken:
            raise ConnectionLost(f"{self.where}: connection is broken ({self.broken})")
        try:
            return fn(self, *args)
        except (socket.timeout, BlockingIOError):  # BlockingIOError: SO_RCVTIMEO / SO_SNDTIMEO expired
            self.broken = f"no answer in {self.io_timeout:g} s (pserver hung or unreachable)"
            raise ConnectionLost(f"{self.where}: {self.broken}") from None
        except (ConnectionLost, OSError) as e:
            self.broken = str(e)
            if isinstance(e, ConnectionLost) and e.said:  # the pserver's own line names it already
                raise
            raise ConnectionLost(f"{self.where}: {e}") from None

    def send(self, header: bytes, *payload: Any) -> None:
        self.stream.send(header, *payload)

    def reply(self) -> P.Header:
        """The next reply header; an ERROR reply is raised as its typed exception."""
        h = self.stream.recv_header()
        if h.op == P.Op.ERROR:
            raise from_wire(h.status, self.stream.recv_json(h))
        return h

    def reply_json(self) -> Optional[Dict[str, Any]]:
        h = self.reply()
        if h.op != P.Op.OK:
            raise ConnectionLost(f"expected OK, got {h.op_name()}")
        return self.stream.recv_json(h) if h.length else None

    def call_json(self, op: int, body: Any, key: int = 0, step: int = 0) -> Optional[Dict[str, Any]]:
        header, payload = json_request(op, body, key=key, step=step)
        self.send(header, *payload)
        return self.reply_json()

    def open_lane(self, lane: L.Lane, layout: Sequence[Tuple[int, int]]) -> Optional[str]:
        """Offer ``lane`` (the trainer's, ``lane.create``) to this connection's pserver with the (block key, offset)
        of each of its blocks in it (docs/architecture.md): None once the pserver took it, else why the connection
        stays on TCP. Run it on the channel (``submit``)."""
        if self.lane_token is None:
            return f"pserver {self.pserver} takes no lanes"
        try:
            nonce = L.offer(lane, *self._lane_of, str(self.lane_token))
        except L.LaneRefused as e:
            return str(e)
        pairs = np.array(layout, "<i8").reshape(-1, 2)
        self.send(P.pack_header(P.Op.LANE, length=len(nonce) + pairs.nbytes), nonce + pairs.tobytes())
        body = self.reply_json() or {}
        return None if body.get("lane") else str(body.get("reason") or "refused")

    def close(self) -> None:
        self.pool.shutdown(wait=False)
        self.reader.shutdown(wait=False)
        try:
            self.sock.close()
        except OSError:
            pass


def reply_timeout(barrier_timeout: float) -> float:
    """How long a trainer waits for any one reply: the barrier timeout plus a margin for the work."""
    return barrier_timeout + max(10.0, barrier_timeout / 2)


def open_socket(host: str, port: int, timeout: float, where: str) -> socket.socket:
    """Connect, retrying while the pserver is not listening yet (trainers may start first)."""
    deadline = time.monotonic() + timeout
    delay = 0.05
    while True:
        try:
            return socket.create_connection((host, port), timeout=max(0.5, min(5.0, deadline - time.monotonic())))
        except OSError as e:
            if time.monotonic() + delay > deadline:
                raise ConnectionLost(f"cannot connect to {where}: {e} (gave up after {timeout:g} s)") from None
            time.sleep(delay)
            delay = min(delay * 2, 0.5)


def fan_out(jobs: Sequence[Tuple[Channel, Callable[..., Any], Tuple[Any, ...]]]) -> List[Future]:
    """Run each (channel, fn, args) on its channel's thread, the last one on the calling thread (``run_here``):
    for a caller about to wait for them all."""
    futures = [ch.submit(fn, *args) for ch, fn, args in jobs[:-1]]
    if jobs:
        ch, fn, args = jobs[-1]
        futures.append(ch.run_here(fn, *args))
    return futures


def gather(futures: Sequence[Future], into: Optional[List[Any]] = None) -> List[Any]:
    """Results of all futures (waiting for every one), raising the first error; ``into`` keeps every
    successful result even then (what must be cleaned up)."""
    results, first = [], None
    for f in futures:
        try:
            results.append(f.result())
            if into is not None:
                into.append(results[-1])
        except BaseException as e:  # noqa: B036 - re-raised below after every future finished
            results.append(None)
            first = first or e
    if first is not None:
        raise first
    return results


Frame = Tuple[bytes, Tuple[Any, ...]]
OnReply = Callable[[Channel, P.Header], None]
# Replies up to this size fit the socket buffers (a receive buffer starts at 128 KB): they can wait until
# every frame is sent, so ``exchange`` reads them on the sending thread, without a hand-off.
INLINE_REPLY_BYTES = 64 << 10


def pipeline(ch: Channel, frames: Sequence[Frame], on_reply: Sequence[OnReply]) -> None:
    """Send every frame, then read one reply per frame; the first error wins, later ones are drained."""
    _read_replies(ch, on_reply, _send_frames(ch, frames))


def exchange(ch: Channel, frames: Sequence[Frame], on_reply: Sequence[OnReply], reply_bytes: int) -> None:
    """``pipeline``, reading the replies (``reply_bytes`` of payload in all) while the frames are sent.

    Needed once replies may fill the socket buffers: a pserver blocked writing a reply nobody reads stops
    reading requests, and a trainer blocked sending them would never read it. Errors as ``pipeline``'s;
    a lost connection is broken both ways, so neither side of the exchange waits on the other."""
    if reply_bytes <= INLINE_REPLY_BYTES:
        pipeline(ch, frames, on_reply)
        return
    reading = ch.reader.submit(ch._guard, _read_replies, on_reply, None, True)
    try:
        first = _send_frames(ch, frames)
    except BaseException:
        ch.abort()  # the reader must not wait for replies to frames never sent
        reading.exception()
        raise
    try:
        reading.result()
    except PSError as e:
        raise (first if isinstance(e, ConnectionLost) and not e.said and first is not None else e) from None
    if first is not None:
        raise first


def _send_frames(ch: Channel, frames: Sequence[Frame]) -> Optional[ConnectionLost]:
    """Send every frame; a lost connection is returned, not raised: the pserver may have said why."""
    try:
        for header, payload in frames:
            ch.send(header, *payload)
    except ConnectionLost as e:
        return e
    return None


def _read_replies(ch: Channel, on_reply: Sequence[OnReply], first: Optional[BaseException],
                  abort: bool = False) -> None:
    """One reply per callback, the first error raised after the rest are drained (``abort``: break the
    connection when it is lost, so a sender blocked on it returns)."""
    for cb in on_reply:
        try:
            cb(ch, ch.reply())
        except PSError as e:
            if first is None or isinstance(first, ConnectionLost) and not first.said and (
                    e.said or not isinstance(e, ConnectionLost)):
                first = e  # what the pserver said beats a broken connection
            if isinstance(e, ConnectionLost):
                break
        except BaseException:
            if abort:
                ch.abort()
            raise
    if abort and isinstance(first, ConnectionLost):
        ch.abort()
    if first is not None:
        raise first


def json_request(op: int, body: Any, key: int = 0, step: int = 0) -> Tuple[bytes, Tuple[Any, ...]]:
    """A JSON request as the (header, payload) pair ``send`` and ``pipeline`` take."""
    data = P.encode_json(body)
    return P.pack_header(op, P.DTYPE_JSON, key=key, step=step, length=len(data)), (data,)


def expect_ok(ch: Channel, h: P.Header) -> None:
    if h.op != P.Op.OK:
        raise ConnectionLost(f"expected OK, got {h.op_name()}")
    if h.length:
        ch.stream.discard()
