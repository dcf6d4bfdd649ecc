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
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

from . import protocol as P
from .auth import TAG_SIZE, Keys
from .errors import ConnectionLost, IntegrityError, ProtocolError

SEGMENT = 1 << 20  # per tag and per fold: fewer calls per byte than 256 KiB, still cached (docs/benchmarks.md)


class Stream:
    """Frames over ``sock`` under ``keys`` (None: integrity off). One reader and one writer at a time."""

    def __init__(self, sock: socket.socket, keys: Optional[Keys], max_frame: int = P.DEFAULT_MAX_FRAME_BYTES
                 ) -> None:
        self.sock = sock
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
        if self.keys is None and ready is None:
            P.send_frame(self.sock, header, *payload)
            return
        total = sum(len(P.byte_view(p)) for p in payload)
        if ready is not None and total:
            ready(min(SEGMENT, total))  # before anything is counted or sent: a failure here leaves no trace
        if self.keys is None:
            self._send_plain(header, payload, ready)
            return
        pos = 0
        mac = self.keys.send
        run = mac.start(self.tx_seq, header)
        self.tx_seq += 1
        out = [memoryview(header), memoryview(run.tag())]
        room = SEGMENT
        copy = self._send_scratch() if volatile else None
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
            self._scratch_tx = memoryview(bytearray(SEGMENT))
        return self._scratch_tx

    def send_json(self, op: int, obj: Any, **fields: Any) -> None:
        body = P.encode_json(obj)
        self.send(P.pack_header(op, P.DTYPE_JSON, length=len(body), **fields), body)

    # -- receiving -------------------------------------------------------------------------------------------

    def recv_header(self) -> P.Header:
        """The next frame's header, verified. The previous frame's payload must have been read."""
        if self.left:
            raise ProtocolError(f"{self.left} payload bytes of the previous frame were not read")
        view = memoryview(self._hbuf)
        P.recv_into(self.sock, view)
        if self.keys is not None:
            mac = self.keys.recv
            self._run = mac.start(self.rx_seq, view[:P.HEADER_SIZE])
            self.rx_seq += 1
            if not hmac.compare_digest(self._run.tag(), view[P.HEADER_SIZE:]):
                raise IntegrityError(f"frame {self.rx_seq - 1}: header failed its MAC (tampered, replayed, "
                                     "reordered, reflected or from another connection)")
        h = P.unpack_header(view[:P.HEADER_SIZE], self.max_frame)
        self.left, self._room = h.length, SEGMENT
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
        if self._scratch is None:
            self._scratch = memoryview(bytearray(SEGMENT))
        off = 0
        while self.left:
            n = min(self.left, self._room)
            dest = into(off) if into is not None else None
            v = self._scratch[:n] if dest is None else P.byte_view(dest)[:n]
            self._fill(v)
            yield off, v
            off += n

    def discard(self) -> None:
        """Read (and still verify) the rest of the payload, so the stream stays in step."""
        for _ in self.chunks():
            pass

    def recv_json(self, h: P.Header) -> Dict[str, Any]:
        if h.length > P.MAX_JSON_BYTES:
            raise ProtocolError(f"JSON payload of {h.length} bytes exceeds {P.MAX_JSON_BYTES}")
        buf = bytearray(h.length)
        self.recv_into(buf)
        return P.decode_json(buf)

    def _fill(self, view: memoryview) -> None:
        if self.keys is None:
            P.recv_into(self.sock, view)
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
                P.recv_views(self.sock, [seg, memoryview(self._tag)] if ends else [seg])
            except ConnectionLost as e:
                raise ConnectionLost(f"connection closed in the middle of a frame ({e})") from None
            self._run.update(seg)
            if ends:
                if not hmac.compare_digest(self._run.tag(), self._tag):
                    raise IntegrityError(f"frame {self.rx_seq - 1}: payload failed its MAC (tampered in transit)")
                self._room = SEGMENT
