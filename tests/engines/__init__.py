"""The engines the suite runs the launcher's backends on, one module each, registered in ``MODULES``: adding an
engine to the suite is its module here and its line there.

A module says, for the backend it drives (``BACKEND``):
- ``NATIVE``: what only that backend's dry run prints (test_backend_contract.py), with ``DRY_RUN_OPTIONS`` (the
  options its dry run needs) and ``NO_HOSTS_OPTIONS`` (those it needs where conf.py has no HOSTS);
- ``ENGINES``: its engines of the conformance suite (``userengine.EngineSpec``: how a user drives it, the
  fixtures it needs, what it does not offer or fails);
- ``HOST_FIXTURES``: the fixtures it defines that build network-namespace hosts (root): conftest.py marks
  every test using one ``cluster``, and the module is a pytest plugin of conftest.py, so its fixtures are
  everyone's.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Dict, List

import pytest
from userengine import EngineSpec

MODULES = ("ssh", "mpi", "slurm", "k8s")

PLUGINS = [f"engines.{m}" for m in MODULES]
pytest.register_assert_rewrite(*PLUGINS)  # they are conftest.py's plugins, imported here first
_modules = [importlib.import_module(p) for p in PLUGINS]
ENGINES: Dict[str, EngineSpec] = {e.name: dataclasses.replace(e, backend=m.BACKEND)
                                  for m in _modules for e in m.ENGINES}
NATIVE: Dict[str, List[str]] = {m.BACKEND: m.NATIVE for m in _modules}
DRY_RUN_OPTIONS: Dict[str, List[str]] = {m.BACKEND: getattr(m, "DRY_RUN_OPTIONS", []) for m in _modules}
NO_HOSTS_OPTIONS: Dict[str, List[str]] = {m.BACKEND: getattr(m, "NO_HOSTS_OPTIONS", []) for m in _modules}
HOST_FIXTURES = frozenset(f for m in _modules for f in getattr(m, "HOST_FIXTURES", ()))
