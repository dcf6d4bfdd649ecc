"""The slurm backend: a real Slurm cluster (munge, slurmctld, slurmd) on 3 namespace hosts of its own
(``slurm_cluster``: tests/enginecluster.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from enginecluster import SlurmCluster, slurm_unavailable_reason
from sshcluster import SSHCluster
from userengine import Engine, EngineSpec, readme_conf, user_env

NATIVE = ["#!/bin/sh", "#SBATCH --nodes=2", "#SBATCH --no-requeue", "#SBATCH --partition=gpu", "#SBATCH --gres=gpu:1",
          "exec srun --nodes=2", "sbatch --parsable"]
DRY_RUN = {"partition": "gpu", "gres": "gpu:1"}
NO_HOSTS = {"nodes": 2}
HOST_FIXTURES = ("slurm_cluster",)


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A real Slurm cluster on 3 hosts of its own, up once per session (~0.4 s; over 20 s seen on a machine
    loaded 10 times over its cores, hence the 90 s limit on the bring-up); leave it quiet
    (``slurm_cluster.wait_quiet()``: no job active, every node idle, no job process on any host)."""
    reason = slurm_unavailable_reason()
    if reason:
        pytest.skip(reason)
    with SSHCluster(3, tmp_path_factory.mktemp("slurm_hosts")) as hosts, SlurmCluster(hosts, timeout=90.0) as slurm:
        yield slurm


def make_slurm(request, tmp_path: Path, slurm: SlurmCluster) -> Engine:
    # ROOT_DIR on the cluster's shared filesystem (as /home is at a Slurm site); no HOSTS and no BACKEND: Slurm
    # places, and `--backend slurm` on every command chooses the engine.
    conf = readme_conf(tmp_path / "conf.py", ROOT_DIR=str(slurm.shared_dir / tmp_path.name), PADDLE_NIC="eth0",
                       PADDLE_PORT=7164, PADDLE_PORTS_NUM=2, PADDLE_PORTS_NUM_FOR_SPARSE=1)

    def cancel() -> None:
        slurm.run(["scancel", "--user=root"], check=False)
        slurm.wait_quiet()
    request.addfinalizer(cancel)
    # The nodes share this machine's filesystem and get the user's environment (srun --export=ALL), so their
    # ~/.cache is the user's; jobs launched at once may share nodes, so each has its own ports.
    return Engine("slurm", tmp_path, conf, user_env(tmp_path, slurm.env), ["--backend", "slurm", "--nodes", "3"],
                  3, 3, slurm.wait_quiet, caches=[tmp_path / ".cache" / "paddle" / "dataset"],
                  own_ports=lambda k: ["--port", str(7164 + 100 * k)] if k else [])


ENGINES = (EngineSpec(
    "slurm", make_slurm, ("slurm_cluster",),
    extra_vars={"PADDLE_CHECKPOINT_DIR": "each node's PADDLE_JOB_DIR is its own directory on the shared filesystem "
                                         "(<job>/node<i>); the checkpoints stay in the job's one directory"},
    runs_on_without_launcher="a launcher that dies while following a job leaves it running, as --detach"),)
