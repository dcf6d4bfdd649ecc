"""``fluid.layers``: the operators the seeds' networks use, added to the default main program (or the one of
``program_guard``). Signatures follow Fluid 1.x; an argument this runtime cannot honour raises ``NotInCompat``.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Union

import numpy as np

from ...missing import NotInCompat, module_getattr
from . import framework as F
from . import kernels as K
from .initializer import Constant, Xavier
from .param_attr import ParamAttr

__all__ = ["concat", "cos_sim", "cross_entropy", "data", "embedding", "fc", "mean", "relu", "sigmoid", "softmax",
           "softmax_with_cross_entropy", "square_error_cost", "tanh"]
__getattr__ = module_getattr(__name__, "paddle.fluid.layers")

Vars = Union[F.Variable, Sequence[F.Variable]]


def _program(*vs: F.Variable) -> F.Program:
    progs = {id(v.block): v.block for v in vs}
    if len(progs) > 1:
        raise ValueError(f"variables {[v.name for v in vs]} belong to different programs")
    return next(iter(progs.values())) if progs else F.default_main_program()


def _append(op_type: str, inputs: Sequence[F.Variable], out_shape: Sequence[int], attrs: Optional[Dict] = None,
            params: Optional[Dict[str, F.Parameter]] = None, dtype: str = "float32") -> F.Variable:
    attrs, params = attrs or {}, params or {}
    for v in inputs:
        if not isinstance(v, F.Variable):
            raise TypeError(f"fluid.layers.{op_type}: inputs must be fluid Variables, got {type(v).__name__}")
    kernel = K.make(op_type, attrs, params)
    return _program(*inputs).append_op(op_type, inputs, out_shape, attrs, params, kernel, dtype)


def _param(program: F.Program, attr: Any, default_name: str, shape: Sequence[int], dtype: str, is_bias: bool,
           sparse: bool = False) -> F.Parameter:
    a = ParamAttr.of(attr)
    init = a.initializer or (Constant(0.0) if is_bias else Xavier())
    return program.create_parameter(a.name or default_name, shape, dtype, init, learning_rate=a.learning_rate,
                                    regularizer=a.regularizer, trainable=a.trainable, sparse=sparse)


def data(name: str, shape: Sequence[int], dtype: Any = "float32", lod_level: int = 0, append_batch_size: bool = True,
         stop_gradient: bool = True, type: Any = None) -> F.Variable:
    """A variable fed by ``Executor.run(feed={name: array})`` (or a ``DataFeeder``)."""
    if lod_level:
        raise NotInCompat(f"fluid.layers.data(name={name!r}, lod_level={lod_level})",
                          "sequence (LoD) inputs are not supported: feed padded, fixed-size arrays")
    return F.default_main_program().create_var(name, F.data_shape(shape, append_batch_size), dtype,
                                               stop_gradient=stop_gradient, is_data=True)


def fc(input: Vars, size: int, num_flatten_dims: int = 1, param_attr: Any = None, bias_attr: Any = None,
       act: Optional[str] = None, is_test: bool = False, name: Optional[str] = None) -> F.Variable:
    """``act(sum_i flatten(input_i) @ W_i + b)``; ``bias_attr=False`` drops the bias."""
    inputs = [input] if isinstance(input, F.Variable) else list(input)
    prog = _program(*inputs)
    base = name or F.unique_name("fc")
    attrs = param_attr if isinstance(param_attr, (list, tuple)) else [param_attr] * len(inputs)
    if len(attrs) != len(inputs):
        raise ValueError(f"fc: {len(attrs)} param_attr for {len(inputs)} inputs")
    params: Dict[str, F.Parameter] = {}
    for i, (x, a) in enumerate(zip(inputs, attrs)):
        in_dim = int(np.prod(x.shape[num_flatten_dims:]))
        if in_dim <= 0:
            raise ValueError(f"fc: input {x.name!r} of shape {list(x.shape)} has no fixed size after dimension "
                             f"{num_flatten_dims}")
        params[f"w{i}"] = _param(prog, a, f"{base}.w_{i}", (in_dim, int(size)), x.dtype, False)
    if bias_attr is not False:
        params["b"] = _param(prog, bias_attr, f"{base}.b_0", (int(size),), inputs[0].dtype, True)
    out_shape = tuple(inputs[0].shape[:num_flatten_dims]) + (int(size),)
    out = _append("fc", inputs, out_shape, {"size": int(size), "num_flatten_dims": int(num_flatten_dims),
                                            "n_inputs": len(inputs)}, params, inputs[0].dtype)
    return _act(out, act)


def _act(x: F.Variable, act: Optional[str]) -> F.Variable:
    if act is None:
        return x
    if act not in K.ACTIVATIONS:
        raise NotInCompat(f"act={act!r}", f"supported: {', '.join(K.ACTIVATIONS)}")
    return _append(act, [x], x.shape, dtype=x.dtype)


def relu(x: F.Variable, name: Optional[str] = None) -> F.Variable:
    return _act(x, "relu")


def tanh(x: F.Variable, name: Optional[str] = None) -> F.Variable:
    return _act(x, "tanh")


def sigmoid(x: F.Variable, name: Optional[str] = None) -> F.Variable:
    return _act(x, "sigmoid")


def softmax(input: F.Variable, use_cudnn: bool = False, name: Optional[str] = None, axis: int = -1) -> F.Variable:
    if axis not in (-1, len(input.shape) - 1):
        raise NotInCompat(f"fluid.layers.softmax(axis={axis})", "only the last axis")
    return _act(input, "softmax")


def embedding(input: F.Variable, size: Sequence[int], is_sparse: bool = False, is_distributed: bool = False,
              padding_idx: Optional[int] = None, param_attr: Any = None, dtype: Any = "float32") -> F.Variable:
    """Rows of a (vocab, dim) table for integer ids. ``is_sparse`` or ``is_distributed``: the table lives only on
    the pservers, sharded by id; trainers fetch the rows a batch needs and push row gradients."""
    if padding_idx is not None:
        raise NotInCompat(f"fluid.layers.embedding(padding_idx={padding_idx})")
    vocab, dim = (int(s) for s in size)
    prog = _program(input)
    table = _param(prog, param_attr, F.unique_name("embedding") + ".w_0", (vocab, dim), F.dtype_name(dtype), False,
                   sparse=bool(is_sparse or is_distributed))
    ids_shape = input.shape[:-1] if len(input.shape) > 1 and input.shape[-1] == 1 else input.shape
    return _append("lookup_table", [input], tuple(ids_shape) + (dim,),
                   {"is_sparse": bool(is_sparse), "is_distributed": bool(is_distributed)}, {"w": table},
                   table.dtype)


def concat(input: Sequence[F.Variable], axis: int = 0, name: Optional[str] = None) -> F.Variable:
    xs: List[F.Variable] = list(input)
    if not xs:
        raise ValueError("concat: no inputs")
    nd = len(xs[0].shape)
    ax = axis + nd if axis < 0 else axis
    if not 0 <= ax < nd or any(len(x.shape) != nd for x in xs):
        raise ValueError(f"concat(axis={axis}): inputs of shapes {[list(x.shape) for x in xs]}")
    shape = list(xs[0].shape)
    shape[ax] = -1 if any(x.shape[ax] < 0 for x in xs) else sum(x.shape[ax] for x in xs)
    return _append("concat", xs, shape, {"axis": ax}, dtype=xs[0].dtype)


def square_error_cost(input: F.Variable, label: F.Variable) -> F.Variable:
    """``(input - label)^2`` element by element."""
    return _append("square_error_cost", [input, label], input.shape, dtype=input.dtype)


def mean(x: F.Variable, name: Optional[str] = None) -> F.Variable:
    """The mean of all elements, shape [1]."""
    return _append("mean", [x], (1,), dtype=x.dtype)


def cross_entropy(input: F.Variable, label: F.Variable, soft_label: bool = False, ignore_index: int = -100
                  ) -> F.Variable:
    """``-log(input[label])`` per row of probabilities. When ``input`` is a softmax, the cost is computed from
    its logits (the same value, without ever taking log(0))."""
    if soft_label:
        raise NotInCompat("fluid.layers.cross_entropy(soft_label=True)", "only integer labels")
    if input.op is not None and input.op.type == "softmax":
        return softmax_with_cross_entropy(input.op.inputs[0], label, ignore_index=ignore_index)
    return _append("cross_entropy", [input, label], tuple(input.shape[:-1]) + (1,), {"ignore_index": ignore_index},
                   dtype=input.dtype)


def softmax_with_cross_entropy(logits: F.Variable, label: F.Variable, soft_label: bool = False,
                               ignore_index: int = -100, numeric_stable_mode: bool = True,
                               return_softmax: bool = False) -> F.Variable:
    if soft_label or return_softmax:
        raise NotInCompat("fluid.layers.softmax_with_cross_entropy(soft_label=True or return_softmax=True)")
    return _append("softmax_with_cross_entropy", [logits, label], tuple(logits.shape[:-1]) + (1,),
                   {"ignore_index": ignore_index}, dtype=logits.dtype)


def cos_sim(X: F.Variable, Y: F.Variable) -> F.Variable:
    """Cosine similarity of the rows of X and Y, shape [-1, 1]."""
    return _append("cos_sim", [X, Y], (X.shape[0], 1), dtype=X.dtype)
