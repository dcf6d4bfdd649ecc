"""``fluid.initializer``: how a parameter's first value is drawn (deterministically: see ``Parameter.seed``).

A sparse table is initialised on the pservers, row by row, uniformly in (-scale, scale): ``sparse_scale`` gives
that scale -- a uniform initializer's own, or for a normal one the uniform scale with the same standard deviation.
"""

from __future__ import annotations

import math
from typing import Any, Tuple

import numpy as np

from ...missing import NotInCompat, Strict, module_getattr

__all__ = ["Constant", "ConstantInitializer", "Normal", "NormalInitializer", "Uniform", "UniformInitializer",
           "Xavier", "XavierInitializer"]
__getattr__ = module_getattr(__name__, "paddle.fluid.initializer")


class Initializer(Strict):
    _paddle_name = "paddle.fluid.initializer.Initializer"
    seed = 0

    def value(self, shape: Tuple[int, ...], dtype: Any, seed: int) -> np.ndarray:
        raise NotImplementedError

    def sparse_scale(self, shape: Tuple[int, ...]) -> float:
        raise NotImplementedError

    def _rng(self, seed: int) -> np.random.Generator:
        return np.random.default_rng(self.seed or seed)


class Constant(Initializer):
    def __init__(self, value: float = 0.0, force_cpu: bool = False) -> None:
        self.constant = float(value)

    def value(self, shape: Tuple[int, ...], dtype: Any, seed: int) -> np.ndarray:
        return np.full(shape, self.constant, dtype=dtype)

    def sparse_scale(self, shape: Tuple[int, ...]) -> float:
        if self.constant != 0.0:
            raise NotInCompat(f"fluid.initializer.Constant({self.constant}) for a sparse table",
                              "its rows start uniform on the pservers; use Constant(0.0) or Uniform(-s, s)")
        return 0.0


class Uniform(Initializer):
    def __init__(self, low: float = -1.0, high: float = 1.0, seed: int = 0) -> None:
        self.low, self.high, self.seed = float(low), float(high), int(seed)

    def value(self, shape: Tuple[int, ...], dtype: Any, seed: int) -> np.ndarray:
        return self._rng(seed).uniform(self.low, self.high, size=shape).astype(dtype)

    def sparse_scale(self, shape: Tuple[int, ...]) -> float:
        if self.low != -self.high:
            raise NotInCompat(f"fluid.initializer.Uniform({self.low}, {self.high}) for a sparse table",
                              "pserver rows are drawn from a range symmetric around 0")
        return self.high


class Normal(Initializer):
    def __init__(self, loc: float = 0.0, scale: float = 1.0, seed: int = 0) -> None:
        self.loc, self.scale, self.seed = float(loc), float(scale), int(seed)

    def value(self, shape: Tuple[int, ...], dtype: Any, seed: int) -> np.ndarray:
        return self._rng(seed).normal(self.loc, self.scale, size=shape).astype(dtype)

    def sparse_scale(self, shape: Tuple[int, ...]) -> float:
        if self.loc != 0.0:
            raise NotInCompat(f"fluid.initializer.Normal(loc={self.loc}) for a sparse table",
                              "pserver rows are drawn around 0")
        return self.scale * math.sqrt(3.0)


def _fans(shape: Tuple[int, ...]) -> Tuple[int, int]:
    if len(shape) == 1:
        return shape[0], shape[0]
    receptive = int(np.prod(shape[2:])) if len(shape) > 2 else 1
    return shape[0] * receptive, shape[1] * receptive


class Xavier(Initializer):
    """Glorot: uniform in +-sqrt(6 / (fan_in + fan_out)), or normal with std sqrt(2 / (fan_in + fan_out))."""

    def __init__(self, uniform: bool = True, fan_in: Any = None, fan_out: Any = None, seed: int = 0) -> None:
        self.uniform, self.fan_in, self.fan_out, self.seed = uniform, fan_in, fan_out, int(seed)

    def _limit(self, shape: Tuple[int, ...]) -> float:
        fi, fo = _fans(shape)
        fi = fi if self.fan_in is None else self.fan_in
        fo = fo if self.fan_out is None else self.fan_out
        return math.sqrt((6.0 if self.uniform else 2.0) / (fi + fo))

    def value(self, shape: Tuple[int, ...], dtype: Any, seed: int) -> np.ndarray:
        limit, rng = self._limit(shape), self._rng(seed)
        if self.uniform:
            return rng.uniform(-limit, limit, size=shape).astype(dtype)
        return rng.normal(0.0, limit, size=shape).astype(dtype)

    def sparse_scale(self, shape: Tuple[int, ...]) -> float:
        return self._limit(shape) * (1.0 if self.uniform else math.sqrt(3.0))


ConstantInitializer, UniformInitializer, NormalInitializer, XavierInitializer = Constant, Uniform, Normal, Xavier
