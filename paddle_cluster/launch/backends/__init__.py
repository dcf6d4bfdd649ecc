"""Launch backends: where a job's processes run (see ``base.Backend``)."""

from ..config import ClusterConfig
from .base import Backend


def backend_for(cfg: ClusterConfig) -> Backend:
    """The backend ``BACKEND`` names: ``ssh`` (``localhost`` as a subprocess) or ``mpi``; Slurm jobs get theirs
    from ``slurm.SlurmBackend`` with the allocation's options."""
    if cfg.backend == "mpi":
        from .mpi import MPIBackend

        return MPIBackend(cfg)
    from .ssh import SSHBackend

    return SSHBackend(cfg)
