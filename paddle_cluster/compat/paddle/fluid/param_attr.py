"""``fluid.ParamAttr``: a parameter's name (the same name shares one parameter), initializer, learning-rate
multiplier, regularizer and whether it is trained."""

from __future__ import annotations

from typing import Any, Optional

from ...missing import NotInCompat, Strict
from .initializer import Initializer


class ParamAttr(Strict):
    _paddle_name = "paddle.fluid.ParamAttr"

    def __init__(self, name: Optional[str] = None, initializer: Optional[Initializer] = None,
                 learning_rate: float = 1.0, regularizer: Any = None, trainable: bool = True,
                 gradient_clip: Any = None, do_model_average: Any = None) -> None:
        if gradient_clip is not None:
            raise NotInCompat("fluid.ParamAttr(gradient_clip=...)")
        self.name = name
        self.initializer = initializer
        self.learning_rate = float(learning_rate)
        self.regularizer = regularizer
        self.trainable = bool(trainable)

    @classmethod
    def of(cls, attr: Any) -> ParamAttr:
        """What Fluid accepts for ``param_attr``/``bias_attr``: None, a name, an initializer or a ParamAttr."""
        if attr is None or attr is True:
            return cls()
        if isinstance(attr, ParamAttr):
            return attr
        if isinstance(attr, str):
            return cls(name=attr)
        if isinstance(attr, Initializer):
            return cls(initializer=attr)
        raise TypeError(f"param_attr: expected None, a name, an initializer or a fluid.ParamAttr, got {attr!r}")
