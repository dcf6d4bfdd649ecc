"""The Slurm backend: ``backend`` runs a job in an allocation, ``jobs`` finds, shows and stops one started
earlier (the layout of its files on the shared filesystem is in ``backend``)."""

from .backend import SlurmBackend
from .options import SlurmOptions

__all__ = ["SlurmBackend", "SlurmOptions"]
