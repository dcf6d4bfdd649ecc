"""Server-side optimizers: dense (whole array) and sparse (row-wise, lazy) updates, numpy only.

Formulas, those of ``torch.optim`` and ``paddle.optimizer`` (``g`` is the gradient plus ``weight_decay *
param`` when weight decay is set, i.e. coupled L2, except for adamw):

* sgd:      ``param -= lr * g``
* momentum: ``v = momentum * v + (1 - dampening) * g`` (the first step ``v = g``, undampened, as torch);
  ``param -= lr * (g + momentum * v)`` with ``nesterov``, else ``param -= lr * v``
* adagrad:  ``m += g * g; param -= lr / (1 + (t-1) * lr_decay) * g / (sqrt(m) + eps)``, ``m`` starting at
  ``initial_accumulator_value``
* adam:     ``t += 1; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
  param -= lr * m_hat / (sqrt(v_hat) + eps)`` with ``m_hat = m / (1-b1^t)``, ``v_hat = v / (1-b2^t)``;
  with ``amsgrad`` ``v_hat`` is that of ``vmax = max(vmax, v)``
* adamw:    ``param *= 1 - lr * weight_decay`` (decoupled), then adam's step without coupled decay

Each optimizer is ONE update function (``UPDATES``) over a parameter, its gradient and its state slots
(``slots(spec)``: which ones depends on the options, so a job without dampening, lr_decay or amsgrad keeps
exactly the state it always had); the dense form applies it to a whole array, the sparse form to the rows named
in ``idx`` (gathered, updated, scattered back), so both round exactly alike. Sparse optimizers are lazy: only
those rows change, and every step count (adam's bias correction, adagrad's lr_decay, momentum's first step) is
kept per row, so a row seen for the first time is treated as at step 1 no matter how old the table is.
``spec.lr`` is read on every ``apply`` so a server can change the learning rate while running.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import numpy as np

OPTIMIZERS = ("sgd", "momentum", "adagrad", "adam", "adamw")
# Options that fix which state an optimizer keeps, or how it starts: set once, never by ``set_hyper``.
STRUCTURAL = frozenset({"name", "dampening", "nesterov", "lr_decay", "initial_accumulator_value", "amsgrad"})
_FLAGS = ("nesterov", "amsgrad")


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
    dampening: float = 0.0
    nesterov: bool = False
    lr_decay: float = 0.0
    initial_accumulator_value: float = 0.0
    amsgrad: bool = False

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.name!r}: expected one of {', '.join(OPTIMIZERS)}")
        for f in dataclasses.fields(self):
            if f.name == "name":
                continue
            value = getattr(self, f.name)
            if f.name in _FLAGS:
                if not isinstance(value, bool):
                    raise ValueError(f"optimizer {f.name}={value!r}: expected true or false")
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"optimizer {f.name}={value!r}: expected a finite number")
            setattr(self, f.name, float(value))
        if min(self.lr, self.eps, self.weight_decay, self.lr_decay, self.initial_accumulator_value) < 0:
            raise ValueError("optimizer lr, eps, weight_decay, lr_decay and initial_accumulator_value must be >= 0")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1 and 0 <= self.momentum < 1):
            raise ValueError("optimizer beta1, beta2 and momentum must be in [0, 1)")
        if not 0 <= self.dampening <= 1:
            raise ValueError(f"optimizer dampening={self.dampening}: expected a number in [0, 1]")
        if self.nesterov and self.name == "momentum" and (self.momentum == 0 or self.dampening != 0):
            raise ValueError("optimizer nesterov=true needs momentum > 0 and dampening = 0")

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> OptimizerSpec:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown optimizer keys {unknown}: expected some of {sorted(known)}")
        return cls(**dict(d))


# -- one update per optimizer ------------------------------------------------------------------------
# Optimizer passes run over chunks of this many bytes of float32, so a chunk is still in cache for the next pass.
# One fold segment (1 MiB): each numpy call costs a few microseconds and a GIL hand-off whatever its size, and
# 256 KiB chunks measured 1.2-1.4x slower per segment than one 1 MiB pass on a 2-core EPYC (1 MiB L2 each).
CHUNK_ELEMS = (1 << 20) // 4


def sgd(param: np.ndarray, grad: np.ndarray, lr: float, *, out: Optional[np.ndarray] = None,
        plus: Optional[np.ndarray] = None, n: int = 1) -> None:
    """``param -= lr * (grad + plus) / n`` in one pass per cache-sized chunk.

    ``out`` (shaped like ``param``) takes the intermediate step; by default ``grad`` does, i.e. it is
    overwritten. ``plus`` adds one more gradient in the same pass and ``n`` averages the sum, so the last of
    several contributions is summed, averaged and applied while each chunk is in cache. Rounding is that
    of ``param -= lr * g`` with ``g = (grad + plus) / n``, whatever the chunking."""
    out = grad if out is None else out
    if param.size <= CHUNK_ELEMS:  # one chunk (a fold segment): one pass, whatever the layout
        _sgd_pass(param, grad, out, plus, lr, n)
        return
    if not (param.flags.c_contiguous and grad.flags.c_contiguous and out.flags.c_contiguous
            and (plus is None or plus.flags.c_contiguous)):
        _sgd_pass(param, grad, out, plus, lr, n)  # a strided view: flattening would copy and lose the update
        return
    pf, gf, of = param.reshape(-1), grad.reshape(-1), out.reshape(-1)
    xf = None if plus is None else plus.reshape(-1)
    for lo in range(0, pf.size, CHUNK_ELEMS):
        hi = lo + CHUNK_ELEMS
        _sgd_pass(pf[lo:hi], gf[lo:hi], of[lo:hi], None if xf is None else xf[lo:hi], lr, n)


def _sgd_pass(p: np.ndarray, g: np.ndarray, c: np.ndarray, x: Optional[np.ndarray], lr: float, n: int) -> None:
    f = p.dtype.type
    if x is not None:
        np.add(g, x, out=c)
        g = c
    if n > 1:
        np.divide(g, f(n), out=c)
        g = c
    np.multiply(g, f(lr), out=c)
    p -= c


def _sgd(s: OptimizerSpec, p: np.ndarray, g: np.ndarray, st: Dict[str, np.ndarray], buf: np.ndarray,
         t: Any) -> None:
    sgd(p, g, s.lr, out=buf)


def _momentum(s: OptimizerSpec, p: np.ndarray, g: np.ndarray, st: Dict[str, np.ndarray], buf: np.ndarray,
              t: Any) -> None:
    """``t`` (counted only with dampening): the step count, scalar or one per row; at 1, ``v = g`` undampened."""
    f, v = p.dtype.type, st["v"]
    v *= f(s.momentum)
    if s.dampening:
        np.multiply(g, f(1.0 - s.dampening), out=buf)
        first = np.asarray(t == 1.0)
        if first.ndim:  # rows seen for the first time
            rows = first[:, 0]
            buf[rows] = g[rows]
        elif first:
            buf[...] = g
        v += buf
    else:
        v += g
    if s.nesterov:
        np.multiply(v, f(s.momentum), out=buf)
        buf += g
        buf *= f(s.lr)
    else:
        np.multiply(v, f(s.lr), out=buf)
    p -= buf


def _adagrad(s: OptimizerSpec, p: np.ndarray, g: np.ndarray, st: Dict[str, np.ndarray], buf: np.ndarray,
             t: Any) -> None:
    """``t`` (counted only with lr_decay): the step count, scalar or one per row."""
    f, m = p.dtype.type, st["m"]
    np.multiply(g, g, out=buf)
    m += buf
    np.sqrt(m, out=buf)
    buf += f(s.eps)
    np.divide(g, buf, out=buf)
    if s.lr_decay:
        buf *= np.asarray(s.lr / (1.0 + (t - 1.0) * s.lr_decay)).astype(p.dtype)
    else:
        buf *= f(s.lr)
    p -= buf


def _adam(s: OptimizerSpec, p: np.ndarray, g: np.ndarray, st: Dict[str, np.ndarray], buf: np.ndarray,
          t: Any) -> None:
    """``t``: the step count, a float (dense) or one per row as a float64 column (sparse). adamw decays
    ``p`` first, decoupled from the gradient."""
    f, m, v = p.dtype.type, st["m"], st["v"]
    step, eps_hat = _adam_scalars(s, t)
    step, eps_hat = np.asarray(step).astype(p.dtype), np.asarray(eps_hat).astype(p.dtype)
    if s.name == "adamw" and s.weight_decay:
        p *= f(1.0 - s.lr * s.weight_decay)
    m *= f(s.beta1)
    np.multiply(g, f(1.0 - s.beta1), out=buf)
    m += buf
    v *= f(s.beta2)
    np.multiply(g, g, out=buf)
    buf *= f(1.0 - s.beta2)
    v += buf
    if s.amsgrad:
        np.maximum(st["vmax"], v, out=st["vmax"])
        v = st["vmax"]
    np.sqrt(v, out=buf)
    buf += eps_hat
    np.divide(m, buf, out=buf)
    buf *= step
    p -= buf


def _adam_scalars(s: OptimizerSpec, t: Any) -> Tuple[Any, Any]:
    """Bias correction folded into the step size: m_hat/(sqrt(v_hat)+eps) == step * m/(sqrt(v)+eps_hat)."""
    bc1 = 1.0 - np.power(s.beta1, t)
    root_bc2 = np.sqrt(1.0 - np.power(s.beta2, t))
    return s.lr * root_bc2 / bc1, s.eps * root_bc2


Update = Callable[[OptimizerSpec, np.ndarray, np.ndarray, Dict[str, np.ndarray], np.ndarray, Any], None]
UPDATES: Dict[str, Update] = {"sgd": _sgd, "momentum": _momentum, "adagrad": _adagrad, "adam": _adam, "adamw": _adam}


def slots(spec: OptimizerSpec) -> Tuple[Tuple[str, ...], bool]:
    """The state slots shaped like the parameter that ``spec`` keeps, and whether it counts steps (slot "t")."""
    if spec.name == "momentum":
        return ("v",), bool(spec.dampening)
    if spec.name == "adagrad":
        return ("m",), bool(spec.lr_decay)
    if spec.name in ("adam", "adamw"):
        return ("m", "v") + (("vmax",) if spec.amsgrad else ()), True
    return (), False


def coupled_decay(spec: OptimizerSpec) -> bool:
    """Whether ``weight_decay * param`` is added to the gradient (L2); adamw decays the parameter instead."""
    return bool(spec.weight_decay) and spec.name != "adamw"


def _initial(spec: OptimizerSpec, slot: str) -> float:
    return spec.initial_accumulator_value if slot == "m" and spec.name == "adagrad" else 0.0


# -- dense ---------------------------------------------------------------------------------------------


class DenseOptimizer:
    """Updates one dense parameter in place; ``state`` holds everything a checkpoint must save."""

    def __init__(self, spec: OptimizerSpec, param: np.ndarray) -> None:
        self.spec = spec
        self.dtype = param.dtype
        self.shape = param.shape
        self._update = UPDATES[spec.name]
        names, counts = slots(spec)
        self.state: Dict[str, np.ndarray] = {k: np.full(param.shape, _initial(spec, k), dtype=param.dtype)
                                             for k in names}
        if counts:
            self.state["t"] = np.zeros((1,), dtype=np.int64)
        # Scratch buffers reused across calls so a step allocates nothing of the parameter's size.
        self._buf = np.empty(param.shape, dtype=param.dtype)
        self._gbuf: Optional[np.ndarray] = None

    def load_state(self, state: Mapping[str, np.ndarray]) -> None:
        """Copy a checkpointed state into this optimizer (same names and shapes)."""
        if set(state) != set(self.state):
            raise ValueError(f"optimizer state has {sorted(state)}, expected {sorted(self.state)}")
        for k, v in state.items():
            if np.shape(v) != self.state[k].shape:
                want = self.state[k].shape
                raise ValueError(f"optimizer state {k!r} has shape {np.shape(v)}, expected {want}")
            self.state[k][...] = v

    def apply(self, param: np.ndarray, grad: np.ndarray) -> None:
        if param.shape != self.shape or grad.shape != self.shape:
            raise ValueError(f"param {param.shape} / grad {grad.shape} do not match {self.shape}")
        g = np.asarray(grad, dtype=self.dtype)
        if coupled_decay(self.spec):
            if self._gbuf is None:
                self._gbuf = np.empty(self.shape, dtype=self.dtype)
            np.multiply(param, self.dtype.type(self.spec.weight_decay), out=self._gbuf)
            self._gbuf += g
            g = self._gbuf
        t = None
        if "t" in self.state:
            self.state["t"] += 1
            t = float(self.state["t"][0])
        self._update(self.spec, param, g, self.state, self._buf, t)


# -- sparse --------------------------------------------------------------------------------------------


class SparseOptimizer:
    """Row-wise (lazy) table update; per-row state lives in caller-owned arrays described by row_slots."""

    def __init__(self, spec: OptimizerSpec, width: int, dtype: Any = np.float32) -> None:
        self.spec = spec
        self.width = int(width)
        self.dtype = np.dtype(dtype)
        self._update = UPDATES[spec.name]
        names, counts = slots(spec)
        self.row_slots: Dict[str, Tuple[Tuple[int, ...], np.dtype]] = {k: ((self.width,), self.dtype) for k in names}
        if counts:
            self.row_slots["t"] = ((), np.dtype(np.int64))

    def new_state(self, capacity: int) -> Dict[str, np.ndarray]:
        """Fresh per-row state for a table of ``capacity`` rows (zero, adagrad's accumulator at its initial value)."""
        return {k: np.full((capacity, *suffix), _initial(self.spec, k), dtype=dt)
                for k, (suffix, dt) in self.row_slots.items()}

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

    def apply(self, table: np.ndarray, state: Dict[str, np.ndarray], idx: np.ndarray, grad: np.ndarray,
              check: Optional[Callable[[np.ndarray], None]] = None,
              check_state: Optional[Callable[[Dict[str, np.ndarray]], None]] = None) -> None:
        """Update ``table[idx]`` and its state rows; ``idx`` must be unique, in-range row positions. ``check``
        sees the updated rows, ``check_state`` their updated state slots, before anything is written back; either
        may refuse them by raising."""
        idx, grad = self._check(table, idx, grad)
        if len(idx) == 0:
            return
        rows = table[idx]
        g = grad + self.dtype.type(self.spec.weight_decay) * rows if coupled_decay(self.spec) else grad
        st = {k: state[k][idx] for k in self.row_slots}
        t = None
        if "t" in st:
            st["t"] += 1
            t = st["t"].astype(np.float64)[:, None]  # each row's own step count, in float64 like the dense path
        self._update(self.spec, rows, g, st, np.empty_like(rows), t)
        if check is not None:
            check(rows)
        if check_state is not None:
            check_state(st)
        table[idx] = rows
        for k, a in st.items():
            state[k][idx] = a
