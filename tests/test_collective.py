"""Collective jobs (no pservers: PSERVERS_PER_NODE = 0, ``run --collective``) on the real test hosts: a
``paddle.distributed`` script as ``python -m paddle.distributed.launch`` would start it, and a busy MASTER_PORT
named before anything starts. A ``torch.distributed`` DDP script on every backend (two trainers per node, as
torchrun's ``--nproc_per_node 2``, on the local one) is the conformance suite's ``collective`` scenario."""

from __future__ import annotations

import re
import textwrap

import pytest
from helpers import OMIT, assert_nothing_left, cli, no_traceback, wait_for, write_conf

from paddle_cluster.contract import TRAINER, Endpoint, JobEnv
from paddle_cluster.ps import connect
from paddle_cluster.ps.errors import ConfigMismatch

# Unchanged from a script paddle.distributed.launch starts: init_parallel_env reads PADDLE_TRAINER_ID,
# PADDLE_TRAINERS_NUM, PADDLE_TRAINER_ENDPOINTS, PADDLE_CURRENT_ENDPOINT and MASTER_ADDR/MASTER_PORT.
PADDLE_PY = """
import paddle, paddle.distributed as dist
dist.init_parallel_env()
t = paddle.to_tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print(f"paddle rank {dist.get_rank()} of {dist.get_world_size()} sum {float(t.numpy()[0]):g}", flush=True)
"""


def _ws(tmp_path, text: str):
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "train.py").write_text(textwrap.dedent(text))
    return ws


def test_a_paddle_distributed_script_across_the_hosts(cluster, tmp_path):
    # No ENV: the nodes (no GPU) choose PADDLE_DISTRI_BACKEND=gloo themselves, as paddle.distributed.launch does;
    # PSERVER_COMMAND left out: write_conf's stand-in pserver has no place in a job without pservers.
    conf = write_conf(tmp_path, cluster, PSERVERS_PER_NODE=0, PSERVER_COMMAND=OMIT)
    res = cli(conf, "run", "--job_dispatch_package", str(_ws(tmp_path, PADDLE_PY)), timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    no_traceback(res)
    got = sorted(re.findall(r"\] paddle rank (\d) of 3 sum (\S+)$", res.stdout, re.M))
    assert got == [(str(r), "6") for r in range(3)], res.stdout  # 1 + 2 + 3 on every rank
    assert_nothing_left(cluster)


def test_a_busy_master_port_is_named_before_anything_starts(cluster, tmp_path):
    blocker = cluster.popen(0, [cluster.python, "-c", textwrap.dedent(f"""
        import socket, time
        s = socket.create_server(("{cluster.ips[0]}", 7164)); time.sleep(60)""")])  # TIME_WAIT of a job before
    try:
        wait_for(lambda: cluster.exec(0, ["ss", "-ltn"]).stdout.count(":7164") > 0, 10, "blocker")
        conf = write_conf(tmp_path, cluster, PSERVER_COMMAND=OMIT)
        res = cli(conf, "run", "--collective", "--job_dispatch_package", str(_ws(tmp_path, PADDLE_PY)))
    finally:
        blocker.kill()
        blocker.wait()
    assert res.returncode == 1
    assert f"node0 ({cluster.hosts[0]}): port(s) 7164 on {cluster.ips[0]} are already in use" in res.stderr
    no_traceback(res)


def test_connect_in_a_job_without_pservers_says_so():
    env = JobEnv("j", (), 2, trainer_endpoints=(Endpoint("10.0.0.1", 7165), Endpoint("10.0.0.2", 7165)),
                 master_port=7164).for_process(TRAINER, 1, "10.0.0.2")
    with pytest.raises(ConfigMismatch, match="this job has no pservers"):
        connect(env=JobEnv.from_environ(env.to_environ()))


def test_a_node_without_gpus_chooses_gloo_for_paddle(tmp_path):
    """A trainer with a collective side on a node without /dev/nvidia<N> gets PADDLE_DISTRI_BACKEND=gloo (what
    paddle.distributed.launch sets there); a GPU node, a pserver, or ENV's own choice are left alone."""
    from paddle_cluster.contract import PSERVER, ROLE_VAR, node_defaults

    trainer = {"PADDLE_TRAINER_ENDPOINTS": "10.0.0.1:7165", ROLE_VAR: TRAINER}
    (tmp_path / "null").touch()
    assert node_defaults(trainer, str(tmp_path)) == {"PADDLE_DISTRI_BACKEND": "gloo"}
    assert node_defaults({**trainer, ROLE_VAR: PSERVER}, str(tmp_path)) == {}
    assert node_defaults({**trainer, "PADDLE_DISTRI_BACKEND": "nccl"}, str(tmp_path)) == {}
    (tmp_path / "nvidia0").touch()
    assert node_defaults(trainer, str(tmp_path)) == {}
    assert node_defaults({**trainer, "CUDA_VISIBLE_DEVICES": ""}, str(tmp_path)) == {"PADDLE_DISTRI_BACKEND": "gloo"}
