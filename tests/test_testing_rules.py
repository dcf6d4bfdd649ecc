"""The suite's own rules (docs/testing.md): skip reasons are always printed; under ``CI=true`` a skipped test fails
the run; test data is found relative to the checkout or by an environment variable, never at one machine's path."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import List

from helpers import REPO, dataset_dir

TESTS = REPO / "tests"
DEMO = '''
import pytest

def test_runs():
    pass

@pytest.mark.skipif(True, reason="no frobnicator on this machine")
def test_marked():
    pass

def test_skips_itself():
    pytest.skip("engine missing: install it")
'''


def _pytest(tmp: Path, **env: str) -> subprocess.CompletedProcess:
    """pytest with the project's settings (pyproject.toml) and tests/conftest.py as a plugin on a demo module."""
    (tmp / "test_demo.py").write_text(DEMO)
    environ = {k: v for k, v in os.environ.items() if k != "CI"}
    environ.update(env, PYTHONPATH=os.pathsep.join([str(TESTS), str(REPO)]))
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c",
                           str(REPO / "pyproject.toml"), "--rootdir", str(tmp), "-p", "conftest",
                           str(tmp / "test_demo.py")], env=environ, capture_output=True, text=True, timeout=120)


def test_skip_reasons_are_printed(tmp_path):
    res = _pytest(tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert re.search(r"SKIPPED \[1\] \S+test_demo.py:\d+: no frobnicator on this machine", res.stdout), res.stdout
    assert "engine missing: install it" in res.stdout
    assert "1 passed, 2 skipped" in res.stdout


def test_under_ci_a_skip_fails_the_run_with_its_reason(tmp_path):
    for value in ("true", "1"):
        res = _pytest(tmp_path, CI=value)
        assert res.returncode == 1, res.stdout + res.stderr
        lines = [ln for ln in res.stdout.splitlines() if ln.startswith(("FAILED", "ERROR"))]
        assert len(lines) == 2, res.stdout
        assert any("test_marked" in ln and "no frobnicator on this machine" in ln for ln in lines), lines
        assert any("test_skips_itself" in ln and "engine missing" in ln for ln in lines), lines
        assert all(f"skipped under CI={value}" in ln for ln in lines), lines
    assert _pytest(tmp_path, CI="false").returncode == 0


def test_cli_runs_keep_the_launchers_state_out_of_the_users_home(tmp_path):
    """Under the suite's conftest, the journal and the archive cache of a test's CLI run are the session's
    (``own_state_dirs``), never the user's ~/.local/state/paddle-cluster (tests used to write journals there)."""
    home = tmp_path / "home"
    probe = tmp_path / "test_state.py"
    probe.write_text(
        "import os\nfrom paddle_cluster.launch import journal\n"
        "from paddle_cluster.launch.config import builtin_default\n\n"
        "def test_state():\n"
        f"    assert not str(journal._state_file(builtin_default())).startswith({str(home)!r})\n"
        f"    assert not os.environ['XDG_CACHE_HOME'].startswith({str(home)!r})\n")
    environ = {k: v for k, v in os.environ.items() if k not in ("CI", "XDG_STATE_HOME", "XDG_CACHE_HOME")}
    environ.update(HOME=str(home), PYTHONPATH=os.pathsep.join([str(TESTS), str(REPO)]))
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c",
                          str(REPO / "pyproject.toml"), "--rootdir", str(tmp_path), "-p", "conftest", str(probe)],
                         env=environ, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr


def test_datasets_come_from_the_checkout_or_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("PADDLE_CLUSTER_DATASETS", raising=False)
    monkeypatch.delenv("PTB_DIR", raising=False)
    assert dataset_dir("ptb", var="PTB_DIR") == REPO.parent / "shared" / "datasets" / "ptb"
    monkeypatch.setenv("PADDLE_CLUSTER_DATASETS", str(tmp_path))
    assert dataset_dir("ptb", var="PTB_DIR") == tmp_path / "ptb"
    monkeypatch.setenv("PTB_DIR", str(tmp_path / "mine"))
    assert dataset_dir("ptb", var="PTB_DIR") == tmp_path / "mine"


def test_no_test_or_example_names_one_machines_path():
    pattern = re.compile(r"/work/|/home/(?!paddle\b)|/root/")
    found = [f"{p.relative_to(REPO)}:{n}: {line.strip()}"
             for top in ("tests", "examples", "bench")
             for p in sorted((REPO / top).rglob("*")) if p.is_file() and p.suffix in (".py", ".md", ".sh", ".txt")
             and "seeds" not in p.parts and p.name != Path(__file__).name
             for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if pattern.search(line)]
    assert not found, "\n".join(found)


def test_not_cluster_selects_no_test_that_builds_hosts(tmp_path):
    """``-m "not cluster"`` runs without root: no test it selects uses a fixture that builds network-namespace
    hosts, its conformance engine's included (conftest.py marks them; a test reaching one some other way fails:
    next test)."""
    (tmp_path / "selected.py").write_text(
        "import json, os\n\n"
        "def pytest_collection_finish(session):\n"
        "    import conftest\n"
        "    found = {i.nodeid: sorted(conftest.HOST_FIXTURES & conftest.fixtures_needed(i)) for i in session.items}\n"
        "    with open(os.environ['SELECTED'], 'w') as f:\n"
        "        json.dump(found, f)\n")
    out = tmp_path / "selected.json"
    environ = {k: v for k, v in os.environ.items() if k != "CI"}
    environ.update(SELECTED=str(out), PYTHONPATH=os.pathsep.join([str(tmp_path), str(TESTS), str(REPO)]))
    # --assert=plain: collecting needs no assertion rewriting, half of its time where no bytecode is cached
    res = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "--assert=plain", "-p", "selected", "-m", "not cluster", str(TESTS)], cwd=REPO, env=environ,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    found = json.loads(out.read_text())
    assert any("[local]" in t for t in found), "the local engine's conformance cases need no root"
    assert not {t: f for t, f in found.items() if f}, {t: f for t, f in found.items() if f}


HOSTS_BY_NAME = '''
def test_gets_hosts_by_name(request):
    request.getfixturevalue("ssh_cluster")
'''


def test_a_test_reaching_hosts_unmarked_fails_saying_so(tmp_path):
    (tmp_path / "test_demo.py").write_text(HOSTS_BY_NAME)
    environ = {k: v for k, v in os.environ.items() if k != "CI"}
    environ.update(PYTHONPATH=os.pathsep.join([str(TESTS), str(REPO)]))
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c",
                          str(REPO / "pyproject.toml"), "--rootdir", str(tmp_path), "-p", "conftest",
                          str(tmp_path / "test_demo.py")], env=environ, capture_output=True, text=True, timeout=120)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "test_gets_hosts_by_name builds hosts (ssh_cluster, which needs root) but is not marked cluster" in \
        res.stdout, res.stdout


def _clock(node: ast.AST) -> bool:
    """``time.monotonic()``, ``time.time()`` or ``time.perf_counter()``."""
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(
        node.func.value, ast.Name) and node.func.value.id == "time" and node.func.attr in ("monotonic", "time",
                                                                                            "perf_counter")


def timing_looks(source: str) -> List[str]:
    """Where ``source`` sleeps and then asserts (the next statement), or asserts on an elapsed time (a clock
    minus something, directly or through a name the same function gave it)."""
    found = []
    tree = ast.parse(source)
    for fn in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
        elapsed = {t.id for n in ast.walk(fn) if isinstance(n, ast.Assign) and isinstance(n.value, ast.BinOp)
                   and isinstance(n.value.op, ast.Sub) and _clock(n.value.left)
                   for t in n.targets if isinstance(t, ast.Name)}
        for n in ast.walk(fn):
            if isinstance(n, ast.Assert) and any(
                    isinstance(x, ast.Name) and x.id in elapsed or isinstance(x, ast.BinOp) and _clock(x.left)
                    for x in ast.walk(n.test)):
                found.append(f"{n.lineno}: asserts on an elapsed time")
            for body in (getattr(n, f, None) for f in ("body", "orelse", "finalbody")):
                if isinstance(body, list):
                    found += [f"{a.lineno}: sleeps, then asserts" for a, b in zip(body, body[1:])
                              if isinstance(b, ast.Assert) and isinstance(a, ast.Expr) and isinstance(a.value, ast.Call)
                              and isinstance(a.value.func, ast.Attribute) and a.value.func.attr == "sleep"]
    return sorted(set(found), key=lambda f: int(f.split(":")[0]))


def test_timing_looks_are_found():
    assert timing_looks("def t():\n    time.sleep(1)\n    assert alive()\n") == ["2: sleeps, then asserts"]
    assert timing_looks("def t():\n    t0 = time.monotonic()\n    run()\n    took = time.monotonic() - t0\n"
                        "    assert took < 5\n") == ["5: asserts on an elapsed time"]
    assert timing_looks("def t():\n    assert time.time() - t0 < 5\n") == ["2: asserts on an elapsed time"]
    # a poll, and a time only printed, are not looks
    assert timing_looks("def t():\n    while not ready():\n        time.sleep(0.1)\n    assert ready()\n"
                        "    took = time.monotonic() - t0\n    print(took)\n") == []


def test_no_test_sleeps_and_looks_or_asserts_on_elapsed_time():
    """A negative check waits for a condition that proves it; a time limit is a deadline on a wait (docs/testing.md,
    Writing a test)."""
    found = [f"{p.relative_to(REPO)}:{f}" for p in sorted(TESTS.rglob("*.py")) if "seeds" not in p.parts
             for f in timing_looks(p.read_text())]
    assert not found, "\n".join(found)
