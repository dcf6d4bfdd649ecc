"""A small numpy layer library with exact backward passes, for trainers that talk to a parameter server.

Each layer caches what it needs in ``forward`` and, in ``backward(dout)``, returns the gradient of its
input(s) and *adds* into the ``grad`` of its parameters (call ``zero_grads`` between steps). Parameters are
named, so a trainer can move values and gradients to and from a pserver by name::

    uniq = np.unique(ids)                       # what Embedding.forward uses internally
    emb_out = emb.forward(ids, rows=ps.pull_sparse("emb", uniq))
    ...; model.backward(...)
    g = emb.sparse_grad                          # SparseGrad(ids=uniq, rows=summed gradient rows)
    ps.push_sparse("emb", g.ids, g.rows); ps.push(dense_grads(model))

Float32 by default; every layer keeps the dtype of its inputs and parameters, so gradient checks can run in
float64. Ragged sequences are ``(ids, offsets)``: sequence ``i`` is ``ids[offsets[i]:offsets[i+1]]``. The loss
layers that end a model are in ``losses.py``.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

# -- parameters ----------------------------------------------------------------------------------------


@dataclass
class Param:
    """A named dense parameter and the gradient accumulated into it."""

    name: str
    value: np.ndarray
    grad: np.ndarray

    @classmethod
    def create(cls, name: str, value: np.ndarray) -> Param:
        return cls(name, value, np.zeros_like(value))


@dataclass
class SparseGrad:
    """Row-sparse gradient: ``rows[k]`` is the gradient of table row ``ids[k]``; ids unique and sorted."""

    ids: np.ndarray
    rows: np.ndarray

    @staticmethod
    def merge(grads: Sequence[SparseGrad]) -> SparseGrad:
        """One gradient with duplicate ids summed."""
        if len(grads) == 1:
            return grads[0]
        ids = np.concatenate([g.ids for g in grads])
        rows = np.concatenate([g.rows for g in grads])
        uniq, inverse = np.unique(ids, return_inverse=True)
        out = np.zeros((len(uniq), rows.shape[1]), dtype=rows.dtype)
        np.add.at(out, inverse, rows)
        return SparseGrad(uniq, out)


def _rng(seed: int, name: str) -> np.random.Generator:
    # Mixing in the name gives each layer its own stream while one seed still fixes the whole model.
    return np.random.default_rng([int(seed), zlib.crc32(name.encode())])


def xavier_uniform(shape: Tuple[int, int], seed: int, name: str, dtype: Any = np.float32) -> np.ndarray:
    fan_in, fan_out = shape
    limit = np.sqrt(6.0 / (fan_in + fan_out))
    return _rng(seed, name).uniform(-limit, limit, size=shape).astype(dtype)


# -- base ----------------------------------------------------------------------------------------------


class Layer:
    """Base class. Parameters and sub-layers are found through the instance's attributes (also in lists)."""

    def forward(self, *args: Any) -> Any:
        raise NotImplementedError

    def backward(self, dout: Any) -> Any:
        raise NotImplementedError

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def own_params(self) -> List[Param]:
        return [v for v in vars(self).values() if isinstance(v, Param)]

    def children(self) -> Iterator[Layer]:
        for v in vars(self).values():
            if isinstance(v, Layer):
                yield v
            elif isinstance(v, (list, tuple)):
                yield from (x for x in v if isinstance(x, Layer))

    def walk(self) -> Iterator[Layer]:
        yield self
        for c in self.children():
            yield from c.walk()


class Sequential(Layer):
    """Layers applied one after another, each with a single input and output."""

    def __init__(self, *layers: Layer) -> None:
        self.layers = list(layers)

    def forward(self, x: np.ndarray) -> np.ndarray:
        for layer in self.layers:
            x = layer.forward(x)
        return x

    def backward(self, dout: np.ndarray) -> np.ndarray:
        for layer in reversed(self.layers):
            dout = layer.backward(dout)
        return dout


# -- model-level helpers -------------------------------------------------------------------------------


def dense_params(model: Layer) -> Dict[str, Param]:
    """All dense parameters by name (a Param shared by two layers appears once)."""
    out: Dict[str, Param] = {}
    for layer in model.walk():
        for p in layer.own_params():
            if p.name in out and out[p.name] is not p:
                raise ValueError(f"two different parameters are named {p.name!r}")
            out[p.name] = p
    return out


def dense_values(model: Layer) -> Dict[str, np.ndarray]:
    return {k: p.value for k, p in dense_params(model).items()}


def dense_grads(model: Layer) -> Dict[str, np.ndarray]:
    return {k: p.grad for k, p in dense_params(model).items()}


def set_dense_values(model: Layer, values: Dict[str, np.ndarray], strict: bool = True) -> None:
    """Copy values (e.g. pulled from the pserver) into the model's parameters, in place."""
    params = dense_params(model)
    missing = sorted(set(params) - set(values))
    if strict and missing:
        raise KeyError(f"no values for parameters {missing}")
    for name, v in values.items():
        if name not in params:
            if strict:
                raise KeyError(f"model has no parameter {name!r}")
            continue
        p = params[name]
        if np.shape(v) != p.value.shape:
            raise ValueError(f"parameter {name!r}: got shape {np.shape(v)}, expected {p.value.shape}")
        p.value[...] = v


def embeddings(model: Layer) -> List[Embedding]:
    return [layer for layer in model.walk() if isinstance(layer, Embedding)]


def sparse_grads(model: Layer) -> Dict[str, SparseGrad]:
    """Row-sparse gradients by table name, summed over every Embedding layer that uses the table."""
    per_table: Dict[str, List[SparseGrad]] = {}
    for e in embeddings(model):
        if e.sparse_grad is not None:
            per_table.setdefault(e.table_name, []).append(e.sparse_grad)
    return {k: SparseGrad.merge(v) for k, v in per_table.items()}


def zero_grads(model: Layer) -> None:
    for p in dense_params(model).values():
        p.grad[...] = 0
    for e in embeddings(model):
        e.sparse_grad = None


# -- layers with parameters ----------------------------------------------------------------------------


class Linear(Layer):
    """``y = x @ W + b`` with ``W`` of shape (in_dim, out_dim); Xavier-uniform ``W``, zero ``b``."""

    def __init__(
        self, name: str, in_dim: int, out_dim: int, seed: int = 0, bias: bool = True, dtype: Any = np.float32
    ) -> None:
        self.weight = Param.create(f"{name}.w", xavier_uniform((in_dim, out_dim), seed, name, dtype))
        self.bias = Param.create(f"{name}.b", np.zeros(out_dim, dtype=dtype)) if bias else None
        self._x: Optional[np.ndarray] = None

    def forward(self, x: np.ndarray) -> np.ndarray:
        self._x = x
        y = x @ self.weight.value
        if self.bias is not None:
            y += self.bias.value
        return y

    def backward(self, dout: np.ndarray) -> np.ndarray:
        x = self._x
        assert x is not None, "backward before forward"
        x2 = x.reshape(-1, x.shape[-1])
        d2 = dout.reshape(-1, dout.shape[-1])
        self.weight.grad += x2.T @ d2
        if self.bias is not None:
            self.bias.grad += d2.sum(axis=0)
        return dout @ self.weight.value.T


class Embedding(Layer):
    """Looks up rows for integer ids; the gradient is row-sparse (``sparse_grad``), never a dense table.

    With ``local=True`` the layer owns a (vocab, dim) table for single-process runs; otherwise pass the
    rows of ``np.unique(ids)`` (as pulled from the pserver) to ``forward``. Several Embedding layers may
    share a ``table_name``; ``sparse_grads(model)`` sums their gradients. ``vocab`` (ids in [0, vocab)) or
    ``max_rows`` (hashed ids, at most that many rows) is the id space its pserver table declares
    (``id_space``).
    """

    def __init__(
        self,
        table_name: str,
        dim: int,
        vocab: Optional[int] = None,
        local: bool = False,
        seed: int = 0,
        dtype: Any = np.float32,
        max_rows: Optional[int] = None,
    ) -> None:
        self.table_name = table_name
        self.dim = int(dim)
        self.vocab = vocab
        self.max_rows = max_rows
        self.dtype = np.dtype(dtype)
        self.table: Optional[np.ndarray] = None
        if local:
            if vocab is None:
                raise ValueError("a local embedding table needs a vocab size")
            self.table = init_embedding((vocab, dim), seed, table_name, dtype)
        self.sparse_grad: Optional[SparseGrad] = None
        self._uniq: Optional[np.ndarray] = None
        self._inverse: Optional[np.ndarray] = None

    def id_space(self) -> Dict[str, int]:
        """What ``PSClient.register_sparse`` declares for this table: ``vocab_size`` and/or ``max_rows``."""
        space = {k: int(v) for k, v in (("vocab_size", self.vocab), ("max_rows", self.max_rows)) if v is not None}
        if not space:
            raise ValueError(f"embedding {self.table_name!r}: declare its id space, vocab=V (ids in [0, V)) or "
                             "max_rows=R (hashed ids, at most R rows), so its pservers can refuse ids outside it")
        return space

    @staticmethod
    def unique(ids: np.ndarray) -> np.ndarray:
        """The row ids whose values ``forward`` needs, in the order it needs them."""
        return np.unique(np.asarray(ids, dtype=np.int64))

    def forward(self, ids: np.ndarray, rows: Optional[np.ndarray] = None) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        uniq, inverse = np.unique(ids.reshape(-1), return_inverse=True)
        if rows is None:
            if self.table is None:
                raise ValueError(f"embedding {self.table_name!r} has no local table: pass the pulled rows")
            rows = self.table[uniq]
        elif rows.shape != (len(uniq), self.dim):
            want = (len(uniq), self.dim)
            raise ValueError(f"rows shape {rows.shape}, expected {want} (the rows of np.unique(ids))")
        self._uniq, self._inverse = uniq, inverse
        return rows[inverse].reshape(*ids.shape, self.dim)

    def backward(self, dout: np.ndarray) -> SparseGrad:
        """Record and return the row-sparse gradient; duplicate ids are summed."""
        assert self._uniq is not None and self._inverse is not None, "backward before forward"
        rows = np.zeros((len(self._uniq), self.dim), dtype=dout.dtype)
        np.add.at(rows, self._inverse, dout.reshape(-1, self.dim))
        g = SparseGrad(self._uniq, rows)
        # Accumulate like dense grads do, for a layer run twice before one update.
        self.sparse_grad = g if self.sparse_grad is None else SparseGrad.merge([self.sparse_grad, g])
        return g


def init_embedding(shape: Tuple[int, int], seed: int, name: str, dtype: Any = np.float32) -> np.ndarray:
    """Uniform in +-1/sqrt(dim), so a sum of a few rows keeps unit-ish scale."""
    limit = 1.0 / np.sqrt(shape[1])
    return _rng(seed, name).uniform(-limit, limit, size=shape).astype(dtype)


# -- activations ---------------------------------------------------------------------------------------


class ReLU(Layer):
    def forward(self, x: np.ndarray) -> np.ndarray:
        self._mask = x > 0
        return np.where(self._mask, x, 0).astype(x.dtype, copy=False)

    def backward(self, dout: np.ndarray) -> np.ndarray:
        return np.where(self._mask, dout, 0).astype(dout.dtype, copy=False)


class Tanh(Layer):
    def forward(self, x: np.ndarray) -> np.ndarray:
        self._y = np.tanh(x)
        return self._y

    def backward(self, dout: np.ndarray) -> np.ndarray:
        return dout * (1 - self._y * self._y)


def sigmoid(x: np.ndarray) -> np.ndarray:
    """Overflow-free logistic function: exp only ever sees non-positive arguments."""
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1 / (1 + e), e / (1 + e)).astype(x.dtype, copy=False)


class Sigmoid(Layer):
    def forward(self, x: np.ndarray) -> np.ndarray:
        self._y = sigmoid(x)
        return self._y

    def backward(self, dout: np.ndarray) -> np.ndarray:
        return dout * self._y * (1 - self._y)


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    z = x - x.max(axis=axis, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=axis, keepdims=True)


class Softmax(Layer):
    """Softmax over the last axis (for outputs; for training use the fused SoftmaxCrossEntropy)."""

    def forward(self, x: np.ndarray) -> np.ndarray:
        self._y = softmax(x)
        return self._y

    def backward(self, dout: np.ndarray) -> np.ndarray:
        y = self._y
        return y * (dout - (dout * y).sum(axis=-1, keepdims=True))


# -- structure -----------------------------------------------------------------------------------------


class Concat(Layer):
    """Concatenates inputs along the last axis; backward returns one gradient per input."""

    def forward(self, xs: Sequence[np.ndarray]) -> np.ndarray:
        self._splits = np.cumsum([x.shape[-1] for x in xs])[:-1]
        return np.concatenate(list(xs), axis=-1)

    def backward(self, dout: np.ndarray) -> List[np.ndarray]:
        return np.split(dout, self._splits, axis=-1)


def lengths_to_offsets(lengths: Sequence[int]) -> np.ndarray:
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


def pack_sequences(seqs: Sequence[Sequence[int]]) -> Tuple[np.ndarray, np.ndarray]:
    """Ragged id lists -> (flat int64 ids, offsets of length len(seqs)+1)."""
    offsets = lengths_to_offsets([len(s) for s in seqs])
    ids = np.fromiter((i for s in seqs for i in s), dtype=np.int64, count=int(offsets[-1]))
    return ids, offsets


class SeqPool(Layer):
    """Sum or mean over ragged sequences: x (N, d) flat rows + offsets (B+1,) -> (B, d).

    Empty sequences pool to zeros (for both modes) and pass no gradient.
    """

    def __init__(self, mode: str = "sum") -> None:
        if mode not in ("sum", "mean"):
            raise ValueError(f"pool mode {mode!r}: expected 'sum' or 'mean'")
        self.mode = mode

    def forward(self, x: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        offsets = np.asarray(offsets, dtype=np.int64)
        if offsets.ndim != 1 or len(offsets) < 1 or offsets[0] != 0 or offsets[-1] != len(x):
            raise ValueError(f"offsets must run from 0 to len(x)={len(x)}")
        lengths = np.diff(offsets)
        if np.any(lengths < 0):
            raise ValueError("offsets must be non-decreasing")
        out = np.zeros((len(lengths), *x.shape[1:]), dtype=x.dtype)
        nonempty = lengths > 0
        if nonempty.any():
            # reduceat sums x[s_i:s_{i+1}]; restricted to non-empty starts that is exactly each sequence.
            out[nonempty] = np.add.reduceat(x, offsets[:-1][nonempty], axis=0)
        self._seg = np.repeat(np.arange(len(lengths)), lengths)
        self._lengths = lengths
        if self.mode == "mean":
            out[nonempty] /= lengths[nonempty].reshape(-1, *([1] * (x.ndim - 1))).astype(x.dtype)
        return out

    def backward(self, dout: np.ndarray) -> np.ndarray:
        if self.mode == "mean":
            scale = 1 / np.maximum(self._lengths, 1).astype(dout.dtype)
            dout = dout * scale.reshape(-1, *([1] * (dout.ndim - 1)))
        return dout[self._seg]


class CosineSimilarity(Layer):
    """Row-wise cosine of a and b (B, d) -> (B,); norms are sqrt(|x|^2 + eps) so zero rows are safe."""

    def __init__(self, eps: float = 1e-8) -> None:
        self.eps = eps

    def forward(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        na = np.sqrt((a * a).sum(axis=-1) + self.eps)
        nb = np.sqrt((b * b).sum(axis=-1) + self.eps)
        c = (a * b).sum(axis=-1) / (na * nb)
        self._cache = (a, b, na, nb, c)
        return c

    def backward(self, dout: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        a, b, na, nb, c = self._cache
        d, na, nb, c = dout[..., None], na[..., None], nb[..., None], c[..., None]
        da = d * (b / (na * nb) - c * a / (na * na))
        db = d * (a / (na * nb) - c * b / (nb * nb))
        return da, db
