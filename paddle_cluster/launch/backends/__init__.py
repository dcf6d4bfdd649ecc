"""Launch backends: where a job runs (``base.Backend``, the contract every backend keeps).

``registry.REGISTRY`` is the one place that names them: a backend is a package here and one line there.
"""

from __future__ import annotations

import importlib
from typing import Any, List, Mapping, Optional, Tuple, Type

from .. import journal
from ..config import ClusterConfig
from ..errors import ClusterError
from ..registry import REGISTRY
from .base import Backend, BackendOption, JobRef


def backend_class(name: str) -> Type[Backend]:
    module, cls = REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)


def declared_options() -> List[Tuple[str, BackendOption]]:
    """Every backend's options, as (backend, option), in registry order."""
    return [(name, opt) for name in REGISTRY for opt in backend_class(name).options]


def foreign_options(backend: str, given: Mapping[str, Any]) -> List[Tuple[str, str]]:
    """The options of ``given`` (dest -> value; None, False or (): not given) that belong to another backend than
    ``backend``, as (flag, its backend)."""
    return [(opt.flag, owner) for owner, opt in declared_options()
            if owner != backend and given.get(opt.dest) not in (None, False, ())]


def backend_for(cfg: ClusterConfig, opts: Optional[Mapping[str, Any]] = None, detach: bool = False) -> Backend:
    """The backend ``BACKEND`` names, with its declared options from ``opts`` (absent ones: the config's)."""
    cls = backend_class(cfg.backend)
    return cls.create(cfg, {o.dest: (opts or {}).get(o.dest) for o in cls.options}, detach)


def find_job(cfg: ClusterConfig, name: str) -> Tuple[Type[Backend], JobRef]:
    """Job ``name`` as the journal remembers it: its backend (the config's BACKEND for a job it does not know)
    and the handle that backend gave it."""
    handle = journal.where(cfg, name)
    backend = handle.get("backend") or cfg.backend
    if backend not in REGISTRY:
        raise ClusterError(f"job {name} ran on backend {backend!r}, which this paddle-cluster does not have")
    return backend_class(backend), JobRef(cfg, name, handle, journal.outcome(cfg, name))
