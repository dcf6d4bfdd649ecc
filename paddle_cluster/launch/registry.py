"""The backends, one line each: ``BACKEND`` (and ``--backend``) name -> ``"module:class"`` of its package under
``launch/backends/``. Imports nothing, so the config can check ``BACKEND`` against it; ``backends`` loads them."""

DEFAULT = "ssh"  # BACKEND when the config sets none
REGISTRY = {
    "ssh": "paddle_cluster.launch.backends.ssh:SSHBackend",  # localhost included, as a subprocess
    "mpi": "paddle_cluster.launch.backends.mpi:MPIBackend",
    "slurm": "paddle_cluster.launch.backends.slurm:SlurmBackend",
    "k8s": "paddle_cluster.launch.backends.k8s:K8sBackend",
}
