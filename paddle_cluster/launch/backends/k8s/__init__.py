"""The Kubernetes backend: ``manifests`` (what ``render k8s`` prints), ``kubectl`` (the command lines of a job and
what they print) and ``backend`` (a job run and followed through them)."""

from .backend import K8sBackend, K8sOptions

__all__ = ["K8sBackend", "K8sOptions"]
