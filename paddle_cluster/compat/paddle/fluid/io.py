"""``fluid.io``: save and load parameters, and an inference model (its graph plus parameters).

Files: ``<dirname>/params.npz`` (or ``filename``) holds every parameter by name -- dense ones pulled from the
pservers when the program trains against them, sparse tables read whole (all ``vocab`` rows) -- written
atomically, read without unpickling. ``save_inference_model`` adds ``__model__.json``: the operators needed for
``target_vars`` from ``feeded_var_names``. It is this package's own format, not Fluid's protobuf ``__model__``.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ....ps import atomic
from ...missing import module_getattr
from . import framework as F
from . import kernels as K

__all__ = ["load_inference_model", "load_params", "load_persistables", "save_inference_model", "save_params",
           "save_persistables"]
__getattr__ = module_getattr(__name__, "paddle.fluid.io")

PARAMS = "params.npz"
MODEL = "__model__.json"
ROWS_PER_PULL = 65536


def _values(program: F.Program, params: Sequence[F.Parameter]) -> Dict[str, np.ndarray]:
    session = program.origin.session
    client = session.client if session is not None and not session.closed else None
    if client is not None:
        session.pull()
    out = {}
    for p in params:
        if p.value is not None:
            out[p.name] = p.value.copy()
        elif client is not None:
            vocab = p.shape[0]
            out[p.name] = np.concatenate([client.pull_sparse(p.name, np.arange(lo, min(lo + ROWS_PER_PULL, vocab)))
                                          for lo in range(0, vocab, ROWS_PER_PULL)])
        else:
            raise ValueError(f"sparse table {p.name!r} lives on the pservers and this program never connected to "
                             "them: run a training step first")
    return out


def _path(dirname: str, filename: Optional[str]) -> str:
    return os.path.join(dirname, filename or PARAMS)


def save_persistables(executor: Any, dirname: str, main_program: Optional[F.Program] = None,
                      filename: Optional[str] = None) -> str:
    """Every parameter of the program into ``dirname`` (the optimizer's state stays on the pservers: see
    docs/checkpoints.md for pserver checkpoints)."""
    program = main_program if main_program is not None else F.default_main_program()
    os.makedirs(dirname, exist_ok=True)
    path = _path(dirname, filename)
    atomic.save_npz_atomic(path, _values(program, program.all_parameters()))
    return path


save_params = save_persistables


def load_persistables(executor: Any, dirname: str, main_program: Optional[F.Program] = None,
                      filename: Optional[str] = None) -> None:
    """Load what ``save_persistables`` wrote into the program's parameters.

    A sparse table becomes a local, dense one: right for inference and evaluation. To resume training with the
    tables on the pservers, resume from the pservers' checkpoints (docs/checkpoints.md)."""
    program = main_program if main_program is not None else F.default_main_program()
    values = atomic.load_npz(_path(dirname, filename))
    missing = [p.name for p in program.all_parameters() if p.name not in values]
    if missing:
        raise ValueError(f"{_path(dirname, filename)} has no values for parameters {missing}")
    for p in program.all_parameters():
        p.set_value(values[p.name])


load_params = load_persistables


def save_inference_model(dirname: str, feeded_var_names: Sequence[str], target_vars: Any, executor: Any,
                         main_program: Optional[F.Program] = None, model_filename: Optional[str] = None,
                         params_filename: Optional[str] = None, export_for_deployment: bool = True) -> List[str]:
    """The operators computing ``target_vars`` from the fed variables, and their parameters."""
    program = main_program if main_program is not None else F.default_main_program()
    targets = [target_vars] if isinstance(target_vars, F.Variable) else list(target_vars)
    feeds = [feeded_var_names] if isinstance(feeded_var_names, str) else list(feeded_var_names)
    ops = program.ancestors(targets)
    used = {v.name for op in ops for v in op.inputs if v.op is None}
    unfed = sorted(used - set(feeds))
    if unfed:
        raise ValueError(f"save_inference_model: the targets also need {unfed}; add them to feeded_var_names")
    params = list({p.name: p for op in ops for p in op.params.values()}.values())
    data = [program.var(n) for n in feeds]
    graph = {
        "feed": feeds, "fetch": [t.name for t in targets],
        "vars": {v.name: {"shape": list(v.shape), "dtype": v.dtype} for v in data},
        "params": {p.name: {"shape": list(p.shape), "dtype": p.dtype} for p in params},
        "ops": [{"type": op.type, "inputs": [v.name for v in op.inputs], "output": op.output.name,
                 "shape": list(op.output.shape), "dtype": op.output.dtype, "attrs": op.attrs,
                 "params": {role: p.name for role, p in op.params.items()}} for op in ops],
    }
    os.makedirs(dirname, exist_ok=True)
    atomic.save_npz_atomic(_path(dirname, params_filename), _values(program, params))
    # Two trainers of one node may save into one directory at once: each writes a temporary of its own.
    tmp = os.path.join(dirname, f".{model_filename or MODEL}.tmp-{os.getpid()}-{threading.get_ident()}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(graph, f, indent=1)
    os.replace(tmp, os.path.join(dirname, model_filename or MODEL))
    return [t.name for t in targets]


def load_inference_model(dirname: str, executor: Any, model_filename: Optional[str] = None,
                         params_filename: Optional[str] = None) -> Tuple[F.Program, List[str], List[F.Variable]]:
    """``[program, feed_names, fetch_targets]`` for ``executor.run(program, feed=..., fetch_list=fetch_targets)``."""
    with open(os.path.join(dirname, model_filename or MODEL), encoding="utf-8") as f:
        graph = json.load(f)
    values = atomic.load_npz(_path(dirname, params_filename))
    prog = F.Program()
    for name, v in graph["vars"].items():
        prog.create_var(name, v["shape"], v["dtype"], is_data=True, stop_gradient=True)
    from .initializer import Constant

    for name, v in graph["params"].items():
        p = prog.create_parameter(name, v["shape"], v["dtype"], Constant(0.0), trainable=False)
        p.set_value(values[name])
    for op in graph["ops"]:
        params = {role: prog.vars[n] for role, n in op["params"].items()}
        kernel = K.make(op["type"], op["attrs"], params)
        out = prog.create_var(op["output"], op["shape"], op["dtype"])
        prog.ops.append(F.Operator(op["type"], [prog.vars[n] for n in op["inputs"]], out, op["attrs"], params, kernel))
    return prog, list(graph["feed"]), [prog.vars[n] for n in graph["fetch"]]
