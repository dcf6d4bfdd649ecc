"""The plan ``build_plan`` returns is the one every node runs, on every backend: the backend renders it without
editing it, and the node reads its share as it is -- filling in only what the plan declares pending (Slurm's
addresses, ``node.messages.resolve``), or, in a Kubernetes pod, adding its process's own part for its index.
Dry runs and renders only: nothing starts."""

from __future__ import annotations

import copy
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import write_settings
from kube.validate import env_of

from paddle_cluster.contract import JobEnv, node_defaults
from paddle_cluster.launch.backends import REGISTRY, backend_for
from paddle_cluster.launch.backends.k8s import manifests as k8s
from paddle_cluster.launch.backends.mpi.backend import plan_file
from paddle_cluster.launch.backends.slurm import backend as slurm
from paddle_cluster.launch.config import load_config
from paddle_cluster.launch.plan import JobPlan, JobSpec, build_plan
from paddle_cluster.node import messages as m
from paddle_cluster.node.bootstrap import read_plan
from paddle_cluster.node.pod import INDEX_VAR, process_environ


def _rendered(tmp: Path, backend: str):
    """``render BACKEND`` of the README's conf.py (two hosts, never contacted): the plan and the request."""
    conf = write_settings(tmp / "conf.py", {"HOSTS": ["root@10.9.0.2", "root@10.9.0.3"], "BACKEND": backend,
                                            "ROOT_DIR": str(tmp / "root"), "PADDLE_NIC": "eth0", "PADDLE_PORT": 7164})
    cfg = load_config(str(conf))
    be = backend_for(cfg, {"image": "registry.example/fit:1"} if backend == "k8s" else {})
    spec = JobSpec(cfg, "final", trainer_args=("--passes", "2"))
    preview = be.preview(spec, lambda _s: None)
    plan = build_plan(spec, preview.topology)
    before = copy.deepcopy(plan.nodes)
    request = be.render(plan, preview)
    assert request.plan is plan and plan.nodes == before, "render edited the plan"
    return plan, request


@pytest.mark.parametrize("backend", list(REGISTRY))
def test_every_backend_renders_the_plan_build_plan_returns(tmp_path, backend):
    """``render`` leaves the plan as it was, and every node's share declares what its node fills in: what the
    backend's topology says only the nodes learn, and nothing else."""
    plan, request = _rendered(tmp_path, backend)
    assert all(n.pending == plan.topology.pending for n in plan.nodes)
    assert all(p in request.text() for p in plan.topology.pending)  # the dry run shows them as they are


def test_ssh_and_mpi_nodes_read_the_plan_as_is(tmp_path):
    """The ssh agent's ``Start`` line and the plan file mpirun's ranks read hold build_plan's shares."""
    plan, _ = _rendered(tmp_path, "ssh")
    assert [m.decode(m.encode(m.Start(n))).plan for n in plan.nodes] == list(plan.nodes)
    plan, _ = _rendered(tmp_path, "mpi")
    path = tmp_path / "plan.jsonl"
    path.write_text(plan_file(plan))
    assert [read_plan(str(path), n.node) for n in plan.nodes] == list(plan.nodes)


def test_slurm_nodes_fill_in_the_declared_addresses_and_get_the_plan_of_those_addresses(tmp_path):
    """Each Slurm node's share names the addresses as the placeholders the plan declares; the node, once its
    peers published theirs, runs what build_plan makes of those addresses (same job id, secret, directories)."""
    plan, request = _rendered(tmp_path, "slurm")
    adir = tmp_path / "attempt"
    slurm.write_plans(str(adir), plan)
    addresses = {0: "10.1.0.7", 1: "10.1.0.9"}
    got = [read_plan(str(adir / slurm.PLAN.format(node=n.node)), n.node, addresses) for n in plan.nodes]
    assert plan.topology.pending == tuple(m.address_placeholder(i) for i in addresses)
    known = dataclasses.replace(plan.topology, pending=(), nodes=tuple(
        dataclasses.replace(p, address=addresses[i]) for i, p in enumerate(plan.topology.nodes)))
    assert got == list(build_plan(plan.spec, known, plan.env.job_id, plan.env.secret).nodes)
    # Each node its own directory; the checkpoints shared, the dispatched workspace the job's directory.
    assert [(n.job_dir, n.environ["PADDLE_JOB_DIR"], n.cwd) for n in got] == [
        (f"{plan.spec.job_dir}/node{i}", f"{plan.spec.job_dir}/node{i}", plan.spec.job_dir) for i in addresses]
    assert {n.environ["PADDLE_CHECKPOINT_DIR"] for n in got} == {f"{plan.spec.job_dir}/checkpoints"}
    with pytest.raises(m.MessageError, match="node1.address.pending"):  # a value missing is named, never run
        read_plan(str(adir / slurm.PLAN.format(node=0)), 0, {0: "10.1.0.7"})


def _pod_environ(plan: JobPlan, docs, node: m.NodePlan) -> dict:
    """What node ``node``'s pod runs its process with: its container's environment as rendered, the secret from
    the Secret, its completion index, and its own part (``node.pod.process_environ``; its address as the plan
    names it: the pod's DNS name)."""
    (proc,) = node.procs
    job = next(d for d in docs if d["kind"] == "Job" and d["metadata"]["labels"][k8s.LABEL_ROLE] == proc.role.lower())
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["args"] == proc.cmd.split() and container["workingDir"] == node.cwd
    assert {v["mountPath"] for v in container["volumeMounts"]} >= {node.job_dir}
    secret = next(d for d in docs if d["kind"] == "Secret")["stringData"][k8s.SECRET_KEY]
    base = {**env_of(container), "PADDLE_JOB_SECRET": secret, INDEX_VAR: str(proc.index)}
    env = JobEnv.from_environ(base)
    assert env is not None
    return process_environ(base, env, proc.index, node.address)


def test_each_pod_runs_its_nodes_share_of_the_plan(tmp_path):
    """A pod is a node of the plan: the manifests' container and the pod entry point's own part make exactly its
    share's environment, command and directories."""
    plan, request = _rendered(tmp_path, "k8s")
    docs = [d for d in yaml.safe_load_all(request.manifests) if d]
    assert len(plan.nodes) == 4  # two pservers, two trainers: a pod each
    for node in plan.nodes:
        want = {**node.environ, **node.procs[0].env}
        got = _pod_environ(plan, docs, node)
        extra = set(got) - set(want) - {INDEX_VAR}
        assert extra <= set(node_defaults(want)), (node.procs[0].name, extra)
        assert {k: got.get(k) for k in want} == want, node.procs[0].name


def test_an_agent_refuses_a_plan_still_holding_a_placeholder(tmp_path):
    """Run as it is, a placeholder would be dialled as an address: the agent stops, naming it, and makes nothing."""
    pending = m.address_placeholder(0)
    plan = m.NodePlan(node=0, address=pending, job_dir=str(tmp_path / "job"), cwd=str(tmp_path), environ={},
                      procs=(), endpoints=(), start_timeout=5.0, pending=(pending,))
    res = subprocess.run([sys.executable, "-m", "paddle_cluster.node", "supervise", "--grace", "1"],
                         input=m.encode(m.Start(plan)) + "\n", capture_output=True, text=True, timeout=60)
    stopped = m.decode(res.stdout.strip().splitlines()[-1])
    assert res.returncode == 1 and isinstance(stopped, m.Stopped), res.stdout + res.stderr
    assert stopped.reason.startswith(f"the plan still holds {pending}"), stopped
    assert not (tmp_path / "job").exists()
