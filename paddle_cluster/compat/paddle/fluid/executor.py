"""``fluid.Executor`` and ``fluid.DataFeeder``, and the ``Session`` that trains a Program against pservers.

A training run of a program with a loss and an optimizer is one parameter-server step: pull the dense
parameters, fetch the rows the batch's ids need from each sparse table (one request per table), run the
operators forward and backward, push the row gradients and the dense gradients. A transpiled program talks to
its job's pservers; one that was never transpiled trains against the pservers ``ps.connect()`` finds: the
launcher's when its contract is in the environment, else an in-process one, so a single-process script runs the
same code. Anything else (a ``clone(for_test=True)``, a program without ``minimize``) runs forward only, with the
newest parameters when connected.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ....contract import JobEnv
from ....ps.client import PSClient, connect
from ....ps.optim import OptimizerSpec
from ....train import layers as L
from ...missing import Strict
from . import framework as F
from . import kernels as K
from .pserver import PServerProgram, PServerStartup


class Session:
    """A program's parameters on the pservers: registered on first use (trainer 0's values win)."""

    def __init__(self, program: F.Program, env: Optional[JobEnv], mode: str) -> None:
        self.program, self.env, self.mode = program, env, mode
        self.client: Optional[PSClient] = None
        self.closed = False
        self.dense: List[F.Parameter] = []

    def connect(self) -> PSClient:
        if self.closed:
            raise RuntimeError("this program's trainer was closed (exe.close()); it cannot run again")
        if self.client is not None:
            return self.client
        prog, opt = self.program, self.program.optimizer
        trained = _params(prog.ancestors([prog.loss])) if prog.loss is not None and opt is not None else []
        spec = opt.spec() if opt is not None else OptimizerSpec()
        client = connect(self.mode, spec, env=self.env)
        try:
            self.dense = sorted((p for p in trained if p.trainable and not p.sparse), key=lambda p: p.name)
            groups: Dict[Tuple, List[F.Parameter]] = {}
            for p in self.dense:  # one registration per distinct optimizer (ParamAttr lr / regulariser)
                s = opt.spec(p)
                groups.setdefault(tuple(sorted(s.to_dict().items())), []).append(p)
            for key, group in groups.items():
                start = client.register_dense({p.name: p.value for p in group}, optimizer=dict(key))
                for p in group:
                    p.param.value[...] = start[p.name]
            for t in sorted((p for p in prog.all_parameters() if p.sparse), key=lambda p: p.name):
                # Fluid's embedding size is [vocabulary, width]: the table's id space is [0, vocabulary).
                client.register_sparse(t.name, t.shape[1], vocab_size=t.shape[0],
                                       init_scale=t.initializer.sparse_scale(t.shape),
                                       seed=t.seed, dtype=F.DTYPES[t.dtype],
                                       optimizer=opt.spec(t) if opt is not None else spec)
        except BaseException:
            client.close()
            raise
        self.client = client
        return client

    def pull(self) -> PSClient:
        """Copy the pservers' dense values for this step into the parameters (those the last step's
        ``push_pull`` brought, unless the step moved on since)."""
        ps = self.connect()
        values = ps.step_values()
        for p in self.dense:
            p.param.value[...] = values[p.name]
        return ps

    def step(self, ops: List[F.Operator], feed: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
        ps = self.pull()
        lookups = _zero_grads(ops)
        values = run_forward(ops, feed, _row_source(ps, lookups, feed))
        run_backward(ops, values, self.program.loss)
        per_table: Dict[str, List[L.SparseGrad]] = {}
        for op in lookups:
            g = op.kernel.emb.sparse_grad
            if g is not None:
                per_table.setdefault(op.kernel.table.name, []).append(g)
        for name, grads in per_table.items():
            g = L.SparseGrad.merge(grads)
            ps.push_sparse(name, g.ids, g.rows)
        ps.finish_step({p.name: p.param.grad for p in self.dense})
        return values

    def close(self) -> None:
        if self.client is not None and not self.closed:
            self.client.close()
        self.closed = True


def _params(ops: Iterable[F.Operator]) -> List[F.Parameter]:
    return list({id(p): p for op in ops for p in op.params.values()}.values())


def _lookups(ops: Sequence[F.Operator]) -> List[F.Operator]:
    return [op for op in ops if isinstance(op.kernel, K.Lookup)]


def _zero_grads(ops: Sequence[F.Operator]) -> List[F.Operator]:
    for p in _params(ops):
        if p.param is not None:
            p.param.grad[...] = 0
    lookups = _lookups(ops)
    for op in lookups:
        op.kernel.emb.sparse_grad = None
    return lookups


def _row_source(ps: PSClient, lookups: List[F.Operator], feed: Mapping[str, np.ndarray]) -> K.RowSource:
    """Rows of a sparse table: the ids of every lookup fed directly are fetched in one request per table."""
    wanted: Dict[str, List[np.ndarray]] = {}
    for op in lookups:
        table, ids = op.kernel.table, op.inputs[0].name
        if table.param is None and ids in feed:
            wanted.setdefault(table.name, []).append(np.asarray(feed[ids]).reshape(-1))
    cached = {}
    for table, ids in wanted.items():
        uniq = np.unique(np.concatenate(ids).astype(np.int64))
        cached[table] = (uniq, ps.pull_sparse(table, uniq))

    def source(table: str, uniq: np.ndarray) -> np.ndarray:
        if table in cached:
            have, rows = cached[table]
            pos = np.searchsorted(have, uniq)
            if len(have) and np.all(pos < len(have)) and np.array_equal(have[np.minimum(pos, len(have) - 1)], uniq):
                return rows[pos]
        return ps.pull_sparse(table, uniq)

    return source


def run_forward(ops: Sequence[F.Operator], feed: Mapping[str, np.ndarray], source: Optional[K.RowSource] = None
                ) -> Dict[str, np.ndarray]:
    values = dict(feed)
    for op in ops:
        missing = [v.name for v in op.inputs if v.name not in values]
        if missing:
            raise ValueError(f"{op.type} needs {', '.join(map(repr, missing))}: feed "
                             f"{'it' if len(missing) == 1 else 'them'} (fed: {sorted(feed) or 'nothing'})")
        if isinstance(op.kernel, K.Lookup):
            op.kernel.source = source
        values[op.output.name] = op.kernel.forward(*(values[v.name] for v in op.inputs))
    return values


def run_backward(ops: Sequence[F.Operator], values: Mapping[str, np.ndarray], loss: F.Variable) -> None:
    """Gradients of ``loss`` into the parameters (dense ``grad``, or the lookups' row-sparse gradients)."""
    grads: Dict[str, np.ndarray] = {loss.name: np.ones_like(values[loss.name])}
    for op in reversed(ops):
        g = grads.pop(op.output.name, None)
        if g is None:
            continue
        for v, gi in zip(op.inputs, op.kernel.backward(g)):
            if gi is not None and v.op is not None:  # fed data needs no gradient
                grads[v.name] = gi if v.name not in grads else grads[v.name] + gi


def feed_arrays(program: F.Program, feed: Optional[Mapping[Any, Any]]) -> Dict[str, np.ndarray]:
    out = {}
    for key, value in (feed or {}).items():
        name = key.name if isinstance(key, F.Variable) else str(key)
        var = program.vars.get(name)
        if var is None or not var.is_data:
            data = sorted(v.name for v in program.vars.values() if v.is_data)
            raise ValueError(f"feed {name!r}: the program has no data variable of that name (it has {data})")
        a = np.asarray(value, dtype=F.DTYPES[var.dtype])
        if a.ndim != len(var.shape) or any(d >= 0 and d != n for d, n in zip(var.shape, a.shape)):
            raise ValueError(f"feed {name!r}: array of shape {list(a.shape)}, the variable has shape "
                             f"{list(var.shape)} (-1: any)")
        out[name] = a
    return out


class CPUPlace(Strict):
    """Accepted where Fluid takes a place; everything runs on the CPU."""

    _paddle_name = "paddle.fluid.CPUPlace"


class Executor(Strict):
    """Runs programs. ``run`` of a pserver program serves until every trainer closed; ``close()`` tells the
    pservers this trainer is done."""

    _paddle_name = "paddle.fluid.Executor"

    def __init__(self, place: Any = None) -> None:
        self.place = place
        self._sessions: List[Session] = []

    def _session(self, origin: F.Program) -> Session:
        if origin.session is None:  # never transpiled: whatever ps.connect() finds (see the module docstring)
            origin.session = Session(origin, None, "sync")
        if origin.session not in self._sessions:
            self._sessions.append(origin.session)
        return origin.session

    def run(self, program: Any = None, feed: Optional[Mapping[Any, Any]] = None, fetch_list: Any = None,
            feed_var_name: str = "feed", fetch_var_name: str = "fetch", scope: Any = None, return_numpy: bool = True,
            use_program_cache: bool = False) -> List[np.ndarray]:
        """Run ``program`` (default: the default main program); returns the fetched values as numpy arrays."""
        program = F.default_main_program() if program is None else program
        if isinstance(program, PServerProgram):
            program.serve()
            return []
        if isinstance(program, PServerStartup):
            return []
        if not isinstance(program, F.Program):
            raise TypeError(f"Executor.run: expected a fluid.Program, got {type(program).__name__}")
        if program.startup_of:
            for main in program.startup_of:
                for p in main.all_parameters():
                    if p.param is not None:
                        p.param.value[...] = p.initial_value()
            return []
        fetch = [self._fetch_var(program, f) for f in (fetch_list or [])]
        feeds = feed_arrays(program, feed)
        training = not program.for_test and program.loss is not None and program.optimizer is not None
        if training:
            ops = program.ancestors([program.loss] + fetch)
            values = self._session(program.origin).step(ops, feeds)
        else:
            ops = program.ancestors(fetch)
            session = program.origin.session
            needs_rows = any(isinstance(op.kernel, K.Lookup) and op.kernel.table.param is None for op in ops)
            if session is not None or needs_rows:
                ps = self._session(program.origin).pull()
                source = _row_source(ps, _lookups(ops), feeds)
            else:
                source = None
            values = run_forward(ops, feeds, source)
        return [self._value(v, values) for v in fetch]

    @staticmethod
    def _fetch_var(program: F.Program, f: Any) -> F.Variable:
        if isinstance(f, F.Variable):
            return f
        if isinstance(f, str):
            return program.var(f)
        raise TypeError(f"fetch_list: expected Variables or names, got {type(f).__name__}")

    @staticmethod
    def _value(var: F.Variable, values: Mapping[str, np.ndarray]) -> np.ndarray:
        if var.name in values:
            return np.array(values[var.name])
        if isinstance(var, F.Parameter) and var.value is not None:
            return var.value.copy()
        raise ValueError(f"cannot fetch {var.name!r}: it is neither fed nor computed by the program run")

    def close(self) -> None:
        """Tell every pserver this trainer is done, so sync barriers stop waiting for it."""
        for s in self._sessions:
            s.close()
        self._sessions.clear()


class DataFeeder(Strict):
    """Turns a batch of samples (tuples in ``feed_list`` order) into ``{name: array}`` for ``Executor.run``,
    each field converted to its variable's dtype and shape ``(batch, *shape[1:])``."""

    _paddle_name = "paddle.fluid.DataFeeder"

    def __init__(self, feed_list: Sequence[Any], place: Any = None, program: Optional[F.Program] = None) -> None:
        prog = program if program is not None else F.default_main_program()
        self.feed_vars = [v if isinstance(v, F.Variable) else prog.var(str(v)) for v in feed_list]

    def feed(self, iterable: Iterable[Sequence[Any]]) -> Dict[str, np.ndarray]:
        batch = list(iterable)
        if not batch:
            raise ValueError("DataFeeder.feed: the batch is empty")
        n = len(self.feed_vars)
        for i, s in enumerate(batch):
            if len(s) != n:
                raise ValueError(f"DataFeeder.feed: sample {i} has {len(s)} fields, feed_list has {n} "
                                 f"({[v.name for v in self.feed_vars]})")
        out = {}
        for i, v in enumerate(self.feed_vars):
            a = np.array([np.asarray(s[i], dtype=F.DTYPES[v.dtype]) for s in batch])
            try:
                out[v.name] = a.reshape((len(batch),) + v.shape[1:])
            except ValueError:
                raise ValueError(f"DataFeeder.feed: field {i} ({v.name!r}) has shape {list(a.shape[1:])} per sample, "
                                 f"the variable has {list(v.shape[1:])}") from None
        return out
