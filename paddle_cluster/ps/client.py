"""The trainer-side client: a small ps-lite-like push / pull / wait API.

Every (pserver, port) pair gets its own connection and worker thread, so a push or pull fans out to every
pserver and port at once (``channel``). ``ps.step`` starts at 0 (or at the step a resumed pserver loaded);
``pull()`` returns the dense values for ``ps.step``, ``push(grads)`` sends the gradients for it and advances
it. In sync mode a pull for step ``t`` waits until every active trainer's gradient for ``t - 1`` is applied,
so the loop is ``params = ps.push_pull(grads_of(params, batch))``: one round trip per step.
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from ..contract import PSERVER, Endpoint, JobEnv, figures_path
from . import atomic
from . import checkpoint as ckpt
from .channel import Channel, gather, reply_timeout
from .counters import FiguresWriter
from .errors import CheckpointError, ConfigMismatch, PSError, UnknownKey
from .optim import OptimizerSpec
from .params import DenseParams, SparseTables
from .placement import DEFAULT_MAX_BLOCK_BYTES
from .wire import protocol as P

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


@dataclass(frozen=True)
class CheckpointInfo:
    """Where each pserver wrote its shard of a checkpoint."""

    step: int
    paths: Tuple[str, ...]


def _timed(fn: Any) -> Any:
    """Counts the seconds a trainer spends in the call (not in one it makes): ``top`` shows its share of each
    second spent waiting on the pservers, and names the trainer that waits least per step the slowest."""
    @functools.wraps(fn)
    def wrapper(self: PSClient, *args: Any, **kwargs: Any) -> Any:
        if self._in_call:
            return fn(self, *args, **kwargs)
        self._in_call, t0 = True, time.perf_counter()
        try:
            return fn(self, *args, **kwargs)
        finally:
            self._in_call = False
            self.ps_seconds += time.perf_counter() - t0
    return wrapper


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
        self._brought: Optional[Tuple[int, Dict[str, np.ndarray]]] = None  # (step, values) finish_step brought
        self._in_call, self.ps_seconds = False, 0.0  # ``_timed``
        self._reduce_seq = 0  # ``sum_over_trainers`` calls made (each trainer makes the same ones)
        self._early: set = set()  # dense parameters whose gradient ``push_pull_part`` sent this step
        # ``push_pull`` leaves a parameter split over lanes there (``value_parts``): for a caller that copies
        # each part into its own parameter anyway (a frontend), one copy of it a step less.
        self.defer_split = False
        # A reply takes at most a barrier wait plus the work itself; a pserver silent for longer is hung
        # (SIGSTOP, a dead link) and the trainer must fail with ConnectionLost, not wait forever.
        io_timeout = reply_timeout(env.barrier_timeout)
        key = env.key_of(self.trainer_id)  # refuses a missing or short secret before any connection
        self._dense_ch: List[List[Channel]] = []
        self._sparse_ch: List[List[Channel]] = []
        self._all: List[Channel] = []
        try:
            opened: Dict[Tuple[int, int], Future] = {}
            with ThreadPoolExecutor(max_workers=max(1, min(32, self.n_pservers * env.ports_per_pserver))) as ex:
                for k in range(self.n_pservers):
                    for port in env.all_ports(k):
                        opened[(k, port)] = ex.submit(Channel, env, key, self.trainer_id, k, port,
                                                      connect_timeout, io_timeout)
                chans = dict(zip(opened, gather(list(opened.values()), self._all)))
            for k in range(self.n_pservers):
                self._dense_ch.append([chans[(k, p)] for p in env.dense_ports(k)])
                self._sparse_ch.append([chans[(k, p)] for p in env.sparse_ports(k)])
            body = {"mode": mode, "optimizer": self.optimizer.to_dict(), "trainers": env.trainers,
                    "n_pservers": self.n_pservers, "staleness": staleness}
            replies = gather([self._ctl(k).submit(Channel.call_json, P.Op.DECLARE, body)
                              for k in range(self.n_pservers)])
        except BaseException:
            self._shutdown_channels()
            raise
        steps = {r["pserver_id"]: r["step"] for r in replies}
        if len(set(steps.values())) != 1:
            self._shutdown_channels()
            raise CheckpointError(
                "pservers resumed from different steps: " + ", ".join(f"pserver {k} at step {s}"
                                                                       for k, s in sorted(steps.items()))
                + " (a checkpoint is incomplete on some pserver; resume all from the same step)")
        self.step: int = next(iter(steps.values()))
        self.resumed_from = [r.get("resumed_from") for r in replies]
        for k, r in enumerate(replies):  # where each pserver's lanes are offered, said on the authenticated connection
            for ch in self._dense_ch[k]:
                ch.lane_token = r.get("lane")
        self._dense = DenseParams(self._dense_ch, env.ports_num, self.max_block_bytes, env.lane)
        self._sparse = SparseTables(self._sparse_ch, self._ctl)
        # A launched trainer (a job directory, not the in-process pserver of an unlaunched script) tells ``top``
        # its step, traffic and mode (sync: the job's rate is the one every trainer shares; async: their sum).
        self._figures: Optional[FiguresWriter] = None
        if env.job_dir and self._local is None:
            path = figures_path(env.job_dir, f"trainer.{self.trainer_id}")
            self._figures = FiguresWriter(path, lambda: {"step": self.step, "ps_seconds": self.ps_seconds,
                                                         "mode": self.mode}).start()

    # -- plumbing -------------------------------------------------------------------------------------------

    def _ctl(self, k: int) -> Channel:
        """The channel control requests to pserver ``k`` use."""
        return self._dense_ch[k][0]

    def _check_open(self) -> None:
        if self._closed:
            raise PSError("this client is closed")

    def _shutdown_channels(self) -> None:
        for ch in self._all:
            ch.close()

    def _track(self, h: PushHandle) -> PushHandle:
        with self._lock:
            self._outstanding.append(h)
        return h

    # -- dense ----------------------------------------------------------------------------------------------

    def register_dense(self, params: Mapping[str, np.ndarray], optimizer: OptimizerLike = None
                       ) -> Dict[str, np.ndarray]:
        """Define dense parameters on the pservers; trainer 0's values (or a resumed checkpoint's) win.

        Returns the values every trainer starts from (the client's own buffers, see ``pull``).
        """
        self._check_open()
        if not params:
            return {}
        spec = as_spec(optimizer, self.optimizer).to_dict()
        return self.pull(self._dense.register(params, spec, init=self.trainer_id == 0, step=self.step))

    @_timed
    def wait(self, handle: Optional[PushHandle] = None) -> None:
        """Wait for one push (or, with no argument, every outstanding one); raises its error."""
        if handle is None:
            with self._lock:
                handles, self._outstanding = self._outstanding, []
            gather([f for h in handles for f in h.futures])
            return
        with self._lock:
            if handle in self._outstanding:
                self._outstanding.remove(handle)
        gather(handle.futures)

    @_timed
    def pull(self, names: Optional[Sequence[str]] = None) -> Dict[str, np.ndarray]:
        """Dense values for ``self.step`` (waits in sync mode until every trainer's previous step applied).

        The arrays are this client's own receive buffers, overwritten by the next ``pull``: copy what
        you want to keep.
        """
        self._check_open()
        self.wait()
        return self._dense.pull(list(self._dense.values) if names is None else list(names), self.step)

    @_timed
    def push(self, grads: Optional[Mapping[str, np.ndarray]] = None, flags: Optional[Mapping[str, int]] = None
             ) -> PushHandle:
        """Send dense gradients for ``self.step`` and advance to the next step.

        Every registered dense parameter needs a gradient. Tables not pushed this step get an empty
        push (sync barriers count every trainer on every step). The gradient arrays are sent without
        copying: do not modify them until the push is waited for (``wait``, or the next ``pull``). ``flags``: a
        parameter's push status (``protocol.NOGRAD_FLAG``: no gradient this step, its array is zeros and only a
        header goes; ``AVERAGED_FLAG``: the step's averaged gradient already), by name.
        """
        self._check_open()
        step = self.step
        futures = self._dense.push(dict(grads or {}), step, flags)
        futures += self._sparse.end_step(step, sync=self.mode == "sync")
        self.step += 1
        return self._track(PushHandle(step, futures))

    @_timed
    def push_pull(self, grads: Optional[Mapping[str, np.ndarray]] = None, flags: Optional[Mapping[str, int]] = None
                  ) -> Dict[str, np.ndarray]:
        """``push(grads)`` then ``pull()`` in one exchange: returns every dense value for the next step.

        Each block's pull follows its push on the same connection, so the step is one round trip and the
        links carry gradients one way and values the other at once. Results equal push-then-pull's; use
        ``push`` and ``pull`` apart when something is computed between them.
        """
        self._check_open()
        early, self._early = self._early, set()
        rest = {n: g for n, g in (grads or {}).items() if n not in early}
        send = self._dense.gradients(rest, whole=not early)
        missing = sorted(set(self._dense.values) - early - set(send)) if early else []
        if missing:
            raise KeyError(f"push needs gradients for every registered dense parameter: missing {missing}")
        step = self.step
        futures = self._sparse.end_step(step, sync=self.mode == "sync")
        self.step += 1  # before the exchange, part of which runs on this thread: the step has begun
        futures += self._dense.push_pull(send, step, flags, copy_split=not self.defer_split)
        self._track(PushHandle(step, futures))
        self.wait()
        return dict(self._dense.values)

    def compress(self, kind: Optional[str]) -> None:
        """Gradient compression for the dense pushes from now on: ``"fp16"`` sends each float32 gradient as
        float16 over TCP (half the bytes; the pservers widen it and update in float32), None sends it as it is.
        ``synchronize()``'s exchange and an averaged step's gradient go uncompressed."""
        if kind not in (None, "fp16"):
            raise ValueError(f"compression {kind!r}: expected None or 'fp16'")
        self._dense.fp16 = kind == "fp16"

    def value_parts(self, name: str) -> List[Tuple[int, int, np.ndarray]]:
        """Where dense parameter ``name``'s values of the last pull or ``push_pull`` are, flat: ``(lo, hi,
        values)`` places to copy from. With ``defer_split`` a parameter split over same-host lanes is read from
        them here rather than copied into the array ``push_pull`` returns (which is then stale for it)."""
        return self._dense.parts(name)

    def push_pull_part(self, grads: Mapping[str, np.ndarray], flags: Optional[Mapping[str, int]] = None) -> None:
        """Sync mode, while the rest of the step's gradients are still being computed: send these parameters'
        gradients for this step now, on the channels' threads, and have their values for the next step come back
        into the receive buffers meanwhile. The step's ``push_pull`` then sends the rest (what it is given again
        of these is not sent twice) and waits for all. The arrays are sent without copying. ``flags``: as
        ``push``'s."""
        self._check_open()
        if self.mode != "sync":
            raise RuntimeError("push_pull_part: sync mode only (an async push is applied as it lands)")
        send = self._dense.gradients(grads, whole=False)
        again = sorted(self._early.intersection(send))
        if again:
            raise ValueError(f"the gradients of {again} were already sent this step")
        self._early.update(send)
        self._track(PushHandle(self.step, self._dense.push_pull(send, self.step, flags, here=False,
                                                                copy_split=not self.defer_split)))

    @property
    def sent_early(self) -> bool:
        """Some dense gradients of this step went with ``push_pull_part`` already."""
        return bool(self._early)

    @_timed
    def reduce(self, grads: Mapping[str, np.ndarray], flags: Optional[Mapping[str, int]] = None
               ) -> Dict[str, Optional[np.ndarray]]:
        """Sync mode: every trainer's dense gradients of this step averaged over the trainers, without applying
        them (``synchronize()``); the step does not advance. A parameter no trainer had a gradient for
        (``protocol.NOGRAD_FLAG`` in ``flags`` on every trainer) is None. Costs one round trip carrying the
        gradients both ways; the step's own push follows (with ``AVERAGED_FLAG``)."""
        self._check_open()
        if self.mode != "sync":
            raise RuntimeError("synchronize(): async mode has no step average to wait for; use mode='sync'")
        if self._early:
            raise RuntimeError("synchronize(): this step's gradients were sent already (push_pull_part)")
        self.wait()
        futures, out, none = self._dense.reduce(self._dense.gradients(dict(grads)), self.step, flags or {})
        gather(futures)
        return {n: None if n in none else a for n, a in out.items()}

    @_timed
    def finish_step(self, grads: Optional[Mapping[str, np.ndarray]] = None) -> None:
        """End a training step with its dense gradients. Sync mode: ``push_pull``, the next step's values
        being fixed once every trainer pushed (``step_values`` returns them); async: ``push``, so the next
        pull, made when it is needed, sees the other trainers' latest pushes."""
        if self.mode == "sync":
            values = self.push_pull(grads)
            self._brought = (self.step, values)
        else:
            self.push(grads)

    def step_values(self) -> Dict[str, np.ndarray]:
        """The dense values for ``self.step``: those the last ``finish_step`` brought, unless the step moved on
        since, else ``pull()`` (which waits for this trainer's last push: its gradient buffers are free)."""
        brought, self._brought = self._brought, None
        return brought[1] if brought is not None and brought[0] == self.step else self.pull()

    # -- sparse ---------------------------------------------------------------------------------------------

    def register_sparse(self, name: str, width: int, *, vocab_size: Optional[int] = None,
                        max_rows: Optional[int] = None, init_scale: float = 0.01, seed: int = 0,
                        dtype: Any = np.float32, optimizer: OptimizerLike = None) -> None:
        """Define a sparse table sharded by ``id % n_pservers``; rows are created on first use with
        ``placement.init_rows(ids, width, init_scale, seed)``.

        Declare its id space: ``vocab_size`` (ids in ``[0, vocab_size)``) and/or ``max_rows`` (a hashed id
        space: any int64 id, at most that many rows in all, ``max_rows / n_pservers`` per pserver). The pservers
        refuse other ids and more rows with ``LimitExceeded`` naming the table, the id and the limit."""
        self._check_open()
        for what, v in (("vocab_size", vocab_size), ("max_rows", max_rows)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1):
                raise ValueError(f"register_sparse({name!r}): {what}={v!r}: expected a positive integer")
        if vocab_size is None and max_rows is None:
            raise ValueError(f"register_sparse({name!r}): declare the table's id space: vocab_size=V (ids in "
                             "[0, V)) or, for hashed ids, max_rows=R (at most R rows)")
        spec = as_spec(optimizer, self.optimizer).to_dict()
        self._sparse.register(name, width, init_scale, seed, dtype, spec,
                              None if vocab_size is None else int(vocab_size),
                              None if max_rows is None else int(max_rows))

    @_timed
    def pull_sparse(self, name: str, ids: Any) -> np.ndarray:
        """Rows of ``ids`` (any int shape) for ``self.step``: result shape ``ids.shape + (width,)``, one row
        per id (duplicates repeated). Only the distinct ids travel, each to the pserver that owns it."""
        self._check_open()
        self._sparse.get(name)
        self.wait()
        return self._sparse.pull(name, ids, self.step)

    def read_sparse(self, name: str) -> Tuple[np.ndarray, np.ndarray]:
        """Every row of table ``name`` that exists, for ``self.step``: (sorted int64 ids, rows of shape
        ``(len(ids), width)``). Reads only, page by page; what a final model or an export needs."""
        self._check_open()
        self._sparse.get(name)
        self.wait()
        return self._sparse.rows(name, self.step)

    @_timed
    def push_sparse(self, name: str, ids: Any, grads: Any) -> PushHandle:
        """Row gradients for ``self.step`` (one row per id; duplicates are summed here). At most once per
        table per step; the step advances with the next ``push``."""
        self._check_open()
        futures = self._sparse.push(name, ids, grads, self.step, all_ps=self.mode == "sync")
        return self._track(PushHandle(self.step, futures))

    # -- control --------------------------------------------------------------------------------------------

    def _broadcast(self, op: int, body: Any) -> List[Optional[Dict[str, Any]]]:
        self._check_open()
        return gather([self._ctl(k).submit(Channel.call_json, op, body, 0, self.step)
                       for k in range(self.n_pservers)])

    def set_hyper(self, names: Optional[Sequence[str]] = None, **values: float) -> None:
        """Change optimizer hyper-parameters (lr, momentum, beta1, beta2, eps, weight_decay) on every
        pserver, effective from ``self.step`` on (in sync mode, exactly from that step's update).

        ``names`` limits the change to those dense parameters and sparse tables (e.g. decay the embedding
        rate but not the dense one); None changes every optimizer."""
        if names is not None:
            names = [names] if isinstance(names, str) else list(names)
            known = set(self._dense.values) | set(self._sparse.tables)
            unknown = sorted(set(names) - known)
            if unknown:
                raise UnknownKey(f"set_hyper: no registered parameter or table {unknown}; known: {sorted(known)}")
        self._broadcast(P.Op.SET_HYPER, {"from_step": self.step, "values": values, "names": names})

    def set_lr(self, lr: float, names: Optional[Sequence[str]] = None) -> None:
        self.set_hyper(names, lr=float(lr))

    def sum_over_trainers(self, values: Sequence[float]) -> Tuple[np.ndarray, int]:
        """The sum of ``values`` over every active trainer (float64, in trainer order: the same bits on every
        trainer) and how many trainers it holds. A collective: every trainer makes the same calls in the same
        order (a trainer that closed no longer counts); bounded by the barrier timeout."""
        self._check_open()
        flat = [float(v) for v in np.asarray(values, dtype=np.float64).reshape(-1)]
        out, n = [], 0
        for lo in range(0, max(1, len(flat)), P.REDUCE_MAX_VALUES):
            part = flat[lo:lo + P.REDUCE_MAX_VALUES]
            self._reduce_seq += 1
            reply = self._ctl(0).submit(Channel.call_json, P.Op.REDUCE,
                                        {"seq": self._reduce_seq, "values": [v.hex() for v in part]}).result()
            out += [float.fromhex(v) for v in reply["sum"]]
            n = int(reply["n"])
        return np.array(out, dtype=np.float64), n

    def status(self) -> List[Dict[str, Any]]:
        """Each pserver's view: mode, active/closed trainers, per-block and per-table steps."""
        self._check_open()
        return gather([self._ctl(k).submit(lambda ch: (ch.send(P.pack_header(P.Op.STATUS)), ch.reply_json())[1])
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

        With a step number or nothing: ``<job_dir>/checkpoints/step-%08d/``; with a name, that directory
        under each pserver's checkpoint root (a name, never a location: no ``/``, not ``.`` or ``..``).
        Only trainer 0 may save.
        """
        if isinstance(dirname_or_step, str) and not ckpt.valid_name(dirname_or_step):
            raise ValueError(f"save_checkpoint({dirname_or_step!r}): give a plain directory name; it is created "
                             "under each pserver's checkpoint root (PADDLE_CHECKPOINT_DIR)")
        if isinstance(dirname_or_step, int) and dirname_or_step != self.step:
            # A checkpoint is named by the step it holds; any other number would make resume pick the wrong one.
            raise ValueError(f"save_checkpoint({dirname_or_step}): the state to save is that of step {self.step} "
                             "(ps.step); pass nothing or ps.step")
        self.wait()
        name = dirname_or_step
        if isinstance(name, int):
            name = os.path.basename(ckpt.step_dir("", name))
        replies = self._broadcast(P.Op.SAVE, {"step": self.step, "path": name})
        return CheckpointInfo(self.step, tuple(r["path"] for r in replies if r))

    def save_dense(self, path: str) -> str:
        """Pull the dense model and write it atomically as ``.npz`` (``path`` may be a directory, then
        ``params.npz`` inside it); returns the file written. Load it with ``load_dense``."""
        params = self.pull()
        if not path.endswith(".npz"):
            path = os.path.join(path, "params.npz")
        atomic.save_npz_atomic(path, params)
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
            if hasattr(self, "_dense"):
                self._dense.close()
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
            if self._figures is not None:
                self._figures.stop()
            if self._local is not None:
                self._local.stop()

    def __enter__(self) -> PSClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def load_dense(path: str) -> Dict[str, np.ndarray]:
    """Read a file written by ``save_dense`` (never unpickles)."""
    return atomic.load_npz(path)


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
    if env is not None and not env.pservers:
        raise ConfigMismatch("connect(): this job has no pservers (PSERVERS_PER_NODE = 0, run --collective): use "
                             "torch.distributed or paddle.distributed in it, or run the job with pservers")
    if env is not None and env.role == PSERVER:
        raise ConfigMismatch("connect() is for trainers, but PADDLE_TRAINING_ROLE=PSERVER: run "
                             "`python -m paddle_cluster.ps` (or paddle_cluster.ps.server.serve(env)) instead")
    local = None
    if env is None:
        from .server.pserver import PServer

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
