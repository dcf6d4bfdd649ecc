"""The trainer-side client: a small ps-lite-like push / pull / wait API.

Every (pserver, port) pair gets its own TCP connection and its own worker thread, so a push or pull fans
out to all pservers and all their ports at once; within one connection requests are pipelined (all
frames sent, then all replies read) and array bytes go straight between numpy buffers and the socket.

Steps: ``ps.step`` starts at 0 (or at the step a resumed pserver loaded). ``pull()`` returns the dense
values for ``ps.step``; ``push(grads)`` sends the gradients for ``ps.step`` and advances it. In sync mode
the pservers hold a pull for step ``t`` until every active trainer's gradient for ``t - 1`` has been
applied, so the canonical loop is simply::

    for batch in data:
        params = ps.pull()
        ps.push(grads_of(params, batch))
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from ..contract import PSERVER, Endpoint, JobEnv
from . import checkpoint as ckpt
from . import protocol as P
from .errors import AuthError, ConfigMismatch, ConnectionLost, PSError, UnknownKey, from_wire
from .optim import OptimizerSpec
from .placement import DEFAULT_MAX_BLOCK_BYTES, Block, place_dense, shard_of, sparse_conn

log = logging.getLogger("paddle_cluster.ps")
OptimizerLike = Union[OptimizerSpec, Mapping[str, Any], str, None]


def as_spec(opt: OptimizerLike, default: Optional[OptimizerSpec] = None) -> OptimizerSpec:
    if opt is None:
        return default if default is not None else OptimizerSpec()
    if isinstance(opt, OptimizerSpec):
        return opt
    if isinstance(opt, str):
        return OptimizerSpec(name=opt)
    return OptimizerSpec.from_dict(opt)


@dataclass
class PushHandle:
    """What ``push``/``push_sparse`` return; pass it to ``wait``."""

    step: int
    futures: List[Future] = field(default_factory=list)

    def done(self) -> bool:
        return all(f.done() for f in self.futures)


@dataclass(frozen=True)
class CheckpointInfo:
    """Where each pserver wrote its shard of a checkpoint."""

    step: int
    paths: Tuple[str, ...]


@dataclass(frozen=True)
class _Table:
    key: int
    name: str
    width: int
    dtype: np.dtype


class _Channel:
    """One authenticated connection to one pserver port, driven by one worker thread."""

    def __init__(self, env: JobEnv, trainer: int, pserver: int, port: int, connect_timeout: float,
                 io_timeout: float) -> None:
        self.pserver = pserver
        self.where = f"pserver {pserver} at {env.pservers[pserver].host}:{port}"
        self.sock = _connect(env.pservers[pserver].host, port, connect_timeout, self.where)
        try:
            P.tune_socket(self.sock)
            self.sock.settimeout(min(30.0, io_timeout))
            P.client_handshake(self.sock, env.secret, env.job_id, trainer)
            self.sock.settimeout(io_timeout)
        except AuthError as e:
            self.sock.close()
            raise AuthError(f"{self.where}: {e}") from None
        except (OSError, PSError) as e:
            self.sock.close()
            raise ConnectionLost(f"{self.where}: handshake failed: {e}") from None
        self.io_timeout = io_timeout
        self.hbuf = bytearray(P.HEADER_SIZE)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"ps{pserver}-{port}")
        self.broken: Optional[str] = None

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        return self.pool.submit(self._guard, fn, *args)

    def _guard(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self.broken:
            raise ConnectionLost(f"{self.where}: connection is broken ({self.broken})")
        try:
            return fn(self, *args)
        except socket.timeout:
            self.broken = f"no answer in {self.io_timeout:g} s (pserver hung or unreachable)"
            raise ConnectionLost(f"{self.where}: {self.broken}") from None
        except ConnectionLost as e:
            self.broken = str(e)
            raise ConnectionLost(f"{self.where}: {e}") from None
        except OSError as e:
            self.broken = str(e)
            raise ConnectionLost(f"{self.where}: {e}") from None

    def send(self, header: bytes, *payload: Any) -> None:
        P.send_frame(self.sock, header, *payload)

    def reply(self) -> P.Header:
        """The next reply header; an ERROR reply is raised as its typed exception."""
        h = P.recv_header(self.sock, self.hbuf, P.DEFAULT_MAX_FRAME_BYTES)
        if h.op == P.Op.ERROR:
            raise from_wire(h.status, P.recv_json(self.sock, h))
        return h

    def reply_json(self) -> Optional[Dict[str, Any]]:
        h = self.reply()
        if h.op != P.Op.OK:
            raise ConnectionLost(f"expected OK, got {h.op_name()}")
        return P.recv_json(self.sock, h) if h.length else None

    def call_json(self, op: int, body: Any, key: int = 0, step: int = 0) -> Optional[Dict[str, Any]]:
        self.send(P.json_frame(op, body, key=key, step=step))
        return self.reply_json()

    def close(self) -> None:
        self.pool.shutdown(wait=False)
        try:
            self.sock.close()
        except OSError:
            pass


def reply_timeout(barrier_timeout: float) -> float:
    """How long a trainer waits for any one reply: the barrier timeout plus a margin for the work."""
    return barrier_timeout + max(10.0, barrier_timeout / 2)


def _connect(host: str, port: int, timeout: float, where: str) -> socket.socket:
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


def _gather(futures: Sequence[Future]) -> List[Any]:
    """Results of all futures (waiting for every one), raising the first error."""
    results, first = [], None
    for f in futures:
        try:
            results.append(f.result())
        except BaseException as e:  # noqa: B036 - re-raised below after every future finished
            results.append(None)
            first = first or e
    if first is not None:
        raise first
    return results


def _pipeline(ch: _Channel, frames: Sequence[Tuple[bytes, Tuple[Any, ...]]],
              on_reply: Sequence[Callable[[_Channel, P.Header], None]]) -> None:
    """Send every frame, then read one reply per frame; the first error wins, later ones are drained."""
    first: Optional[BaseException] = None
    try:
        for header, payload in frames:
            ch.send(header, *payload)
    except ConnectionLost as e:
        first = e  # the pserver may have said why before closing: read on
    for cb in on_reply:
        try:
            cb(ch, ch.reply())
        except PSError as e:
            if first is None or isinstance(first, ConnectionLost) and not isinstance(e, ConnectionLost):
                first = e
            if isinstance(e, ConnectionLost):
                break
    if first is not None:
        raise first


def _expect_ok(ch: _Channel, h: P.Header) -> None:
    if h.op != P.Op.OK:
        raise ConnectionLost(f"expected OK, got {h.op_name()}")
    if h.length:
        P.discard(ch.sock, h.length)


class PSClient:
    """A trainer's connection to every pserver of a job. Use ``connect()`` to make one."""

    def __init__(self, env: JobEnv, *, mode: str = "sync", optimizer: OptimizerLike = None,
                 trainer_id: Optional[int] = None, max_block_bytes: int = DEFAULT_MAX_BLOCK_BYTES,
                 connect_timeout: float = 60.0, staleness: Optional[int] = None, _local_server: Any = None) -> None:
        if mode not in ("sync", "async"):
            raise ValueError(f"mode {mode!r}: expected 'sync' or 'async'")
        self.env = env
        self.mode = mode
        self.optimizer = as_spec(optimizer)
        tid = env.trainer_id if trainer_id is None else trainer_id
        self.trainer_id = 0 if tid is None else int(tid)
        self.n_pservers = len(env.pservers)
        self.max_block_bytes = int(max_block_bytes)
        self._local = _local_server
        self._closed = False
        self._lock = threading.Lock()
        self._outstanding: List[PushHandle] = []
        self._dense: Dict[str, np.ndarray] = {}
        self._versions: Dict[int, int] = {}  # block key -> pserver's update count at our last pull
        self._blocks: Dict[str, List[Block]] = {}
        self._tables: Dict[str, _Table] = {}
        self._sparse_pushed: set = set()
        self._next_key = 0
        self._next_table = 0
        self._loads: Optional[Tuple[int, ...]] = None
        # A reply takes at most a barrier wait plus the work itself; a pserver silent for longer is hung
        # (SIGSTOP, a dead link) and the trainer must fail with ConnectionLost, not wait forever.
        io_timeout = reply_timeout(env.barrier_timeout)
        self._dense_ch: List[List[_Channel]] = []
        self._sparse_ch: List[List[_Channel]] = []
        self._all: List[_Channel] = []
        try:
            opened: Dict[Tuple[int, int], Future] = {}
            with ThreadPoolExecutor(max_workers=max(1, min(32, self.n_pservers * env.ports_per_pserver))) as ex:
                for k in range(self.n_pservers):
                    for port in sorted(set(env.dense_ports(k)) | set(env.sparse_ports(k))):
                        opened[(k, port)] = ex.submit(_Channel, env, self.trainer_id, k, port, connect_timeout,
                                                      io_timeout)
                chans = dict(zip(opened, _gather_all(list(opened.values()), self._all)))
            for k in range(self.n_pservers):
                self._dense_ch.append([chans[(k, p)] for p in env.dense_ports(k)])
                self._sparse_ch.append([chans[(k, p)] for p in env.sparse_ports(k)])
            body = {"mode": mode, "optimizer": self.optimizer.to_dict(), "trainers": env.trainers,
                    "n_pservers": self.n_pservers, "staleness": staleness}
            replies = _gather([self._ctl(k).submit(_Channel.call_json, P.Op.DECLARE, body)
                               for k in range(self.n_pservers)])
        except BaseException:
            self._shutdown_channels()
            raise
        steps = {r["pserver_id"]: r["step"] for r in replies}
        if len(set(steps.values())) != 1:
            self._shutdown_channels()
            raise ckpt.CheckpointError(
                "pservers resumed from different steps: " + ", ".join(f"pserver {k} at step {s}"
                                                                       for k, s in sorted(steps.items()))
                + " (a checkpoint is incomplete on some pserver; resume all from the same step)")
        self.step: int = next(iter(steps.values()))
        self.resumed_from = [r.get("resumed_from") for r in replies]

    # -- plumbing -------------------------------------------------------------------------------------------

    def _ctl(self, k: int) -> _Channel:
        """The channel control requests to pserver ``k`` use."""
        return self._dense_ch[k][0]

    def _check_open(self) -> None:
        if self._closed:
            raise PSError("this client is closed")

    def _shutdown_channels(self) -> None:
        for ch in self._all:
            ch.close()

    def _block_channel(self, b: Block) -> _Channel:
        return self._dense_ch[b.pserver][b.conn]

    def _by_channel(self, blocks: Sequence[Block]) -> Dict[_Channel, List[Block]]:
        out: Dict[_Channel, List[Block]] = {}
        for b in blocks:
            out.setdefault(self._block_channel(b), []).append(b)
        return out

    # -- registration ---------------------------------------------------------------------------------------

    def register_dense(self, params: Mapping[str, np.ndarray], optimizer: OptimizerLike = None
                       ) -> Dict[str, np.ndarray]:
        """Define dense parameters on the pservers; trainer 0's values (or a resumed checkpoint's) win.

        Returns the values every trainer starts from (the client's own buffers, see ``pull``).
        """
        self._check_open()
        if not params:
            return {}
        dup = sorted(set(params) & set(self._dense))
        if dup:
            raise ValueError(f"dense parameters {dup} are already registered")
        spec = as_spec(optimizer, self.optimizer).to_dict()
        arrays = {}
        for name, value in params.items():
            a = np.asarray(value)
            P.dtype_code(a.dtype)
            arrays[name] = np.ascontiguousarray(a)
        placement = place_dense({n: (a.shape, a.dtype) for n, a in arrays.items()}, self.n_pservers,
                                self.env.ports_num, max_block_bytes=self.max_block_bytes, first_key=self._next_key,
                                loads=self._loads)
        self._next_key += len(placement.blocks)
        self._loads = placement.loads
        by_name = placement.by_name()
        initialized: Dict[int, bool] = {}

        def define(ch: _Channel, blocks: List[Block]) -> None:
            frames = [(P.json_frame(P.Op.DEF_DENSE, {**b.meta(), "optimizer": spec}, key=b.key), ()) for b in blocks]

            def got(b: Block) -> Callable[[_Channel, P.Header], None]:
                def cb(ch: _Channel, h: P.Header) -> None:
                    initialized[b.key] = bool(P.recv_json(ch.sock, h)["initialized"])
                return cb
            _pipeline(ch, frames, [got(b) for b in blocks])
            if self.trainer_id == 0:
                mine = [b for b in blocks if not initialized[b.key]]
                frames = [(P.pack_header(P.Op.INIT_DENSE, P.dtype_code(b.dtype), key=b.key, step=self.step,
                                         length=b.nbytes), (arrays[b.name][b.lo:b.hi],)) for b in mine]
                _pipeline(ch, frames, [_expect_ok] * len(mine))

        _gather([ch.submit(define, bl) for ch, bl in self._by_channel(placement.blocks).items()])
        for name, a in arrays.items():
            self._dense[name] = np.empty(a.shape, dtype=a.dtype)
            self._blocks[name] = by_name[name]
        return self.pull(list(arrays))

    def register_sparse(self, name: str, width: int, *, init_scale: float = 0.01, seed: int = 0,
                        dtype: Any = np.float32, optimizer: OptimizerLike = None) -> None:
        """Define a sparse table sharded by ``id % n_pservers``; rows are created on first use with
        ``placement.init_rows(ids, width, init_scale, seed)``."""
        self._check_open()
        if name in self._tables:
            raise ValueError(f"sparse table {name!r} is already registered")
        dt = np.dtype(dtype)
        P.dtype_code(dt)
        t = _Table(self._next_table, name, int(width), dt)
        body = {"name": name, "width": t.width, "dtype": dt.name, "init_scale": float(init_scale), "seed": int(seed),
                "optimizer": as_spec(optimizer, self.optimizer).to_dict()}
        _gather([self._ctl(k).submit(_Channel.call_json, P.Op.DEF_SPARSE, body, t.key)
                 for k in range(self.n_pservers)])
        self._next_table += 1
        self._tables[name] = t

    # -- dense ----------------------------------------------------------------------------------------------

    def wait(self, handle: Optional[PushHandle] = None) -> None:
        """Wait for one push (or, with no argument, every outstanding one); raises its error."""
        if handle is None:
            with self._lock:
                handles, self._outstanding = self._outstanding, []
            _gather([f for h in handles for f in h.futures])
            return
        with self._lock:
            if handle in self._outstanding:
                self._outstanding.remove(handle)
        _gather(handle.futures)

    def pull(self, names: Optional[Sequence[str]] = None) -> Dict[str, np.ndarray]:
        """Dense values for ``self.step`` (waits in sync mode until every trainer's previous step applied).

        The arrays are this client's own receive buffers, overwritten by the next ``pull``: copy what
        you want to keep.
        """
        self._check_open()
        self.wait()
        names = list(self._dense) if names is None else list(names)
        unknown = [n for n in names if n not in self._dense]
        if unknown:
            raise KeyError(f"dense parameters {unknown} are not registered")
        blocks = [b for n in names for b in self._blocks[n]]
        step = self.step

        def fetch(ch: _Channel, blocks: List[Block]) -> None:
            frames = [(P.pack_header(P.Op.PULL_DENSE, P.dtype_code(b.dtype), key=b.key, step=step), ()) for b in blocks]

            def into(b: Block) -> Callable[[_Channel, P.Header], None]:
                def cb(ch: _Channel, h: P.Header) -> None:
                    if h.op != P.Op.DATA or h.key != b.key or h.length != b.nbytes:
                        raise ConnectionLost(f"bad reply to pull of key {b.key}: {h}")
                    P.recv_into(ch.sock, P.byte_view(self._dense[b.name][b.lo:b.hi]))
                    self._versions[b.key] = h.step
                return cb
            _pipeline(ch, frames, [into(b) for b in blocks])

        _gather([ch.submit(fetch, bl) for ch, bl in self._by_channel(blocks).items()])
        return {n: self._dense[n] for n in names}

    def push(self, grads: Optional[Mapping[str, np.ndarray]] = None) -> PushHandle:
        """Send dense gradients for ``self.step`` and advance to the next step.

        Every registered dense parameter needs a gradient. Tables not pushed this step get an empty
        push (sync barriers count every trainer on every step). The gradient arrays are sent without
        copying: do not modify them until the push is waited for (``wait``, or the next ``pull``).
        """
        self._check_open()
        grads = dict(grads or {})
        missing = sorted(set(self._dense) - set(grads))
        extra = sorted(set(grads) - set(self._dense))
        if missing or extra:
            raise KeyError(f"push needs gradients for exactly the registered dense parameters: "
                           f"missing {missing}, unknown {extra}")
        send: Dict[str, np.ndarray] = {}
        for name, g in grads.items():
            want = self._dense[name]
            g = np.ascontiguousarray(g, dtype=want.dtype)
            if g.shape != want.shape:
                raise ValueError(f"gradient of {name!r} has shape {g.shape}, the parameter has {want.shape}")
            send[name] = g
        step = self.step
        futures: List[Future] = []

        def push_blocks(ch: _Channel, blocks: List[Block]) -> None:
            frames = [(P.pack_header(P.Op.PUSH_DENSE, P.dtype_code(b.dtype), key=b.key, step=step, length=b.nbytes,
                                     aux=self._versions.get(b.key, 0)), (send[b.name][b.lo:b.hi],)) for b in blocks]
            _pipeline(ch, frames, [_expect_ok] * len(blocks))

        blocks = [b for n in sorted(send) for b in self._blocks[n]]
        futures += [ch.submit(push_blocks, bl) for ch, bl in self._by_channel(blocks).items()]
        if self.mode == "sync":
            empty = np.empty(0, dtype=np.int64)
            for name, t in self._tables.items():
                if name not in self._sparse_pushed:
                    futures += self._push_rows(t, step, empty, np.empty((0, t.width), dtype=t.dtype), all_ps=True)
        self._sparse_pushed.clear()
        self.step += 1
        h = PushHandle(step, futures)
        with self._lock:
            self._outstanding.append(h)
        return h

    # -- sparse ---------------------------------------------------------------------------------------------

    def _table(self, name: str) -> _Table:
        try:
            return self._tables[name]
        except KeyError:
            raise KeyError(f"sparse table {name!r} is not registered") from None

    def _sparse_channel(self, t: _Table, k: int) -> _Channel:
        chans = self._sparse_ch[k]
        return chans[sparse_conn(t.key, len(chans))]

    def pull_sparse(self, name: str, ids: Any) -> np.ndarray:
        """Rows of ``ids`` (any int shape) for ``self.step``: result shape ``ids.shape + (width,)``, one row
        per id (duplicates repeated). Only the distinct ids travel, each to the pserver that owns it."""
        self._check_open()
        t = self._table(name)
        ids = np.asarray(ids, dtype=np.int64)
        uniq, inv = np.unique(ids.reshape(-1), return_inverse=True)
        out = np.empty((len(uniq), t.width), dtype=t.dtype)
        owner = shard_of(uniq, self.n_pservers)
        step = self.step

        def fetch(ch: _Channel, sel: np.ndarray) -> None:
            sub = np.ascontiguousarray(uniq[sel])
            rows = np.empty((len(sub), t.width), dtype=t.dtype)

            def cb(ch: _Channel, h: P.Header) -> None:
                if h.op != P.Op.DATA or h.length != rows.nbytes:
                    raise ConnectionLost(f"bad reply to sparse pull of {name!r}: {h}")
                P.recv_into(ch.sock, P.byte_view(rows))
            _pipeline(ch, [(P.pack_header(P.Op.PULL_SPARSE, P.dtype_code(np.int64), key=t.key, step=step,
                                          length=sub.nbytes, aux=len(sub)), (sub,))], [cb])
            out[sel] = rows

        self.wait()
        futures = []
        for k in range(self.n_pservers):
            sel = np.flatnonzero(owner == k)
            if len(sel):
                futures.append(self._sparse_channel(t, k).submit(fetch, sel))
        _gather(futures)
        return out[inv].reshape(ids.shape + (t.width,))

    def push_sparse(self, name: str, ids: Any, grads: Any) -> PushHandle:
        """Row gradients for ``self.step`` (one row per id; duplicates are summed here). At most once per
        table per step; the step advances with the next ``push``."""
        self._check_open()
        t = self._table(name)
        if name in self._sparse_pushed:
            raise ValueError(f"sparse table {name!r} was already pushed for step {self.step}")
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        grads = np.asarray(grads, dtype=t.dtype).reshape(-1, t.width)
        if len(grads) != len(ids):
            raise ValueError(f"push_sparse({name!r}): {len(ids)} ids but {len(grads)} gradient rows")
        uniq, inv = np.unique(ids, return_inverse=True)
        if len(uniq) == len(ids):
            summed = np.empty_like(grads)
            summed[inv] = grads
        else:
            summed = np.zeros((len(uniq), t.width), dtype=t.dtype)
            np.add.at(summed, inv, grads)
        self._sparse_pushed.add(name)
        h = PushHandle(self.step, self._push_rows(t, self.step, uniq, summed, all_ps=self.mode == "sync"))
        with self._lock:
            self._outstanding.append(h)
        return h

    def _push_rows(self, t: _Table, step: int, ids: np.ndarray, grads: np.ndarray, all_ps: bool) -> List[Future]:
        owner = shard_of(ids, self.n_pservers)
        futures = []
        for k in range(self.n_pservers):
            sel = np.flatnonzero(owner == k)
            if not len(sel) and not all_ps:
                continue
            sub_ids = np.ascontiguousarray(ids[sel])
            sub_g = np.ascontiguousarray(grads[sel])
            header = P.pack_header(P.Op.PUSH_SPARSE, P.dtype_code(t.dtype), key=t.key, step=step,
                                   length=sub_ids.nbytes + sub_g.nbytes, aux=len(sub_ids))
            futures.append(self._sparse_channel(t, k).submit(
                lambda ch, hd=header, a=sub_ids, g=sub_g: _pipeline(ch, [(hd, (a, g))], [_expect_ok])))
        return futures

    # -- control --------------------------------------------------------------------------------------------

    def _broadcast(self, op: int, body: Any) -> List[Optional[Dict[str, Any]]]:
        self._check_open()
        return _gather([self._ctl(k).submit(_Channel.call_json, op, body, 0, self.step)
                        for k in range(self.n_pservers)])

    def set_hyper(self, names: Optional[Sequence[str]] = None, **values: float) -> None:
        """Change optimizer hyper-parameters (lr, momentum, beta1, beta2, eps, weight_decay) on every
        pserver, effective from ``self.step`` on (in sync mode, exactly from that step's update).

        ``names`` limits the change to those dense parameters and sparse tables (e.g. decay the embedding
        rate but not the dense one); None changes every optimizer."""
        if names is not None:
            names = [names] if isinstance(names, str) else list(names)
            known = set(self._dense) | set(self._tables)
            unknown = sorted(set(names) - known)
            if unknown:
                raise UnknownKey(f"set_hyper: no registered parameter or table {unknown}; known: {sorted(known)}")
        self._broadcast(P.Op.SET_HYPER, {"from_step": self.step, "values": values, "names": names})

    def set_lr(self, lr: float, names: Optional[Sequence[str]] = None) -> None:
        self.set_hyper(names, lr=float(lr))

    def status(self) -> List[Dict[str, Any]]:
        """Each pserver's view: mode, active/closed trainers, per-block and per-table steps."""
        self._check_open()
        return _gather([self._ctl(k).submit(lambda ch: (ch.send(P.pack_header(P.Op.STATUS)), ch.reply_json())[1])
                        for k in range(self.n_pservers)])

    def wait_others_closed(self, timeout: float) -> bool:
        """Block until every other trainer has closed; False if some are still open after ``timeout`` s.

        In async mode the model is final only after every trainer's last push: trainer 0 calls this before
        its final evaluation and save."""
        others = set(range(self.env.trainers)) - {self.trainer_id}
        deadline = time.monotonic() + timeout
        while others:
            if all(others <= set(s["closed"]) for s in self.status()):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)
        return True

    def save_checkpoint(self, dirname_or_step: Union[str, int, None] = None) -> CheckpointInfo:
        """Each pserver saves its shard for ``self.step`` (after every earlier step is applied).

        With a step number or nothing: ``<job_dir>/checkpoints/step-%08d/``; with a directory, that
        directory (relative ones are resolved by each pserver under its checkpoint root).
        """
        if isinstance(dirname_or_step, int) and dirname_or_step != self.step:
            # A checkpoint is named by the step it holds; any other number would make resume pick the wrong one.
            raise ValueError(f"save_checkpoint({dirname_or_step}): the state to save is that of step {self.step} "
                             "(ps.step); pass nothing or ps.step")
        self.wait()
        path = None if dirname_or_step is None or isinstance(dirname_or_step, int) else str(dirname_or_step)
        body = {"step": self.step, "path": path}
        if isinstance(dirname_or_step, int):
            body["path"] = os.path.basename(ckpt.step_dir("", dirname_or_step))
        replies = self._broadcast(P.Op.SAVE, body)
        return CheckpointInfo(self.step, tuple(r["path"] for r in replies if r))

    def save_dense(self, path: str) -> str:
        """Pull the dense model and write it atomically as ``.npz`` (``path`` may be a directory, then
        ``params.npz`` inside it); returns the file written. Load it with ``load_dense``."""
        params = self.pull()
        if not path.endswith(".npz"):
            path = os.path.join(path, "params.npz")
        ckpt.save_npz_atomic(path, params)
        return path

    def close(self) -> None:
        """Tell every pserver this trainer is done (its barriers stop counting us), then disconnect."""
        if self._closed:
            return
        try:
            self.wait()
        except PSError as e:
            log.warning("trainer %d: an outstanding push failed while closing: %s", self.trainer_id, e)
        finally:
            self._closed = True
            futures = []
            for k in range(self.n_pservers):
                ch = self._ctl(k)
                futures.append(ch.submit(lambda c: (c.send(P.pack_header(P.Op.CLOSE)), c.reply_json())))
            for k, f in enumerate(futures):
                try:
                    f.result(timeout=10.0)
                except Exception as e:
                    log.warning("trainer %d: pserver %d did not acknowledge close: %s", self.trainer_id, k, e)
            self._shutdown_channels()
            if self._local is not None:
                self._local.stop()

    def __enter__(self) -> PSClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _gather_all(futures: Sequence[Future], into: List[Any]) -> List[Any]:
    """Like ``_gather`` but keeps every successful result in ``into`` so it can be cleaned up on error."""
    results, first = [], None
    for f in futures:
        try:
            r = f.result()
            into.append(r)
            results.append(r)
        except BaseException as e:  # noqa: B036 - re-raised below
            first = first or e
    if first is not None:
        raise first
    return results


def load_dense(path: str) -> Dict[str, np.ndarray]:
    """Read a file written by ``save_dense`` (never unpickles)."""
    return ckpt.load_npz(path)


def connect(mode: str = "sync", optimizer: OptimizerLike = None, *, env: Optional[JobEnv] = None,
            trainer_id: Optional[int] = None, max_block_bytes: int = DEFAULT_MAX_BLOCK_BYTES,
            connect_timeout: float = 60.0, staleness: Optional[int] = None) -> PSClient:
    """Connect this trainer to its job's pservers (from ``JobEnv.from_environ()`` unless ``env`` is given).

    With no contract in the environment, starts an in-process pserver on 127.0.0.1 (one trainer), so a
    training script also runs unlaunched. ``staleness`` (async mode): a pserver drops a dense gradient
    computed on values more than that many updates older than the block's current ones.
    """
    if env is None:
        env = JobEnv.from_environ()
    if env is not None and env.role == PSERVER:
        raise ConfigMismatch("connect() is for trainers, but PADDLE_TRAINING_ROLE=PSERVER: run "
                             "`python -m paddle_cluster.ps` (or paddle_cluster.ps.__main__.main()) instead")
    local = None
    if env is None:
        from .server import PServer

        local_env = JobEnv(job_id="local", pservers=(Endpoint("127.0.0.1", 0),), trainers=1, ports_num=1,
                           ports_num_for_sparse=0, secret=secrets.token_hex(16), job_dir=os.getcwd())
        local = PServer(local_env, 0).start()
        env = replace(local_env, pservers=(Endpoint("127.0.0.1", local.ports[0]),), trainer_id=0)
    try:
        return PSClient(env, mode=mode, optimizer=optimizer, trainer_id=trainer_id, max_block_bytes=max_block_bytes,
                        connect_timeout=connect_timeout, staleness=staleness, _local_server=local)
    except BaseException:
        if local is not None:
            local.stop()
        raise
