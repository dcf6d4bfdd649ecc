"""One authenticated connection's frames, in one direction each way, with integrity.

With integrity on (the default) a frame is its header, a tag, then the payload with another tag after every
``SEGMENT`` bytes and after its last byte::

    header(40) tag | payload[0:S] tag | payload[S:2S] tag | ... | payload[kS:n] tag

Every tag is the negotiated frame MAC (``auth``: HMAC-SHA256 or Poly1305, this direction's key) bound to the
frame's sequence number -- counted by both ends, never sent -- and to its place in the frame: HMAC covers the
header and all payload bytes before the tag, Poly1305 the piece since the last tag under a key of its own.
So a header is verified before anything acts on it, every segment before it is used, and a flipped,
replayed, reordered, reflected or spliced frame fails at its first tag. A receiver reads a segment and its
tag with one ``recvmsg_into`` and hashes the segment right after (still in cache); a sender hashes a
segment right before handing it and its tag to one ``sendmsg``. Without integrity a frame is header +
payload.
"""

from __future__ import annotations

import hmac
import socket
import struct
import time
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

from ..counters import PROCESS
from ..errors import ConnectionLost, IntegrityError, ProtocolError
from . import protocol as P
from .auth import TAG_SIZE, Keys

SEGMENT = 1 << 20  # per tag and per fold: fewer calls per byte than 256 KiB, still cached (docs/benchmarks.md)
DISCARD = 16 << 10  # what a payload read only to be dropped is read into, at a time


class Stalled(BlockingIOError):
    """A frame did not arrive whole within the stall bound, however its bytes were paced."""


class Scratch:
    """Where a connection's segment-sized scratch buffers are charged (a pserver's ``Budget``), and what for."""

    def __init__(self, charge: Callable[[int, str], None], who: str) -> None:
        self.charge, self.who = charge, who


class Stream:
    """Frames over ``sock`` under ``keys`` (None: integrity off). One reader and one writer at a time.

    ``stall`` (a pserver's connection): the seconds a frame may take to arrive whole, counted while this side
    waits in ``recv`` for it (not while it waits for other trainers between segments), however the peer paces
    its bytes; past it ``Stalled``. ``SO_RCVTIMEO`` starts at ``stall`` and is lowered to what the frame has left
    only after a short read, so a frame that arrives at speed costs no extra system call. ``scratch``: where the
    segment buffers a connection allocates are charged (``held`` says how much)."""

    def __init__(self, sock: socket.socket, keys: Optional[Keys], max_frame: int = P.DEFAULT_MAX_FRAME_BYTES,
                 stall: Optional[float] = None, scratch: Optional[Scratch] = None) -> None:
        self.sock = sock
        self.stall = stall
        self.scratch = scratch
        self.held = 0  # bytes of scratch buffers charged to ``scratch``
        self.tally = PROCESS.tally()  # [bytes sent, bytes received], for ``top``
        self._clock = 0.0  # seconds the frame being read may still wait in recv
        self._timeo = stall  # the socket's SO_RCVTIMEO
        if stall is not None:
            self._set_timeo(stall)
        self.keys = keys
        self.max_frame = max_frame
        self.tx_seq = 0
        self.rx_seq = 0
        self._hbuf = bytearray(P.HEADER_SIZE + (TAG_SIZE if keys else 0))
        self._tag = bytearray(TAG_SIZE)
        self._run: Any = None  # the running MAC of the frame being read
        self._room = SEGMENT  # payload bytes until the next tag
        self.left = 0  # payload bytes of the frame being read not read yet
        self._scratch: Optional[memoryview] = None
        self._scratch_tx: Optional[memoryview] = None

    # -- sending ---------------------------------------------------------------------------------------------

    def send(self, header: bytes, *payload: Any, volatile: bool = False,
             ready: Optional[Callable[[int], None]] = None) -> None:
        """Send one frame (header from ``protocol.pack_header``) with ``payload`` buffers, never joined.

        ``volatile``: the payload may change while it is sent (an async pull racing an update); each
        segment is then copied before it is hashed, so the bytes sent are the bytes MACed. ``ready(end)``:
        returns once the payload up to ``end`` (a segment's end) is final; called before that segment is
        hashed or sent, the first time before the header is (a sync pull sent as its segments are applied)."""
        total = sum(len(P.byte_view(p)) for p in payload)
        self.tally[0] += len(header) + total  # what ``top`` shows as bytes/s sent
        if self.keys is None and ready is None:
            P.send_frame(self.sock, header, *payload)
            return
        if ready is not None and total:
            ready(min(SEGMENT, total))  # before anything is counted or sent: a failure here leaves no trace
        if self.keys is None:
            self._send_plain(header, payload, ready)
            return
        copy = self._send_scratch() if volatile else None  # before anything is counted: it may be refused
        pos = 0
        mac = self.keys.send
        run = mac.start(self.tx_seq, header)
        self.tx_seq += 1
        out = [memoryview(header), memoryview(run.tag())]
        room = SEGMENT
        for p in payload:
            v = P.byte_view(p)
            off = 0
            while off < len(v):
                if ready is not None and room == SEGMENT and pos:
                    ready(min(pos + SEGMENT, total))
                piece = v[off:off + room]
                if copy is not None:  # at its place in the segment: a segment may span two buffers
                    at = SEGMENT - room
                    copy[at:at + len(piece)] = piece
                    piece = copy[at:at + len(piece)]
                run.update(piece)
                out.append(piece)
                off += len(piece)
                pos += len(piece)
                room -= len(piece)
                if room == 0:
                    out.append(memoryview(run.tag()))
                    P.send_views(self.sock, out)
                    out, room = [], SEGMENT
        if room != SEGMENT:
            out.append(memoryview(run.tag()))
        if out:
            P.send_views(self.sock, out)

    def _send_plain(self, header: bytes, payload: Tuple[Any, ...], ready: Any) -> None:
        """``send`` without integrity of one payload buffer, a segment at a time as ``ready`` lets it."""
        (v,) = [P.byte_view(p) for p in payload] or [memoryview(b"")]
        out = [memoryview(header)]
        for off in range(0, len(v), SEGMENT):
            if off:
                ready(min(off + SEGMENT, len(v)))
            out.append(v[off:off + SEGMENT])
            P.send_views(self.sock, out)
            out = []
        if out:
            P.send_views(self.sock, out)

    def _send_scratch(self) -> memoryview:
        if self._scratch_tx is None:
            self._charge("a send buffer")
            self._scratch_tx = memoryview(bytearray(SEGMENT))
        return self._scratch_tx

    def _charge(self, what: str) -> None:
        """Charge one more segment-sized buffer of this connection (``LimitExceeded`` if it does not fit)."""
        if self.scratch is not None:
            self.scratch.charge(SEGMENT, f"{what} of {SEGMENT >> 20} MiB for {self.scratch.who}")
            self.held += SEGMENT

    def send_json(self, op: int, obj: Any, **fields: Any) -> None:
        body = P.encode_json(obj)
        self.send(P.pack_header(op, P.DTYPE_JSON, length=len(body), **fields), body)

    # -- receiving -------------------------------------------------------------------------------------------

    def recv_header(self) -> P.Header:
        """The next frame's header, verified. The previous frame's payload must have been read."""
        if self.left:
            raise ProtocolError(f"{self.left} payload bytes of the previous frame were not read")
        view = memoryview(self._hbuf)
        if self.stall is not None:
            self._clock = self.stall  # the frame's clock starts with its first byte
            if self._timeo != self.stall:
                self._set_timeo(self.stall)
        self._recv([view])
        if self.keys is not None:
            mac = self.keys.recv
            self._run = mac.start(self.rx_seq, view[:P.HEADER_SIZE])
            self.rx_seq += 1
            if not hmac.compare_digest(self._run.tag(), view[P.HEADER_SIZE:]):
                raise IntegrityError(f"frame {self.rx_seq - 1}: header failed its MAC (tampered, replayed, "
                                     "reordered, reflected or from another connection)")
        h = P.unpack_header(view[:P.HEADER_SIZE], self.max_frame)
        self.left, self._room = h.length, SEGMENT
        self.tally[1] += P.HEADER_SIZE + h.length  # what ``top`` shows as bytes/s received
        return h

    def recv_into(self, *views: Any) -> None:
        """Read the rest of the frame's payload into ``views`` (their sizes must add up to it); returns once
        every byte is verified."""
        vs = [P.byte_view(v) for v in views]
        total = sum(len(v) for v in vs)
        if total != self.left:
            raise ProtocolError(f"frame has {self.left} payload bytes left, {total} expected")
        for v in vs:
            self._fill(v)

    def chunks(self, into: Optional[Callable[[int], Any]] = None) -> Iterator[Tuple[int, memoryview]]:
        """The rest of the payload as (offset, verified bytes) pieces of at most ``SEGMENT`` bytes, each
        received into ``into(offset)`` (a buffer of ``SEGMENT`` bytes) or, where that is None, into a reused
        scratch buffer (valid until the next piece)."""
        off = 0
        while self.left:
            n = min(self.left, self._room)
            dest = into(off) if into is not None else None
            if dest is None and self._scratch is None:
                self._charge("a receive buffer")
                self._scratch = memoryview(bytearray(SEGMENT))
            v = self._scratch[:n] if dest is None else P.byte_view(dest)[:n]
            self._fill(v)
            yield off, v
            off += n

    def discard(self) -> None:
        """Read (and still verify) the rest of the payload, so the stream stays in step: ``DISCARD`` bytes at a
        time, so a refused payload costs no buffer of its size."""
        buf = memoryview(bytearray(min(self.left, DISCARD)))
        while self.left:
            self._fill(buf[:min(self.left, len(buf))])

    def recv_json(self, h: P.Header) -> Dict[str, Any]:
        if h.length > P.MAX_JSON_BYTES:
            raise ProtocolError(f"JSON payload of {h.length} bytes exceeds {P.MAX_JSON_BYTES}")
        buf = bytearray(h.length)
        self.recv_into(buf)
        return P.decode_json(buf)

    def _fill(self, view: memoryview) -> None:
        if self.keys is None:
            self._recv([view])
            self.left -= len(view)
            return
        off, n = 0, len(view)
        while off < n:
            seg = view[off:off + self._room]
            self._room -= len(seg)
            self.left -= len(seg)
            off += len(seg)
            ends = self._room == 0 or self.left == 0
            # The segment and its tag in one call; hashed right after, while the bytes are still cached.
            try:
                self._recv([seg, memoryview(self._tag)] if ends else [seg])
            except ConnectionLost as e:
                raise ConnectionLost(f"connection closed in the middle of a frame ({e})") from None
            self._run.update(seg)
            if ends:
                if not hmac.compare_digest(self._run.tag(), self._tag):
                    raise IntegrityError(f"frame {self.rx_seq - 1}: payload failed its MAC (tampered in transit)")
                self._room = SEGMENT

    def _recv(self, views: list) -> None:
        """Fill ``views`` (``protocol.recv_views``), within what the frame's clock has left."""
        if self.stall is None:
            P.recv_views(self.sock, views)
            return
        if len(views) > 1:
            views = [v for v in views if len(v)]
        elif not len(views[0]):
            return
        got = 0
        while views:
            t0 = time.monotonic()
            try:
                r = self.sock.recvmsg_into(views, 0, socket.MSG_WAITALL)[0] if len(views) > 1 else \
                    self.sock.recv_into(views[0], len(views[0]), socket.MSG_WAITALL)
            except BlockingIOError:  # SO_RCVTIMEO passed without a byte
                r = -1
            except ConnectionResetError as e:
                raise ConnectionLost(f"connection reset: {e}") from None
            self._clock -= time.monotonic() - t0
            if r == 0:
                raise ConnectionLost(f"connection closed after {got} of {got + sum(map(len, views))} bytes")
            if r > 0:
                got += r
                P.consume(views, r)
            if not views:
                return
            # A short read: the peer is slower than the socket's timeout. What the frame has left bounds the
            # next wait, whatever its pace.
            if self._clock <= 0:
                raise Stalled(f"a frame did not arrive whole within {self.stall:g} s")
            if self._timeo is None or self._timeo - self._clock > 0.05 * self.stall:
                self._set_timeo(self._clock)

    def _set_timeo(self, seconds: float) -> None:
        seconds = max(seconds, 0.001)  # 0 would mean no timeout at all
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                             struct.pack("ll", int(seconds), int(seconds % 1 * 1e6)))
        self._timeo = seconds
