"""The static graph ``fluid.layers`` builds: ``Program``, ``Variable``, ``Parameter``, ``Operator``.

A Program is a list of operators in creation order (so already topologically sorted). Each operator has one
output variable and a numpy kernel (``kernels.py``) with a forward and an exact backward pass; parameters are
variables that carry either their value (dense) or, for a sparse table, only its shape: the table lives on the
pservers. The Executor (``executor.py``) runs the operators a fetch or a loss needs.
"""

from __future__ import annotations

import contextlib
import zlib
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from ....train import layers as L
from ...missing import NotInCompat, Strict

DTYPES = {"float32": np.float32, "float64": np.float64, "int64": np.int64, "int32": np.int32}

_counters: Dict[str, int] = {}


def unique_name(prefix: str) -> str:
    """``fc_0``, ``fc_1``, ...: names unique in the process, like Fluid's ``unique_name.generate``."""
    n = _counters.get(prefix, 0)
    _counters[prefix] = n + 1
    return f"{prefix}_{n}"


def dtype_name(dtype: Any) -> str:
    name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    if name not in DTYPES:
        raise NotInCompat(f"dtype {dtype!r}", f"supported: {', '.join(DTYPES)}")
    return name


class Variable(Strict):
    """A named value of a Program: fed data, an operator's output, or a parameter. ``shape`` has -1 for the
    batch dimension."""

    _paddle_name = "paddle.fluid.Variable"

    def __init__(self, block: Program, name: str, shape: Sequence[int], dtype: Any = "float32", lod_level: int = 0,
                 persistable: bool = False, stop_gradient: bool = False, is_data: bool = False) -> None:
        self.block = block
        self.name = name
        self.shape = tuple(int(d) for d in shape)
        self.dtype = dtype_name(dtype)
        self.lod_level = int(lod_level)
        self.persistable = persistable
        self.stop_gradient = stop_gradient
        self.is_data = is_data
        self.op: Optional[Operator] = None

    @property
    def program(self) -> Program:
        return self.block

    def __repr__(self) -> str:
        return f"Variable({self.name!r}, shape={list(self.shape)}, dtype={self.dtype})"


class Parameter(Variable):
    """A trainable value. Dense: ``param`` holds value and gradient. Sparse table (``is_sparse``/
    ``is_distributed`` embedding): ``param`` is None while the rows live on the pservers."""

    _paddle_name = "paddle.fluid.Parameter"

    def __init__(self, block: Program, name: str, shape: Sequence[int], dtype: Any, initializer: Any,
                 learning_rate: float = 1.0, regularizer: Any = None, trainable: bool = True,
                 sparse: bool = False) -> None:
        super().__init__(block, name, shape, dtype, persistable=True, stop_gradient=not trainable)
        self.initializer = initializer
        self.learning_rate = float(learning_rate)
        self.regularizer = regularizer
        self.trainable = trainable
        self.sparse = sparse
        self.param: Optional[L.Param] = None
        if not sparse:
            self.param = L.Param.create(name, self.initial_value())

    def initial_value(self) -> np.ndarray:
        return self.initializer.value(self.shape, DTYPES[self.dtype], self.seed)

    @property
    def seed(self) -> int:
        """Fixed by the program's ``random_seed`` and the name: every trainer builds the same values."""
        return (zlib.crc32(self.name.encode()) ^ int(self.block.random_seed)) & 0x7FFFFFFF

    @property
    def value(self) -> Optional[np.ndarray]:
        return None if self.param is None else self.param.value

    def set_value(self, value: np.ndarray) -> None:
        """Load a value (e.g. from ``fluid.io``): a sparse table becomes a local, dense one."""
        value = np.asarray(value, dtype=DTYPES[self.dtype])
        if value.shape != self.shape:
            raise ValueError(f"parameter {self.name!r}: value of shape {value.shape}, expected {self.shape}")
        if self.param is None:
            self.param = L.Param.create(self.name, value.copy())
            self.sparse = False
        else:
            self.param.value[...] = value


class Operator:
    """One node: ``type`` and ``attrs`` (JSON-safe, saved by ``save_inference_model``), inputs, one output,
    the parameters it uses by role (``{"w": ..., "b": ...}``) and its kernel. ``grad_inputs`` are the variables
    its backward returns gradients for (normally ``inputs``)."""

    def __init__(self, type: str, inputs: Sequence[Variable], output: Variable, attrs: Dict[str, Any],
                 params: Dict[str, Parameter], kernel: Any) -> None:
        self.type = type
        self.inputs = list(inputs)
        self.output = output
        self.attrs = attrs
        self.params = params
        self.kernel = kernel
        output.op = self

    def __repr__(self) -> str:
        return f"Operator({self.type}: {[v.name for v in self.inputs]} -> {self.output.name})"


class Program(Strict):
    """Fluid's Program and its one block: variables, parameters and operators, plus what ``minimize`` and
    ``DistributeTranspiler`` attach (the loss, the optimizer, the job)."""

    _paddle_name = "paddle.fluid.Program"

    def __init__(self) -> None:
        self.random_seed = 0
        self.ops: List[Operator] = []
        self.vars: Dict[str, Variable] = {}
        self.loss: Optional[Variable] = None
        self.optimizer: Any = None
        self.for_test = False
        self.origin: Program = self
        # Set on the origin by the Executor or the transpiler: the connection to the pservers.
        self.session: Any = None
        # A startup program: the main programs whose parameters running it initialises.
        self.startup_of: List[Program] = []

    # -- building ------------------------------------------------------------------------------------------
    def _add_var(self, var: Variable) -> Variable:
        if var.name in self.vars:
            raise ValueError(f"the program already has a variable named {var.name!r}")
        self.vars[var.name] = var
        return var

    def create_var(self, name: str, shape: Sequence[int], dtype: Any = "float32", **kw: Any) -> Variable:
        return self._add_var(Variable(self, name, shape, dtype, **kw))

    def create_parameter(self, name: str, shape: Sequence[int], dtype: Any, initializer: Any, **kw: Any
                         ) -> Parameter:
        """A new parameter, or the existing one of that name (a ``ParamAttr(name=...)`` shared by layers)."""
        old = self.vars.get(name)
        if isinstance(old, Parameter):
            if old.shape != tuple(shape):
                raise ValueError(f"parameter {name!r} is shared with shape {list(old.shape)}, asked for {list(shape)}")
            return old
        return self._add_var(Parameter(self, name, shape, dtype, initializer, **kw))  # type: ignore[return-value]

    def append_op(self, type: str, inputs: Sequence[Variable], out_shape: Sequence[int], attrs: Dict[str, Any],
                  params: Dict[str, Parameter], kernel: Any, dtype: Any = "float32") -> Variable:
        out = self.create_var(unique_name(f"{type}.tmp"), out_shape, dtype)
        self.ops.append(Operator(type, inputs, out, attrs, params, kernel))
        return out

    # -- Fluid's Program API -------------------------------------------------------------------------------
    def global_block(self) -> Program:
        return self

    def var(self, name: str) -> Variable:
        try:
            return self.vars[name]
        except KeyError:
            raise ValueError(f"the program has no variable {name!r}") from None

    def list_vars(self) -> Iterator[Variable]:
        return iter(list(self.vars.values()))

    def all_parameters(self) -> List[Parameter]:
        return [v for v in self.vars.values() if isinstance(v, Parameter)]

    def clone(self, for_test: bool = False) -> Program:
        """A program with this one's operators and parameters (shared), e.g. ``for_test=True``: forward only."""
        c = Program()
        c.random_seed, c.ops, c.vars = self.random_seed, list(self.ops), dict(self.vars)
        c.loss, c.optimizer, c.origin = self.loss, self.optimizer, self.origin
        c.for_test = for_test or self.for_test
        return c

    def ancestors(self, targets: Sequence[Variable]) -> List[Operator]:
        """The operators ``targets`` depend on, in program order."""
        needed, stack = set(), [v for v in targets if v.op is not None]
        while stack:
            op = stack.pop().op
            if op is None or id(op) in needed:
                continue
            needed.add(id(op))
            stack.extend(v for v in op.inputs if v.op is not None)
        return [op for op in self.ops if id(op) in needed]


_main = Program()
_startup = Program()
_startup.startup_of.append(_main)


def default_main_program() -> Program:
    return _main


def default_startup_program() -> Program:
    """Running it (re)initialises the parameters of the programs built with it."""
    return _startup


@contextlib.contextmanager
def program_guard(main_program: Program, startup_program: Optional[Program] = None) -> Iterator[None]:
    """Layers built inside go to ``main_program``; ``startup_program`` initialises their parameters."""
    global _main, _startup
    for what, p in (("main_program", main_program), ("startup_program", startup_program)):
        if p is not None and not isinstance(p, Program):
            raise TypeError(f"program_guard: {what} must be a fluid.Program, got {type(p).__name__}")
    prev = (_main, _startup)
    _main = main_program
    _startup = startup_program if startup_program is not None else _startup
    if main_program not in _startup.startup_of:
        _startup.startup_of.append(main_program)
    try:
        yield
    finally:
        _main, _startup = prev


def data_shape(shape: Sequence[int], append_batch_size: bool) -> Tuple[int, ...]:
    """Fluid's rule: a -1 (or None) anywhere means the batch dimension is already there."""
    dims = [-1 if d is None else int(d) for d in shape]
    if append_batch_size and all(d >= 0 for d in dims):
        dims = [-1] + dims
    return tuple(dims)
