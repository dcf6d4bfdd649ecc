"""``fluid.optimizer``: SGD, Momentum, Adagrad and Adam, run by the pservers (``paddle_cluster.ps.optim``).

``minimize(loss)`` marks ``loss`` as what the loss's program trains; each parameter's optimizer is this one with
its ``ParamAttr`` learning-rate multiplier and regulariser applied. Sparse tables use the pservers' lazy,
row-wise variants (Adam included).
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

from ....ps.optim import OptimizerSpec
from ...missing import NotInCompat, Strict, module_getattr
from .framework import Parameter, Variable
from .regularizer import L2Decay

__all__ = ["SGD", "Adagrad", "AdagradOptimizer", "Adam", "AdamOptimizer", "Momentum", "MomentumOptimizer",
           "SGDOptimizer"]
__getattr__ = module_getattr(__name__, "paddle.fluid.optimizer")


def _decay(reg: Any, where: str) -> float:
    if reg is None:
        return 0.0
    if isinstance(reg, L2Decay):
        return reg.coeff
    raise NotInCompat(f"{where}={type(reg).__name__}", "only fluid.regularizer.L2Decay")


class Optimizer(Strict):
    _paddle_name = "paddle.fluid.optimizer.Optimizer"

    def __init__(self, name: str, learning_rate: Any, regularization: Any = None, **hyper: float) -> None:
        if isinstance(learning_rate, Variable) or isinstance(learning_rate, bool) \
                or not isinstance(learning_rate, (int, float)):
            raise NotInCompat(f"learning_rate={learning_rate!r}", "a number; schedules are not supported (change "
                              "the rate while training with the pserver client's set_lr)")
        self.name, self.learning_rate, self.hyper = name, float(learning_rate), hyper
        self.weight_decay = _decay(regularization, "regularization")
        OptimizerSpec(name=name, lr=self.learning_rate, **hyper)  # check the values now, where they were given

    def spec(self, param: Optional[Parameter] = None) -> OptimizerSpec:
        """This optimizer as the pservers run it for ``param`` (its lr multiplier and regulariser applied)."""
        lr, decay = self.learning_rate, self.weight_decay
        if param is not None:
            lr *= param.learning_rate
            if param.regularizer is not None:
                decay = _decay(param.regularizer, f"ParamAttr(regularizer) of {param.name!r}")
        return OptimizerSpec(name=self.name, lr=lr, weight_decay=decay, **self.hyper)

    def minimize(self, loss: Variable, startup_program: Any = None, parameter_list: Any = None,
                 no_grad_set: Any = None) -> Tuple[List[Any], List[Any]]:
        """Train ``loss``'s program to minimise it; returns ``([], [])`` (there are no optimizer operators)."""
        if not isinstance(loss, Variable):
            raise TypeError(f"minimize: expected the loss Variable, got {type(loss).__name__}")
        if parameter_list is not None or no_grad_set is not None:
            raise NotInCompat("minimize(parameter_list=..., no_grad_set=...)",
                              "use ParamAttr(trainable=False) to freeze a parameter")
        if loss.shape not in ((1,), ()):
            raise ValueError(f"minimize: the loss must be a scalar (e.g. fluid.layers.mean(cost)), {loss.name!r} "
                             f"has shape {list(loss.shape)}")
        prog = loss.block
        prog.loss, prog.optimizer = loss, self
        return [], []


class SGD(Optimizer):
    def __init__(self, learning_rate: Any, regularization: Any = None, name: Optional[str] = None) -> None:
        super().__init__("sgd", learning_rate, regularization)


class Momentum(Optimizer):
    def __init__(self, learning_rate: Any, momentum: float, use_nesterov: bool = False, regularization: Any = None,
                 name: Optional[str] = None) -> None:
        if use_nesterov:
            raise NotInCompat("fluid.optimizer.Momentum(use_nesterov=True)")
        super().__init__("momentum", learning_rate, regularization, momentum=momentum)


class Adagrad(Optimizer):
    def __init__(self, learning_rate: Any, epsilon: float = 1.0e-6, regularization: Any = None,
                 name: Optional[str] = None, initial_accumulator_value: float = 0.0) -> None:
        if initial_accumulator_value:
            raise NotInCompat("fluid.optimizer.Adagrad(initial_accumulator_value != 0)")
        super().__init__("adagrad", learning_rate, regularization, eps=epsilon)


class Adam(Optimizer):
    def __init__(self, learning_rate: Any = 0.001, beta1: float = 0.9, beta2: float = 0.999, epsilon: float = 1e-8,
                 regularization: Any = None, name: Optional[str] = None, lazy_mode: bool = False) -> None:
        super().__init__("adam", learning_rate, regularization, beta1=beta1, beta2=beta2, eps=epsilon)


SGDOptimizer, MomentumOptimizer, AdagradOptimizer, AdamOptimizer = SGD, Momentum, Adagrad, Adam
