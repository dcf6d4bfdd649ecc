"""The k8s backend: the real kubectl against the Kubernetes stand-in (tests/kube/) on 4 namespace
hosts of its own (``kube_cluster``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from enginecluster import kubectl_unavailable_reason
from helpers import free_port_range, wait_for
from sshcluster import SSHCluster
from userengine import Engine, EngineSpec, job_processes, readme_conf, user_env

NATIVE = ["kind: Secret", "kind: Job", "image: registry.example/fit:1"]
DRY_RUN = NO_HOSTS = {"image": "registry.example/fit:1"}
# One pserver and one trainer pod without HOSTS: PSERVERS_PER_NODE and TRAINERS_PER_NODE.
NO_HOSTS_NATIVE = [*NATIVE[:2], "1 pserver(s), 1 trainer(s)"]
PRINTS_SECRETS = True  # the manifests' Secret is what kubectl applies
HOST_FIXTURES = ("kube_cluster",)


@pytest.fixture(scope="session")
def kube_cluster(tmp_path_factory):
    """The Kubernetes stand-in (tests/kube/) on 4 SSH hosts of its own, shared by the session."""
    from kube.standin import StandIn

    reason = kubectl_unavailable_reason()
    if reason:
        pytest.skip(reason)
    with SSHCluster(4, tmp_path_factory.mktemp("kube_hosts")) as hosts:
        k = StandIn(hosts, tmp_path_factory.mktemp("kube") / "kube")
        yield k
        k.close()


def make_k8s(request, tmp_path: Path, kube) -> Engine:
    from kube.standin import IMAGE

    # conf.py in the directory the user runs from (no --conf): HOSTS x 1 pserver and trainer pods.
    readme_conf(tmp_path / "conf.py", HOSTS=["a", "b"], ROOT_DIR=str(tmp_path / "root"),
                PADDLE_PORT=free_port_range(3), PADDLE_PORTS_NUM=2, PADDLE_PORTS_NUM_FOR_SPARSE=1)
    eng = Engine("k8s", tmp_path, None, user_env(tmp_path, kube.env), ["--backend", "k8s", "--image", IMAGE],
                 2, 2, lambda: quiet(), log_node=lambda t: f"trainer.{t}",
                 # A volume every pod mounts (the stand-in's pods see this machine's files), named by
                 # PADDLE_DATA_HOME in ENV: an image has no ~/.cache of the user's.
                 caches=[tmp_path / "datasets"], cache_keys={"ENV": {"PADDLE_DATA_HOME": str(tmp_path / "datasets")}})

    def quiet() -> None:
        left = {}

        def gone() -> bool:
            left.update(objects=sorted(kube.objects()), processes=job_processes(eng.jobs) or kube.processes())
            return not left["objects"] and not left["processes"]
        try:
            wait_for(gone, 60, "no object or pod left")
        except AssertionError:
            raise AssertionError(f"left: {left}") from None
    return eng


ENGINES = (EngineSpec(
    "k8s", make_k8s, ("kube_cluster",),
    not_offered={"max_restarts": "a failed pod fails its Job; restarts from checkpoints need a launcher-run backend "
                                 "(run refuses --max_restarts with BACKEND k8s)"},
    runs_on_without_launcher="the job lives on the cluster; kill deletes it"),)
