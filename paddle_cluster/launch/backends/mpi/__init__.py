"""The MPI backend: ``HOSTS`` prepared as over SSH, one Open MPI ``mpirun`` or MPICH (Hydra) ``mpiexec``
starting a rank per host."""

from .backend import MPIBackend

__all__ = ["MPIBackend"]
