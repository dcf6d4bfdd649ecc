"""The ssh backend: the built-in local cluster (HOSTS = ["localhost"]) and the session's 3 namespace hosts
(``ssh_cluster``, conftest.py: many tests use those hosts, so their fixtures are conftest's)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from helpers import free_port_range, rc_python, wait_for
from userengine import Engine, EngineSpec, readme_conf, user_env

NATIVE = ["ssh plan of job dry", "pserver.0: ", "trainer.1: python3 train.py --num_passes 2"]


def make_local(request, tmp_path: Path) -> Engine:
    # Two pservers and two trainers on the one host (as the built-in local cluster has), so that ids, counts
    # and lists are checked with more than one of each.
    conf = readme_conf(tmp_path / "conf.py", HOSTS=["localhost"], ROOT_DIR=str(tmp_path / "jobs"), PADDLE_NIC="lo",
                       PADDLE_PORT=free_port_range(6), PADDLE_PORTS_NUM=2, PADDLE_PORTS_NUM_FOR_SPARSE=1,
                       PSERVERS_PER_NODE=2, TRAINERS_PER_NODE=2)
    return Engine("local", tmp_path, conf, user_env(tmp_path), [], 2, 2, lambda: None,
                  log_node=lambda t: "localhost", caches=[tmp_path / ".cache" / "paddle" / "dataset"],
                  own_ports=lambda k: ["--port", str(free_port_range(6))] if k else [], trainers_per_node=2)


def hosts_engine(request, tmp: Path, name: str, cluster, base: dict, opts: list, **more) -> Engine:
    """An engine on the namespace hosts of ``cluster`` (ssh, and mpi over the same hosts): the README's conf.py
    with the hosts' key and known_hosts, and ``more`` keys."""
    ctx = rc_python(cluster, tmp)  # the hosts' python with numpy is on the PATH their login shell's rc sets
    ctx.__enter__()
    request.addfinalizer(lambda: ctx.__exit__(None, None, None))

    def quiet() -> None:
        wait_for(lambda: not any(cluster.pids(i) for i in range(cluster.n)), 30, "the hosts to be empty")

    request.addfinalizer(lambda: [cluster.kill_all(i) for i in range(cluster.n)])
    keys = dict(HOSTS=cluster.hosts, ROOT_DIR="/home/paddle", PADDLE_NIC="eth0", PADDLE_PORT=7164,
                PADDLE_PORTS_NUM=2, PADDLE_PORTS_NUM_FOR_SPARSE=1,
                # The test hosts' key and host keys: what a user's ~/.ssh holds (paramiko and mpirun's ssh
                # would not both read a ~/.ssh/config under the test's HOME).
                SSH_IDENTITY_FILE=cluster.key_path, SSH_KNOWN_HOSTS=cluster.known_hosts, **more)
    # The hosts' home (/root) is this machine's: each host's cache is under its own /home/paddle instead,
    # named by PADDLE_DATA_HOME in ENV (docs/migrating.md#datasets).
    caches = [cluster.root_dir(i) / ".cache" / "paddle" / "dataset" for i in range(cluster.n)]
    for c in caches:
        request.addfinalizer(lambda c=c: shutil.rmtree(c.parent.parent, ignore_errors=True))
    return Engine(name, tmp, readme_conf(tmp / "conf.py", **keys), user_env(tmp, base), opts, 3, 3, quiet,
                  caches=caches, cache_keys={"ENV": {"PADDLE_DATA_HOME": "/home/paddle/.cache/paddle/dataset"}},
                  own_ports=lambda k: ["--port", str(7164 + 100 * k)] if k else [])


def make_ssh(request, tmp_path: Path, ssh_cluster) -> Engine:
    return hosts_engine(request, tmp_path, "ssh", ssh_cluster, dict(os.environ), ["--backend", "ssh"])


ENGINES = (EngineSpec("local", make_local), EngineSpec("ssh", make_ssh, ("ssh_cluster",)))
