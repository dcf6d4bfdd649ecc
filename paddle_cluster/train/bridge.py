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
   then ``values = b.step(dense_grads, row_grads, hypers)``: every dense gradient by name (a missing one counts
   as zero), ``row_grads[table]`` a list of ``(unique ids, their row gradients)`` (one per lookup; duplicates are
   summed), ``hypers[i]`` group ``i``'s hyper-parameters now (e.g. ``{"lr": 0.05}``): a change since the last
   step (an LR scheduler) is sent with ``set_hyper`` and applies from this step's update on. Returns every dense
   value after the step (copy them back: the arrays are the client's buffers, valid until the next step).
   Every trainer passes the same ``hypers``; trainer 0's are the ones sent.
4. ``b.table_rows(name)`` (the rows that exist: ids, rows) and ``b.table_dense(name)`` (the whole table, rows
   never touched at their initial value) build the final model; ``b.save_checkpoint()`` (trainer 0) has the
   pservers save parameters and optimizer state; ``b.close()`` ends the trainer.

Errors are one line: an id outside a table's id space (``ValueError``), a structural option changed after
``define`` (``ValueError``), a parameter shape other trainers disagree on (``ps.ConfigMismatch`` naming it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ..ps import PSClient, connect, init_rows
from ..ps.optim import STRUCTURAL, OptimizerSpec

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


class Bridge:
    """A trainer's model on the pservers, driven by a framework frontend (see the module's contract)."""

    def __init__(self, mode: str = "sync", ps: Optional[PSClient] = None, **connect_kw: Any) -> None:
        self.ps = ps if ps is not None else connect(mode=mode, **connect_kw)
        self.groups: List[Group] = []
        self.tables: Dict[str, TableDef] = {}
        self.names: List[str] = []
        self._sent: List[Dict[str, Any]] = []  # per group: the hyper-parameters the pservers use
        self._shapes: Dict[str, Tuple[Tuple[int, ...], np.dtype]] = {}
        self.start_step = 0

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

    def lookup(self, table: str, ids: Any) -> Lookup:
        """The rows of ``ids`` (any integer shape) for this step; only the unique ids travel."""
        t = self.tables.get(table)
        if t is None:
            raise KeyError(f"table {table!r} is not defined; defined: {sorted(self.tables)}")
        ids = np.asarray(ids)
        if ids.dtype.kind not in "iu":
            raise ValueError(f"embedding {table!r}: ids must be integers, got {ids.dtype}")
        uniq, inverse = np.unique(ids.reshape(-1).astype(np.int64), return_inverse=True)
        if len(uniq) and (uniq[0] < 0 or uniq[-1] >= t.num_embeddings):
            bad = int(uniq[0] if uniq[0] < 0 else uniq[-1])
            raise ValueError(f"embedding {table!r}: id {bad} is outside its id space [0, {t.num_embeddings}) "
                             f"(num_embeddings={t.num_embeddings})")
        rows = self.ps.pull_sparse(table, uniq) if len(uniq) else np.empty((0, t.width), dtype=t.dtype)
        return Lookup(table, uniq, inverse, rows, ids.shape)

    def step(self, dense_grads: Mapping[str, Optional[np.ndarray]],
             row_grads: Mapping[str, Sequence[Tuple[np.ndarray, np.ndarray]]],
             hypers: Sequence[Mapping[str, Any]] = ()) -> Dict[str, np.ndarray]:
        """Send this step's gradients (and any hyper-parameter change); the dense values after it."""
        self._send_hypers(hypers)
        for name, parts in row_grads.items():
            if name not in self.tables:
                raise KeyError(f"row gradients for table {name!r}, which is not defined")
            parts = [(i, g) for i, g in parts if len(i)]
            if parts:
                self.ps.push_sparse(name, np.concatenate([i for i, _ in parts]),
                                    np.concatenate([g for _, g in parts]))
        grads = {}
        for name in self.names:
            g = dense_grads.get(name)
            shape, dtype = self._shapes[name]
            grads[name] = np.zeros(shape, dtype) if g is None else np.ascontiguousarray(g, dtype=dtype)
        if self.ps.mode == "sync":
            return self.ps.push_pull(grads)
        self.ps.push(grads)
        return self.ps.pull()

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

    def table_dense(self, name: str) -> np.ndarray:
        """Table ``name`` whole, ``(num_embeddings, width)``: the rows that exist, the others at the initial value
        their first use would give them. Refused above ``DENSE_TABLE_BYTES``: use ``table_rows``."""
        t = self.tables[name]
        nbytes = t.num_embeddings * t.width * np.dtype(t.dtype).itemsize
        if nbytes > DENSE_TABLE_BYTES:
            raise ValueError(f"table {name!r} whole would be {nbytes >> 20} MiB ({t.num_embeddings} rows of "
                             f"{t.width}), more than {DENSE_TABLE_BYTES >> 20} MiB")
        ids, rows = self.table_rows(name)
        out = np.empty((t.num_embeddings, t.width), dtype=t.dtype)
        chunk = max(1, (1 << 18) // t.width)
        for lo in range(0, t.num_embeddings, chunk):
            hi = min(lo + chunk, t.num_embeddings)
            out[lo:hi] = init_rows(np.arange(lo, hi), t.width, t.init_scale, t.seed, t.dtype)
        out[ids] = rows
        return out

    def save_checkpoint(self, name: Optional[str] = None) -> Any:
        """(Trainer 0.) The pservers save every parameter, table row and optimizer state of this step."""
        return self.ps.save_checkpoint(name)

    def close(self) -> None:
        self.ps.close()
