"""Shared fixtures: a real multi-host SSH cluster (tests/sshcluster.py) and the conformance suite's ``engine``;
each engine's own fixtures (Open MPI, Slurm, the Kubernetes stand-in) are its module's under tests/engines/,
loaded here as plugins.

Only the cluster fixtures live here; put other fixtures in the test files that use them, and shared helpers
in helpers.py.
"""

from __future__ import annotations

import os

import engines
import pytest
from sshcluster import SSHCluster, unavailable_reason

pytest_plugins = engines.PLUGINS
# The fixtures that build network-namespace hosts, which needs root.
HOST_FIXTURES = frozenset({"ssh_cluster", "make_ssh_cluster"}) | engines.HOST_FIXTURES


def fixtures_needed(item) -> set:
    """The fixtures ``item`` uses, with those of its conformance engine (which it gets by name at setup)."""
    names = set(getattr(item, "fixturenames", ()))
    spec = engines.ENGINES.get(getattr(getattr(item, "callspec", None), "params", {}).get("engine"))
    return names | set(spec.fixtures if spec else ())


def pytest_collection_modifyitems(items):
    # Tests that build hosts get the 'cluster' marker, so `-m "not cluster"` runs without root.
    for item in items:
        if HOST_FIXTURES & fixtures_needed(item):
            item.add_marker(pytest.mark.cluster)


_running = []  # the test being set up or run


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item):
    _running.append(item)
    yield
    _running.pop()


def pytest_fixture_setup(fixturedef, request):
    """A test that reaches a host-building fixture some way the marking above does not see (a fixture got by
    name) fails, rather than making `-m "not cluster"` need root."""
    if fixturedef.argname in HOST_FIXTURES and _running and not _running[-1].get_closest_marker("cluster"):
        pytest.fail(f"{_running[-1].nodeid} builds hosts ({fixturedef.argname}, which needs root) but is not "
                    "marked cluster: declare what it needs (conftest.py, HOST_FIXTURES; tests/engines/)",
                    pytrace=False)


def skips_fail() -> bool:
    """Under CI (``CI`` set, as CI runners do, and not false/0/no) a skipped test is a failure: the project's own
    scripts install every engine and dataset the suite needs, so a skip there means something is missing."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.skipped and not hasattr(rep, "wasxfail") and skips_fail():
        where, line, reason = rep.longrepr if isinstance(rep.longrepr, tuple) else ("", 0, str(rep.longrepr))
        rep.outcome = "failed"
        rep.longrepr = f"skipped under CI={os.environ['CI']}, which counts as a failure: {reason} ({where}:{line})"


def pytest_collectreport(report):
    if report.skipped and skips_fail():  # a whole module skipped at collection
        report.outcome = "failed"
        report.longrepr = f"skipped under CI={os.environ['CI']}, which counts as a failure: {report.longrepr}"


@pytest.fixture(scope="session", autouse=True)
def own_state_dirs(tmp_path_factory):
    """The launcher's journal (XDG_STATE_HOME) and archive cache (XDG_CACHE_HOME) of every CLI run the tests make
    live in this session's directories, never in the user's ~/.local/state or ~/.cache; a test that needs its
    own sets them (or HOME) in the environment it gives the CLI."""
    root = tmp_path_factory.mktemp("xdg")
    saved = {k: os.environ.get(k) for k in ("XDG_STATE_HOME", "XDG_CACHE_HOME")}
    os.environ.update(XDG_STATE_HOME=str(root / "state"), XDG_CACHE_HOME=str(root / "cache"))
    yield root
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _skip_if_unavailable() -> None:
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="session")
def ssh_cluster(tmp_path_factory):
    """A 3-host cluster shared by the whole session; leave it as you found it (see SSHCluster.kill_all)."""
    _skip_if_unavailable()
    with SSHCluster(3, tmp_path_factory.mktemp("ssh_cluster")) as cluster:
        yield cluster


@pytest.fixture
def cluster(ssh_cluster):
    """The session's 3-host cluster, with whatever a test left running on it killed when the test ends."""
    yield ssh_cluster
    for i in range(len(ssh_cluster.hosts)):
        ssh_cluster.kill_all(i)


@pytest.fixture
def make_ssh_cluster(tmp_path_factory):
    """Factory ``make_ssh_cluster(n=2)`` -> a fresh SSHCluster, closed when the test ends (~0.3 s each)."""
    _skip_if_unavailable()
    made = []

    def make(n: int = 2) -> SSHCluster:
        cluster = SSHCluster(n, tmp_path_factory.mktemp(f"ssh_cluster{n}_"))
        made.append(cluster)
        return cluster

    yield make
    for cluster in made:
        cluster.close()


@pytest.fixture
def engine(request, tmp_path):
    """The conformance suite's engine ``request.param`` (tests/engines/) as a user drives it (tests/userengine.py)."""
    spec = engines.ENGINES[request.param]
    reason = spec.unavailable()
    if reason:
        pytest.skip(reason)
    return spec.make(request, tmp_path, *[request.getfixturevalue(f) for f in spec.fixtures])
