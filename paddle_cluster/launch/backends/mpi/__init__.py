"""The Open MPI backend: ``HOSTS`` prepared as over SSH, one ``mpirun`` starting a rank per host."""

from .backend import MPIBackend

__all__ = ["MPIBackend"]
