"""The Kubernetes job ``render k8s`` makes of a config, for tests that look at its manifests: the backend's
topology, ``build_plan`` of it (as for every backend), and what the manifests say of that plan."""

from __future__ import annotations

from typing import Tuple

from paddle_cluster.launch.backends.k8s import manifests as k8s
from paddle_cluster.launch.config import ClusterConfig
from paddle_cluster.launch.plan import JobPlan, JobSpec, build_plan


def k8s_plan(cfg: ClusterConfig, *, job_name: str, namespace: str = k8s.DEFAULT_NAMESPACE,
             workspace: str = k8s.DEFAULT_WORKSPACE, trainer_args: Tuple[str, ...] = (), packed: bool = False,
             jobset: bool = False) -> Tuple[str, JobPlan]:
    """The job's Kubernetes name and its plan."""
    name, topology = k8s.topology(cfg, job_name=job_name, namespace=namespace, workspace=workspace, packed=packed,
                                  jobset=jobset)
    return name, build_plan(JobSpec(cfg, job_name, trainer_args=trainer_args), topology)


def k8s_job(cfg: ClusterConfig, *, job_name: str, image: str, namespace: str = k8s.DEFAULT_NAMESPACE,
            workspace: str = k8s.DEFAULT_WORKSPACE, trainer_args: Tuple[str, ...] = (), workspace_pack: bytes = b"",
            jobset: bool = False) -> k8s.K8sJob:
    name, plan = k8s_plan(cfg, job_name=job_name, namespace=namespace, workspace=workspace,
                          trainer_args=trainer_args, packed=bool(workspace_pack), jobset=jobset)
    return k8s.job_of(plan, name=name, namespace=namespace, image=image, workspace_pack=workspace_pack, jobset=jobset)
