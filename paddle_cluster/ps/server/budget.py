"""What a pserver may hold: one memory budget for its dense blocks, table rows and buffers together, charged
before anything is allocated, so a request that would go past it is refused (``LimitExceeded``) instead of
the pserver running out of memory.

The default is a share of the node's memory: ``DEFAULT_FRACTION`` of the smaller of ``MemTotal`` and the
cgroup's limit, divided among the job's pservers on that node. The rest is left for the trainers, the
transient copy a checkpoint makes and the interpreter itself. What is charged and what is not, row by row:
docs/reliability.md, *What is bounded, by what figure*.

Temporaries a request makes the pserver allocate while it is served are charged too, or made in bounded pieces:

* charged while the request holds them: a sparse request's ids and rows (``table.TableShard.pull``/``push``), its
  lookup's positions (8 bytes per id) and scratch (``ID_SCRATCH`` per id of a ``LOOKUP_IDS`` chunk), the id
  index's copy while new ids are inserted (``INSERT_SCRATCH`` per row), a table's old and new arrays while it
  grows, a page of ``ROWS_SPARSE``, a JSON body (``declare.JSON_HELD`` per byte), a ``STATUS`` reply;
* in bounded pieces, not charged: new rows initialised ``INIT_CHUNK`` elements at a time (columns of one row at
  a time for a wider row); a sync sparse step's mean merged and applied ``APPLY_BYTES`` of rows at a time, and
  any sparse update applied so (the optimizer's copies of the rows, their state and its scratch); dense sync
  SGD folded in 1 MiB segments (``dense.POOL_BYTES`` of them); a refused payload read 16 KiB at a time.
"""

from __future__ import annotations

import threading
from typing import Optional

from ..errors import LimitExceeded

DEFAULT_FRACTION = 0.5
SHARD_OVERHEAD = 8192  # what a block or table costs besides its arrays and name (locks, conditions, bookkeeping:
#                        6-7.5 KiB measured with tracemalloc, a 1 KiB name included)
CONN_OVERHEAD = 64 << 10  # an authenticated connection besides its buffers: its thread, stream and small scratch
_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def human(n: int) -> str:
    """``n`` bytes for a message: ``1.5 GiB``, ``640 KiB``, ``12 B``."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.4g} {unit}"
    return f"{n} B"


def machine_memory() -> Optional[int]:
    """The memory this process may use: MemTotal, or the cgroup's limit when lower; None if unknown."""
    total = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    total = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    for path in _CGROUP_LIMITS:
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) > 0:  # "max" or a huge v1 number: no limit below MemTotal
            total = int(text) if total is None else min(total, int(text))
    return total


def default_limit(pservers_on_node: int) -> int:
    """This pserver's share of the node: ``DEFAULT_FRACTION`` of its memory over the pservers on it (1 GiB
    when the memory cannot be read)."""
    mem = machine_memory() or (2 << 30)
    return int(mem * DEFAULT_FRACTION) // max(1, pservers_on_node)


class Budget:
    """Bytes charged against a limit; ``charge`` refuses, naming what asked, the pserver and the limit."""

    def __init__(self, limit: int, pserver_id: int, source: str) -> None:
        self.limit = int(limit)
        self.pserver_id = pserver_id
        self.source = source  # where the limit came from, for the message
        self.used = 0
        self._lock = threading.Lock()

    def charge(self, nbytes: int, what: str) -> None:
        """Reserve ``nbytes`` for ``what`` (a Python integer: never wraps) or raise ``LimitExceeded``."""
        nbytes = int(nbytes)
        with self._lock:
            if self.used + nbytes > self.limit:
                raise LimitExceeded(
                    f"pserver {self.pserver_id}: {what} needs {human(nbytes)} but {human(self.used)} of its "
                    f"{human(self.limit)} memory budget ({self.source}) is in use; declare smaller tables or "
                    "blocks, use more pservers, or raise PADDLE_PSERVER_MEMORY")
            self.used += nbytes

    def release(self, nbytes: int) -> None:
        with self._lock:
            self.used = max(0, self.used - int(nbytes))
