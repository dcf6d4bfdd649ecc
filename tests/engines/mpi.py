"""The mpi backend: Open MPI's mpirun, and MPICH's mpiexec beside it, over the session's namespace hosts
(``mpi_env``: tests/enginecluster.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from enginecluster import MPIEnv, mpi_unavailable_reason, mpich_unavailable_reason
from userengine import Engine, EngineSpec

from engines.ssh import hosts_engine

NATIVE = ["mpirun --hostfile", "10.9.0.3 slots=1", "Host 10.9.0.2", "bootstrap"]
HOST_FIXTURES = ("mpi_env",)


@pytest.fixture(scope="session")
def mpi_env(ssh_cluster, tmp_path_factory) -> MPIEnv:
    """Open MPI over the session's ``ssh_cluster`` (``mpi_env.cluster``): ``mpi_env.argv(cmd)``, ``env=mpi_env.env``.

    Leave the hosts as you found them: no rank or child left (``mpi_env.cluster.pids(i) == []``).
    """
    reason = mpi_unavailable_reason()
    if reason:
        pytest.skip(reason)
    return MPIEnv.for_cluster(ssh_cluster, tmp_path_factory.mktemp("mpi"))


def make_openmpi(request, tmp_path: Path, mpi_env: MPIEnv) -> Engine:
    return hosts_engine(request, tmp_path, "mpi-openmpi", mpi_env.cluster, mpi_env.env, ["--backend", "mpi"])


def make_mpich(request, tmp_path: Path, mpi_env: MPIEnv) -> Engine:
    # Beside Open MPI, `mpirun` is Open MPI's: a MPICH user names it.
    return hosts_engine(request, tmp_path, "mpi-mpich", mpi_env.cluster, mpi_env.env, ["--backend", "mpi"],
                        MPI_IMPL="mpich")


ENGINES = (EngineSpec("mpi-openmpi", make_openmpi, ("mpi_env",)),
           EngineSpec("mpi-mpich", make_mpich, ("mpi_env",), unavailable=mpich_unavailable_reason))
