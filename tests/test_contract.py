"""The environment-variable contract (paddle_cluster/contract.py): both directions, all three dialects."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paddle_cluster.contract import (
    PSERVER,
    TRAINER,
    ContractError,
    Endpoint,
    JobEnv,
    ProcessEnv,
    derive_trainer_key,
    pserver_ports,
    trainer_ports,
)
from paddle_cluster.launch.config import ClusterConfig, HostSpec

SECRET = "5ec7e1a97d2c4b8e3f6a0d5c9b1e7f4a2d"  # as a job secret must be: not guessable (jobsecret.estimate)
SECRET2 = "9b1e4c7f2a5d8e3b6c9f1a4d7e2b5c8f07"  # as a job secret must be: not guessable (jobsecret.estimate)

FLUID = ("PADDLE_TRAINING_ROLE", "PADDLE_PSERVER_IPS", "PADDLE_PSERVER_PORT", "PADDLE_TRAINERS",
         "PADDLE_TRAINER_ID", "PADDLE_CURRENT_IP")
V2 = ("PADDLE_INIT_PSERVERS", "PADDLE_INIT_PORT", "PADDLE_INIT_PORTS_NUM", "PADDLE_INIT_PORTS_NUM_FOR_SPARSE",
      "PADDLE_INIT_NUM_GRADIENT_SERVERS", "PADDLE_INIT_TRAINER_ID")
JOB = ("PADDLE_JOB_ID", "PADDLE_PSERVER_ENDPOINTS", "PADDLE_JOB_DIR", "PADDLE_WORKSPACE", "PADDLE_BARRIER_TIMEOUT")


def job(**kw) -> JobEnv:
    """Two nodes, two pservers each (consecutive port ranges on a node), four trainers."""
    base = dict(job_id="JOB20240101-ab12", trainers=4, ports_num=2, ports_num_for_sparse=3,
                pservers=(Endpoint("10.0.0.1", 7164), Endpoint("10.0.0.1", 7169),
                          Endpoint("10.0.0.2", 7164), Endpoint("10.0.0.2", 7169)),
                secret=SECRET, job_dir="/home/paddle/JOB1", workspace="/home/paddle/JOB1/ws",
                barrier_timeout=30.5)
    base.update(kw)
    return JobEnv(**base)


# -- round trips -------------------------------------------------------------------------------------
@pytest.mark.parametrize("form", ["job", "trainer", "pserver"])
def test_round_trip(form):
    env = job()
    if form == "trainer":
        env = env.for_process(TRAINER, 3, "10.0.0.2")
    elif form == "pserver":
        env = env.for_process(PSERVER, 1, "10.0.0.1")
    back = JobEnv.from_environ(env.to_environ())
    # The job-wide form reaches every process: it carries no secret (pservers get it, trainers their key).
    assert back == (dataclasses.replace(env, secret="") if form == "job" else env)
    assert back.role == env.role and back.trainer_id == env.trainer_id and back.pserver_id == env.pserver_id


hosts = st.from_regex(r"[a-z0-9][a-z0-9.-]{0,15}", fullmatch=True)


@settings(max_examples=100, deadline=None)
@given(data=st.data(), n_ps=st.integers(1, 6), trainers=st.integers(1, 8), ports_num=st.integers(1, 4),
       sparse=st.integers(0, 4), timeout=st.floats(0.001, 1e6, allow_nan=False))
def test_round_trip_property(data, n_ps, trainers, ports_num, sparse, timeout):
    eps = tuple(Endpoint(data.draw(hosts), data.draw(st.integers(1, 65535))) for _ in range(n_ps))
    env = JobEnv(job_id=data.draw(st.from_regex(r"[A-Za-z0-9_-]{1,20}", fullmatch=True)), pservers=eps,
                 trainers=trainers, ports_num=ports_num, ports_num_for_sparse=sparse, secret=SECRET2,
                 job_dir="/j", workspace="/j/ws", barrier_timeout=timeout)
    role = data.draw(st.sampled_from([None, TRAINER, PSERVER]))
    if role == TRAINER:
        env = env.for_process(TRAINER, data.draw(st.integers(0, trainers - 1)), data.draw(hosts))
    elif role == PSERVER:
        env = env.for_process(PSERVER, data.draw(st.integers(0, n_ps - 1)), data.draw(hosts))
    else:
        env = dataclasses.replace(env, secret="")  # the job-wide form carries no secret
    assert JobEnv.from_environ(env.to_environ()) == env


# -- the names and their values ----------------------------------------------------------------------
def test_trainer_names_and_values():
    e = job().for_process(TRAINER, 2, "10.0.0.2").to_environ()
    for name in FLUID + V2 + JOB:
        assert name in e, name
    assert e["PADDLE_TRAINING_ROLE"] == "TRAINER"
    assert e["PADDLE_PSERVER_IPS"] == "10.0.0.1,10.0.0.1,10.0.0.2,10.0.0.2"
    assert e["PADDLE_PSERVER_PORT"] == "7164"
    assert e["PADDLE_TRAINERS"] == "4"
    assert e["PADDLE_TRAINER_ID"] == "2"
    assert e["PADDLE_CURRENT_IP"] == "10.0.0.2"
    assert e["PADDLE_INIT_PSERVERS"] == e["PADDLE_PSERVER_IPS"]
    assert e["PADDLE_INIT_PORT"] == "7164"
    assert e["PADDLE_INIT_PORTS_NUM"] == "2"
    assert e["PADDLE_INIT_PORTS_NUM_FOR_SPARSE"] == "3"
    assert e["PADDLE_INIT_NUM_GRADIENT_SERVERS"] == "4"  # v2's name for the number of trainers
    assert e["PADDLE_INIT_TRAINER_ID"] == "2"
    assert e["PADDLE_JOB_ID"] == "JOB20240101-ab12"
    assert e["PADDLE_PSERVER_ENDPOINTS"] == "10.0.0.1:7164,10.0.0.1:7169,10.0.0.2:7164,10.0.0.2:7169"
    # A trainer gets its own key, never the job secret.
    assert "PADDLE_JOB_SECRET" not in e
    assert e["PADDLE_TRAINER_KEY"] == derive_trainer_key(SECRET, "JOB20240101-ab12", 2)
    assert e["PADDLE_TRAINER_KEY"] != job().for_process(TRAINER, 1, "10.0.0.2").to_environ()["PADDLE_TRAINER_KEY"]
    assert e["PADDLE_JOB_DIR"] == "/home/paddle/JOB1"
    assert e["PADDLE_WORKSPACE"] == "/home/paddle/JOB1/ws"
    assert float(e["PADDLE_BARRIER_TIMEOUT"]) == 30.5
    assert e["PYTHONUNBUFFERED"] == "1"
    assert "PADDLE_PSERVER_ID" not in e
    assert all(isinstance(v, str) for v in e.values())


def test_pserver_names_and_values():
    e = job().for_process(PSERVER, 3, "10.0.0.2").to_environ()
    assert e["PADDLE_TRAINING_ROLE"] == "PSERVER"
    assert e["PADDLE_CURRENT_IP"] == "10.0.0.2"
    assert e["PADDLE_PSERVER_ID"] == "3"
    assert e["PADDLE_CURRENT_ENDPOINT"] == "10.0.0.2:7169"
    assert "PADDLE_TRAINER_ID" not in e and "PADDLE_INIT_TRAINER_ID" not in e
    assert e["PADDLE_JOB_SECRET"] == SECRET and "PADDLE_TRAINER_KEY" not in e


def test_job_wide_form_has_no_per_process_names():
    e = job().to_environ()
    for name in ("PADDLE_TRAINING_ROLE", "PADDLE_TRAINER_ID", "PADDLE_INIT_TRAINER_ID", "PADDLE_CURRENT_IP",
                 "PADDLE_PSERVER_ID", "PADDLE_CURRENT_ENDPOINT"):
        assert name not in e
    assert "PADDLE_JOB_SECRET" not in e and "PADDLE_TRAINER_KEY" not in e


def test_secrets_stay_out_of_reprs_and_short_ones_are_refused():
    env = job()
    for e in (env, env.for_process(TRAINER, 1, "h"), env.for_process(PSERVER, 0, "h")):
        assert SECRET[:12] not in repr(e) and derive_trainer_key(SECRET, env.job_id, 1) not in repr(e)
    with pytest.raises(ContractError, match="PADDLE_JOB_SECRET has 5 characters, fewer than 32.*secrets.token_hex"):
        job(secret="short").key_of(0)
    with pytest.raises(ContractError, match=r"PADDLE_TRAINER_KEY \(or PADDLE_JOB_SECRET\) is not set.*token_hex"):
        job(secret="").key_of(0)
    assert env.for_process(TRAINER, 1, "h").key_of(1) == derive_trainer_key(SECRET, env.job_id, 1)
    assert JobEnv.from_environ({**env.to_environ(), "PADDLE_INTEGRITY": "0"}).integrity is False
    with pytest.raises(ContractError, match="PADDLE_INTEGRITY"):
        JobEnv.from_environ({**env.to_environ(), "PADDLE_INTEGRITY": "maybe"})


def test_extra_variables_are_passed_through():
    e = job(extra={"OMP_NUM_THREADS": "1"}).for_process(TRAINER, 0, "10.0.0.1").to_environ()
    assert e["OMP_NUM_THREADS"] == "1"


def test_not_launched():
    assert JobEnv.from_environ({}) is None
    assert JobEnv.from_environ({"HOME": "/root"}) is None


# -- seed-style environments (seed 003's table: Fluid names only) --------------------------------------
SEED_COMMON = {"PADDLE_PSERVER_IPS": "ps0.paddlepaddle.com,ps1.paddlepaddle.com", "PADDLE_TRAINERS": "2",
               "PADDLE_PSERVER_PORT": "6174"}


def test_seed_pserver_environment():
    env = JobEnv.from_environ({"PADDLE_TRAINING_ROLE": "PSERVER", "PADDLE_CURRENT_IP": "ps1.paddlepaddle.com",
                               **SEED_COMMON})
    assert env.role == PSERVER
    assert env.pservers == (Endpoint("ps0.paddlepaddle.com", 6174), Endpoint("ps1.paddlepaddle.com", 6174))
    assert env.pserver_id == 1 and str(env.current_endpoint) == "ps1.paddlepaddle.com:6174"
    assert env.trainers == 2 and env.trainer_id is None


def test_seed_trainer_environment():
    env = JobEnv.from_environ({"PADDLE_TRAINING_ROLE": "TRAINER", "PADDLE_TRAINER_ID": "1", **SEED_COMMON})
    assert env.role == TRAINER and env.trainer_id == 1 and env.trainers == 2
    assert [str(e) for e in env.pservers] == ["ps0.paddlepaddle.com:6174", "ps1.paddlepaddle.com:6174"]
    assert env.dense_ports(1) == (6174,)


def test_v2_only_environment():
    env = JobEnv.from_environ({"PADDLE_INIT_PSERVERS": "10.1.0.1,10.1.0.2", "PADDLE_INIT_PORT": "7164",
                               "PADDLE_INIT_PORTS_NUM": "2", "PADDLE_INIT_PORTS_NUM_FOR_SPARSE": "2",
                               "PADDLE_INIT_NUM_GRADIENT_SERVERS": "3", "PADDLE_INIT_TRAINER_ID": "2"})
    assert env.trainers == 3 and env.trainer_id == 2
    assert env.all_ports(1) == (7164, 7165, 7166, 7167)
    assert env.pservers[1].host == "10.1.0.2"


# -- bad values name the variable ----------------------------------------------------------------------
GOOD = job().for_process(TRAINER, 1, "10.0.0.1").to_environ()


@pytest.mark.parametrize("changes, name", [
    ({"PADDLE_TRAINERS": "two"}, "PADDLE_TRAINERS"),
    ({"PADDLE_TRAINERS": "0"}, "PADDLE_TRAINERS"),
    ({"PADDLE_TRAINER_ID": "4"}, "PADDLE_TRAINER_ID"),
    ({"PADDLE_TRAINER_ID": "-1"}, "PADDLE_TRAINER_ID"),
    ({"PADDLE_TRAINER_ID": "first"}, "PADDLE_TRAINER_ID"),
    ({"PADDLE_TRAINING_ROLE": "WORKER"}, "PADDLE_TRAINING_ROLE"),
    ({"PADDLE_TRAINING_ROLE": "PSERVER", "PADDLE_PSERVER_ID": "9"}, "PADDLE_PSERVER_ID"),
    ({"PADDLE_PSERVER_ENDPOINTS": "10.0.0.1"}, "PADDLE_PSERVER_ENDPOINTS"),
    ({"PADDLE_PSERVER_ENDPOINTS": "10.0.0.1:http"}, "PADDLE_PSERVER_ENDPOINTS"),
    ({"PADDLE_PSERVER_ENDPOINTS": "10.0.0.1:99999"}, "PADDLE_PSERVER_ENDPOINTS"),
    ({"PADDLE_PSERVER_ENDPOINTS": ",,"}, "PADDLE_PSERVER_ENDPOINTS"),
    ({"PADDLE_INIT_PORTS_NUM": "many"}, "PADDLE_INIT_PORTS_NUM"),
    ({"PADDLE_INIT_PORTS_NUM_FOR_SPARSE": "-2"}, "PADDLE_INIT_PORTS_NUM_FOR_SPARSE"),
    ({"PADDLE_BARRIER_TIMEOUT": "soon"}, "PADDLE_BARRIER_TIMEOUT"),
    ({"PADDLE_BARRIER_TIMEOUT": "-5"}, "PADDLE_BARRIER_TIMEOUT"),
])
def test_bad_values_name_the_variable(changes, name):
    with pytest.raises(ContractError, match=name):
        JobEnv.from_environ({**GOOD, **changes})


@pytest.mark.parametrize("env, name", [
    ({"PADDLE_PSERVER_IPS": "a,b", "PADDLE_TRAINERS": "2"}, "PADDLE_PSERVER_PORT"),
    ({**SEED_COMMON, "PADDLE_PSERVER_PORT": "x"}, "PADDLE_PSERVER_PORT"),
    ({**SEED_COMMON, "PADDLE_TRAINERS": "2.5"}, "PADDLE_TRAINERS"),
    # a pserver that names an address no pserver has, or one several pservers share
    ({**SEED_COMMON, "PADDLE_TRAINING_ROLE": "PSERVER", "PADDLE_CURRENT_IP": "ps9"}, "PADDLE_CURRENT_IP"),
    ({**SEED_COMMON, "PADDLE_PSERVER_IPS": "ps0,ps0", "PADDLE_TRAINING_ROLE": "PSERVER",
      "PADDLE_CURRENT_IP": "ps0"}, "PADDLE_CURRENT_IP"),
])
def test_bad_seed_style_values_name_the_variable(env, name):
    with pytest.raises(ContractError, match=name):
        JobEnv.from_environ(env)


def test_constructor_refuses_inconsistent_contract():
    with pytest.raises(ContractError, match="PADDLE_TRAINER_ID"):
        job(role=TRAINER, trainer_id=4)
    with pytest.raises(ContractError, match="PADDLE_INIT_PORTS_NUM"):
        job(ports_num=0)


# -- ports -------------------------------------------------------------------------------------------
def test_port_helpers():
    env = job()
    assert env.ports_per_pserver == 5
    assert env.dense_ports(0) == (7164, 7165)
    assert env.sparse_ports(0) == (7166, 7167, 7168)
    assert env.all_ports(1) == (7169, 7170, 7171, 7172, 7173)
    assert env.all_ports(1) == env.dense_ports(1) + env.sparse_ports(1)
    # pservers on one node take consecutive, non-overlapping ranges
    assert set(env.all_ports(0)).isdisjoint(env.all_ports(1))
    assert env.all_ports(0)[-1] + 1 == env.all_ports(1)[0]


def test_sparse_shares_dense_ports_when_none_configured():
    env = job(ports_num_for_sparse=0)
    assert env.sparse_ports(2) == env.dense_ports(2) == env.all_ports(2) == (7164, 7165)


def test_config_and_contract_agree_on_the_port_layout():
    cfg = ClusterConfig(hosts=(HostSpec.parse("a"),), paddle_port=9000, paddle_ports_num=2,
                        paddle_ports_num_for_sparse=1, pservers_per_node=3)
    env = JobEnv("j", tuple(Endpoint("a", cfg.pserver_ports(k)[0]) for k in range(3)), 1,
                 ports_num=cfg.paddle_ports_num, ports_num_for_sparse=cfg.paddle_ports_num_for_sparse)
    for k in range(3):
        assert env.all_ports(k) == cfg.pserver_ports(k)
    assert cfg.node_ports() == tuple(range(9000, 9009))


def test_one_port_model():
    assert pserver_ports(9000, 2, 1) == (9000, 9001, 9002)
    assert pserver_ports(9000, 2, 1, index=2) == (9006, 9007, 9008)
    assert pserver_ports(9000, 1, 0, index=3) == (9003,)


# -- the process-local companion -------------------------------------------------------------------------
def test_process_env_defaults_and_round_trip():
    assert ProcessEnv.from_environ({}) == ProcessEnv()
    assert ProcessEnv().max_frame_bytes == 1 << 30 and ProcessEnv().log_level == "INFO"
    p = ProcessEnv(job_dir="/j", trainer_id=3, max_frame_bytes=4096, log_level="DEBUG")
    assert ProcessEnv.from_environ(p.to_environ()) == p
    # a trainer launched with the v2 names only
    assert ProcessEnv.from_environ({"PADDLE_INIT_TRAINER_ID": "2"}).trainer_id == 2
    # the job-wide contract and its companion agree on what they share
    env = job().for_process(TRAINER, 3, "10.0.0.2").to_environ()
    assert ProcessEnv.from_environ(env) == ProcessEnv(job_dir="/home/paddle/JOB1", trainer_id=3)


@pytest.mark.parametrize("changes, name", [
    ({"PADDLE_MAX_FRAME_BYTES": "big"}, "PADDLE_MAX_FRAME_BYTES"),
    ({"PADDLE_MAX_FRAME_BYTES": "0"}, "PADDLE_MAX_FRAME_BYTES"),
    ({"PADDLE_TRAINER_ID": "x"}, "PADDLE_TRAINER_ID"),
    ({"PADDLE_TRAINER_ID": "-2"}, "PADDLE_TRAINER_ID"),
])
def test_process_env_bad_values_name_the_variable(changes, name):
    with pytest.raises(ContractError, match=name):
        ProcessEnv.from_environ(changes)


def test_environment_doc_lists_every_variable():
    from pathlib import Path

    doc = (Path(__file__).resolve().parent.parent / "docs" / "environment.md").read_text()
    env = collective_job()
    names = set(env.for_process(TRAINER, 0, "h").to_environ()) | set(env.for_process(PSERVER, 0, "h").to_environ())
    for name in sorted(names):
        assert f"| `{name}` |" in doc, name  # a row of the table
    assert "JobEnv.from_environ()" in doc


# -- the collective variables (torch.distributed, paddle.distributed, Paddle fleet) --------------------------------
def collective_job(**kw) -> JobEnv:
    """``job()`` with its trainers' collective side: two nodes, two trainers each, after the pservers' ports."""
    base = dict(trainer_endpoints=tuple(Endpoint(h, p) for h in ("10.0.0.1", "10.0.0.2") for p in (7175, 7176)),
                master_port=7174, local_world_size=2, nic="eth0")
    base.update(kw)
    return job(**base)


def test_a_trainer_gets_torchrun_and_paddle_launch_variables():
    env = collective_job().for_process(TRAINER, 3, "10.0.0.2").to_environ()
    assert {k: env[k] for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                "GROUP_RANK")} == {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "7174", "RANK": "3",
                                                   "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                                                   "GROUP_RANK": "1"}
    assert env["PADDLE_TRAINER_ENDPOINTS"] == "10.0.0.1:7175,10.0.0.1:7176,10.0.0.2:7175,10.0.0.2:7176"
    assert env["PADDLE_CURRENT_ENDPOINT"] == "10.0.0.2:7176"
    assert env["PADDLE_TRAINER_ID"] == "3" and env["PADDLE_TRAINERS_NUM"] == "4" and env["TRAINING_ROLE"] == TRAINER
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "eth0"
    assert env["PADDLE_PSERVERS_IP_PORT_LIST"] == env["PADDLE_PSERVER_ENDPOINTS"]


def test_a_pserver_gets_the_names_paddle_fleet_reads():
    env = collective_job().for_process(PSERVER, 1, "10.0.0.1").to_environ()
    assert (env["TRAINING_ROLE"], env["POD_IP"], env["PADDLE_PORT"]) == (PSERVER, "10.0.0.1", "7169")
    assert env["PADDLE_CURRENT_ENDPOINT"] == "10.0.0.1:7169" and "RANK" not in env and "LOCAL_RANK" not in env
    assert env["PADDLE_PSERVERS_IP_PORT_LIST"] == "10.0.0.1:7164,10.0.0.1:7169,10.0.0.2:7164,10.0.0.2:7169"


def test_env_overrides_the_interface_only():
    env = collective_job(extra={"GLOO_SOCKET_IFNAME": "ib0"}).for_process(TRAINER, 0, "h").to_environ()
    assert env["GLOO_SOCKET_IFNAME"] == "ib0" and env["NCCL_SOCKET_IFNAME"] == "eth0"
    from paddle_cluster.contract import SOCKET_IFNAME_VARS, TORCH_VARS, reserved_names

    reserved = reserved_names()
    assert set(TORCH_VARS) | {"PADDLE_TRAINER_ENDPOINTS", "TRAINING_ROLE", "POD_IP", "PADDLE_PORT"} <= reserved
    assert not set(SOCKET_IFNAME_VARS) & reserved


@pytest.mark.parametrize("form", ["job", "trainer", "pserver"])
def test_collective_round_trip(form):
    env = collective_job()
    env = {"job": dataclasses.replace(env, secret=""), "trainer": env.for_process(TRAINER, 2, "10.0.0.2"),
           "pserver": env.for_process(PSERVER, 3, "10.0.0.2")}[form]
    assert JobEnv.from_environ(env.to_environ()) == env


def test_a_job_without_pservers_is_a_contract_of_trainers():
    env = collective_job(pservers=(), ports_num=1, ports_num_for_sparse=0).for_process(TRAINER, 1, "10.0.0.1")
    environ = env.to_environ()
    assert environ["PADDLE_PSERVER_ENDPOINTS"] == "" and "PADDLE_PSERVERS_IP_PORT_LIST" not in environ
    back = JobEnv.from_environ(environ)
    assert back == env and back.pservers == () and back.trainer_id == 1
    assert JobEnv.from_environ({}) is None


@pytest.mark.parametrize("kw, msg", [
    (dict(trainer_endpoints=(Endpoint("h", 1),)), "PADDLE_TRAINER_ENDPOINTS names 1 trainers"),
    (dict(local_world_size=3), "LOCAL_WORLD_SIZE=3"),
])
def test_inconsistent_collective_values_are_refused(kw, msg):
    with pytest.raises(ContractError, match=msg):
        collective_job(**kw)


def test_trainer_ports_follow_the_pservers():
    assert trainer_ports(7164, 2, 2, 1, 3) == (7170, 7171, 7172, 7173)  # MASTER_PORT, then 3 trainers
    assert trainer_ports(7164, 0, 2, 1, 1) == (7164, 7165)  # no pservers: MASTER_PORT is PADDLE_PORT
    assert trainer_ports(7164, 2, 2, 1, 3)[0] == pserver_ports(7164, 2, 1, 1)[-1] + 1


def _literal_uses(tree) -> set:
    """The ``PADDLE_*`` string constants a module uses as a variable's name: a key or subscript, a ``get``/
    ``pop``/``setdefault`` argument, an ``in`` test, or a module constant's value. Text in messages is not."""
    import ast

    def name(node) -> str:
        ok = isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("PADDLE_")
        return node.value if ok and not node.value.startswith("PADDLE_CLUSTER_") else ""  # the launcher's own

    found = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Subscript):
            found.add(name(n.slice))
        elif isinstance(n, ast.Dict):
            found.update(name(k) for k in n.keys if k is not None)
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in (
                "get", "pop", "setdefault") and n.args:
            found.add(name(n.args[0]))
        elif isinstance(n, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in n.ops):
            found.add(name(n.left))
        elif isinstance(n, ast.Assign):
            found.add(name(n.value))
    return found - {""}


def test_only_contract_names_the_variables():
    """contract.py says it is the one module that reads or sets the variables: others use its constants."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    spelt = {}
    for path in sorted((root / "paddle_cluster").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel != "paddle_cluster/contract.py":
            names = _literal_uses(ast.parse(path.read_text(encoding="utf-8")))
            if names:
                spelt[rel] = sorted(names)
    assert spelt == {}
