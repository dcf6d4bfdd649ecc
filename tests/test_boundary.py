"""The layers: the node side (everything of paddle_cluster but the launcher) imports none of the launcher's
libraries (nodes have Python and numpy, not click, Fabric or matplotlib), and no module of the launcher imports
one that imports it back."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Set

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


PACKAGE = Path(__file__).resolve().parent.parent / "paddle_cluster"


def _import_graph(folder: Path) -> Dict[str, Set[str]]:
    """Each module under ``folder`` -> the modules under it that it imports: every import statement, one inside a
    function or under ``TYPE_CHECKING`` included (a lazy import is still a dependency)."""
    def name(path: Path) -> str:
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    files = {name(p): p for p in folder.rglob("*.py")}
    graph: Dict[str, Set[str]] = {}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        targets: Set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]) if node.level else ""
                source = ".".join(p for p in (base, node.module or "") if p)
                targets.update(f"{source}.{a.name}" if f"{source}.{a.name}" in files else source for a in node.names)
        graph[mod] = {t for t in targets if t in files}
    return graph


def _circles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one module, or of one importing itself (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    out: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while not part or part[-1] != v:
                part.append(stack.pop())
            if len(part) > 1 or v in graph[v]:
                out.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_launcher_has_no_import_circle():
    """No module of ``launch/`` imports (lazily, or for types only, included) one that imports it back, so its
    modules stand in layers, each importing only those below it: with no circle no import runs back up. (The
    configuration is handed the backends' keys; it does not import the backends to learn them.)"""
    graph = _import_graph(PACKAGE / "launch")
    assert "paddle_cluster.launch.backends.base" in graph["paddle_cluster.launch.backends.ssh.backend"]  # it reads
    assert "paddle_cluster.launch.dispatch" in graph["paddle_cluster.launch.backends.ssh.prepare"]  # from ... import
    assert not _circles(graph), _circles(graph)


def test_the_circle_finder_finds_a_lazy_import_back():
    """The check above can fail: a function-level import back up (as config once imported the backends) is a
    circle."""
    graph = _import_graph(PACKAGE / "launch")
    graph["paddle_cluster.launch.config"].add("paddle_cluster.launch.backends")
    assert any("paddle_cluster.launch.config" in c and "paddle_cluster.launch.backends" in c for c in _circles(graph))
