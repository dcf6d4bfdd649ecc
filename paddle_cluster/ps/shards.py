"""What a pserver holds: dense blocks and its shard of each sparse table, and how a gradient changes them.

Each shard has its own condition variable (``cv``), which doubles as its sync-mode barrier (see ``sync``),
its step counter and how far into the server's hyper-parameter history it is.
"""

from __future__ import annotations

import threading
from typing import Any, Dict, Optional, Set, Tuple

import numpy as np

from . import optim
from .errors import ProtocolError
from .optim import OptimizerSpec
from .placement import init_rows
from .stream import SEGMENT


class Shard:
    """What dense blocks and table shards share: a step counter, a barrier and a hyper-parameter cursor."""

    def __init__(self, key: int, name: str, spec: OptimizerSpec, declared: Dict[str, Any], step: int) -> None:
        self.key = key
        self.name = name
        self.spec = spec
        self.declared = declared  # spec as first defined; later definitions must match it
        self.step = step
        self.lock = threading.RLock()
        self.cv = threading.Condition(self.lock)
        self.pending: Dict[int, Any] = {}  # trainer -> its contribution to ``step``
        self.receiving: Set[int] = set()
        self.hyper_seen = 0  # the last hyper-parameter change (``HyperChange.seq``) applied to ``spec``

    def describe(self) -> str:
        raise NotImplementedError

    def wake(self) -> None:
        """(Holding ``cv``.) Something any waiter may be waiting for changed: wake every one."""
        self.cv.notify_all()


class DenseBlock(Shard):
    def __init__(self, key: int, meta: Dict[str, Any], spec: OptimizerSpec, declared: Dict[str, Any],
                 step: int) -> None:
        super().__init__(key, meta["name"], spec, declared, step)
        self.meta = meta
        self.dtype = np.dtype(meta["dtype"])
        self.shape = tuple(meta["shape"])
        self.param = np.zeros(self.shape, dtype=self.dtype)
        self.nbytes = self.param.nbytes
        self.opt = optim.make_dense(spec, self.param)
        self.initialized = False
        self.initializing = False
        # Sync mode with several trainers: their gradients of the current step, summed in trainer order
        # (see handlers.push_dense). One buffer per block, allocated on first use.
        self._acc: Optional[np.ndarray] = None
        self.acc_busy = False  # a push is being received straight into acc
        self.applying = False
        self.error: Optional[str] = None
        # Sync-mode SGD (``fold``): this step's segments some trainers have sent, and how many are applied.
        self.segs: Dict[int, Any] = {}
        self.segs_done = 0
        self.n_segs = max(1, -(-self.nbytes // SEGMENT))
        self.applied: Set[int] = set()  # segments already at ``step + 1`` (a pull of it may send them)
        # One condition per segment on ``cv``'s lock, for those waiting on one segment (its trainers in order,
        # its pulls): with 4 trainers, waking every waiter of the block at each fold put the pserver's threads
        # on a core 3x as often as the fold needs.
        self.seg_cv = tuple(threading.Condition(self.lock) for _ in range(self.n_segs))

    def describe(self) -> str:
        return f"block {self.name}[{self.meta['lo']}:{self.meta['hi']}]"

    def wake(self) -> None:
        super().wake()
        for c in self.seg_cv:
            c.notify_all()

    def ready(self, i: int, step: int) -> bool:
        """(Holding ``cv``.) Does segment ``i`` hold its value of ``step``?"""
        return self.step >= step or (self.step == step - 1 and i in self.applied)

    @property
    def acc(self) -> np.ndarray:
        if self._acc is None:
            self._acc = np.empty(self.shape, dtype=self.dtype)
        return self._acc

    @property
    def plain_sgd(self) -> bool:
        return self.spec.name == "sgd" and self.spec.weight_decay == 0

    def apply_mean(self, g: np.ndarray, n: int) -> None:
        """Apply the mean gradient ``g / n``; ``g`` is scratch (it may be overwritten)."""
        if self.plain_sgd:
            # No buffer of the block's size is touched besides param and g (same rounding as the optimizer's).
            optim.sgd(self.param, g, self.spec.lr, n=n)
            return
        if n > 1:
            g /= self.dtype.type(n)
        self.opt.apply(self.param, g)

    def apply_sum_with(self, g: np.ndarray, n: int) -> None:
        """Plain SGD: add ``g`` to the sum in ``acc`` of ``n - 1`` gradients, average and apply, chunk by
        chunk while the chunk is in cache (the same operations, in the same order, as summing first)."""
        optim.sgd(self.param, self.acc, self.spec.lr, plus=g, n=n)


class TableShard(Shard):
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
        self.opt = optim.make_sparse(spec, self.width, self.dtype)
        self.keys = np.empty(0, dtype=np.int64)  # sorted ids
        self.pos = np.empty(0, dtype=np.int64)  # row of keys[i] in table
        self.n = 0
        self.table = np.empty((0, self.width), dtype=self.dtype)
        self.state: Dict[str, np.ndarray] = self.opt.new_state(0)

    def describe(self) -> str:
        return f"table {self.name!r}"

    def grow(self, need: int) -> None:
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
        self.grow(len(new))
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

    def apply_rows(self, ids: np.ndarray, grads: np.ndarray) -> None:
        """Apply row gradients of sorted unique ``ids`` (rows created on first use)."""
        if len(ids):
            pos = self.lookup(ids)  # may grow (reallocate) the table: look up before reading self.table
            self.opt.apply(self.table, self.state, pos, grads)

    def pending_mean(self) -> Tuple[np.ndarray, np.ndarray]:
        """The mean of the pending contributions, summed in trainer order: (sorted unique ids, row grads)."""
        contributors = sorted(self.pending)
        if len(contributors) == 1:
            return self.pending[contributors[0]]
        all_ids = np.concatenate([self.pending[c][0] for c in contributors])
        all_g = np.concatenate([self.pending[c][1] for c in contributors])
        ids, inv = np.unique(all_ids, return_inverse=True)
        g = np.zeros((len(ids), self.width), dtype=self.dtype)
        np.add.at(g, inv, all_g)
        g /= self.dtype.type(len(contributors))
        return ids, g
