"""Shared fixtures: a real multi-host SSH cluster (see tests/sshcluster.py).

Only the cluster fixtures live here; put other fixtures in the test files that use them.
"""

from __future__ import annotations

import pytest
from sshcluster import SSHCluster, unavailable_reason

_CLUSTER_FIXTURES = {"ssh_cluster", "make_ssh_cluster"}


def pytest_collection_modifyitems(items):
    # Tests that use a cluster get the 'cluster' marker, so `-m "not cluster"` runs without root.
    for item in items:
        if _CLUSTER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.cluster)


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
