"""What a pserver's request handlers work on (``State``): its identity and bounds, its barriers, what trainer 0
declared and the shards it holds. The server makes one and hands it to every handler; handlers never see the
server itself (its sockets and lifecycle)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from .. import checkpoint as ckpt
from ..wire.lane import Desk
from .budget import Budget
from .dense import DenseBlock, DenseShared
from .shard import Shard
from .sync import Sync
from .table import TableShard


@dataclass
class State:
    """One pserver's state. ``done`` is set once every trainer has closed (or on ``stop``)."""

    pserver_id: int
    n_pservers: int
    trainers: int
    max_frame: int
    checkpoint_root: str
    budget: Budget
    allow_nonfinite: bool
    sync: Sync
    dense: DenseShared
    done: threading.Event
    # What trainer 0 declared (the mode and staleness bound are the barriers' business: ``sync``).
    optimizer: Optional[Dict[str, Any]] = None
    dropped_stale: int = 0
    base_step: int = 0
    resumed_from: Optional[str] = None
    blocks: Dict[int, DenseBlock] = field(default_factory=dict)
    tables: Dict[int, TableShard] = field(default_factory=dict)
    waiting: Dict[int, int] = field(default_factory=dict)  # trainer -> its definitions waiting for trainer 0's
    lanes: Optional[Desk] = None  # where same-host lanes are offered (None: this pserver takes none)
    rounds: Dict[int, Any] = field(default_factory=dict)  # REDUCE calls under way (``reduce.Round`` by call)

    def shards(self) -> List[Shard]:
        """Every dense block, then every table shard."""
        return [*self.blocks.values(), *self.tables.values()]

    def snapshot(self, step: int) -> ckpt.ShardState:
        """A consistent copy of everything this pserver holds (no optimizer apply runs meanwhile)."""
        with self.sync.rw.exclusive():
            blocks = [ckpt.BlockState(b.key, b.name, b.meta["lo"], b.meta["hi"], b.dtype.name,
                                      {"declared": b.declared, "current": b.spec_at(step)}, b.step.n, b.param.copy(),
                                      {k: v.copy() for k, v in b.opt.state.items()})
                      for b in self.blocks.values()]
            tables = [ckpt.TableState(t.key, t.name, t.width, t.dtype.name, t.init_scale, t.seed,
                                      {"declared": t.declared, "current": t.spec_at(step)}, t.step.n, t.keys.copy(),
                                      t.table[t.pos], {k: v[t.pos] for k, v in t.state.items()})
                      for t in self.tables.values()]
        return ckpt.ShardState(step, self.pserver_id, self.n_pservers, self.sync.mode, self.optimizer, blocks, tables)
