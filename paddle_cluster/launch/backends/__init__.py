"""Launch backends: where a job's processes run (see ``base.Backend``)."""

from ..config import ClusterConfig
from .base import Backend


def backend_for(cfg: ClusterConfig) -> Backend:
    """The backend a config asks for; today every config runs over SSH (``localhost`` as a subprocess)."""
    from .ssh import SSHBackend

    return SSHBackend(cfg)
