"""The error for a PaddlePaddle name the compatibility package does not have, and the module hook raising it."""

from __future__ import annotations

import importlib
from typing import Any, Callable, Iterable

DOC = "docs/migrating.md#the-paddle-compatibility-package"


class NotInCompat(AttributeError):
    """A PaddlePaddle name that ``paddle_cluster.compat.paddle`` does not provide.

    An AttributeError, so ``hasattr`` and ``getattr(x, name, default)`` keep working; the message names the
    missing name and where to read what exists instead.
    """

    def __init__(self, paddle_name: str, hint: str = "") -> None:
        self.paddle_name = paddle_name
        extra = f" ({hint})" if hint else ""
        super().__init__(f"{paddle_name} is not provided by paddle_cluster's PaddlePaddle compatibility "
                         f"package{extra}; {DOC} lists what is there and how to port the rest")


def module_getattr(module: str, paddle_prefix: str, lazy: Iterable[str] = ()) -> Callable[[str], Any]:
    """A module-level ``__getattr__``: imports the submodules in ``lazy`` on first use, raises ``NotInCompat``
    for any other public name. ``paddle_prefix`` is how the module is spelt in PaddlePaddle (``paddle.fluid``)."""
    lazy = frozenset(lazy)

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):  # Python's own probes (__path__, __wrapped__, ...): the ordinary answer
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        if name in lazy:
            return importlib.import_module(f"{module}.{name}")
        raise NotInCompat(f"{paddle_prefix}.{name}")

    return __getattr__


class Strict:
    """Mixin for compatibility classes: a missing public attribute raises ``NotInCompat`` naming it."""

    _paddle_name = "paddle"

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        raise NotInCompat(f"{self._paddle_name}.{name}")
