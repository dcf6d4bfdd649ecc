"""The engines the suite runs the launcher's backends on: one module each, named as the backend is in the
launcher's ``REGISTRY``, which is the list: a backend of the registry without its module here is an error.

A module says, for its backend:
- ``NATIVE``: what only that backend's dry run prints (test_backend_contract.py), with ``DRY_RUN`` (the options
  its dry run needs, as ``create`` takes them: keyword -> value; given on the command line by their flags) and
  ``NO_HOSTS`` (those it needs where conf.py has no HOSTS), ``NO_HOSTS_NATIVE`` (what that dry run prints;
  default: the first two of ``NATIVE``) and ``PRINTS_SECRETS`` (its request holds the job's secret: the engine
  is given it there);
- ``ENGINES``: its engines of the conformance suite (``userengine.EngineSpec``: how a user drives it, the
  fixtures it needs, what it does not offer or fails);
- ``HOST_FIXTURES``: the fixtures it defines that build network-namespace hosts (root): conftest.py marks
  every test using one ``cluster``, and the module is a pytest plugin of conftest.py, so its fixtures are
  everyone's.
"""

from __future__ import annotations

import dataclasses
import importlib
from types import ModuleType
from typing import Any, Dict, List, Mapping

import pytest
from userengine import EngineSpec

from paddle_cluster.launch.backends import backend_class
from paddle_cluster.launch.registry import REGISTRY

PLUGINS = [f"engines.{b}" for b in REGISTRY]
pytest.register_assert_rewrite(*PLUGINS)  # they are conftest.py's plugins, imported here first


def _module(backend: str) -> ModuleType:
    try:
        return importlib.import_module(f"engines.{backend}")
    except ModuleNotFoundError as e:
        if e.name != f"engines.{backend}":
            raise
        raise ImportError(f"backend {backend} of the launcher's REGISTRY has no test module: write "
                          f"tests/engines/{backend}.py (docs/backends.md, Adding a backend)") from None


def flags(backend: str, given: Mapping[str, Any]) -> List[str]:
    """``given`` (keyword -> value of ``backend``'s declared options) as its command line."""
    by_dest = {o.dest: o for o in backend_class(backend).options}
    out: List[str] = []
    for dest, value in given.items():
        opt = by_dest[dest]
        out += [opt.flag] if opt.kind is bool else \
            [a for v in (value if opt.multiple else [value]) for a in (opt.flag, str(v))]
    return out


_modules = {b: _module(b) for b in REGISTRY}
ENGINES: Dict[str, EngineSpec] = {e.name: dataclasses.replace(e, backend=b)
                                  for b, m in _modules.items() for e in m.ENGINES}
NATIVE: Dict[str, List[str]] = {b: m.NATIVE for b, m in _modules.items()}
DRY_RUN: Dict[str, Dict[str, Any]] = {b: getattr(m, "DRY_RUN", {}) for b, m in _modules.items()}
DRY_RUN_OPTIONS: Dict[str, List[str]] = {b: flags(b, given) for b, given in DRY_RUN.items()}
NO_HOSTS_OPTIONS: Dict[str, List[str]] = {b: flags(b, getattr(m, "NO_HOSTS", {})) for b, m in _modules.items()}
NO_HOSTS_NATIVE: Dict[str, List[str]] = {b: getattr(m, "NO_HOSTS_NATIVE", m.NATIVE[:2]) for b, m in _modules.items()}
PRINTS_SECRETS = frozenset(b for b, m in _modules.items() if getattr(m, "PRINTS_SECRETS", False))
HOST_FIXTURES = frozenset(f for m in _modules.values() for f in getattr(m, "HOST_FIXTURES", ()))
