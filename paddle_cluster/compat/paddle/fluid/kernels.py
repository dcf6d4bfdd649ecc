"""Numpy kernels of the operators: ``forward(*inputs)`` and ``backward(dout)`` -> one gradient per input.

Where ``paddle_cluster.train.layers`` has the computation (fc = ``Linear``, embedding lookup, activations,
cosine similarity) the kernel wraps that layer and its exact backward pass; the element-wise losses and
reductions Fluid has as separate operators are written here. ``make`` builds a kernel from an operator's type,
attributes and parameters, which is also how ``load_inference_model`` rebuilds a saved graph.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ....train import layers as L

Grads = Tuple[Optional[np.ndarray], ...]
RowSource = Callable[[str, np.ndarray], np.ndarray]


class Kernel:
    def forward(self, *xs: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def backward(self, dout: np.ndarray) -> Grads:
        raise NotImplementedError


class Fc(Kernel):
    """``sum_i flatten(x_i) @ W_i + b``: one ``Linear`` per input sharing the output (bias on the first)."""

    def __init__(self, weights: Sequence[L.Param], bias: Optional[L.Param], num_flatten_dims: int) -> None:
        self.nfd = int(num_flatten_dims)
        self.linears: List[L.Linear] = []
        for i, w in enumerate(weights):
            lin = L.Linear(w.name, *w.value.shape, bias=False, dtype=w.value.dtype)
            lin.weight, lin.bias = w, (bias if i == 0 else None)
            self.linears.append(lin)

    def forward(self, *xs: np.ndarray) -> np.ndarray:
        self._shapes = [x.shape for x in xs]
        lead = xs[0].shape[:self.nfd]
        y = sum(lin.forward(x.reshape(int(np.prod(lead)), -1)) for lin, x in zip(self.linears, xs))
        return y.reshape(*lead, -1)

    def backward(self, dout: np.ndarray) -> Grads:
        d2 = dout.reshape(-1, dout.shape[-1])
        return tuple(lin.backward(d2).reshape(s) for lin, s in zip(self.linears, self._shapes))


class Unary(Kernel):
    """An activation layer (``ReLU``, ``Tanh``, ``Sigmoid``, ``Softmax`` over the last axis)."""

    def __init__(self, layer: L.Layer) -> None:
        self.layer = layer

    def forward(self, x: np.ndarray) -> np.ndarray:
        return self.layer.forward(x)

    def backward(self, dout: np.ndarray) -> Grads:
        return (self.layer.backward(dout),)


class Lookup(Kernel):
    """Embedding rows for integer ids (a trailing dimension of 1 is dropped, as Fluid's ``lookup_table``).

    A dense table (``table.param``) is read locally and gets a dense gradient; a sparse table's rows come from
    ``source(table_name, unique_ids)`` (the pservers) and its gradient stays row-sparse in ``emb.sparse_grad``.
    """

    def __init__(self, table: Any) -> None:
        self.table = table
        self.emb = L.Embedding(table.name, table.shape[1], vocab=table.shape[0])
        self.source: Optional[RowSource] = None

    def forward(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids)
        if ids.dtype.kind not in "iu":
            raise TypeError(f"embedding {self.table.name!r}: ids must be integers, got {ids.dtype}")
        ids = ids.astype(np.int64, copy=False)
        if ids.ndim > 1 and ids.shape[-1] == 1:
            ids = ids[..., 0]
        uniq = L.Embedding.unique(ids)
        vocab = self.table.shape[0]
        if len(uniq) and (uniq[0] < 0 or uniq[-1] >= vocab):
            bad = uniq[0] if uniq[0] < 0 else uniq[-1]
            raise ValueError(f"embedding {self.table.name!r}: id {bad} is outside the table's {vocab} rows")
        if self.table.param is not None:
            rows = self.table.param.value[uniq]
        else:
            if self.source is None:
                raise RuntimeError(f"sparse table {self.table.name!r} has no pserver connection to read rows from")
            rows = self.source(self.table.name, uniq)
        return self.emb.forward(ids, rows=rows)

    def backward(self, dout: np.ndarray) -> Grads:
        g = self.emb.backward(dout)
        if self.table.param is not None:
            np.add.at(self.table.param.grad, g.ids, g.rows)
            self.emb.sparse_grad = None
        return (None,)


class Concat(Kernel):
    def __init__(self, axis: int) -> None:
        self.axis = int(axis)

    def forward(self, *xs: np.ndarray) -> np.ndarray:
        self._sizes = np.cumsum([x.shape[self.axis] for x in xs])[:-1]
        return np.concatenate(xs, axis=self.axis)

    def backward(self, dout: np.ndarray) -> Grads:
        return tuple(np.split(dout, self._sizes, axis=self.axis))


class SquareError(Kernel):
    """Element-wise ``(input - label)^2`` (Fluid's ``square_error_cost``; ``mean`` is a separate operator)."""

    def forward(self, x: np.ndarray, label: np.ndarray) -> np.ndarray:
        self._d = x - np.asarray(label, dtype=x.dtype).reshape(x.shape)
        return self._d * self._d

    def backward(self, dout: np.ndarray) -> Grads:
        g = 2 * self._d * dout
        return g, -g


class Mean(Kernel):
    """Mean of all elements, as a shape (1,) array."""

    def forward(self, x: np.ndarray) -> np.ndarray:
        self._shape, self._dtype = x.shape, x.dtype
        return np.array([x.mean()], dtype=x.dtype)

    def backward(self, dout: np.ndarray) -> Grads:
        return (np.full(self._shape, dout.reshape(-1)[0] / max(1, int(np.prod(self._shape))), dtype=self._dtype),)


def _labels(label: np.ndarray, n: int) -> np.ndarray:
    lab = np.asarray(label).reshape(-1).astype(np.int64)
    if len(lab) != n:
        raise ValueError(f"cross entropy: {len(lab)} labels for {n} rows")
    return lab


class CrossEntropy(Kernel):
    """``-log(p[label])`` per row of probabilities (hard labels); rows labelled ``ignore_index`` cost 0."""

    def __init__(self, ignore_index: int = -100) -> None:
        self.ignore = int(ignore_index)

    def forward(self, p: np.ndarray, label: np.ndarray) -> np.ndarray:
        lab = _labels(label, len(p))
        self._keep = lab != self.ignore
        self._lab = np.where(self._keep, lab, 0)
        self._p = p
        picked = np.maximum(p[np.arange(len(p)), self._lab], np.finfo(p.dtype).tiny)
        self._picked = picked
        return np.where(self._keep, -np.log(picked), 0).astype(p.dtype).reshape(-1, 1)

    def backward(self, dout: np.ndarray) -> Grads:
        g = np.zeros_like(self._p)
        rows = np.arange(len(g))
        g[rows, self._lab] = np.where(self._keep, -dout.reshape(-1) / self._picked, 0)
        return g, None


class SoftmaxCrossEntropy(CrossEntropy):
    """``cross_entropy(softmax(logits))`` per row, computed from the logits so it never takes log(0)."""

    def forward(self, z: np.ndarray, label: np.ndarray) -> np.ndarray:
        lab = _labels(label, len(z))
        self._keep = lab != self.ignore
        self._lab = np.where(self._keep, lab, 0)
        z = z - z.max(axis=-1, keepdims=True)
        lse = np.log(np.exp(z).sum(axis=-1))
        self._probs = np.exp(z - lse[:, None])
        return np.where(self._keep, lse - z[np.arange(len(z)), self._lab], 0).astype(z.dtype).reshape(-1, 1)

    def backward(self, dout: np.ndarray) -> Grads:
        g = self._probs.copy()
        g[np.arange(len(g)), self._lab] -= 1
        g *= np.where(self._keep, dout.reshape(-1), 0)[:, None]
        return g.astype(self._probs.dtype, copy=False), None


class CosSim(Kernel):
    """Row-wise cosine similarity, shape (N, 1)."""

    def __init__(self) -> None:
        self.layer = L.CosineSimilarity()

    def forward(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return self.layer.forward(a, b).reshape(-1, 1)

    def backward(self, dout: np.ndarray) -> Grads:
        return self.layer.backward(dout.reshape(-1))


ACTIVATIONS: Dict[str, Callable[[], L.Layer]] = {"relu": L.ReLU, "tanh": L.Tanh, "sigmoid": L.Sigmoid,
                                                  "softmax": L.Softmax}


def make(op_type: str, attrs: Dict[str, Any], params: Dict[str, Any]) -> Kernel:
    """The kernel of an operator (``params``: the framework's ``Parameter`` objects by role)."""
    if op_type == "fc":
        n = attrs["n_inputs"]
        return Fc([params[f"w{i}"].param for i in range(n)], params["b"].param if "b" in params else None,
                  attrs["num_flatten_dims"])
    if op_type in ACTIVATIONS:
        return Unary(ACTIVATIONS[op_type]())
    if op_type == "lookup_table":
        return Lookup(params["w"])
    if op_type == "concat":
        return Concat(attrs["axis"])
    if op_type == "cross_entropy":
        return CrossEntropy(attrs.get("ignore_index", -100))
    if op_type == "softmax_with_cross_entropy":
        return SoftmaxCrossEntropy(attrs.get("ignore_index", -100))
    simple: Dict[str, Callable[[], Kernel]] = {"square_error_cost": SquareError, "mean": Mean, "cos_sim": CosSim}
    if op_type in simple:
        return simple[op_type]()
    raise ValueError(f"unknown operator type {op_type!r}")
