"""Server-side optimizers: dense (whole array) and sparse (row-wise, lazy) updates, numpy only.

Formulas (``g`` is the gradient plus ``weight_decay * param`` when weight decay is set, i.e. coupled L2):

* sgd:      ``param -= lr * g``
* momentum: ``v = momentum * v + g; param -= lr * v``
* adagrad:  ``m += g * g; param -= lr * g / (sqrt(m) + eps)``
* adam:     ``t += 1; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
  param -= lr * m_hat / (sqrt(v_hat) + eps)`` with ``m_hat = m / (1-b1^t)``, ``v_hat = v / (1-b2^t)``

Sparse optimizers are lazy: only the rows named in ``idx`` change, and Adam counts steps per row, so a row
seen for the first time gets a full bias correction no matter how old the table is. ``spec.lr`` is read on
every ``apply`` so a server can change the learning rate while running.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Tuple

import numpy as np

OPTIMIZERS = ("sgd", "momentum", "adagrad", "adam")
SPARSE_OPTIMIZERS = ("sgd", "momentum", "adagrad", "adam")


@dataclass
class OptimizerSpec:
    """Which optimizer and its hyper-parameters; JSON-safe through ``to_dict``/``from_dict``."""

    name: str = "sgd"
    lr: float = 0.01
    momentum: float = 0.9
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.name!r}: expected one of {', '.join(OPTIMIZERS)}")
        for f in dataclasses.fields(self):
            if f.name == "name":
                continue
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"optimizer {f.name}={value!r}: expected a finite number")
            setattr(self, f.name, float(value))
        if self.lr < 0 or self.eps < 0 or self.weight_decay < 0:
            raise ValueError("optimizer lr, eps and weight_decay must be >= 0")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1 and 0 <= self.momentum < 1):
            raise ValueError("optimizer beta1, beta2 and momentum must be in [0, 1)")

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> OptimizerSpec:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown optimizer keys {unknown}: expected some of {sorted(known)}")
        return cls(**dict(d))


# -- dense ---------------------------------------------------------------------------------------------


class DenseOptimizer:
    """Updates one dense parameter in place; ``state`` holds everything a checkpoint must save."""

    def __init__(self, spec: OptimizerSpec, param: np.ndarray) -> None:
        self.spec = spec
        self.dtype = param.dtype
        self.shape = param.shape
        self.state: Dict[str, np.ndarray] = {}
        # Scratch buffers reused across calls so a step allocates nothing of the parameter's size.
        self._buf = np.empty(param.shape, dtype=param.dtype)
        self._gbuf = None

    def load_state(self, state: Mapping[str, np.ndarray]) -> None:
        """Copy a checkpointed state into this optimizer (same names and shapes)."""
        if set(state) != set(self.state):
            raise ValueError(f"optimizer state has {sorted(state)}, expected {sorted(self.state)}")
        for k, v in state.items():
            if np.shape(v) != self.state[k].shape:
                want = self.state[k].shape
                raise ValueError(f"optimizer state {k!r} has shape {np.shape(v)}, expected {want}")
            self.state[k][...] = v

    def _grad(self, param: np.ndarray, grad: np.ndarray) -> np.ndarray:
        if param.shape != self.shape or grad.shape != self.shape:
            raise ValueError(f"param {param.shape} / grad {grad.shape} do not match {self.shape}")
        grad = np.asarray(grad, dtype=self.dtype)
        if self.spec.weight_decay == 0:
            return grad
        if self._gbuf is None:
            self._gbuf = np.empty(self.shape, dtype=self.dtype)
        np.multiply(param, self.dtype.type(self.spec.weight_decay), out=self._gbuf)
        self._gbuf += grad
        return self._gbuf

    def apply(self, param: np.ndarray, grad: np.ndarray) -> None:
        raise NotImplementedError


class DenseSGD(DenseOptimizer):
    def apply(self, param: np.ndarray, grad: np.ndarray) -> None:
        g = self._grad(param, grad)
        # Same rounding as ``param -= lr * grad`` (lr cast to the param dtype, one multiply, one subtract).
        np.multiply(g, self.dtype.type(self.spec.lr), out=self._buf)
        param -= self._buf


class DenseMomentum(DenseOptimizer):
    def __init__(self, spec: OptimizerSpec, param: np.ndarray) -> None:
        super().__init__(spec, param)
        self.state["v"] = np.zeros(param.shape, dtype=param.dtype)

    def apply(self, param: np.ndarray, grad: np.ndarray) -> None:
        g = self._grad(param, grad)
        v = self.state["v"]
        v *= self.dtype.type(self.spec.momentum)
        v += g
        np.multiply(v, self.dtype.type(self.spec.lr), out=self._buf)
        param -= self._buf


class DenseAdagrad(DenseOptimizer):
    def __init__(self, spec: OptimizerSpec, param: np.ndarray) -> None:
        super().__init__(spec, param)
        self.state["m"] = np.zeros(param.shape, dtype=param.dtype)

    def apply(self, param: np.ndarray, grad: np.ndarray) -> None:
        g = self._grad(param, grad)
        m, buf = self.state["m"], self._buf
        np.multiply(g, g, out=buf)
        m += buf
        np.sqrt(m, out=buf)
        buf += self.dtype.type(self.spec.eps)
        np.divide(g, buf, out=buf)
        buf *= self.dtype.type(self.spec.lr)
        param -= buf


class DenseAdam(DenseOptimizer):
    def __init__(self, spec: OptimizerSpec, param: np.ndarray) -> None:
        super().__init__(spec, param)
        self.state["m"] = np.zeros(param.shape, dtype=param.dtype)
        self.state["v"] = np.zeros(param.shape, dtype=param.dtype)
        self.state["t"] = np.zeros((1,), dtype=np.int64)

    def apply(self, param: np.ndarray, grad: np.ndarray) -> None:
        g = self._grad(param, grad)
        s, m, v, t = self.spec, self.state["m"], self.state["v"], self.state["t"]
        buf, f = self._buf, self.dtype.type
        t += 1
        step, eps_hat = _adam_scalars(s, float(t[0]))
        m *= f(s.beta1)
        np.multiply(g, f(1.0 - s.beta1), out=buf)
        m += buf
        v *= f(s.beta2)
        np.multiply(g, g, out=buf)
        buf *= f(1.0 - s.beta2)
        v += buf
        np.sqrt(v, out=buf)
        buf += f(eps_hat)
        np.divide(m, buf, out=buf)
        buf *= f(step)
        param -= buf


def _adam_scalars(s: OptimizerSpec, t: Any) -> Tuple[Any, Any]:
    """Bias correction folded into the step size: m_hat/(sqrt(v_hat)+eps) == step * m/(sqrt(v)+eps_hat)."""
    bc1 = 1.0 - np.power(s.beta1, t)
    root_bc2 = np.sqrt(1.0 - np.power(s.beta2, t))
    return s.lr * root_bc2 / bc1, s.eps * root_bc2


_DENSE = {"sgd": DenseSGD, "momentum": DenseMomentum, "adagrad": DenseAdagrad, "adam": DenseAdam}


def make_dense(spec: OptimizerSpec, param: np.ndarray) -> DenseOptimizer:
    """The dense optimizer ``spec`` names, with zeroed state shaped like ``param``."""
    return _DENSE[spec.name](spec, param)


# -- sparse --------------------------------------------------------------------------------------------


class SparseOptimizer:
    """Row-wise (lazy) table update; per-row state lives in caller-owned arrays described by row_slots."""

    row_slots: Dict[str, Tuple[Tuple[int, ...], np.dtype]]

    def __init__(self, spec: OptimizerSpec, width: int, dtype: Any = np.float32) -> None:
        self.spec = spec
        self.width = int(width)
        self.dtype = np.dtype(dtype)
        self.row_slots = {}

    def new_state(self, capacity: int) -> Dict[str, np.ndarray]:
        """Zeroed per-row state for a table of ``capacity`` rows (a convenience for callers and tests)."""
        return {k: np.zeros((capacity, *suffix), dtype=dt) for k, (suffix, dt) in self.row_slots.items()}

    def _check(self, table: np.ndarray, idx: np.ndarray, grad: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        idx = np.asarray(idx, dtype=np.int64).reshape(-1)
        grad = np.asarray(grad, dtype=self.dtype)
        if table.ndim != 2 or table.shape[1] != self.width:
            raise ValueError(f"table shape {table.shape} does not have width {self.width}")
        if grad.shape != (idx.shape[0], self.width):
            raise ValueError(f"grad shape {grad.shape}, expected {(idx.shape[0], self.width)}")
        if len(idx):
            # Negative positions would wrap around and duplicates would drop updates, both silently.
            if idx.min() < 0 or idx.max() >= table.shape[0]:
                raise ValueError(f"row positions must be in [0, {table.shape[0]})")
            if len(idx) > 1 and len(np.unique(idx)) != len(idx):
                raise ValueError("row positions must be unique (sum duplicate rows' gradients first)")
        return idx, grad

    def _grad(self, rows: np.ndarray, grad: np.ndarray) -> np.ndarray:
        if self.spec.weight_decay == 0:
            return grad
        return grad + self.dtype.type(self.spec.weight_decay) * rows

    def apply(
        self, table: np.ndarray, state: Dict[str, np.ndarray], idx: np.ndarray, grad: np.ndarray
    ) -> None:
        """Update ``table[idx]`` and its state rows; ``idx`` must be unique, in-range row positions."""
        raise NotImplementedError


class SparseSGD(SparseOptimizer):
    def apply(self, table, state, idx, grad) -> None:
        idx, grad = self._check(table, idx, grad)
        if len(idx) == 0:
            return
        rows = table[idx]
        g = self._grad(rows, grad)
        # Same rounding as the dense SGD on the same rows.
        rows -= self.dtype.type(self.spec.lr) * g
        table[idx] = rows


class SparseMomentum(SparseOptimizer):
    def __init__(self, spec: OptimizerSpec, width: int, dtype: Any = np.float32) -> None:
        super().__init__(spec, width, dtype)
        self.row_slots = {"v": ((self.width,), self.dtype)}

    def apply(self, table, state, idx, grad) -> None:
        idx, grad = self._check(table, idx, grad)
        if len(idx) == 0:
            return
        f = self.dtype.type
        rows = table[idx]
        g = self._grad(rows, grad)
        v = state["v"][idx]
        v *= f(self.spec.momentum)
        v += g
        state["v"][idx] = v
        rows -= f(self.spec.lr) * v
        table[idx] = rows


class SparseAdagrad(SparseOptimizer):
    def __init__(self, spec: OptimizerSpec, width: int, dtype: Any = np.float32) -> None:
        super().__init__(spec, width, dtype)
        self.row_slots = {"m": ((self.width,), self.dtype)}

    def apply(self, table, state, idx, grad) -> None:
        idx, grad = self._check(table, idx, grad)
        if len(idx) == 0:
            return
        f = self.dtype.type
        rows = table[idx]
        g = self._grad(rows, grad)
        m = state["m"][idx]
        m += g * g
        state["m"][idx] = m
        denom = np.sqrt(m)
        denom += f(self.spec.eps)
        np.divide(g, denom, out=denom)
        denom *= f(self.spec.lr)
        rows -= denom
        table[idx] = rows


class SparseAdam(SparseOptimizer):
    def __init__(self, spec: OptimizerSpec, width: int, dtype: Any = np.float32) -> None:
        super().__init__(spec, width, dtype)
        self.row_slots = {
            "m": ((self.width,), self.dtype),
            "v": ((self.width,), self.dtype),
            "t": ((), np.dtype(np.int64)),
        }

    def apply(self, table, state, idx, grad) -> None:
        idx, grad = self._check(table, idx, grad)
        if len(idx) == 0:
            return
        s, f = self.spec, self.dtype.type
        rows = table[idx]
        g = self._grad(rows, grad)
        t = state["t"][idx] + 1
        state["t"][idx] = t
        # Per-row bias correction from each row's own step count, computed in float64 like the dense path.
        step, eps_hat = _adam_scalars(s, t.astype(np.float64))
        m = state["m"][idx]
        m *= f(s.beta1)
        m += f(1.0 - s.beta1) * g
        state["m"][idx] = m
        v = state["v"][idx]
        v *= f(s.beta2)
        v += f(1.0 - s.beta2) * (g * g)
        state["v"][idx] = v
        denom = np.sqrt(v)
        denom += eps_hat.astype(self.dtype)[:, None]
        np.divide(m, denom, out=denom)
        denom *= step.astype(self.dtype)[:, None]
        rows -= denom
        table[idx] = rows


_SPARSE = {"sgd": SparseSGD, "momentum": SparseMomentum, "adagrad": SparseAdagrad, "adam": SparseAdam}


def make_sparse(spec: OptimizerSpec, width: int, dtype: Any = np.float32) -> SparseOptimizer:
    """The row-wise optimizer ``spec`` names for a table of rows of ``width`` values."""
    if spec.name not in _SPARSE:
        raise ValueError(f"optimizer {spec.name!r} has no sparse form: expected one of {', '.join(_SPARSE)}")
    return _SPARSE[spec.name](spec, width, dtype)
