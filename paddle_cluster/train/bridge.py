"""The framework-neutral core of a framework frontend (``paddle_cluster.torch``, a Paddle one): numpy in, numpy
out, no framework imported here.

Contract (what a frontend does, in order):

1. ``b = Bridge(mode)`` connects (``ps.connect``: the job's pservers, or alone an in-process one);
   ``b.rank``/``b.size`` are this trainer's id and the trainer count.
2. ``start = b.define(dense, tables, groups)`` once: ``dense`` maps a stable parameter name to its numpy value,
   ``tables`` are ``TableDef``s (an embedding's id space, width, initial rows), ``groups`` are ``Group``s: which
   dense names and tables one optimizer spec (``OptimizerSpec``) updates. Returns the values every trainer starts
   from (trainer 0's, or a resumed checkpoint's): copy them into the framework's parameters.
   ``b.start_step`` is the step it starts at (0, or the checkpoint's).
3. Each step: ``rows = b.lookup(table, ids)`` for the embeddings the forward pass uses (a ``Lookup``: the unique
   ids, ``inverse`` such that ``rows[inverse].reshape(ids.shape + (width,))`` are the ids' rows, and the rows);
   then ``values = b.step(dense_grads, row_grads, hypers)``: every dense gradient by name (None or missing: the
   parameter has none this step; it counts as zero in the trainers' mean, DDP's rule, and is not updated at all
   when no trainer has one, torch's), ``row_grads[table]`` a list of ``(unique ids, their row gradients)``
   (one per lookup; duplicates are summed), ``hypers[i]`` group ``i``'s hyper-parameters now (e.g.
   ``{"lr": 0.05}``): a change since the last step (an LR scheduler) is sent with ``set_hyper`` and applies from
   this step's update on. Returns every dense value after the step (copy them back: the arrays are the client's
   buffers, valid until the next step). Every trainer passes the same ``hypers``; trainer 0's are the ones sent.
   Clipping the whole batch's gradient: ``avg = b.synchronize(dense_grads)`` first (every trainer's gradients
   averaged as the step would, nothing applied; None where no trainer has one), then ``b.step(final, rows,
   hypers, averaged=True)`` with the gradient made from ``avg`` (the same on every trainer: trainer 0's goes).
4. ``b.final(tables)`` (the dense values and each table, whole or its existing rows) builds the final model;
   ``b.save_checkpoint()`` (trainer 0) has the pservers save parameters and optimizer state; ``b.close()`` ends
   the trainer.

A frontend's ``DistributedOptimizer`` is the process's one (``hold``); ``rank``, ``size``, ``shutdown`` and
``save_atomically`` here are its module functions' whole body.

Errors are one line: an id outside a table's id space (``ValueError``), a structural option changed after
``define`` (``ValueError``), a parameter shape other trainers disagree on (``ps.ConfigMismatch`` naming it).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from ..contract import JobEnv
from ..ps import PSClient, connect, init_rows
from ..ps.optim import STRUCTURAL, OptimizerSpec
from ..ps.wire import protocol as P

DENSE_TABLE_BYTES = 1 << 30  # ``table_dense`` refuses a whole table larger than this: read ``table_rows`` instead


@dataclass(frozen=True)
class TableDef:
    """An embedding table on the pservers: ids in ``[0, num_embeddings)``, rows of ``width``; a row is created,
    uniform in ``(-init_scale, init_scale)`` from ``seed``, the first time an id is used."""

    name: str
    num_embeddings: int
    width: int
    init_scale: float = 0.01
    seed: int = 0
    dtype: Any = np.float32


@dataclass
class Group:
    """The dense parameters (by name) and tables one optimizer updates with one set of hyper-parameters."""

    spec: OptimizerSpec
    names: List[str] = field(default_factory=list)
    tables: List[str] = field(default_factory=list)


@dataclass(frozen=True)
class Lookup:
    """One lookup: ``rows[inverse]`` (reshaped to ``shape + (width,)``) are the rows of the ids asked for."""

    table: str
    ids: np.ndarray  # unique, sorted
    inverse: np.ndarray
    rows: np.ndarray
    shape: Tuple[int, ...]
    padded: bool = False  # ``inverse`` also holds ``len(ids)``: a padding id, whose row is zeros (append one)


class Bridge:
    """A trainer's model on the pservers, driven by a framework frontend (see the module's contract)."""

    def __init__(self, mode: str = "sync", ps: Optional[PSClient] = None, **connect_kw: Any) -> None:
        self.ps = ps if ps is not None else connect(mode=mode, **connect_kw)
        self.groups: List[Group] = []
        self.tables: Dict[str, TableDef] = {}
        self.names: List[str] = []
        self._sent: List[Dict[str, Any]] = []  # per group: the hyper-parameters the pservers use
        self._shapes: Dict[str, Tuple[Tuple[int, ...], np.dtype]] = {}
        self._zero: Dict[str, np.ndarray] = {}
        self.start_step = 0
        self._told_rows: set = set()  # tables ``final`` gave as rows because whole they are too big (said once)

    @property
    def rank(self) -> int:
        return self.ps.trainer_id

    @property
    def size(self) -> int:
        return self.ps.env.trainers

    @property
    def resumed(self) -> bool:
        return any(r is not None for r in self.ps.resumed_from)

    def define(self, dense: Mapping[str, np.ndarray], tables: Sequence[TableDef], groups: Sequence[Group]
               ) -> Dict[str, np.ndarray]:
        """Register every dense parameter and table with its group's optimizer; the values to start from."""
        if self.groups:
            raise RuntimeError("define() was already called: a model is defined once per trainer")
        placed = [n for g in groups for n in g.names]
        placed_tables = [n for g in groups for n in g.tables]
        if sorted(placed) != sorted(dense) or len(set(placed)) != len(placed):
            raise ValueError(f"every dense parameter must be in exactly one group: groups name {sorted(placed)}, "
                             f"the model has {sorted(dense)}")
        if sorted(placed_tables) != sorted(t.name for t in tables) or len(set(placed_tables)) != len(placed_tables):
            raise ValueError(f"every table must be in exactly one group: groups name {sorted(placed_tables)}, "
                             f"the tables are {sorted(t.name for t in tables)}")
        start: Dict[str, np.ndarray] = {}
        for g in groups:
            mine = {n: np.ascontiguousarray(dense[n]) for n in g.names}
            if mine:
                start.update({n: v.copy() for n, v in self.ps.register_dense(mine, g.spec).items()})
            for name in g.tables:
                t = next(t for t in tables if t.name == name)
                self.ps.register_sparse(t.name, t.width, vocab_size=t.num_embeddings, init_scale=t.init_scale,
                                        seed=t.seed, dtype=t.dtype, optimizer=g.spec)
                self.tables[t.name] = t
        self.groups = [dataclasses.replace(g, names=list(g.names), tables=list(g.tables)) for g in groups]
        self.names = list(dense)
        self._shapes = {n: (np.shape(v), np.asarray(v).dtype) for n, v in start.items()}
        # A resumed job's pservers hold the hyper-parameters the checkpoint had: the first step sends the
        # trainer's own whole, so the pservers and the framework's optimizer agree again.
        self._sent = [{} if self.resumed else g.spec.to_dict() for g in self.groups]
        self.start_step = self.ps.step
        return start

    def lookup(self, table: str, ids: Any, padding_idx: Optional[int] = None) -> Lookup:
        """The rows of ``ids`` (any integer shape) for this step; only the unique ids travel. ``padding_idx``:
        that id is no row on the pservers (never created, never given a gradient): ``inverse`` points it past
        the rows, at the zero row the caller appends (``padded``)."""
        t = self.tables.get(table)
        if t is None:
            raise KeyError(f"table {table!r} is not defined; defined: {sorted(self.tables)}")
        ids = np.asarray(ids)
        if ids.dtype.kind not in "iu":
            raise ValueError(f"embedding {table!r}: ids must be integers, got {ids.dtype}")
        flat = ids.reshape(-1).astype(np.int64)
        keep = None if padding_idx is None else flat != padding_idx
        uniq, inverse = np.unique(flat if keep is None else flat[keep], return_inverse=True)
        if keep is not None:
            inverse, kept = np.full(len(flat), len(uniq), dtype=np.int64), inverse
            inverse[keep] = kept
        if len(uniq) and (uniq[0] < 0 or uniq[-1] >= t.num_embeddings):
            bad = int(uniq[0] if uniq[0] < 0 else uniq[-1])
            raise ValueError(f"embedding {table!r}: id {bad} is outside its id space [0, {t.num_embeddings}) "
                             f"(num_embeddings={t.num_embeddings})")
        rows = self.ps.pull_sparse(table, uniq) if len(uniq) else np.empty((0, t.width), dtype=t.dtype)
        return Lookup(table, uniq, inverse, rows, ids.shape, keep is not None)

    def step(self, dense_grads: Mapping[str, Optional[np.ndarray]],
             row_grads: Mapping[str, Sequence[Tuple[np.ndarray, np.ndarray]]],
             hypers: Sequence[Mapping[str, Any]] = (), averaged: bool = False) -> Dict[str, np.ndarray]:
        """Send this step's gradients (and any hyper-parameter change); the dense values after it. ``averaged``:
        ``dense_grads`` is the step's whole gradient after ``synchronize`` (the same on every trainer): trainer
        0's is applied as it is, the others send no gradient."""
        if not averaged:
            refuse_empty_batch(dense_grads, row_grads)
        self._send_hypers(hypers)
        for name, parts in row_grads.items():
            if name not in self.tables:
                raise KeyError(f"row gradients for table {name!r}, which is not defined")
            parts = [(i, g) for i, g in parts if len(i)]
            if parts:
                self.ps.push_sparse(name, np.concatenate([i for i, _ in parts]),
                                    np.concatenate([g for _, g in parts]))
        if averaged and self.rank != 0:
            dense_grads = {}
        grads, flags = self._dense(dense_grads)
        if averaged:
            flags = {n: flags.get(n, P.AVERAGED_FLAG) for n in self.names}
        if self.ps.mode == "sync":
            return self.ps.push_pull(grads, flags)
        self.ps.push(grads, flags)
        return self.ps.pull()

    def send_early(self, dense_grads: Mapping[str, np.ndarray], hypers: Sequence[Mapping[str, Any]] = ()) -> None:
        """Sync mode, during backward: send these dense gradients of this step now (a bucket whose gradients are
        final; ``train/overlap.py``), their values for the next step coming back meanwhile; ``step`` then sends
        the rest. ``hypers`` (as ``step``'s) go first, before the step's first bucket."""
        if not self.ps.sent_early:
            self._send_hypers(hypers)
        self.ps.push_pull_part({n: np.ascontiguousarray(g, dtype=self._shapes[n][1]) for n, g in dense_grads.items()})

    def synchronize(self, dense_grads: Mapping[str, Optional[np.ndarray]]) -> Dict[str, Optional[np.ndarray]]:
        """Sync mode: this step's dense gradients averaged over every trainer (as the step would apply them),
        nothing applied; None for a parameter no trainer had a gradient for. The step then goes with
        ``step(..., averaged=True)``."""
        return self.ps.reduce(*self._dense(dense_grads))

    def _dense(self, dense_grads: Mapping[str, Optional[np.ndarray]]) -> Tuple[Dict[str, np.ndarray], Dict[str, int]]:
        """Every dense parameter's gradient to send, and the flags of those without one (``NOGRAD_FLAG``)."""
        grads, flags = {}, {}
        for name in self.names:
            g = dense_grads.get(name)
            if g is None:  # flagged, no payload on the wire: counted as zero, and no update where no trainer has one
                grads[name], flags[name] = self._zeros(name), P.NOGRAD_FLAG
            else:
                grads[name] = np.ascontiguousarray(g, dtype=self._shapes[name][1])
        return grads, flags

    def _zeros(self, name: str) -> np.ndarray:
        """A read-only zero array shaped like dense parameter ``name`` (made once)."""
        z = self._zero.get(name)
        if z is None:
            shape, dtype = self._shapes[name]
            z = self._zero[name] = np.zeros(shape, dtype)
            z.flags.writeable = False
        return z

    def _send_hypers(self, hypers: Sequence[Mapping[str, Any]]) -> None:
        if hypers and len(hypers) != len(self.groups):
            raise ValueError(f"{len(hypers)} groups' hyper-parameters for {len(self.groups)} groups")
        for g, sent, now in zip(self.groups, self._sent, hypers):
            spec = g.spec.to_dict()
            changed = {k: v for k, v in now.items() if sent.get(k) != v}
            moved = sorted(k for k in changed if k in STRUCTURAL and spec.get(k) != now[k])
            if moved:
                raise ValueError(f"{', '.join(f'{k}={now[k]!r}' for k in moved)}: fixed when the model was defined "
                                 f"({', '.join(f'{k}={spec.get(k)!r}' for k in moved)}); only "
                                 f"{', '.join(sorted(set(spec) - STRUCTURAL))} may change during training")
            changed = {k: v for k, v in changed.items() if k not in STRUCTURAL}
            if changed:
                OptimizerSpec.from_dict({**spec, **changed})  # a bad value fails here, in one line
                if self.rank == 0 and (g.names or g.tables):  # trainer 0 runs the job's hyper-parameters
                    # One group is the whole model: no names (the pservers bound how many a change may name).
                    names = None if len(self.groups) == 1 else g.names + g.tables
                    self.ps.set_hyper(names, **{k: float(v) for k, v in changed.items()})
                sent.update(changed)

    def table_rows(self, name: str) -> Tuple[np.ndarray, np.ndarray]:
        """The rows of table ``name`` that exist (sorted ids, rows), as of this step."""
        return self.ps.read_sparse(name)

    def whole_bytes(self, name: str) -> int:
        """What table ``name`` whole (``table_dense``) takes."""
        t = self.tables[name]
        return t.num_embeddings * t.width * np.dtype(t.dtype).itemsize

    def table_dense(self, name: str) -> np.ndarray:
        """Table ``name`` whole, ``(num_embeddings, width)``: the rows that exist, the others at the initial value
        their first use would give them. Refused above ``DENSE_TABLE_BYTES``: use ``table_rows``."""
        t = self.tables[name]
        nbytes = self.whole_bytes(name)
        if nbytes > DENSE_TABLE_BYTES:
            raise ValueError(f"table {name!r} whole would be {nbytes >> 20} MiB ({t.num_embeddings} rows of "
                             f"{t.width}), more than {DENSE_TABLE_BYTES >> 20} MiB: pass tables='rows' (or the "
                             "default, 'auto') for the rows that exist")
        ids, rows = self.table_rows(name)
        out = np.empty((t.num_embeddings, t.width), dtype=t.dtype)
        chunk = max(1, (1 << 18) // t.width)
        for lo in range(0, t.num_embeddings, chunk):
            hi = min(lo + chunk, t.num_embeddings)
            out[lo:hi] = init_rows(np.arange(lo, hi), t.width, t.init_scale, t.seed, t.dtype)
        out[ids] = rows
        return out

    def final(self, tables: str = "auto", final_wait: float = 600.0
              ) -> Tuple[Dict[str, np.ndarray], Dict[str, Union[np.ndarray, Tuple[np.ndarray, np.ndarray]]]]:
        """The model the pservers hold now: every dense value, and each table whole (an array: ``table_dense``)
        or as its existing rows (a tuple: ``table_rows``): ``tables="whole"``, ``"rows"``, or ``"auto"``, whole
        up to ``DENSE_TABLE_BYTES`` and rows above (said once on stderr). Async mode: trainer 0 first waits
        (``final_wait`` s at most) for the other trainers to finish."""
        if tables not in ("auto", "whole", "rows"):
            raise ValueError(f"state_dict(tables={tables!r}): expected 'auto', 'whole' or 'rows'")
        if self.ps.mode == "async" and self.size > 1 and self.rank == 0:
            self.ps.wait_others_closed(final_wait)
        out: Dict[str, Union[np.ndarray, Tuple[np.ndarray, np.ndarray]]] = {}
        for name in self.tables:
            whole = tables == "whole" or (tables == "auto" and self.whole_bytes(name) <= DENSE_TABLE_BYTES)
            out[name] = self.table_dense(name) if whole else self.table_rows(name)
            if tables == "auto" and not whole and name not in self._told_rows:
                self._told_rows.add(name)
                sys.stderr.write(f"paddle_cluster: table {name!r} whole would be {self.whole_bytes(name) >> 20} MiB "
                                 f"(over {DENSE_TABLE_BYTES >> 20} MiB): the model holds its {len(out[name][0])} "
                                 "existing rows instead, under <its weight>.ids and <its weight>.rows\n")
        return self.ps.pull(), out

    def save_checkpoint(self, name: Optional[str] = None) -> Any:
        """Trainer 0: the pservers save every parameter, table row and optimizer state of this step. Other
        trainers: nothing (None)."""
        return self.ps.save_checkpoint(name) if self.rank == 0 else None

    def close(self) -> None:
        self.ps.close()


@contextlib.contextmanager
def skipping_synchronize(synced: bool) -> Iterator[None]:
    """Both frontends' ``skip_synchronize()``: the ``step()`` inside applies what ``synchronize()`` left in
    ``p.grad``; refused in one line when ``synchronize()`` was not called since the gradients were cleared."""
    if not synced:
        raise RuntimeError("DistributedOptimizer.skip_synchronize(): call opt.synchronize() after backward() "
                           "first; without it, step() averages the trainers' gradients itself")
    yield


def refuse_empty_batch(dense_grads: Mapping[str, Optional[np.ndarray]],
                       row_grads: Mapping[str, Sequence[Tuple[np.ndarray, np.ndarray]]]) -> None:
    """ValueError (one line) for a step computed on an empty batch: every gradient exactly zero and no embedding
    row looked up. Averaged with the other trainers' gradients its zeros would shrink the step by 1/N, silently:
    DDP does that, this runtime refuses it (a trainer that ended leaves the average instead)."""
    if any(len(i) for parts in row_grads.values() for i, _ in parts):
        return
    given = sorted((g for g in dense_grads.values() if g is not None), key=np.size)
    if given and not any(np.any(g) for g in given):  # smallest first: a bias decides it in microseconds
        raise ValueError("DistributedOptimizer.step(): this trainer's batch is empty (every gradient is exactly zero "
                         "and no embedding row was looked up): averaged with the other trainers' gradients, its zeros "
                         "would shrink the step silently; give every trainer at least one sample of every batch (or "
                         "drop the last partial batch), or end this trainer with shutdown() when its shard is done: "
                         "the other trainers' mean is then the step")


# The process's one frontend ``DistributedOptimizer`` (it has a ``bridge``): a trainer trains one model.
_held: Optional[Any] = None


def vacant() -> None:
    """RuntimeError when the process already has its DistributedOptimizer (checked before building another)."""
    if _held is not None:
        raise RuntimeError("DistributedOptimizer: this process already has one; wrap one optimizer per "
                           "trainer (give it several parameter groups for several rules' hyper-parameters)")


def hold(owner: Any) -> None:
    """Make ``owner`` (a frontend's DistributedOptimizer, connected) the process's one; ``shutdown`` at exit."""
    global _held
    vacant()
    _held = owner
    # Before the client's thread pools stop at interpreter exit (threading's exit hooks run before atexit's,
    # the latest first), so a script that just ends still tells the pservers it is done.
    getattr(threading, "_register_atexit", atexit.register)(shutdown)


def held(what: str) -> Any:
    """The process's DistributedOptimizer, for ``what`` ("state_dict(model)"); RuntimeError without one."""
    if _held is None:
        raise RuntimeError(f"{what}: no DistributedOptimizer in this process")
    return _held


def rank() -> int:
    """This trainer's id (alone: 0)."""
    if _held is not None:
        return _held.bridge.rank
    env = JobEnv.from_environ()
    return 0 if env is None or env.trainer_id is None else int(env.trainer_id)


def size() -> int:
    """The job's trainer count (alone: 1)."""
    if _held is not None:
        return _held.bridge.size
    env = JobEnv.from_environ()
    return 1 if env is None else int(env.trainers)


def shutdown() -> None:
    """Tell the pservers this trainer is done (also run at exit): in a job, they exit once every trainer is."""
    global _held
    if _held is not None:
        owner, _held = _held, None
        owner.bridge.close()


def save_atomically(path: str, write: Callable[[str], None]) -> Optional[str]:
    """Trainer 0 runs ``write(tmp)`` and moves ``tmp`` to ``path`` (a reader never sees half a file); the path
    written, or None on other trainers, which write nothing. If writing fails, the pservers first save a
    checkpoint of this step (every parameter, row and optimizer state: ``--resume_from`` continues from it),
    so the trainer's error, which ends the job, never loses the model; the error says where it is."""
    if rank() != 0:
        return None
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        write(tmp)
        os.replace(tmp, path)
    except Exception as e:
        raise RuntimeError(f"save {path!r} failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}; "
                           f"{_rescue()}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _rescue() -> str:
    """After a failed save: have the pservers save a checkpoint; what to tell the user about it."""
    if _held is None:
        return "no DistributedOptimizer holds the model on pservers"
    try:
        info = _held.bridge.save_checkpoint()
    except Exception as e:  # noqa: BLE001  (said in the one line; the save's own error is the one raised)
        return f"the pservers could not save a checkpoint either: {str(e).splitlines()[0]}"
    return (f"the pservers saved a checkpoint of step {info.step} first ({', '.join(info.paths)}): "
            "`paddle-cluster run --resume_from JOB` continues from it")
