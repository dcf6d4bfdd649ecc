"""``import paddle_cluster.compat.paddle as paddle``: the part of PaddlePaddle's ``paddle`` module the seeds use.

``paddle.batch``, ``paddle.reader.*``, ``paddle.dataset.{uci_housing,movielens,imikolov}``, ``paddle.init`` and
``paddle.fluid`` (imported on first use, or as ``import paddle_cluster.compat.paddle.fluid as fluid``). Any
other name raises ``NotInCompat`` naming it. Node side: stdlib + numpy only.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional

from ...contract import JobEnv, init_flags, with_init_flags
from ...train import data as _data
from ..missing import NotInCompat, module_getattr
from . import dataset, reader

__all__ = ["InitConfig", "NotInCompat", "batch", "dataset", "fluid", "init", "reader"]
__getattr__ = module_getattr(__name__, "paddle", lazy=("fluid",))

_TRUE = ("1", "true", "yes", "on")


def batch(reader: Callable[[], Iterator[Any]], batch_size: int, drop_last: bool = False
          ) -> Callable[[], Iterator[List[Any]]]:
    """Groups a reader's samples into lists of ``batch_size``; the last, shorter one is kept unless ``drop_last``."""
    size = int(batch_size)
    if size <= 0:
        raise ValueError(f"batch_size should be a positive integer, got batch_size={batch_size!r}")
    return _data.batch(reader, size, drop_last=drop_last)


@dataclass(frozen=True)
class InitConfig:
    """What ``paddle.init`` was told: every flag (``PADDLE_INIT_*`` overridden by keywords) and the job they
    describe (None: no pservers named, a local run)."""

    flags: Dict[str, str] = field(default_factory=dict)
    env: Optional[JobEnv] = None

    def flag(self, name: str, default: str = "") -> str:
        return self.flags.get(name, default)

    @property
    def use_gpu(self) -> bool:
        return self.flag("use_gpu", "0").strip().lower() in _TRUE


_config: Optional[InitConfig] = None


def init(**kwargs: Any) -> InitConfig:
    """PaddlePaddle v2's ``paddle.init``: reads every ``PADDLE_INIT_<FLAG>`` variable, lets the keywords
    (``use_gpu``, ``trainer_count``, ``port``, ``ports_num``, ``ports_num_for_sparse``, ``num_gradient_servers``,
    ``trainer_id``, ``pservers``, ...) override them, and records the result (``init_config()``).

    Under the launcher its ``PADDLE_PSERVER_ENDPOINTS`` names the pservers (it is exact when a host runs several).
    """
    global _config
    environ = with_init_flags(kwargs)
    cfg = InitConfig(flags=init_flags(environ), env=JobEnv.from_environ(environ))
    if cfg.use_gpu:
        print("paddle.init: use_gpu is ignored: paddle_cluster trains on the CPU with numpy", file=sys.stderr)
    _config = cfg
    return cfg


def init_config() -> Optional[InitConfig]:
    """What the last ``paddle.init`` call recorded (None before any)."""
    return _config
