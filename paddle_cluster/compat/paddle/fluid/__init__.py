"""``import paddle_cluster.compat.paddle.fluid as fluid``: the part of Fluid 1.x the seeds' scripts use.

A static graph (``Program``/``Variable``) built by ``fluid.layers``, evaluated by the ``Executor`` with
``paddle_cluster.train.layers`` kernels, trained through the parameter server (``DistributeTranspiler`` for a
job's pservers, an in-process pserver otherwise). Any other name raises ``NotInCompat`` naming it.
"""

from ...missing import NotInCompat, module_getattr
from . import initializer, io, layers, optimizer, regularizer
from .executor import CPUPlace, DataFeeder, Executor
from .framework import (
    Parameter,
    Program,
    Variable,
    default_main_program,
    default_startup_program,
    program_guard,
)
from .param_attr import ParamAttr
from .transpiler import DistributeTranspiler

__all__ = ["CPUPlace", "DataFeeder", "DistributeTranspiler", "Executor", "NotInCompat", "ParamAttr", "Parameter",
           "Program", "Variable", "default_main_program", "default_startup_program", "initializer", "io", "layers",
           "optimizer", "program_guard", "regularizer"]
__getattr__ = module_getattr(__name__, "paddle.fluid")
