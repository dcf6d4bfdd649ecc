"""The SSH backend (``HOSTS`` over SSH; ``localhost`` as a subprocess): ``backend`` runs a job, ``jobs`` finds,
shows and stops one started earlier, and checks the hosts."""

from .backend import SSHBackend

__all__ = ["SSHBackend"]
