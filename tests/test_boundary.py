"""The node side (everything of paddle_cluster but the launcher) imports none of the launcher's libraries:
nodes have Python and numpy, not click, Fabric or matplotlib."""

from __future__ import annotations

import json
import subprocess
import sys

from helpers import checkout_env

LAUNCHER_ONLY = ("click", "fabric", "invoke", "paramiko", "rich", "yaml", "matplotlib")

# Run in a fresh interpreter: this test process has the launcher's libraries loaded already. Every module
# of paddle_cluster outside the launcher (launch/, cli, __main__) is imported, __main__ modules too (they
# only run under ``python -m``); printed: each module and the launcher-only libraries its import loaded.
WALK = r"""
import importlib, json, os, pkgutil, sys
import paddle_cluster

LAUNCHER = {"launch", "cli", "__main__"}
FORBIDDEN = set(json.loads(sys.argv[1]))


def loaded():
    return {name.partition(".")[0] for name in sys.modules} & FORBIDDEN


def walk(path, prefix):  # by directory, importing nothing, so each import below is charged what it loads
    for m in pkgutil.iter_modules([path], prefix):
        yield m.name
        if m.ispkg:
            yield from walk(os.path.join(path, m.name.rpartition(".")[2]), m.name + ".")


# PaddlePaddle's own import loads click and rich: charged to paddle, not to paddle_cluster.paddle, which is
# imported only by a script that uses paddle anyway.
try:
    import paddle  # noqa: F401
except ImportError:
    pass

names = ["paddle_cluster"] + [n for n in walk(paddle_cluster.__path__[0], "paddle_cluster.")
                              if n.split(".")[1] not in LAUNCHER]
report = {}
for name in names:
    before = loaded()
    importlib.import_module(name)
    report[name] = sorted(loaded() - before)
import paddle_cluster.cli  # the check itself: the launcher does load them
print(json.dumps({"modules": report, "launcher_loads": sorted(loaded())}))
"""


def test_node_side_imports_no_launcher_library():
    res = subprocess.run([sys.executable, "-c", WALK, json.dumps(LAUNCHER_ONLY)], capture_output=True, text=True,
                         timeout=120, env=checkout_env(), stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.splitlines()[-1])
    modules = out["modules"]
    # The walk found the node side: the contract, the agent, the pserver and the trainer's toolkit.
    assert "paddle_cluster.contract" in modules
    assert any(m.startswith("paddle_cluster.node.") for m in modules), sorted(modules)
    assert any(m.startswith(("paddle_cluster.ps.", "paddle_cluster.runtime.")) for m in modules), sorted(modules)
    assert not any(m.startswith(("paddle_cluster.launch", "paddle_cluster.cli")) for m in modules)
    offenders = {m: libs for m, libs in modules.items() if libs}
    assert not offenders, f"node-side modules that load launcher-only libraries: {offenders}"
    # Detection works: importing the CLI loads click (and the rest of the launcher's libraries).
    assert "click" in out["launcher_loads"], out["launcher_loads"]


def test_a_node_session_does_not_import_numpy():
    """The session (probe, workspace, then the agent) runs on every node for every job: numpy (and the pserver
    package, which imports it) would cost each node ~0.2 s of CPU that it does not need."""
    code = ("import sys; import paddle_cluster.node.session; "
            "print(sorted(m for m in ('numpy', 'paddle_cluster.ps') if m in sys.modules))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=checkout_env(), stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"
