"""Refusing NaN and Inf gradients: one bad trainer's push would otherwise reach every trainer's parameters."""

from __future__ import annotations

from typing import Iterable, Mapping, Optional

import numpy as np

from ..errors import NonFinite

_BLAS = (np.dtype(np.float32), np.dtype(np.float64))


def all_finite(a: np.ndarray) -> bool:
    """Does ``a`` hold no NaN or Inf? One BLAS dot of ``a`` with itself (NaN and Inf propagate into it) costs
    about half an ``isfinite`` pass; a dot that overflows on finite values is settled by that exact pass."""
    if a.dtype.kind != "f" or a.size == 0:
        return True
    flat = a.reshape(-1)
    with np.errstate(all="ignore"):
        if a.dtype in _BLAS and np.isfinite(np.dot(flat, flat)):
            return True
        return bool(np.isfinite(flat).all())


def trainers(ids: Iterable[int]) -> str:
    """``trainer 1`` / ``trainers 0, 1``: whose gradients an update summed, for a message."""
    ids = sorted(ids)
    return f"trainer {ids[0]}" if len(ids) == 1 else "trainers " + ", ".join(map(str, ids))


def updated(a: np.ndarray, what: str, by: str, step: int) -> None:
    """Raise ``NonFinite`` unless ``a``, the values an update of ``what`` (the parameter) at ``step`` made from
    ``by``'s gradients ("trainer 1", "trainers 0, 1"), is finite: finite gradients can still overflow it."""
    if not all_finite(a):
        raise update_refused(what, by, step)


def update_refused(what: str, by: str, step: int) -> NonFinite:
    """What ``updated`` raises (a caller checking ``all_finite`` itself builds the message only on failure)."""
    return NonFinite(f"the update of {what} at step {step} from {by}'s gradient would make it hold NaN or Inf "
                     "(finite values overflowed: lower the learning rate, clip the gradients); refused "
                     "(PADDLE_ALLOW_NONFINITE=1 accepts it)")


def check(a: np.ndarray, what: str, trainer: int, step: int) -> None:
    """Raise ``NonFinite`` naming ``what`` (the parameter) and the trainer unless ``a`` is finite."""
    if not all_finite(a):
        raise push_refused(what, trainer, step)


def push_refused(what: str, trainer: int, step: int) -> NonFinite:
    """What ``check`` raises."""
    return NonFinite(f"trainer {trainer} pushed a gradient of {what} holding NaN or Inf at step {step}; refused "
                     "so it cannot reach the other trainers' parameters (look for a diverging loss or bad input "
                     "in that trainer; PADDLE_ALLOW_NONFINITE=1 accepts such gradients)")


def bad_state(state: Mapping[str, np.ndarray]) -> Optional[str]:
    """The first optimizer state slot (Adam's ``m``/``v``, Adagrad's accumulator, momentum's ``v``) holding NaN
    or Inf; None when all are finite."""
    for k, a in state.items():
        if not all_finite(a):
            return k
    return None


def state_refused(what: str, slot: str, optimizer: str, by: str, step: int) -> NonFinite:
    """An update of ``what`` that would make its optimizer state ``slot`` NaN or Inf: its parameter would then
    never move again (Adam's ``v`` at Inf makes every step 0), silently, and checkpoints would hold it."""
    return NonFinite(f"the update of {what} at step {step} from {by}'s gradient would make its {optimizer} state "
                     f"{slot!r} hold NaN or Inf (finite gradients overflowed it: clip the gradients, lower their "
                     "scale); refused (PADDLE_ALLOW_NONFINITE=1 accepts it)")
