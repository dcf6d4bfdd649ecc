"""Launch backends: where a job runs (``base.Backend``, the contract every backend keeps).

``registry.REGISTRY`` is the one place that names them: a backend is a package here and one line there.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Dict, List, Mapping, Optional, Tuple, Type

from .. import journal
from ..config import KEYS, ClusterConfig, ConfKey, refuse_line_break
from ..errors import ClusterError, ConfigError
from ..registry import REGISTRY
from .base import Backend, BackendOption, JobRef


def backend_class(name: str) -> Type[Backend]:
    module, cls = REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)


def declared_options() -> List[Tuple[str, BackendOption]]:
    """Every backend's options, as (backend, option), in registry order. Backends may declare the same option
    (two engines' ``--queue``): the same flag, keyword and kind, which ``run`` has once."""
    out = [(name, opt) for name in REGISTRY for opt in backend_class(name).options]
    first: Dict[str, Tuple[str, BackendOption]] = {}
    for name, opt in out:
        other, seen = first.setdefault(opt.flag, (name, opt))
        if (seen.dest, seen.kind, seen.multiple) != (opt.dest, opt.kind, opt.multiple) or \
                any(o.dest == opt.dest and o.flag != opt.flag for _, o in out):
            raise TypeError(f"backends {other} and {name} declare {opt.flag} ({opt.dest}) differently: one flag is "
                            "one keyword and kind")
    return out


def declared_conf_keys() -> Tuple[ConfKey, ...]:
    """Every backend's conf keys (``Backend.conf_keys``), which the CLI hands to the configuration
    (``config.load_config``); a name two backends declare differently, or ``ClusterConfig`` has, is refused."""
    out: Dict[str, ConfKey] = {}
    for name in REGISTRY:
        for key in backend_class(name).conf_keys:
            if key.name in KEYS or out.setdefault(key.name, key) != key:
                raise TypeError(f"backend {name} declares conf key {key.name}, which another backend or ClusterConfig "
                                "has: one key, one meaning")
    return tuple(out.values())


def option_owners() -> Dict[str, List[str]]:
    """Each declared option's keyword -> the backends declaring it."""
    owners: Dict[str, List[str]] = {}
    for name, opt in declared_options():
        owners.setdefault(opt.dest, []).append(name)
    return owners


def run_options(only: Optional[str] = None, check: bool = False) -> List[BackendOption]:
    """The options ``run`` (``only``: ``render <only>``; ``check``: ``check``) takes: one per flag, an option
    several backends declare with each one's help."""
    mine: Dict[str, List[Tuple[str, BackendOption]]] = {}
    for owner, o in declared_options():
        if only in (None, owner) and (o.check or not check):
            mine.setdefault(o.flag, []).append((owner, o))
    return [dataclasses.replace(opts[0][1], help=" ".join(f"{b}: {o.help}" for b, o in opts)) if len(opts) > 1
            else opts[0][1] for opts in mine.values()]


def foreign_options(backend: str, given: Mapping[str, Any]) -> List[Tuple[str, str]]:
    """The options of ``given`` (dest -> value; None, False or (): not given) that no option of ``backend`` is,
    as (flag, the backends declaring it: "k8s" or "k8s or --backend pbs"), once each."""
    owners = option_owners()
    out = {opt.flag: " or --backend ".join(owners[opt.dest]) for _, opt in declared_options()
           if backend not in owners[opt.dest] and given.get(opt.dest) not in (None, False, ())}
    return list(out.items())


def backend_of(cfg: ClusterConfig) -> Type[Backend]:
    """The backend ``BACKEND`` names (``--backend`` included), once the config has what it needs."""
    cls = backend_class(cfg.backend)
    _require_hosts(cls, cfg, _chosen(cfg))
    return cls


def _chosen(cfg: ClusterConfig) -> str:
    """Where the config's backend came from: an option, the file, or the default."""
    option = dict(cfg.options).get("BACKEND", "")
    return (f"{option} {cfg.backend}" if option.startswith("-") else option if option else
            f"BACKEND = {cfg.backend!r} in {cfg.source}" if "BACKEND" in cfg.file_keys else
            f"the default; {cfg.source} sets no BACKEND")


def _require_hosts(cls: Type[Backend], cfg: ClusterConfig, why: str) -> None:
    """HOSTS is required by the backends whose nodes are its machines, not by those whose engine gives them."""
    if cls.needs_hosts and not cfg.hosts:
        others = " or ".join(f"--backend {b}" for b in REGISTRY if not backend_class(b).needs_hosts)
        raise ConfigError("HOSTS", None, f"backend {cls.name} ({why}) runs the job on the machines HOSTS "
                          f'lists: list them, e.g. HOSTS = ["root@192.168.1.10"], or run on an engine that gives '
                          f"the nodes: {others}", cfg.source, unset=True)


def backend_for(cfg: ClusterConfig, opts: Optional[Mapping[str, Any]] = None, detach: bool = False) -> Backend:
    """The backend ``BACKEND`` names, with its declared options from ``opts`` (absent ones: the config's)."""
    cls = backend_of(cfg)
    given = {o.dest: (opts or {}).get(o.dest) for o in cls.options}
    for o in cls.options:  # every value may end up in a script or a manifest
        for value in given[o.dest] if o.multiple and given[o.dest] else [given[o.dest]]:
            if isinstance(value, str):
                refuse_line_break(o.flag, value)
    return cls.create(cfg, given, detach)


def find_job(cfg: ClusterConfig, name: str) -> Tuple[Type[Backend], JobRef]:
    """Job ``name`` as the journal remembers it: its backend (the config's BACKEND for a job it does not know)
    and the handle that backend gave it."""
    handle = journal.where(cfg, name)
    backend = handle.get("backend") or cfg.backend
    if backend not in REGISTRY:
        raise ClusterError(f"job {name} ran on backend {backend!r}, which this paddle-cluster does not have")
    cls = backend_class(backend)
    _require_hosts(cls, cfg, f"job {name} ran on it" if handle.get("backend") else _chosen(cfg))
    return cls, JobRef(cfg, name, handle, journal.outcome(cfg, name))
