"""A pserver's shard of a sparse table (``TableShard``): its id space, rows made on first use, how a row gradient
changes them, and everything a request does to it -- pushing row gradients, pulling rows, reading pages of
them -- through its step (``shard.Step``)."""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import numpy as np

from .. import optim
from ..errors import ConfigMismatch, LimitExceeded, ProtocolError
from ..optim import OptimizerSpec
from ..placement import init_rows
from ..wire import protocol as P
from . import finite
from .budget import Budget
from .net import Conn
from .shard import Shard
from .sync import Sync

INIT_CHUNK = 1 << 18  # elements of new rows initialised at once: a bounded scratch, whatever a request asks
APPLY_BYTES = 1 << 20  # bytes of row gradients folded and applied at once: the optimizer's scratch is a few of these
ID_SCRATCH = 64  # bytes a lookup holds per id asked (positions, masks, the new ids), charged while it works
LOOKUP_IDS = 1 << 16  # ids a request's lookup handles at once: its scratch is bounded whatever the request asks
INSERT_SCRATCH = 24  # bytes per row of the id index while new ids are inserted (its new arrays and mask)
ROWS_PAGE_BYTES = 16 << 20  # the most a ROWS_SPARSE reply carries: a table of any size is read page by page


def shard_rows(vocab_size: Optional[int], max_rows: Optional[int], pserver_id: int, n_pservers: int
               ) -> Optional[int]:
    """How many rows of a table pserver ``pserver_id`` may hold: the ids of ``[0, vocab_size)`` it owns (id %
    n_pservers), and its even share of ``max_rows``; None when neither is declared."""
    limits = []
    if vocab_size is not None:
        limits.append(max(0, -(-(vocab_size - pserver_id) // n_pservers)))
    if max_rows is not None:
        limits.append(-(-max_rows // n_pservers))
    return min(limits) if limits else None


class TableShard(Shard):
    """Pserver ``pserver_id``'s rows of a table. Its id space (``meta``: ``vocab_size``: ids in [0, V);
    ``max_rows``: a row budget for the whole table, split evenly over the pservers) bounds what it creates;
    every allocation is charged to ``budget`` first."""

    def __init__(self, key: int, meta: Dict[str, Any], spec: OptimizerSpec, declared: Dict[str, Any],
                 step: int, sync: Sync, pserver_id: int, n_pservers: int, budget: Budget,
                 finite: bool = True) -> None:
        super().__init__(key, meta["name"], spec, declared, step, sync)
        self.meta = meta
        self.budget = budget
        self.finite = finite  # refuse NaN or Inf gradients and updates (not PADDLE_ALLOW_NONFINITE)
        self.vocab_size: Optional[int] = meta.get("vocab_size")
        self.max_rows: Optional[int] = meta.get("max_rows")
        self.row_limit = shard_rows(self.vocab_size, self.max_rows, pserver_id, n_pservers)
        self.width = int(meta["width"])
        self.dtype = np.dtype(meta["dtype"])
        self.init_scale = float(meta["init_scale"])
        self.seed = int(meta["seed"])
        self.pserver_id = pserver_id
        self.n_pservers = n_pservers
        self.opt = optim.SparseOptimizer(spec, self.width, self.dtype)
        self.keys = np.empty(0, dtype=np.int64)  # sorted ids
        self.pos = np.empty(0, dtype=np.int64)  # row of keys[i] in table
        self.n = 0
        self.table = np.empty((0, self.width), dtype=self.dtype)
        self.state: Dict[str, np.ndarray] = self.opt.new_state(0)
        # Bytes per row of capacity: the row, its optimizer slots, and its id and position (16 B).
        self.row_bytes = self.width * self.dtype.itemsize + 16 + sum(
            math.prod(suffix) * np.dtype(dt).itemsize for suffix, dt in self.opt.row_slots.values())

    def label(self) -> str:
        return f"table {self.name!r}"

    def id_space(self) -> str:
        parts = ([f"vocab_size={self.vocab_size}"] if self.vocab_size is not None else []) + \
            ([f"max_rows={self.max_rows}"] if self.max_rows is not None else [])
        return ", ".join(parts) or "undeclared"

    def bound(self, meta: Dict[str, Any]) -> None:
        """Take the id space of ``meta`` (trainer 0's definition of a table restored from a checkpoint); refuses
        (``ConfigMismatch``) one the restored rows do not fit."""
        vocab, max_rows = meta.get("vocab_size"), meta.get("max_rows")
        limit = shard_rows(vocab, max_rows, self.pserver_id, self.n_pservers)
        outside = self.n and vocab is not None and (self.keys[0] < 0 or self.keys[-1] >= vocab)
        if outside or (limit is not None and self.n > limit):
            raise ConfigMismatch(f"{self.label()}: the checkpoint holds {self.n} rows with ids "
                                 f"{int(self.keys[0])}..{int(self.keys[-1])} on pserver {self.pserver_id}, more "
                                 f"than vocab_size={vocab}, max_rows={max_rows} allow")
        self.meta, self.vocab_size, self.max_rows, self.row_limit = meta, vocab, max_rows, limit

    def admit(self, ids: np.ndarray, trainer: int) -> None:
        """Refuse (``LimitExceeded``) sorted unique ``ids`` outside the declared id space: one compare per end."""
        if self.vocab_size is not None and len(ids) and (ids[0] < 0 or ids[-1] >= self.vocab_size):
            bad = int(ids[0] if ids[0] < 0 else ids[-1])
            raise LimitExceeded(f"{self.label()}: trainer {trainer} sent id {bad}, outside the table's id space "
                                f"[0, {self.vocab_size}) (vocab_size={self.vocab_size}, as trainer 0 declared it): "
                                "ids must be below the vocabulary size; hash larger id spaces into it")

    def grow(self, need: int) -> None:
        cap = len(self.table)
        if self.n + need <= cap:
            return
        if self.row_limit is not None and self.n + need > self.row_limit:
            raise LimitExceeded(f"{self.label()}: {need} new rows would make {self.n + need} on pserver "
                                f"{self.pserver_id}, past its row budget of {self.row_limit} ({self.id_space()} "
                                f"over {self.n_pservers} pservers)")
        new_cap = max(self.n + need, 2 * cap, 1024)
        if self.row_limit is not None:
            new_cap = min(new_cap, self.row_limit)
        # The new arrays whole: the old ones are held too until copied, and given back after.
        try:
            self.budget.charge(new_cap * self.row_bytes, f"{self.label()} growing to {new_cap} rows")
        except LimitExceeded:
            new_cap = self.n + need  # no room to spare: exactly what is needed, else refused
            self.budget.charge(new_cap * self.row_bytes, f"{self.label()} growing to {new_cap} rows")
        table = np.empty((new_cap, self.width), dtype=self.dtype)
        table[: self.n] = self.table[: self.n]
        self.table = table
        state = self.opt.new_state(new_cap)
        for k, a in self.state.items():
            state[k][: self.n] = a[: self.n]
        self.state = state
        self.budget.release(cap * self.row_bytes)

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """Row positions of sorted unique ``ids``, creating missing rows with the deterministic init."""
        idx = np.searchsorted(self.keys, ids)
        found = idx < len(self.keys)
        found[found] = self.keys[idx[found]] == ids[found]
        if found.all():
            return self.pos[idx]
        new = ids[~found]
        try:
            self.grow(len(new))
        except LimitExceeded as e:
            raise LimitExceeded(f"{e}; the first new id is {int(new[0])}") from None
        new_pos = np.arange(self.n, self.n + len(new), dtype=np.int64)
        self._init(new)
        self.n += len(new)
        held = INSERT_SCRATCH * (self.n + len(new))
        self.budget.charge(held, f"{self.label()}: inserting {len(new)} ids into its index of {self.n} rows")
        try:
            ins = np.searchsorted(self.keys, new)
            self.keys = np.insert(self.keys, ins, new)
            self.pos = np.insert(self.pos, ins, new_pos)
        finally:
            self.budget.release(held)
        return self.pos[np.searchsorted(self.keys, ids)]

    def _init(self, new: np.ndarray) -> None:
        """Write the initial values of the rows of ``new`` (ids) at ``self.n`` on, ``INIT_CHUNK`` elements at a time
        (``init_rows`` holds ~28 bytes per element while it works): rows at a time, or, for a row wider than that,
        columns of one row at a time."""
        step = max(1, INIT_CHUNK // self.width)
        for lo in range(0, len(new), step):
            part = new[lo:lo + step]
            at = self.n + lo
            for c in range(0, self.width, INIT_CHUNK if step == 1 else self.width):
                hi = min(self.width, c + INIT_CHUNK) if step == 1 else self.width
                self.table[at: at + len(part), c:hi] = init_rows(part, self.width, self.init_scale, self.seed,
                                                                 self.dtype, (c, hi))

    def charged_lookup(self, ids: np.ndarray, trainer: int) -> np.ndarray:
        """``lookup`` for trainer ``trainer``'s request, ``LOOKUP_IDS`` ids at a time: its scratch (``ID_SCRATCH``
        per id of a chunk) and the positions it returns (8 bytes per id) charged to the budget while it works."""
        held = 8 * len(ids) + ID_SCRATCH * min(len(ids), LOOKUP_IDS)
        self.budget.charge(held, f"{self.label()}: looking up trainer {trainer}'s {len(ids)} ids")
        try:
            if len(ids) <= LOOKUP_IDS:
                return self.lookup(ids)
            pos = np.empty(len(ids), dtype=np.int64)
            for lo in range(0, len(ids), LOOKUP_IDS):
                pos[lo:lo + LOOKUP_IDS] = self.lookup(ids[lo:lo + LOOKUP_IDS])
            return pos
        finally:
            self.budget.release(held)

    def check_ids(self, ids: np.ndarray) -> None:
        if len(ids) > 1 and not bool(np.all(ids[1:] > ids[:-1])):
            raise ProtocolError(f"{self.label()}: ids are not sorted and unique")
        if len(ids) and bool(np.any(np.mod(ids, self.n_pservers) != self.pserver_id)):
            raise ProtocolError(f"{self.label()}: ids that belong to another pserver")

    def apply_rows(self, ids: np.ndarray, grads: np.ndarray, pos: Optional[np.ndarray] = None,
                   by: Optional[str] = None) -> None:
        """Apply row gradients of sorted unique ``ids`` (rows created on first use; ``pos``: their rows, as a
        ``lookup`` made them -- a row never moves). ``by`` (whose gradients, for the message): refuse
        (``NonFinite``) an update that would make a row hold NaN or Inf, changing nothing."""
        if len(ids):
            if pos is None:
                pos = self.lookup(ids)  # may grow (reallocate) the table: look up before reading self.table
            check = None if by is None else (lambda rows: finite.updated(rows, self.label(), by, self.step.n))
            state_check = None if by is None else self._state_check(by)
            step = self._chunk_rows()  # the optimizer holds a few copies of what it updates at once
            for lo in range(0, len(ids), step):
                self.opt.apply(self.table, self.state, pos[lo:lo + step], grads[lo:lo + step], check, state_check)

    def _chunk_rows(self, contributors: int = 1) -> int:
        """Rows of gradient folded and applied at once: ``APPLY_BYTES`` in all, at least one row."""
        return max(1, APPLY_BYTES // (contributors * self.width * self.dtype.itemsize))

    def _state_check(self, by: str) -> Callable[[Dict[str, np.ndarray]], None]:
        """What refuses updated optimizer state rows holding NaN or Inf (``NonFinite`` naming the table, the slot
        and ``by``), before they are written back: the table and its state are left as they were."""
        def check(state: Dict[str, np.ndarray]) -> None:
            slot = finite.bad_state(state)
            if slot is not None:
                raise finite.state_refused(self.label(), slot, self.spec.name, by, self.step.n)
        return check

    def pending_means(self) -> Iterator[Tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]]:
        """The mean of the pending contributions (``(ids, grads, rows)`` each), summed in trainer order, as
        (sorted unique ids, row grads, their rows if known), a chunk at a time: each contributor's ids are sorted,
        so the chunks merge them by id, at most ``APPLY_BYTES`` of gradients in each -- the fold's scratch is
        bounded whatever the pushes hold. Each row's sum is ``0 + g0 + g1 + ...`` in trainer order, then divided."""
        parts = self.step.contributions()
        if len(parts) == 1:
            yield parts[0]
            return
        per, at, n = self._chunk_rows(len(parts)), [0] * len(parts), self.dtype.type(len(parts))
        while True:
            live = [k for k, (ids, _, _) in enumerate(parts) if at[k] < len(ids)]
            if not live:
                return
            # The largest id every contributor's next ``per`` ids reach: each adds at most ``per`` rows below it.
            bound = min(parts[k][0][min(at[k] + per, len(parts[k][0])) - 1] for k in live)
            spans = []
            for k, (ids, _, _) in enumerate(parts):
                end = at[k] + int(np.searchsorted(ids[at[k]:at[k] + per], bound, side="right"))
                spans.append((at[k], end))
                at[k] = end
            u = np.unique(np.concatenate([parts[k][0][a:b] for k, (a, b) in enumerate(spans)]))
            g = np.zeros((len(u), self.width), dtype=self.dtype)
            for k, (a, b) in enumerate(spans):
                if b > a:
                    g[np.searchsorted(u, parts[k][0][a:b])] += parts[k][1][a:b]  # unique positions: no lost add
            g /= n
            yield u, g, None

    # -- requests --------------------------------------------------------------------------------------------

    def _rows_fit(self, n: int, trainer: int, what: str) -> None:
        """Refuse, from the header alone, a request for more rows than this pserver may ever hold."""
        if self.row_limit is not None and n > self.row_limit:
            raise LimitExceeded(f"{self.label()}: trainer {trainer} sent a {what} of {n} ids, more than the "
                                f"{self.row_limit} rows pserver {self.pserver_id} may hold of it ({self.id_space()})")

    def pull(self, conn: Conn, h: P.Header) -> None:
        """Reply with the rows of the ``h.aux`` ids the request carries, as of step ``h.step`` (waited for in sync
        mode); rows not there yet are made (the deterministic init)."""
        n = h.aux
        if h.dtype != P.dtype_code(np.int64):
            raise ProtocolError(f"{self.label()}: a pull carries int64 ids, frame says dtype code {h.dtype}")
        P.expect_length(h, 8 * n, f"{self.label()}: pull of {n} ids")
        self._rows_fit(n, conn.trainer, "pull")
        held = n * (8 + self.width * self.dtype.itemsize)  # the ids, and the rows of the reply
        self.budget.charge(held, f"{self.label()}: a pull of {n} rows")
        try:
            ids = np.empty(n, dtype=np.int64)
            conn.stream.recv_into(ids)
            self.check_ids(ids)
            self.admit(ids, conn.trainer)
            with self.cv:
                self.step.wait(h.step, "pull")
                with self.sync.rw.shared():
                    pos = self.charged_lookup(ids, conn.trainer)  # may grow the table: before reading self.table
                    rows = self.table[pos]
                step = self.step.n
            header = P.pack_header(P.Op.DATA, P.dtype_code(self.dtype), key=h.key, step=step, length=rows.nbytes,
                                   aux=n)
            conn.stream.send(header, rows)
        finally:
            self.budget.release(held)

    def push(self, conn: Conn, h: P.Header) -> bool:
        """Receive trainer ``conn.trainer``'s gradients of ``h.aux`` rows for step ``h.step``: async mode applies
        them now; sync mode holds them (charged to the budget) until every active trainer's are in, then applies
        their mean. A repeat of a push already counted is read and dropped. True: a table drops no push as stale
        (the staleness bound is the dense blocks' rule)."""
        n, t, at = h.aux, conn.trainer, self.step
        if h.dtype != P.dtype_code(self.dtype):
            raise ProtocolError(f"{self.label()} is {self.dtype}, frame says dtype code {h.dtype}")
        P.expect_length(h, n * (8 + self.width * self.dtype.itemsize), f"{self.label()}: push of {n} rows")
        self._rows_fit(n, t, "push")
        with self.cv:
            new = at.begin(t, h.step)
        if not new:
            conn.stream.discard()
            return True
        held = h.length  # the ids and rows received: held until the step is applied (``_complete``)
        try:
            self.budget.charge(held, f"{self.label()}: a push of {n} rows")
            try:
                ids = np.empty(n, dtype=np.int64)
                grads = np.empty((n, self.width), dtype=self.dtype)
                conn.stream.recv_into(ids, grads)
                self.check_ids(ids)
                self.admit(ids, t)
                if self.finite:
                    finite.check(grads, self.label(), t, h.step)
                with self.cv, self.sync.rw.shared():
                    # Rows are made now (the values a pull would make), so the row budget refuses this trainer's
                    # push, never the apply that another trainer's push completes.
                    pos = self.charged_lookup(ids, t)
            except BaseException:
                self.budget.release(held)
                raise
        finally:
            with self.cv:
                at.end(t)
        with self.cv:
            if self.sync.mode == "async":
                try:
                    with at.advancing(None):
                        self.apply_rows(ids, grads, pos, f"trainer {t}" if self.finite else None)
                finally:
                    self.budget.release(held)
            elif at.take(t, h.step, (ids, grads, pos)):
                self._complete()
            else:
                self.budget.release(held)
            self.wake()
        return True

    def rows(self, conn: Conn, h: P.Header) -> None:
        """A page of the rows that exist: those with ids from the payload's first id on, in id order, at most
        ``h.aux`` of them and at most ``ROWS_PAGE_BYTES`` of reply (the reply's ``aux``: how many). Reads only
        (no row is created), for step ``h.step``: the final model's table, page by page."""
        if h.dtype != P.dtype_code(np.int64):
            raise ProtocolError(f"{self.label()}: a rows request carries one int64 id, frame says dtype code "
                                f"{h.dtype}")
        P.expect_length(h, 8, f"{self.label()}: rows request")
        first = np.empty(1, dtype=np.int64)
        conn.stream.recv_into(first)
        limit = max(1, min(int(h.aux), ROWS_PAGE_BYTES // (8 + self.width * self.dtype.itemsize)))
        with self.cv:
            self.step.wait(h.step, "rows")
            with self.sync.rw.shared():
                lo = int(np.searchsorted(self.keys[:self.n], first[0]))
                n = max(0, min(limit, self.n - lo))
                held = n * (8 + self.width * self.dtype.itemsize)  # the page's copy, held until sent
                self.budget.charge(held, f"{self.label()}: a page of {n} rows")
                ids = self.keys[lo:lo + n].copy()
                rows = self.table[self.pos[lo:lo + n]]
            step = self.step.n
        try:
            header = P.pack_header(P.Op.DATA, P.dtype_code(self.dtype), key=h.key, step=step,
                                   length=ids.nbytes + rows.nbytes, aux=n)
            conn.stream.send(header, ids, rows)
        finally:
            self.budget.release(held)

    def trainer_closed(self) -> None:
        """(Holding ``cv``.) A trainer closed: a step that was waiting only for it completes now."""
        if self.sync.mode == "sync":
            self._complete()
        self.wake()

    def _complete(self) -> None:
        """(Holding ``cv``.) Once every active trainer pushed, apply the mean of their row gradients."""
        at = self.step
        if not at.full():
            return
        by = finite.trainers(at.contributors()) if self.finite else None
        held = sum(i.nbytes + r.nbytes for i, r, _ in at.contributions())  # what the pushes held (``push``)
        try:
            with at.advancing(at.n):
                for ids, g, pos in self.pending_means():
                    self.apply_rows(ids, g, pos, by)
        finally:
            self.budget.release(held)
        self.wake()
