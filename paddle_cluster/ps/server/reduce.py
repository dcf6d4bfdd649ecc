"""``REDUCE``: the trainers' sum of a few numbers (a loss to average, BatchNorm statistics to share), on pserver 0.

Every active trainer sends its numbers for round ``seq`` (its own count of calls: each trainer makes the same
calls in the same order, as with any collective); the reply, once every active trainer has sent (a closed one
stops counting), is their sum in trainer order and how many trainers it holds. Values travel as ``float.hex``
strings, so NaN and Inf (a diverged loss) arrive as they were and every trainer gets the same bits. A round is
forgotten once every trainer in it has had its answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Set

from ..errors import ConfigMismatch, LimitExceeded
from ..wire import protocol as P
from .declare import json_body
from .net import Conn
from .state import State

HELD_PER_VALUE = 80  # bytes a waiting value holds (its float, its list slot, its share of the round)


@dataclass
class Round:
    """One call's parts, by trainer; ``answered``: trainers whose request has ended."""

    width: int
    parts: Dict[int, List[float]] = field(default_factory=dict)
    answered: Set[int] = field(default_factory=set)
    held: int = 0  # bytes charged to the budget for the parts


def _values(body: dict, trainer: int) -> List[float]:
    raw = body.get("values")
    if not isinstance(raw, list) or not all(isinstance(v, str) for v in raw):
        raise ConfigMismatch(f"trainer {trainer}: REDUCE needs 'values', a list of float.hex strings")
    try:
        return [float.fromhex(v) for v in raw]
    except ValueError as e:
        raise ConfigMismatch(f"trainer {trainer}: REDUCE value: {e}") from None


def reduce_op(st: State, conn: Conn, h: P.Header) -> None:
    with json_body(st, conn, h, "REDUCE", P.MAX_JSON_BYTES) as b:
        values, seq = _values(b, conn.trainer), int(b.get("seq", -1))
    if len(values) > P.REDUCE_MAX_VALUES:
        raise LimitExceeded(f"trainer {conn.trainer}: REDUCE of {len(values)} values; at most "
                            f"{P.REDUCE_MAX_VALUES} per call")
    if st.pserver_id != 0:
        raise ConfigMismatch(f"REDUCE goes to pserver 0, not pserver {st.pserver_id}")
    held = HELD_PER_VALUE * len(values)
    st.budget.charge(held, f"trainer {conn.trainer}'s {len(values)} values to sum with the other trainers'")
    sync = st.sync
    with sync.lock:
        r = st.rounds.setdefault(seq, Round(len(values)))
        if len(values) != r.width or conn.trainer in r.parts:
            st.budget.release(held)
            raise ConfigMismatch(f"trainer {conn.trainer} sums {len(values)} values in call {seq}, other trainers "
                                 f"{r.width}: every trainer averages the same things in the same order"
                                 if len(values) != r.width else f"trainer {conn.trainer} sent call {seq} twice")
        r.parts[conn.trainer] = values
        r.held += held  # held by the round until its last answer: the parts stay that long
        sync.lock.notify_all()
        try:
            sync.wait(sync.lock, lambda: sync.active <= r.parts.keys(), seq, f"averaging, call {seq}",
                      lambda: sync.active - r.parts.keys(), lambda: conn.gone)
            total = [0.0] * r.width
            for t in sorted(r.parts):
                total = [a + v for a, v in zip(total, r.parts[t])]
            n = len(r.parts)
        finally:
            r.answered.add(conn.trainer)
            if r.answered >= r.parts.keys():
                del st.rounds[seq]
                st.budget.release(r.held)
    conn.reply_ok({"sum": [v.hex() for v in total], "n": n})
