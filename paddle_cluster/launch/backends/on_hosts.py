"""What the engines running jobs on the machines of ``HOSTS`` share (ssh, and mpi over the same hosts): ``check``,
``plot``, ``top`` and ``fetch`` reach each host over its connection."""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Sequence

from ..access import nodes_with_lib
from ..config import ClusterConfig
from ..fetch import AgentFiles, Outputs
from ..plot import collect
from ..preflight import CheckLine, check_cluster
from ..top import HostsSource
from .base import JobRef

CHECKS = ("every host of HOSTS: SSH without prompts, the interpreter every process will run (PYTHON as the login "
          "shell finds it, as an absolute path) and its numpy, PADDLE_NIC, ports, ROOT_DIR, disk")


class OnHosts:
    """A mixin before ``Backend``: the job's nodes are the hosts of HOSTS, each reached over its connection."""

    @classmethod
    def check(cls, cfg: ClusterConfig, opts: Mapping[str, Any]) -> Sequence[CheckLine]:
        """Every host's preflight (``CHECKS``)."""
        return check_cluster(cfg)

    @classmethod
    def metrics(cls, job: JobRef) -> Dict[str, List[dict]]:
        """From the job directory on each host."""
        return collect(job.cfg, job.name)

    @classmethod
    def figures(cls, job: JobRef) -> HostsSource:
        """``node top`` on each host."""
        return HostsSource(job.cfg, job.name)

    @classmethod
    def outputs(cls, job: JobRef) -> Outputs:
        """Each host's job directory over its connection."""
        nodes, lib, _ = nodes_with_lib(job.cfg)
        return Outputs([AgentFiles(n, lib, job.cfg.job_dir(job.name)) for n in nodes], nodes)
