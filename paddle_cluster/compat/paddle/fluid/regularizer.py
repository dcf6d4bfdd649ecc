"""``fluid.regularizer``: L2 weight decay, applied by the pservers' optimizer (``weight_decay``)."""

from __future__ import annotations

from ...missing import Strict, module_getattr

__all__ = ["L2Decay", "L2DecayRegularizer"]
__getattr__ = module_getattr(__name__, "paddle.fluid.regularizer")


class L2Decay(Strict):
    """Adds ``coeff * param`` to the gradient (coupled L2, as Fluid's L2DecayRegularizer)."""

    _paddle_name = "paddle.fluid.regularizer.L2Decay"

    def __init__(self, regularization_coeff: float = 0.0) -> None:
        self.coeff = float(regularization_coeff)


L2DecayRegularizer = L2Decay
