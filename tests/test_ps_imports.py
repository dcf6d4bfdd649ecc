"""The parameter-server runtime's modules import each other in one direction: no import circle in ``ps/``,
counting imports made under ``TYPE_CHECKING`` or inside a function (a shard and its barriers once named each
other that way). Read from the source (``ast``), nothing imported."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set

from helpers import REPO

PKG = REPO / "paddle_cluster"


def _graph(root: Path, files: List[Path]) -> Dict[str, Set[str]]:
    """Module -> the modules among ``files`` (under ``root``) it imports anywhere in its text."""
    names = {".".join(p.relative_to(root).with_suffix("").parts): p for p in files}
    return {m: _imports(p, m, set(names)) - {m} for m, p in names.items()}


def _imports(path: Path, name: str, modules: Set[str]) -> Set[str]:
    """The modules of ``modules`` that module ``name`` (at ``path``) imports; a package's ``__init__`` is its face
    (it hands names on), so an import of one of its modules counts as that module."""
    here = name.split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else node.module or ""
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return {m for m in out if m in modules}


def _circle(graph: Dict[str, Set[str]]) -> List[str]:
    """One import circle of ``graph`` (its modules in order), or none."""
    state: Dict[str, int] = {}  # 1: on the current path, 2: done
    path: List[str] = []

    def visit(m: str) -> List[str]:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        state[m] = 2
        path.pop()
        return []

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return []


def test_ps_has_no_import_circle():
    graph = _graph(REPO, [p for p in (PKG / "ps").rglob("*.py") if p.name != "__init__.py"])
    assert "paddle_cluster.ps.server.sync" in graph["paddle_cluster.ps.server.shard"]  # the reading finds imports
    assert not _circle(graph), " -> ".join(_circle(graph))


def test_the_circle_finder_finds_one_made_under_type_checking(tmp_path):
    """The check itself: a pair of modules naming each other only under ``TYPE_CHECKING`` is a circle."""
    pkg = tmp_path / "paddle_cluster" / "ps"
    pkg.mkdir(parents=True)
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import A\n")
    a, b = "paddle_cluster.ps.a", "paddle_cluster.ps.b"
    assert _circle(_graph(tmp_path, sorted(pkg.glob("*.py")))) in ([a, b, a], [b, a, b])
