"""The k8s backend's keys of conf.py (``K8S_*``), and their values in a config as typed settings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ...config import ClusterConfig, ConfKey
from .manifests import DEFAULT_NAMESPACE

IMAGE = ConfKey("K8S_IMAGE", None)
NAMESPACE = ConfKey("K8S_NAMESPACE", DEFAULT_NAMESPACE)
PSERVER_REQUESTS = ConfKey("K8S_PSERVER_REQUESTS", "")  # "cpu=2,memory=4Gi"; default cpu=1,memory=1Gi
TRAINER_REQUESTS = ConfKey("K8S_TRAINER_REQUESTS", "")
KEYS = (IMAGE, NAMESPACE, PSERVER_REQUESTS, TRAINER_REQUESTS)


@dataclass(frozen=True)
class K8sSettings:
    """What a config's ``K8S_*`` keys say (their defaults where it sets none)."""

    image: Optional[str]
    namespace: str
    pserver_requests: str
    trainer_requests: str

    @classmethod
    def of(cls, cfg: ClusterConfig) -> K8sSettings:
        return cls(*(key.of(cfg) for key in KEYS))
