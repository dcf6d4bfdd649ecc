"""Versioned binary wire protocol between trainers and pservers.

A frame is a fixed 40-byte little-endian header followed by ``length`` payload bytes. Array payloads are
the raw bytes of a C-contiguous numpy array (sent with one ``sendmsg`` of header + memoryview, received
with ``recv_into`` straight into a preallocated array); small control messages carry JSON. Nothing is
ever pickled.

Header fields (``HEADER``): magic ``b"PDPS"``, version, op, dtype code, status (error code in ERROR
replies, flags otherwise), trainer id, key (dense block or sparse table id), step, payload length, aux
(op-specific: row count for sparse frames).

Every connection starts with the handshake of ``auth`` (trainer identity, per-connection keys); after it,
frames travel through a ``stream.Stream``, which adds a MAC tag after the header and after every segment of
the payload unless integrity is off.
"""

from __future__ import annotations

import enum
import json
import socket
import struct
from dataclasses import dataclass
from typing import Any, Dict

import numpy as np

from ..errors import ConnectionLost, ProtocolError

MAGIC = b"PDPS"
VERSION = 2  # 2: per-connection frame MACs, pserver-bound handshake, trainer keys
HEADER = struct.Struct("<4sHBBHhIqQQ")
HEADER_SIZE = HEADER.size  # 40
# JSON control messages are small; a bigger one is an attack or a bug.
MAX_JSON_BYTES = 1 << 20
REDUCE_MAX_VALUES = 16384  # values per REDUCE call: the request and its reply stay well inside a JSON frame
DEFAULT_MAX_FRAME_BYTES = 1 << 30
NO_TRAINER = -1
LANE_FLAG = 1  # status of PUSH_DENSE, PULL_DENSE and its DATA reply: the array is in the connection's lane
# Status of PUSH_DENSE: this trainer has no gradient for the block this step (its payload is zeros): it counts
# as zero in the mean (DDP's rule), and a step in which no trainer has one leaves the block as it is (torch's).
NOGRAD_FLAG = 2
# Status of PUSH_DENSE: the payload is the step's whole gradient, averaged over the trainers already (the step
# after a synchronize()): the step applies it as it is, not divided by the trainer count; the other trainers
# push NOGRAD_FLAG without payload (EMPTY_FLAG).
AVERAGED_FLAG = 4
# Status of PUSH_DENSE: a gradient to average over the trainers, not to apply (``synchronize()``); of PULL_DENSE:
# reply with that average for ``step`` (its DATA reply has NOGRAD_FLAG when no trainer had a gradient).
REDUCE_FLAG = 8
# Status of a step's PUSH_DENSE with NOGRAD_FLAG: no payload at all (length 0), the zeros it stands for are the
# pserver's: a trainer without a gradient (every trainer but 0 after a synchronize()) sends a header only.
EMPTY_FLAG = 16


class Op(enum.IntEnum):
    AUTH_CHALLENGE = 1
    AUTH_RESPONSE = 2
    AUTH_OK = 3
    DECLARE = 10  # JSON: mode + default optimizer; trainer 0 declares, others must agree
    DEF_DENSE = 11  # JSON: one dense block's definition
    INIT_DENSE = 12  # raw: a block's initial value (first writer wins)
    DEF_SPARSE = 13  # JSON: one sparse table's definition
    PUSH_DENSE = 20  # raw gradient of one block for ``step``
    PULL_DENSE = 21  # -> DATA: the block's value for ``step``
    PUSH_SPARSE = 22  # aux=n: n int64 ids then n rows of gradients
    PULL_SPARSE = 23  # aux=n: n int64 ids -> DATA: n rows
    ROWS_SPARSE = 24  # aux=at most n rows, payload: int64 first id -> DATA aux=m: the m rows from it, ids then rows
    SET_HYPER = 30  # JSON: optimizer hyper-parameters from a step on
    SAVE = 31  # JSON: write this pserver's shard of a checkpoint
    CLOSE = 32  # this trainer is done
    STATUS = 33  # -> JSON: steps, active trainers, table sizes
    LANE = 34  # raw: a lane's nonce, then int64 (block key, offset) pairs (``lane``) -> JSON {lane, reason}
    REDUCE = 35  # JSON {seq, values}, pserver 0: -> JSON {sum, n}, the active trainers' sum (``server.reduce``)
    OK = 40  # reply, optional JSON payload
    DATA = 41  # reply, raw payload
    ERROR = 42  # reply, JSON {"message": ...}; status = errors.PSError.code


REQUEST_OPS = frozenset(op for op in Op if 10 <= op < 40)

_DTYPES = {
    1: np.dtype(np.float32),
    2: np.dtype(np.float64),
    3: np.dtype(np.int64),
    4: np.dtype(np.int32),
    5: np.dtype(np.float16),
    6: np.dtype(np.uint8),
}
_CODES = {dt: code for code, dt in _DTYPES.items()}
DTYPE_NONE = 0
DTYPE_JSON = 6  # JSON payloads travel as uint8


def dtype_code(dtype: Any) -> int:
    dt = np.dtype(dtype)
    try:
        return _CODES[dt]
    except KeyError:
        raise ValueError(f"dtype {dt} is not supported on the wire: use one of {sorted(map(str, _CODES))}") from None


@dataclass(frozen=True)
class Header:
    """One decoded frame header."""

    op: int
    dtype: int = DTYPE_NONE
    status: int = 0
    trainer: int = NO_TRAINER
    key: int = 0
    step: int = 0
    length: int = 0
    aux: int = 0

    def op_name(self) -> str:
        try:
            return Op(self.op).name
        except ValueError:
            return f"op {self.op}"


def pack_header(op: int, dtype: int = DTYPE_NONE, status: int = 0, trainer: int = NO_TRAINER, key: int = 0,
                step: int = 0, length: int = 0, aux: int = 0) -> bytes:
    return HEADER.pack(MAGIC, VERSION, op, dtype, status, trainer, key, step, length, aux)


def unpack_header(buf: Any, max_frame: int = DEFAULT_MAX_FRAME_BYTES) -> Header:
    """Decode and sanity-check a header; ``ProtocolError`` says what is wrong."""
    magic, version, op, dtype, status, trainer, key, step, length, aux = HEADER.unpack(buf)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r}")
    if version != VERSION:
        raise ProtocolError(f"unsupported protocol version {version} (this side speaks {VERSION})")
    if length > max_frame:
        raise ProtocolError(f"frame of {length} bytes exceeds the {max_frame}-byte cap")
    return Header(op, dtype, status, trainer, key, step, length, aux)


def expect_length(h: Header, want: int, what: str) -> None:
    """Refuse a frame whose payload is not the ``want`` bytes its request needs (``what`` names it)."""
    if h.length != want:
        raise ProtocolError(f"{what} expects {want} payload bytes, frame has {h.length}")


# -- socket I/O --------------------------------------------------------------------------------------------


def tune_socket(sock: socket.socket) -> None:
    """Small request/response frames must not wait for Nagle (44 ms vs 77 us per round trip)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def byte_view(arr: Any) -> memoryview:
    """A flat byte view of a C-contiguous array or bytes-like object, without copying."""
    if isinstance(arr, np.ndarray):
        if arr.nbytes == 0:
            return memoryview(b"")
        if not arr.flags.c_contiguous:
            raise ValueError("array payloads must be C-contiguous")
        return memoryview(arr.reshape(-1).view(np.uint8))
    view = memoryview(arr)
    if view.nbytes == 0:
        return memoryview(b"")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def send_frame(sock: socket.socket, header: bytes, *payload: Any) -> None:
    """Send header and payload buffers with as few ``sendmsg`` calls as the kernel allows."""
    views = [memoryview(header)]
    for p in payload:
        v = byte_view(p)
        if len(v):
            views.append(v)
    send_views(sock, views)


def consume(views: list, n: int) -> None:
    """Drop the first ``n`` bytes of ``views`` (what one call sent or received): whole views from the
    front, then the start of the next."""
    while n:
        first = len(views[0])
        if n >= first:
            n -= first
            views.pop(0)
        else:
            views[0] = views[0][n:]
            n = 0


def send_views(sock: socket.socket, views: list) -> None:
    """``sendmsg`` every view, resuming after partial sends (``views`` is consumed)."""
    try:
        while views:
            consume(views, sock.sendmsg(views))
    except (BrokenPipeError, ConnectionResetError) as e:
        raise ConnectionLost(f"connection broke while sending: {e}") from None


def recv_into(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` completely from the socket; a peer that closes early raises ``ConnectionLost``."""
    recv_views(sock, [view])


def recv_views(sock: socket.socket, views: list) -> None:
    """Fill every view in turn with one ``recvmsg_into`` (``MSG_WAITALL``: on a blocking socket the kernel
    fills them all in one call, so a segment and its tag cost one syscall); resumes after a short read."""
    views = [v for v in views if len(v)]
    n = sum(len(v) for v in views)
    got = 0
    try:
        while views:
            r = sock.recvmsg_into(views, 0, socket.MSG_WAITALL)[0] if len(views) > 1 else \
                sock.recv_into(views[0], len(views[0]), socket.MSG_WAITALL)
            if r == 0:
                raise ConnectionLost(f"connection closed after {got} of {n} bytes")
            got += r
            consume(views, r)
    except ConnectionResetError as e:
        raise ConnectionLost(f"connection reset: {e}") from None


def set_io_timeout(sock: socket.socket, seconds: float) -> None:
    """Blocking I/O that fails (``BlockingIOError``) after ``seconds`` without progress, by SO_RCVTIMEO and
    SO_SNDTIMEO: unlike ``settimeout`` no poll() before every call, and ``MSG_WAITALL`` fills a whole
    buffer in one ``recv``."""
    sock.settimeout(None)
    tv = struct.pack("ll", int(seconds), int(seconds % 1 * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


# -- JSON control messages --------------------------------------------------------------------------------


def encode_json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode("utf-8")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # encode_json never writes NaN or Infinity: a peer that does is wrong


def decode_json(data: Any) -> Dict[str, Any]:
    try:
        obj = json.loads(bytes(data).decode("utf-8"), parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError) as e:
        raise ProtocolError(f"bad JSON payload: {e}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("JSON payload is not an object")
    return obj
