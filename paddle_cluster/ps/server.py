"""The pserver: a threaded TCP server holding dense blocks and sparse-table shards.

One accept thread per port and one handler thread per connection; a connection serves one request at a
time, so per-connection state needs no locks. Each dense block and each table shard has its own
condition variable, which doubles as the sync-mode barrier: pushes for step ``t`` land in per-trainer
buffers, and the push that completes the set of active trainers applies the averaged gradient and wakes
the pulls for ``t + 1``. Waits are bounded by ``barrier_timeout`` and fail with a ``BarrierTimeout``
naming the trainers that never arrived.

Malformed input from any peer costs that peer its connection and nothing else: the reason is logged in
one line, no parameter changes, everyone else keeps being served.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple

import numpy as np

from ..contract import JobEnv, ProcessEnv
from . import checkpoint as ckpt
from . import protocol as P
from .errors import (
    AuthError,
    BarrierTimeout,
    CheckpointError,
    ConfigMismatch,
    ConnectionLost,
    MissingTrainer,
    ProtocolError,
    PSError,
    RemoteError,
    UnknownKey,
)
from .optim import OptimizerSpec, make_dense, make_sparse
from .placement import init_rows

log = logging.getLogger("paddle_cluster.ps")
MODES = ("sync", "async")
_HYPER_KEYS = frozenset(f.name for f in dataclasses.fields(OptimizerSpec)) - {"name"}
# Optimizer passes run over chunks of this many bytes, so a chunk is still in cache for the next pass.
_CHUNK_ELEMS = (256 << 10) // 4


class _RWLock:
    """Optimizer applies share it; a checkpoint snapshot takes it exclusively (a consistent cut)."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._readers = 0
        self._writer = False

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._cv:
            while self._writer:
                self._cv.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cv:
                self._readers -= 1
                self._cv.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cv:
            while self._writer:
                self._cv.wait()
            self._writer = True
            while self._readers:
                self._cv.wait()
        try:
            yield
        finally:
            with self._cv:
                self._writer = False
                self._cv.notify_all()


def _spec_key(d: Dict[str, Any]) -> Dict[str, Any]:
    return OptimizerSpec.from_dict(d).to_dict()


class _Shard:
    """What dense blocks and table shards share: a step counter, a barrier and a hyper-parameter cursor."""

    def __init__(self, key: int, name: str, spec: OptimizerSpec, declared: Dict[str, Any], step: int) -> None:
        self.key = key
        self.name = name
        self.spec = spec
        self.declared = declared  # spec as first defined; later definitions must match it
        self.step = step
        self.cv = threading.Condition()
        self.pending: Dict[int, Any] = {}  # trainer -> its contribution to ``step``
        self.receiving: Set[int] = set()
        self.hyper_pos = 0


class _DenseBlock(_Shard):
    def __init__(self, key: int, meta: Dict[str, Any], spec: OptimizerSpec, declared: Dict[str, Any],
                 step: int) -> None:
        super().__init__(key, meta["name"], spec, declared, step)
        self.meta = meta
        self.dtype = np.dtype(meta["dtype"])
        self.shape = tuple(meta["shape"])
        self.param = np.zeros(self.shape, dtype=self.dtype)
        self.nbytes = self.param.nbytes
        self.opt = make_dense(spec, self.param)
        self.flat = self.param.reshape(-1)  # a view: updates of flat ranges change param
        self.initialized = False
        self.initializing = False
        # Sync mode with several trainers: their gradients of the current step, summed in trainer order
        # (see PServer._op_push_dense). One buffer per block, allocated on first use.
        self._acc: Optional[np.ndarray] = None
        self.acc_busy = False  # a push is being received straight into acc
        self.applying = False
        self.error: Optional[str] = None

    def describe(self) -> str:
        return f"block {self.name}[{self.meta['lo']}:{self.meta['hi']}]"

    @property
    def acc(self) -> np.ndarray:
        if self._acc is None:
            self._acc = np.empty(self.shape, dtype=self.dtype)
        return self._acc


class _TableShard(_Shard):
    def __init__(self, key: int, meta: Dict[str, Any], spec: OptimizerSpec, declared: Dict[str, Any],
                 step: int, pserver_id: int, n_pservers: int) -> None:
        super().__init__(key, meta["name"], spec, declared, step)
        self.meta = meta
        self.width = int(meta["width"])
        self.dtype = np.dtype(meta["dtype"])
        self.init_scale = float(meta["init_scale"])
        self.seed = int(meta["seed"])
        self.pserver_id = pserver_id
        self.n_pservers = n_pservers
        self.opt = make_sparse(spec, self.width, self.dtype)
        self.keys = np.empty(0, dtype=np.int64)  # sorted ids
        self.pos = np.empty(0, dtype=np.int64)  # row of keys[i] in table
        self.n = 0
        self.table = np.empty((0, self.width), dtype=self.dtype)
        self.state: Dict[str, np.ndarray] = self.opt.new_state(0)

    def describe(self) -> str:
        return f"table {self.name!r}"

    def _grow(self, need: int) -> None:
        cap = len(self.table)
        if self.n + need <= cap:
            return
        new_cap = max(self.n + need, 2 * cap, 1024)
        table = np.empty((new_cap, self.width), dtype=self.dtype)
        table[: self.n] = self.table[: self.n]
        self.table = table
        state = self.opt.new_state(new_cap)
        for k, a in self.state.items():
            state[k][: self.n] = a[: self.n]
        self.state = state

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """Row positions of sorted unique ``ids``, creating missing rows with the deterministic init."""
        idx = np.searchsorted(self.keys, ids)
        found = idx < len(self.keys)
        found[found] = self.keys[idx[found]] == ids[found]
        if found.all():
            return self.pos[idx]
        new = ids[~found]
        self._grow(len(new))
        new_pos = np.arange(self.n, self.n + len(new), dtype=np.int64)
        self.table[self.n: self.n + len(new)] = init_rows(new, self.width, self.init_scale, self.seed, self.dtype)
        self.n += len(new)
        ins = np.searchsorted(self.keys, new)
        self.keys = np.insert(self.keys, ins, new)
        self.pos = np.insert(self.pos, ins, new_pos)
        return self.pos[np.searchsorted(self.keys, ids)]

    def check_ids(self, ids: np.ndarray) -> None:
        if len(ids) > 1 and not bool(np.all(ids[1:] > ids[:-1])):
            raise ProtocolError(f"{self.describe()}: ids are not sorted and unique")
        if len(ids) and bool(np.any(np.mod(ids, self.n_pservers) != self.pserver_id)):
            raise ProtocolError(f"{self.describe()}: ids that belong to another pserver")


class _Conn:
    """One authenticated connection's state (touched only by its handler thread)."""

    def __init__(self, sock: socket.socket, peer: str, port: int) -> None:
        self.sock = sock
        self.peer = peer
        self.port = port
        self.trainer = -1
        self.hbuf = bytearray(P.HEADER_SIZE)
        self.consumed = True
        self.scratch: Optional[bytearray] = None
        self.rbuf = np.empty(0, dtype=np.uint8)  # receive buffer for dense pushes, grown to the largest block

    def discard(self, n: int) -> None:
        if self.scratch is None:
            self.scratch = bytearray(1 << 20)
        P.discard(self.sock, n, self.scratch)

    def grad_buffer(self, b: _DenseBlock) -> np.ndarray:
        """This connection's receive buffer as an array shaped like block ``b`` (reused by every push)."""
        if self.rbuf.nbytes < b.nbytes:
            self.rbuf = np.empty(b.nbytes, dtype=np.uint8)
        return self.rbuf[: b.nbytes].view(b.dtype).reshape(b.shape)


class PServer:
    """Pserver ``pserver_id`` of the job described by ``env``.

    ``resume`` is a loaded checkpoint shard (see ``checkpoint.resolve_resume``). ``ports`` overrides the
    contract's ports (0 = any free port), which the in-process local mode uses.
    """

    def __init__(self, env: JobEnv, pserver_id: int, *, resume: Optional[ckpt.ShardState] = None,
                 checkpoint_root: Optional[str] = None, max_frame: int = P.DEFAULT_MAX_FRAME_BYTES,
                 host: Optional[str] = None, ports: Optional[Tuple[int, ...]] = None) -> None:
        self.env = env
        self.pserver_id = pserver_id
        self.n_pservers = len(env.pservers)
        self.host = host or env.pservers[pserver_id].host
        self.want_ports = tuple(ports) if ports is not None else env.all_ports(pserver_id)
        self.ports: Tuple[int, ...] = ()
        self.max_frame = int(max_frame)
        self.barrier_timeout = float(env.barrier_timeout)
        self.checkpoint_root = checkpoint_root or ckpt.default_root(env.job_dir)
        if not env.secret:
            log.warning("pserver %d: PADDLE_JOB_SECRET is empty; connections are authenticated with an "
                        "empty key", pserver_id)
        self.lock = threading.Condition()
        self.mode: Optional[str] = None
        self.optimizer: Optional[Dict[str, Any]] = None
        self.staleness: Optional[int] = None  # async: drop dense gradients computed on values this old
        self.dropped_stale = 0
        self.base_step = 0
        self.resumed_from: Optional[str] = None
        self.blocks: Dict[int, _DenseBlock] = {}
        self.tables: Dict[int, _TableShard] = {}
        # (from_step, values, names): names None = every parameter and table, else only those named.
        self.hyper: List[Tuple[int, Dict[str, float], Optional[frozenset]]] = []
        self.active = frozenset(range(env.trainers))
        self.closed: Set[int] = set()
        self.last_seen: Dict[int, float] = {}
        self.rw = _RWLock()
        self._apply_pool = ThreadPoolExecutor(max_workers=max(2, min(8, os.cpu_count() or 2)),
                                              thread_name_prefix=f"pserver{pserver_id}-apply")
        self._done = threading.Event()
        self._listeners: List[socket.socket] = []
        self._conns: Set[socket.socket] = set()
        self._threads: List[threading.Thread] = []
        if resume is not None:
            self._load(resume)
        self._ops: Dict[int, Callable[[_Conn, P.Header], None]] = {
            P.Op.DECLARE: self._op_declare,
            P.Op.DEF_DENSE: self._op_def_dense,
            P.Op.INIT_DENSE: self._op_init_dense,
            P.Op.DEF_SPARSE: self._op_def_sparse,
            P.Op.PUSH_DENSE: self._op_push_dense,
            P.Op.PULL_DENSE: self._op_pull_dense,
            P.Op.PUSH_SPARSE: self._op_push_sparse,
            P.Op.PULL_SPARSE: self._op_pull_sparse,
            P.Op.SET_HYPER: self._op_set_hyper,
            P.Op.SAVE: self._op_save,
            P.Op.CLOSE: self._op_close,
            P.Op.STATUS: self._op_status,
        }

    # -- lifecycle ---------------------------------------------------------------------------------------

    def start(self) -> PServer:
        """Bind every port (all or nothing) and start accepting."""
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
            t = threading.Thread(target=self._accept_loop, args=(s,), daemon=True,
                                 name=f"pserver{self.pserver_id}-accept-{s.getsockname()[1]}")
            t.start()
            self._threads.append(t)
        log.info("pserver %d listening on %s ports %s", self.pserver_id, self.host,
                 ",".join(map(str, self.ports)))
        return self

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until every trainer has closed (or ``stop``); True if so."""
        return self._done.wait(timeout)

    def serve_forever(self) -> None:
        if not self._listeners:
            self.start()
        while not self._done.wait(0.5):
            pass
        self.stop()

    def stop(self) -> None:
        self._done.set()
        self._close_listeners()
        self._apply_pool.shutdown(wait=False)
        with self.lock:
            conns = list(self._conns)
            self.lock.notify_all()
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for shard in list(self.blocks.values()) + list(self.tables.values()):
            with shard.cv:
                shard.cv.notify_all()

    @property
    def stopped(self) -> bool:
        return self._done.is_set()

    def _close_listeners(self) -> None:
        for s in self._listeners:
            try:
                s.close()
            except OSError:
                pass

    def _accept_loop(self, lsock: socket.socket) -> None:
        port = lsock.getsockname()[1]
        while not self._done.is_set():
            try:
                sock, addr = lsock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            t = threading.Thread(target=self._serve_conn, args=(sock, f"{addr[0]}:{addr[1]}", port), daemon=True,
                                 name=f"pserver{self.pserver_id}-conn-{addr[1]}")
            t.start()

    # -- one connection ----------------------------------------------------------------------------------

    def _serve_conn(self, sock: socket.socket, peer: str, port: int) -> None:
        conn = _Conn(sock, peer, port)
        with self.lock:
            self._conns.add(sock)
        try:
            sock.settimeout(10.0)  # a peer that never answers the challenge must not pin a thread forever
            P.tune_socket(sock)
            try:
                conn.trainer = P.server_handshake(sock, self.env.secret, self.env.job_id, self.env.trainers)
            except ConnectionLost as e:
                # Closed before answering the challenge: a port probe (the launcher's readiness check), not news.
                log.debug("pserver %d: %s closed before authenticating: %s", self.pserver_id, peer, e)
                return
            except (AuthError, ProtocolError, OSError) as e:
                self._drop(conn, f"authentication failed: {e}")
                return
            sock.settimeout(None)
            self._touch(conn.trainer)
            while not self._done.is_set():
                try:
                    h = P.recv_header(sock, conn.hbuf, self.max_frame)
                except ConnectionLost:
                    return  # orderly close by the trainer
                except ProtocolError as e:
                    self._drop(conn, f"bad frame header: {e}", e)
                    return
                conn.consumed = h.length == 0
                if not self._handle(conn, h):
                    return
        except OSError as e:
            if not self._done.is_set():
                log.info("pserver %d: connection from %s ended: %s", self.pserver_id, peer, e)
        finally:
            with self.lock:
                self._conns.discard(sock)
            try:
                sock.close()
            except OSError:
                pass

    def _handle(self, conn: _Conn, h: P.Header) -> bool:
        """Serve one request; False when the connection must be dropped."""
        self._touch(conn.trainer)
        handler = self._ops.get(h.op)
        try:
            if handler is None:
                raise ProtocolError(f"unknown or unexpected {h.op_name()}")
            handler(conn, h)
            return True
        except (ProtocolError, UnknownKey, AuthError) as e:
            self._drop(conn, f"{h.op_name()} key={h.key}: {e}", e)
            return False
        except ConnectionLost as e:
            log.info("pserver %d: trainer %d (%s) went away during %s: %s", self.pserver_id, conn.trainer,
                     conn.peer, h.op_name(), e)
            return False
        except PSError as e:
            # A request-level failure (barrier timeout, mismatch): report it and keep the connection.
            if isinstance(e, BarrierTimeout):
                log.warning("%s", e)
            if not conn.consumed:
                conn.discard(h.length)
            self._reply_error(conn, e)
            return True
        except OSError:
            raise
        except Exception as e:  # a bug must cost one connection, not the pserver
            log.exception("pserver %d: internal error serving %s from trainer %d", self.pserver_id, h.op_name(),
                          conn.trainer)
            self._drop(conn, f"internal error: {e!r}", RemoteError(f"pserver {self.pserver_id}: {e!r}"))
            return False

    def _drop(self, conn: _Conn, why: str, err: Optional[PSError] = None) -> None:
        who = f"trainer {conn.trainer}" if conn.trainer >= 0 else "unauthenticated peer"
        log.warning("pserver %d: dropped connection from %s (%s, port %d): %s", self.pserver_id, conn.peer, who,
                    conn.port, why)
        if err is not None and conn.trainer >= 0:
            try:
                conn.sock.settimeout(1.0)
                self._reply_error(conn, err)
            except (OSError, PSError):
                pass

    def _reply_error(self, conn: _Conn, e: PSError) -> None:
        body = e.to_wire()
        msg = str(body.get("message", ""))
        if not msg.startswith(("pserver", "barrier")):
            body["message"] = f"pserver {self.pserver_id}: {msg}"
        P.send_frame(conn.sock, P.json_frame(P.Op.ERROR, body, status=e.code))

    def _reply_ok(self, conn: _Conn, body: Optional[Dict[str, Any]] = None, *, key: int = 0, step: int = 0) -> None:
        if body is None:
            P.send_frame(conn.sock, P.pack_header(P.Op.OK, key=key, step=step))
        else:
            P.send_frame(conn.sock, P.json_frame(P.Op.OK, body, key=key, step=step))

    def _read_json(self, conn: _Conn, h: P.Header) -> Dict[str, Any]:
        body = P.recv_json(conn.sock, h)
        conn.consumed = True
        return body

    # -- trainers and barriers ----------------------------------------------------------------------------

    def _touch(self, trainer: int) -> None:
        if trainer >= 0:
            self.last_seen[trainer] = time.monotonic()

    def _missing(self, trainers: Any) -> List[MissingTrainer]:
        now = time.monotonic()
        out = []
        for t in sorted(trainers):
            seen = self.last_seen.get(t)
            out.append(MissingTrainer(t, None if seen is None else round(now - seen, 1)))
        return out

    def _timeout(self, step: int, what: str, missing: List[MissingTrainer]) -> BarrierTimeout:
        waiting = ", ".join(m.describe() for m in missing) or "no trainer (it should have completed)"
        return BarrierTimeout(
            f"barrier timeout at step {step} on pserver {self.pserver_id} ({what}): waiting for {waiting} "
            f"for more than {self.barrier_timeout:g} s", step, self.pserver_id, missing)

    def _wait(self, cv: threading.Condition, ready: Callable[[], bool], step: int, what: str,
              missing: Callable[[], Any]) -> None:
        """Wait (holding ``cv``) until ``ready()``; on timeout raise a BarrierTimeout naming ``missing()``."""
        if ready():
            return
        deadline = time.monotonic() + self.barrier_timeout
        while not ready():
            if self._done.is_set():
                raise RemoteError(f"pserver {self.pserver_id} is shutting down")
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._timeout(step, what, self._missing(missing()))
            cv.wait(min(left, 1.0))

    def _shard_missing(self, shard: _Shard) -> Callable[[], Any]:
        return lambda: set(self.active) - set(shard.pending) - shard.receiving

    def _wait_step(self, shard: _Shard, step: int, what: str) -> None:
        if isinstance(shard, _DenseBlock) and shard.error:
            raise RemoteError(f"pserver {self.pserver_id}: {shard.error}")
        if isinstance(shard, _DenseBlock) and not shard.initialized:
            self._wait(shard.cv, lambda: shard.initialized, step, f"{what} {shard.describe()}: initial value",
                       lambda: {0} - self.closed)
        if self.mode == "sync":
            self._wait(shard.cv, lambda: shard.step >= step, step, f"{what} {shard.describe()}",
                       self._shard_missing(shard))

    def _ready_to_apply(self, shard: _Shard) -> bool:
        return bool(shard.pending) and self.active.issubset(shard.pending.keys())

    def _apply_hyper(self, shard: _Shard, step: Optional[int]) -> None:
        """Catch ``shard.spec`` up with the hyper-parameter changes effective at ``step`` (None: all)."""
        while shard.hyper_pos < len(self.hyper):
            from_step, values, names = self.hyper[shard.hyper_pos]
            if step is not None and from_step > step:
                break
            if names is None or shard.name in names:
                for k, v in values.items():
                    setattr(shard.spec, k, v)
            shard.hyper_pos += 1

    def _complete_dense(self, b: _DenseBlock) -> None:
        """(Holding ``b.cv``.) Once every active trainer pushed, apply the averaged gradient.

        The apply runs on the apply pool, not on the connection thread, so the connection can already
        receive the next block while this one is being updated (the pull for the next step waits for it).
        """
        if b.applying or not self._ready_to_apply(b):
            return
        b.applying = True
        self._apply_pool.submit(self._apply_dense, b)

    def _apply_dense(self, b: _DenseBlock) -> None:
        with b.cv:
            try:
                # b.acc holds the contributors' gradients, summed in trainer order by _op_push_dense.
                with self.rw.shared():
                    self._apply_hyper(b, b.step)
                    self._apply_grad(b, b.acc, len(b.pending))
                    b.step += 1
            except Exception as e:  # keep serving; the waiting pulls report it
                log.exception("pserver %d: optimizer failed on %s", self.pserver_id, b.describe())
                b.error = f"optimizer failed on {b.describe()} at step {b.step}: {e!r}"
            finally:
                b.pending.clear()
                b.applying = False
                b.cv.notify_all()

    def _complete_table(self, t: _TableShard) -> None:
        if not self._ready_to_apply(t):
            return
        contributors = sorted(t.pending)
        if len(contributors) == 1:
            ids, g = t.pending[contributors[0]]
        else:
            all_ids = np.concatenate([t.pending[c][0] for c in contributors])
            all_g = np.concatenate([t.pending[c][1] for c in contributors])
            ids, inv = np.unique(all_ids, return_inverse=True)
            g = np.zeros((len(ids), t.width), dtype=t.dtype)
            np.add.at(g, inv, all_g)
            g /= t.dtype.type(len(contributors))
        with self.rw.shared():
            self._apply_hyper(t, t.step)
            if len(ids):
                pos = t.lookup(ids)  # may grow (reallocate) the table: look up before reading t.table
                t.opt.apply(t.table, t.state, pos, g)
            t.step += 1
        t.pending.clear()
        t.cv.notify_all()

    # -- requests ------------------------------------------------------------------------------------------

    def _op_declare(self, conn: _Conn, h: P.Header) -> None:
        body = self._read_json(conn, h)
        mode = body.get("mode")
        if mode not in MODES:
            raise ConfigMismatch(f"mode {mode!r}: expected one of {', '.join(MODES)}")
        try:
            opt = _spec_key(body.get("optimizer") or {})
        except (ValueError, TypeError) as e:
            raise ConfigMismatch(f"bad optimizer spec: {e}") from None
        if body.get("trainers") != self.env.trainers or body.get("n_pservers") != self.n_pservers:
            raise ConfigMismatch(
                f"trainer {conn.trainer} thinks the job has {body.get('trainers')} trainers and "
                f"{body.get('n_pservers')} pservers; this pserver was started for {self.env.trainers} and "
                f"{self.n_pservers}")
        staleness = body.get("staleness")
        if staleness is not None and (not isinstance(staleness, int) or staleness < 0):
            raise ConfigMismatch(f"staleness {staleness!r}: expected a non-negative integer or null")
        with self.lock:
            if conn.trainer == 0 and self.mode is None:
                self.mode, self.optimizer, self.staleness = mode, opt, staleness
                self.lock.notify_all()
            self._wait(self.lock, lambda: self.mode is not None, self.base_step, "waiting for trainer 0 to declare",
                       lambda: {0})
            if mode != self.mode:
                raise ConfigMismatch(f"trainer {conn.trainer} asks for mode {mode!r} but the job runs in "
                                     f"{self.mode!r} mode (declared by trainer 0)")
            if staleness != self.staleness:
                raise ConfigMismatch(f"trainer {conn.trainer} asks for staleness bound {staleness} but trainer 0 "
                                     f"declared {self.staleness}")
            if opt != self.optimizer:
                raise ConfigMismatch(f"trainer {conn.trainer} declares optimizer {opt} but trainer 0 declared "
                                     f"{self.optimizer}")
        self._reply_ok(conn, {"pserver_id": self.pserver_id, "step": self.base_step, "mode": self.mode,
                              "resumed_from": self.resumed_from})

    def _check_declared(self) -> None:
        if self.mode is None:
            raise ConfigMismatch("no DECLARE yet: the trainer must declare the mode first")

    def _parse_spec(self, body: Dict[str, Any]) -> Dict[str, Any]:
        try:
            return _spec_key(body.get("optimizer") or self.optimizer or {})
        except (ValueError, TypeError) as e:
            raise ConfigMismatch(f"bad optimizer spec: {e}") from None

    def _op_def_dense(self, conn: _Conn, h: P.Header) -> None:
        body = self._read_json(conn, h)
        self._check_declared()
        try:
            meta = {"name": str(body["name"]), "lo": int(body["lo"]), "hi": int(body["hi"]),
                    "shape": [int(s) for s in body["shape"]], "dtype": np.dtype(body["dtype"]).name}
            P.dtype_code(meta["dtype"])
        except (KeyError, TypeError, ValueError) as e:
            raise ProtocolError(f"bad dense block definition: {e!r}") from None
        if any(s < 0 for s in meta["shape"]):
            raise ProtocolError(f"bad dense block shape {meta['shape']}")
        spec = self._parse_spec(body)
        with self.lock:
            b = self.blocks.get(h.key)
            if b is None:
                nbytes = int(np.prod(meta["shape"], dtype=np.int64)) * np.dtype(meta["dtype"]).itemsize
                if nbytes > self.max_frame:
                    raise ProtocolError(f"block of {nbytes} bytes exceeds the {self.max_frame}-byte frame cap")
                b = _DenseBlock(h.key, meta, OptimizerSpec.from_dict(spec), spec, self.base_step)
                self.blocks[h.key] = b
            elif b.meta != meta:
                raise ConfigMismatch(f"dense block {h.key}: trainer {conn.trainer} defines {meta} but it is "
                                     f"{b.meta} (do all trainers register the same parameters?)")
            elif b.declared != spec:
                raise ConfigMismatch(f"dense block {b.describe()}: trainer {conn.trainer} uses optimizer {spec}, "
                                     f"the job uses {b.declared}")
        self._reply_ok(conn, {"step": b.step, "initialized": b.initialized}, key=h.key)

    def _block(self, h: P.Header, want_len: Optional[int] = None) -> _DenseBlock:
        b = self.blocks.get(h.key)
        if b is None:
            raise UnknownKey(f"no dense block with key {h.key}")
        if h.dtype != P.dtype_code(b.dtype):
            raise ProtocolError(f"{b.describe()} is {b.dtype}, frame says dtype code {h.dtype}")
        if want_len is not None and h.length != want_len:
            raise ProtocolError(f"{b.describe()} expects {want_len} payload bytes, frame has {h.length}")
        return b

    def _op_init_dense(self, conn: _Conn, h: P.Header) -> None:
        b = self._block(h, None)
        if h.length != b.nbytes:
            raise ProtocolError(f"{b.describe()} expects {b.nbytes} payload bytes, frame has {h.length}")
        with b.cv:
            mine = not (b.initialized or b.initializing)
            b.initializing = b.initializing or mine
        if not mine:
            conn.discard(h.length)
        else:
            try:
                P.recv_into(conn.sock, P.byte_view(b.param))
            except BaseException:
                with b.cv:
                    b.initializing = False
                    b.cv.notify_all()
                raise
            with b.cv:
                b.initialized, b.initializing = True, False
                b.cv.notify_all()
        conn.consumed = True
        self._reply_ok(conn, key=h.key, step=b.step)

    def _op_push_dense(self, conn: _Conn, h: P.Header) -> None:
        """Receive one block's gradient and fold it in.

        Memory: a gradient is received whole into this connection's buffer (or, for the first of several
        sync trainers, straight into the block's sum), so a frame cut short changes nothing. Sync mode
        with several trainers keeps one sum per block, added in trainer order (the first two in either
        order: float addition commutes), so the result never depends on arrival order. The last
        contribution of a step is folded and, for plain SGD, applied in one cache-sized pass.
        """
        b = self._block(h)
        if h.length != b.nbytes:
            raise ProtocolError(f"{b.describe()} expects {b.nbytes} payload bytes, frame has {h.length}")
        t = conn.trainer
        sync = self.mode == "sync"
        with b.cv:
            self._wait_step(b, h.step, "push")
            if sync:
                dup = h.step < b.step or t in b.pending or t in b.receiving or b.applying
            else:
                dup = t in b.receiving
            direct = (sync and not dup and not b.pending and not b.acc_busy and self.active != {t}
                      and t in sorted(self.active)[:2])
            if not dup:
                b.receiving.add(t)
                b.acc_busy = b.acc_busy or direct
        if dup:
            conn.discard(h.length)  # an idempotent repeat of a push already counted
            conn.consumed = True
            self._reply_ok(conn, key=h.key, step=b.step)
            return
        dest = b.acc if direct else conn.grad_buffer(b)
        try:
            P.recv_into(conn.sock, P.byte_view(dest))
        except BaseException:
            with b.cv:
                b.receiving.discard(t)
                b.acc_busy = b.acc_busy and not direct
                b.cv.notify_all()
            raise
        conn.consumed = True
        with b.cv:
            try:
                if not sync:
                    if self.staleness is not None and b.step - h.aux > self.staleness:
                        # Bounded staleness: the trainer computed this on values older than allowed (aux
                        # carries the block version it pulled).
                        self.dropped_stale += 1
                    else:
                        with self.rw.shared():
                            self._apply_hyper(b, None)
                            self._apply_grad(b, dest, 1)
                            b.step += 1
                elif b.step == h.step:
                    if direct:
                        b.acc_busy = False
                        b.pending[t] = True
                        self._complete_dense(b)
                    else:
                        self._wait(b.cv, lambda: b.step != h.step or self._may_fold(b, t), h.step,
                                   f"push {b.describe()}: summing in trainer order",
                                   lambda: {u for u in self.active if u < t} - set(b.pending))
                        if b.step == h.step:
                            self._fold(b, t, dest)
            finally:
                b.receiving.discard(t)
                if direct:
                    b.acc_busy = False
                b.cv.notify_all()
        self._reply_ok(conn, key=h.key, step=b.step)

    def _may_fold(self, b: _DenseBlock, t: int) -> bool:
        """(Holding ``b.cv``.) May trainer ``t`` add its gradient to the block's sum now?"""
        if b.acc_busy or b.applying:
            return False
        order = sorted(self.active | {t})
        first_two = set(order[:2])
        return all(u in b.pending for u in order if u < t) or (t in first_two and set(b.pending) <= first_two)

    def _fold(self, b: _DenseBlock, t: int, g: np.ndarray) -> None:
        """(Holding ``b.cv``.) Add trainer ``t``'s gradient ``g`` (a connection buffer) to step ``b.step``."""
        first = not b.pending
        b.pending[t] = True
        last = self._ready_to_apply(b)
        if first and last:  # the only contributor: apply straight from the receive buffer
            with self.rw.shared():
                self._apply_hyper(b, b.step)
                self._apply_grad(b, g, 1)
                b.step += 1
            b.pending.clear()
            return
        if not last or not self._plain_sgd(b):
            if first:
                np.copyto(b.acc, g)
            else:
                np.add(b.acc, g, out=b.acc)  # acc is a read-only property: `b.acc += g` would assign to it
            self._complete_dense(b)
            return
        # Last of several with plain SGD: add, average and apply chunk by chunk while the chunk is in cache
        # (the same operations, in the same order, as summing first and applying after).
        with self.rw.shared():
            self._apply_hyper(b, b.step)
            n = b.dtype.type(len(b.pending))
            lr = b.dtype.type(b.spec.lr)
            acc, gf = b.acc.reshape(-1), g.reshape(-1)
            for lo in range(0, b.flat.size, _CHUNK_ELEMS):
                hi = lo + _CHUNK_ELEMS
                a = acc[lo:hi]
                a += gf[lo:hi]
                a /= n
                a *= lr
                b.flat[lo:hi] -= a
            b.step += 1
        b.pending.clear()

    @staticmethod
    def _plain_sgd(b: _DenseBlock) -> bool:
        return b.spec.name == "sgd" and b.spec.weight_decay == 0

    def _apply_grad(self, b: _DenseBlock, g: np.ndarray, n: int) -> None:
        """Apply the mean gradient ``g / n`` to block ``b``; ``g`` is scratch (it may be overwritten)."""
        if n > 1:
            g /= b.dtype.type(n)
        if self._plain_sgd(b):
            # ``param -= lr * g`` in one pass per cache-sized chunk, reusing g's memory: no buffer of the
            # block's size is touched besides param and g (same rounding as the optimizer's own apply).
            lr = b.dtype.type(b.spec.lr)
            gf = g.reshape(-1)
            for lo in range(0, b.flat.size, _CHUNK_ELEMS):
                hi = lo + _CHUNK_ELEMS
                c = gf[lo:hi]
                c *= lr
                b.flat[lo:hi] -= c
        else:
            b.opt.apply(b.param, g)

    def _op_pull_dense(self, conn: _Conn, h: P.Header) -> None:
        b = self._block(h, 0)
        with b.cv:
            self._wait_step(b, h.step, "pull")
            step = b.step
        # Sent outside the lock: in sync mode nothing can update this block until this trainer pushes again,
        # and a stalled reader must never block the other trainers. Async pulls may see a concurrent update.
        P.send_frame(conn.sock, P.pack_header(P.Op.DATA, P.dtype_code(b.dtype), key=h.key, step=step,
                                              length=b.nbytes), b.param)

    def _op_def_sparse(self, conn: _Conn, h: P.Header) -> None:
        body = self._read_json(conn, h)
        self._check_declared()
        try:
            meta = {"name": str(body["name"]), "width": int(body["width"]), "dtype": np.dtype(body["dtype"]).name,
                    "init_scale": float(body["init_scale"]), "seed": int(body["seed"])}
            P.dtype_code(meta["dtype"])
        except (KeyError, TypeError, ValueError) as e:
            raise ProtocolError(f"bad sparse table definition: {e!r}") from None
        if meta["width"] < 1:
            raise ProtocolError(f"bad sparse table width {meta['width']}")
        spec = self._parse_spec(body)
        with self.lock:
            t = self.tables.get(h.key)
            if t is None:
                try:
                    t = _TableShard(h.key, meta, OptimizerSpec.from_dict(spec), spec, self.base_step,
                                    self.pserver_id, self.n_pservers)
                except ValueError as e:
                    raise ConfigMismatch(str(e)) from None
                self.tables[h.key] = t
            elif t.meta != meta:
                raise ConfigMismatch(f"sparse table {h.key}: trainer {conn.trainer} defines {meta} but it is {t.meta}")
            elif t.declared != spec:
                raise ConfigMismatch(f"{t.describe()}: trainer {conn.trainer} uses optimizer {spec}, the job uses "
                                     f"{t.declared}")
        self._reply_ok(conn, {"step": t.step, "rows": t.n}, key=h.key)

    def _table(self, h: P.Header) -> _TableShard:
        t = self.tables.get(h.key)
        if t is None:
            raise UnknownKey(f"no sparse table with key {h.key}")
        return t

    def _op_pull_sparse(self, conn: _Conn, h: P.Header) -> None:
        t = self._table(h)
        n = h.aux
        if h.dtype != P.dtype_code(np.int64) or h.length != 8 * n:
            raise ProtocolError(f"{t.describe()}: pull of {n} ids needs {8 * n} int64 bytes, frame has {h.length}")
        ids = np.empty(n, dtype=np.int64)
        P.recv_into(conn.sock, P.byte_view(ids))
        conn.consumed = True
        t.check_ids(ids)
        with t.cv:
            self._wait_step(t, h.step, "pull")
            with self.rw.shared():
                pos = t.lookup(ids)
                rows = t.table[pos]
            step = t.step
        P.send_frame(conn.sock, P.pack_header(P.Op.DATA, P.dtype_code(t.dtype), key=h.key, step=step,
                                              length=rows.nbytes, aux=n), rows)

    def _op_push_sparse(self, conn: _Conn, h: P.Header) -> None:
        t = self._table(h)
        n = h.aux
        row_bytes = t.width * t.dtype.itemsize
        if h.dtype != P.dtype_code(t.dtype) or h.length != n * (8 + row_bytes):
            raise ProtocolError(f"{t.describe()}: push of {n} rows needs {n * (8 + row_bytes)} bytes of {t.dtype}, "
                                f"frame has {h.length} (dtype code {h.dtype})")
        tr = conn.trainer
        with t.cv:
            self._wait_step(t, h.step, "push")
            dup = self.mode == "sync" and (h.step < t.step or tr in t.pending or tr in t.receiving)
            if not dup:
                t.receiving.add(tr)
        if dup:
            conn.discard(h.length)
        else:
            try:
                ids = np.empty(n, dtype=np.int64)
                grads = np.empty((n, t.width), dtype=t.dtype)
                P.recv_into(conn.sock, P.byte_view(ids))
                P.recv_into(conn.sock, P.byte_view(grads))
                conn.consumed = True
                t.check_ids(ids)
            finally:
                with t.cv:
                    t.receiving.discard(tr)
            with t.cv:
                if self.mode == "async":
                    with self.rw.shared():
                        self._apply_hyper(t, None)
                        if n:
                            pos = t.lookup(ids)
                            t.opt.apply(t.table, t.state, pos, grads)
                        t.step += 1
                elif t.step == h.step:
                    t.pending[tr] = (ids, grads)
                    self._complete_table(t)
                t.cv.notify_all()
        conn.consumed = True
        self._reply_ok(conn, key=h.key, step=t.step)

    def _op_set_hyper(self, conn: _Conn, h: P.Header) -> None:
        body = self._read_json(conn, h)
        values = body.get("values")
        if not isinstance(values, dict) or not values:
            raise ConfigMismatch("SET_HYPER needs a non-empty 'values' object")
        bad = sorted(set(values) - _HYPER_KEYS)
        if bad:
            raise ConfigMismatch(f"cannot set {bad}: settable are {sorted(_HYPER_KEYS)}")
        try:
            base = dict(self.optimizer or OptimizerSpec().to_dict())
            OptimizerSpec.from_dict({**base, **values})
            values = {k: float(v) for k, v in values.items()}
            from_step = int(body.get("from_step", 0))
            names = body.get("names")
            if names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
                raise ValueError("'names' must be a list of parameter/table names")
        except (ValueError, TypeError) as e:
            raise ConfigMismatch(f"bad hyper-parameters {values}: {e}") from None
        with self.lock:
            self.hyper.append((from_step, values, None if names is None else frozenset(names)))
        self._reply_ok(conn)

    def _op_close(self, conn: _Conn, h: P.Header) -> None:
        if h.length:
            conn.discard(h.length)
            conn.consumed = True
        self._reply_ok(conn)
        t = conn.trainer
        with self.lock:
            self.closed.add(t)
            self.active = frozenset(self.active - {t})
            all_closed = len(self.closed) >= self.env.trainers
            self.lock.notify_all()
        log.info("pserver %d: trainer %d closed (%d of %d closed)", self.pserver_id, t, len(self.closed),
                 self.env.trainers)
        # A barrier that was waiting only for this trainer completes now.
        for b in list(self.blocks.values()):
            with b.cv:
                if self.mode == "sync":
                    self._complete_dense(b)
                b.cv.notify_all()
        for tb in list(self.tables.values()):
            with tb.cv:
                if self.mode == "sync":
                    self._complete_table(tb)
                tb.cv.notify_all()
        if all_closed:
            log.info("pserver %d: all %d trainers closed; exiting", self.pserver_id, self.env.trainers)
            self._done.set()

    def _op_status(self, conn: _Conn, h: P.Header) -> None:
        if h.length:
            raise ProtocolError("STATUS takes no payload")
        with self.lock:
            body = {
                "pserver_id": self.pserver_id, "mode": self.mode, "base_step": self.base_step,
                "staleness": self.staleness, "dropped_stale": self.dropped_stale,
                "active": sorted(self.active), "closed": sorted(self.closed), "resumed_from": self.resumed_from,
                "blocks": {str(k): {"name": b.name, "step": b.step, "lr": b.spec.lr} for k, b in self.blocks.items()},
                "tables": {str(k): {"name": t.name, "step": t.step, "rows": t.n, "lr": t.spec.lr}
                           for k, t in self.tables.items()},
            }
        self._reply_ok(conn, body)

    # -- checkpoints ---------------------------------------------------------------------------------------

    def _op_save(self, conn: _Conn, h: P.Header) -> None:
        body = self._read_json(conn, h)
        step = int(body.get("step", h.step))
        path = body.get("path") or ckpt.step_dir(self.checkpoint_root, step)
        if not os.path.isabs(path):
            path = os.path.join(self.checkpoint_root, path)
        if self.mode == "sync":
            for shard in list(self.blocks.values()) + list(self.tables.values()):
                with shard.cv:
                    self._wait_step(shard, step, "checkpoint")
        try:
            d = ckpt.save_shard(path, self.snapshot(step))
        except OSError as e:
            raise CheckpointError(f"cannot write checkpoint {path}: {e}") from None
        log.info("pserver %d: saved checkpoint of step %d to %s", self.pserver_id, step, d)
        self._reply_ok(conn, {"path": d, "step": step})

    def snapshot(self, step: int) -> ckpt.ShardState:
        """A consistent copy of everything this pserver holds (no optimizer apply runs meanwhile)."""
        with self.rw.exclusive():
            blocks = [
                ckpt.BlockState(b.key, b.name, b.meta["lo"], b.meta["hi"], b.dtype.name,
                                {"declared": b.declared, "current": self._spec_at(b, step)}, b.step, b.param.copy(),
                                {k: v.copy() for k, v in b.opt.state.items()})
                for b in self.blocks.values()
            ]
            tables = []
            for t in self.tables.values():
                pos = t.pos
                tables.append(ckpt.TableState(
                    t.key, t.name, t.width, t.dtype.name, t.init_scale, t.seed,
                    {"declared": t.declared, "current": self._spec_at(t, step)}, t.step, t.keys.copy(), t.table[pos],
                    {k: v[pos] for k, v in t.state.items()}))
            return ckpt.ShardState(step, self.pserver_id, self.n_pservers, self.mode, self.optimizer, blocks,
                                   tables)

    def _spec_at(self, shard: _Shard, step: int) -> Dict[str, Any]:
        """The spec the update of ``step`` will use: includes hyper-parameter changes not yet applied."""
        spec = shard.spec.to_dict()
        for from_step, values, names in self.hyper[shard.hyper_pos:]:
            if self.mode == "sync" and from_step > step:
                break
            if names is None or shard.name in names:
                spec.update(values)
        return spec

    def _load(self, shard: ckpt.ShardState) -> None:
        self.mode, self.optimizer, self.base_step = shard.mode, shard.optimizer, shard.step
        self.resumed_from = shard.path
        for bs in shard.blocks:
            spec = OptimizerSpec.from_dict(bs.spec["current"])
            meta = {"name": bs.name, "lo": bs.lo, "hi": bs.hi, "shape": list(bs.param.shape), "dtype": bs.dtype}
            b = _DenseBlock(bs.key, meta, spec, bs.spec["declared"], bs.step)
            b.param[...] = bs.param
            try:
                b.opt.load_state(bs.opt_state)
            except ValueError as e:
                raise CheckpointError(f"checkpoint {shard.path}: {b.describe()}: {e}") from None
            b.initialized = True
            self.blocks[bs.key] = b
        for ts in shard.tables:
            spec = OptimizerSpec.from_dict(ts.spec["current"])
            meta = {"name": ts.name, "width": ts.width, "dtype": ts.dtype, "init_scale": ts.init_scale,
                    "seed": ts.seed}
            t = _TableShard(ts.key, meta, spec, ts.spec["declared"], ts.step, self.pserver_id, self.n_pservers)
            n = len(ts.ids)
            t._grow(n)
            t.table[:n] = ts.rows
            if set(ts.slots) != set(t.state):
                raise CheckpointError(f"checkpoint {shard.path}: {t.describe()} has optimizer slots "
                                      f"{sorted(ts.slots)}, expected {sorted(t.state)}")
            for k, v in ts.slots.items():
                t.state[k][:n] = v
            t.keys = np.asarray(ts.ids, dtype=np.int64).copy()
            t.pos = np.arange(n, dtype=np.int64)
            t.n = n
            self.tables[ts.key] = t
        log.info("pserver %d: resumed from %s (step %d, %d blocks, %d tables)", self.pserver_id, shard.path,
                 shard.step, len(self.blocks), len(self.tables))


def serve(env: JobEnv, proc: ProcessEnv = ProcessEnv()) -> int:
    """Run pserver ``env.pserver_id`` until every trainer has closed or SIGTERM/SIGINT; returns the exit code
    of ``python -m paddle_cluster.ps`` (0 done; 3 the requested checkpoint is unusable; 4 cannot listen)."""
    k = env.pserver_id
    if k is None:
        raise ValueError("serve() needs the contract of one pserver (JobEnv.for_process(PSERVER, ...))")
    logging.basicConfig(stream=sys.stderr, level=getattr(logging, proc.log_level.upper(), logging.INFO),
                        format=f"%(asctime)s pserver[{k}] %(levelname)s %(message)s")
    root = env.checkpoint_dir or ckpt.default_root(env.job_dir)
    try:
        shard = ckpt.resolve_resume(env.resume, root, k, len(env.pservers))
    except (CheckpointError, ValueError) as e:
        log.error("cannot resume (%s): %s", env.resume, e)
        return 3
    if env.resume and shard is None:
        log.info("no checkpoint under %s; starting fresh", root)
    server = PServer(env, k, resume=shard, checkpoint_root=root, max_frame=proc.max_frame_bytes)
    try:
        server.start()
    except OSError as e:
        log.error("%s", e)
        return 4

    def on_signal(signum: int, _frame: object) -> None:
        log.info("signal %d: shutting down", signum)
        server.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print(f"PSERVER_READY {k} {server.host} {','.join(map(str, server.ports))}", flush=True)
    server.serve_forever()
    return 0
