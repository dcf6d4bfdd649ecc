"""Where dense blocks and sparse rows live.

Every trainer computes the placement itself from (names, shapes, dtypes, number of pservers), so the
functions here are pure and deterministic: no hashing of names, no dict-order dependence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

MIN_BLOCK_ELEMS = 8192
DEFAULT_MAX_BLOCK_BYTES = 4 << 20


@dataclass(frozen=True)
class Block:
    """Rows ``[lo, hi)`` of dense parameter ``name``, held by ``pserver`` and sent over its dense port ``conn``."""

    key: int
    name: str
    lo: int
    hi: int
    shape: Tuple[int, ...]  # of the block
    dtype: str
    pserver: int
    conn: int

    @cached_property  # asked several times per block per step
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize  # Python integers: never wraps

    def meta(self) -> Dict[str, object]:
        return {"name": self.name, "lo": self.lo, "hi": self.hi, "shape": list(self.shape), "dtype": self.dtype}


def split_rows(shape: Sequence[int], dtype: object, max_block_bytes: int = DEFAULT_MAX_BLOCK_BYTES,
               min_block_elems: int = MIN_BLOCK_ELEMS, parts: int = 1) -> List[Tuple[int, int]]:
    """Row ranges of the blocks of a parameter: each at most ``max_block_bytes`` (unless one row is
    bigger) and at least ``min_block_elems`` elements (unless the whole parameter is smaller); their number a
    multiple of ``parts`` where those limits allow, so that ``parts`` pservers can hold equal shares of it."""
    if len(shape) == 0:
        return [(0, 1)]
    rows = int(shape[0])
    if rows == 0:
        return [(0, 0)]
    row_elems = math.prod(int(s) for s in shape[1:])
    row_bytes = max(1, row_elems * np.dtype(dtype).itemsize)
    max_rows = max(1, max_block_bytes // row_bytes)
    n = math.ceil(rows / max_rows)
    min_rows = max(1, math.ceil(min_block_elems / max(1, row_elems)))
    n = -(-n // parts) * parts  # equal shares: a 64 MB parameter on 3 pservers is 18 blocks, not 6 + 5 + 5
    n = max(1, min(n, rows // min_rows))
    return [(i * rows // n, (i + 1) * rows // n) for i in range(n)]


@dataclass(frozen=True)
class Placement:
    """The blocks of a set of dense parameters; ``loads`` are bytes per pserver after placing them."""

    blocks: Tuple[Block, ...]
    loads: Tuple[int, ...]

    def by_name(self) -> Dict[str, List[Block]]:
        out: Dict[str, List[Block]] = {}
        for b in self.blocks:
            out.setdefault(b.name, []).append(b)
        return out


def place_dense(params: Mapping[str, Tuple[Sequence[int], object]], n_pservers: int, conns_per_pserver: int,
                *, max_block_bytes: int = DEFAULT_MAX_BLOCK_BYTES, first_key: int = 0,
                loads: Optional[Sequence[int]] = None) -> Placement:
    """Split ``{name: (shape, dtype)}`` into blocks and place them greedily by bytes.

    Each parameter is split into a multiple of ``n_pservers`` blocks of equal rows where it is big enough
    (``split_rows``), then largest block first onto the least-loaded pserver (ties: lower pserver index), and
    likewise over that pserver's dense connections: every pserver holds its share to within a few rows, so
    with one pserver per node no node's link carries more than its share (docs/benchmarks.md). Keys are
    numbered from ``first_key`` in (sorted name, row) order.
    """
    if n_pservers < 1 or conns_per_pserver < 1:
        raise ValueError("need at least one pserver and one connection per pserver")
    pieces = []
    key = first_key
    for name in sorted(params):
        shape, dtype = params[name]
        shape = tuple(int(s) for s in shape)
        dt = np.dtype(dtype)
        for lo, hi in split_rows(shape, dt, max_block_bytes, parts=n_pservers):
            bshape = (hi - lo,) + shape[1:] if shape else ()
            nbytes = math.prod(bshape) * dt.itemsize
            pieces.append((key, name, lo, hi, bshape, dt.str, nbytes))
            key += 1
    ps_load = list(loads) if loads is not None else [0] * n_pservers
    conn_load = [[0] * conns_per_pserver for _ in range(n_pservers)]
    assigned: Dict[int, Tuple[int, int]] = {}
    for key, _name, _lo, _hi, _bshape, _dt, nbytes in sorted(pieces, key=lambda p: (-p[6], p[1], p[2])):
        k = min(range(n_pservers), key=lambda i: (ps_load[i], i))
        c = min(range(conns_per_pserver), key=lambda i: (conn_load[k][i], i))
        ps_load[k] += nbytes
        conn_load[k][c] += nbytes
        assigned[key] = (k, c)
    blocks = tuple(
        Block(key, name, lo, hi, bshape, np.dtype(dt).name, assigned[key][0], assigned[key][1])
        for key, name, lo, hi, bshape, dt, _n in pieces
    )
    return Placement(blocks, tuple(ps_load))


def shard_of(ids: np.ndarray, n_pservers: int) -> np.ndarray:
    """The pserver that owns each sparse row id (``id % n``, non-negative for negative ids too)."""
    return np.mod(np.asarray(ids, dtype=np.int64), n_pservers)


def sparse_conn(table_key: int, n_sparse_conns: int) -> int:
    """Which of a pserver's sparse connections carries a table's traffic."""
    return table_key % n_sparse_conns


# splitmix64 constants: a well-mixed, counter-based generator, so row ``id`` gets the same values no matter
# which pserver creates it or in which order rows are created.
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


def init_rows(ids: np.ndarray, width: int, scale: float, seed: int, dtype: object = np.float32,
              columns: Optional[Tuple[int, int]] = None) -> np.ndarray:
    """Deterministic initial rows: uniform(-scale, scale), a pure function of (seed, id, column). ``columns``
    (``(lo, hi)``): only those columns, as the whole rows hold them (a row wider than memory allows at once)."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    lo, hi = columns if columns is not None else (0, width)
    with np.errstate(over="ignore"):
        base = _mix(ids.view(np.uint64) * _GOLDEN + _mix(np.array([seed], dtype=np.int64).view(np.uint64)))
        cols = np.arange(lo + 1, hi + 1, dtype=np.uint64) * _GOLDEN
        x = _mix(base[:, None] ^ cols[None, :])
    u = (x >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))
    return ((2.0 * u - 1.0) * scale).astype(dtype)
