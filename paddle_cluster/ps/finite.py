"""Refusing NaN and Inf gradients: one bad trainer's push would otherwise reach every trainer's parameters."""

from __future__ import annotations

import numpy as np

from .errors import NonFinite

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


def check(a: np.ndarray, what: str, trainer: int, step: int) -> None:
    """Raise ``NonFinite`` naming ``what`` (the parameter) and the trainer unless ``a`` is finite."""
    if not all_finite(a):
        raise NonFinite(f"trainer {trainer} pushed a gradient of {what} holding NaN or Inf at step {step}; refused "
                        "so it cannot reach the other trainers' parameters (look for a diverging loss or bad input "
                        "in that trainer; PADDLE_ALLOW_NONFINITE=1 accepts such gradients)")
