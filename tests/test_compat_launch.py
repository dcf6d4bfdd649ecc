"""The launcher's side of running PaddlePaddle users' files as they are: the entry script in both roles, the v2
options, same-machine HOSTS entries (pure parts; the runs are in test_compat_run.py)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
from helpers import checkout_env

from paddle_cluster import contract
from paddle_cluster.contract import PSERVER, TRAINER, ContractError, Endpoint, JobEnv
from paddle_cluster.launch import entry, machines
from paddle_cluster.launch.config import builtin_default, parse_config
from paddle_cluster.launch.errors import ConfigError
from paddle_cluster.launch.plan import JobSpec, Topology, build_plan
from paddle_cluster.node.probe import machine_id


# -- v2 options ------------------------------------------------------------------------------------------
def test_v2_options_both_spellings_booleans_and_other_arguments_left_alone():
    got = contract.v2_options(["--trainer_count=4", "--use_gpu", "false", "--num_passes", "3", "--local",
                               "--data", "x", "--saving_period=2", "pos", "--save_dir=out"])
    assert got == {"trainer_count": "4", "use_gpu": "0", "num_passes": "3", "local": "1", "saving_period": "2",
                   "save_dir": "out"}
    assert contract.v2_options(["--use_gpu=True", "--ports_num", "3"]) == {"use_gpu": "1", "ports_num": "3"}


@pytest.mark.parametrize("args, words", [
    (["--trainer_count=four"], ["--trainer_count=four", "whole number"]),
    (["--use_gpu=maybe"], ["--use_gpu=maybe", "true or false"]),
    (["--trainer_id=1"], ["--trainer_id=1", "PADDLE_INIT_TRAINER_ID", "launcher"]),
    (["--pservers", "10.0.0.1"], ["PADDLE_INIT_PSERVERS", "HOSTS"]),
])
def test_v2_options_refused_with_the_option_and_the_fix(args, words):
    with pytest.raises(ContractError) as e:
        contract.v2_options(args)
    for w in words:
        assert w in str(e.value)


def test_init_options_reach_every_process_environment():
    env = JobEnv("j", (Endpoint("127.0.0.1", 7164),), 2, init={"trainer_count": "4", "num_passes": "3"})
    for role, i in ((TRAINER, 1), (PSERVER, 0)):
        e = env.for_process(role, i, "127.0.0.1").to_environ()
        assert e["PADDLE_INIT_TRAINER_COUNT"] == "4" and e["PADDLE_INIT_NUM_PASSES"] == "3"
        assert e["PADDLE_INIT_USE_GPU"] == "0"
    assert contract.init_flags(env.to_environ())["trainer_count"] == "4"
    with pytest.raises(ContractError, match="port"):
        JobEnv("j", (Endpoint("h", 1),), 1, init={"port": "9"})


# -- entry script --------------------------------------------------------------------------------------
TRAINER_ONLY = 'import os\nassert os.environ["PADDLE_TRAINING_ROLE"] == "TRAINER"\n'


def test_handles_pserver_is_a_static_check_of_the_code_for_the_pserver_role():
    assert entry.handles_pserver('import os\nif os.getenv("PADDLE_TRAINING_ROLE") == "PSERVER":\n  serve()\n')
    assert entry.handles_pserver('from paddle_cluster import contract\nif env.role == contract.PSERVER: pass\n')
    # reads the role, but only to check it is a trainer (issue 24): not a pserver
    assert not entry.handles_pserver(TRAINER_ONLY)
    assert not entry.handles_pserver('raise AssertionError("PADDLE_TRAINING_ROLE should be one of [TRAINER, '
                                     'PSERVER]")\n')
    assert not entry.handles_pserver('"""Run me as PSERVER or TRAINER."""\nprint(1)\n')
    assert entry.handles_pserver('if x\n  role == "PSERVER"')  # does not parse: read as text


def _ws(tmp_path, name, text):
    (tmp_path / name).write_text(text)
    return str(tmp_path)


def test_settle_runs_a_role_handling_entry_in_both_roles(tmp_path):
    ws = _ws(tmp_path, "dist_train.py", 'import os\nif os.getenv("PADDLE_TRAINING_ROLE") == "PSERVER": pass\n')
    cfg = builtin_default()
    got = entry.settle(cfg.__class__(**{**cfg.__dict__, "entry": "dist_train.py"}), ws, None,
                       ["--trainer_count=2", "--ports_num", "3"])
    assert got.cfg.commands("py") == ("py dist_train.py", "py dist_train.py")
    assert got.cfg.paddle_ports_num == 3 and got.init == {"trainer_count": "2"}
    # the first line says what was chosen, why, and how to choose the other
    assert got.notes[0].startswith("pservers run dist_train.py as PADDLE_TRAINING_ROLE=PSERVER")
    assert "run --pserver builtin" in got.notes[0]


def test_settle_a_trainer_only_script_gets_the_builtin_pserver(tmp_path):
    ws = _ws(tmp_path, "train.py", TRAINER_ONLY)
    got = entry.settle(builtin_default(), ws, None, [])
    assert got.cfg.commands("py")[0] == "py -m paddle_cluster.ps"
    assert got.notes[0].startswith("pservers run the built-in pserver")
    assert "train.py does not handle PADDLE_TRAINING_ROLE=PSERVER" in got.notes[0]
    assert "run --pserver entry" in got.notes[0]


def test_an_explicit_pserver_command_is_honoured_even_when_it_is_the_default(tmp_path):
    ws = _ws(tmp_path, "train.py", 'import os\nif os.getenv("PADDLE_TRAINING_ROLE") == "PSERVER": pass\n')
    # issue 24: docs/migrating.md's advice, which the launcher ignored because it equals the default
    cfg = parse_config({"HOSTS": ["localhost"], "PSERVER_COMMAND": "{python} -m paddle_cluster.ps"}, "conf.py")
    got = entry.settle(cfg, ws, None, [])
    assert got.cfg.commands("py")[0] == "py -m paddle_cluster.ps"
    assert "PSERVER_COMMAND" in got.notes[0] and "conf.py" in got.notes[0]
    cfg = parse_config({"HOSTS": ["localhost"], "PSERVER_COMMAND": "{python} ps.py"}, "conf.py")
    assert entry.settle(cfg, ws, None, []).cfg.commands("py")[0] == "py ps.py"


def test_run_pserver_option_chooses_either_way_over_the_config(tmp_path):
    ws = _ws(tmp_path, "train.py", TRAINER_ONLY)
    cfg = parse_config({"HOSTS": ["localhost"], "PSERVER_COMMAND": "{python} ps.py"}, "conf.py")
    got = entry.settle(cfg, ws, None, ["--x"], pserver="entry")
    assert got.cfg.commands("py")[0] == "py train.py" and "--pserver entry" in got.notes[0]
    plan = build_plan(JobSpec(got.cfg, "j", dispatch_dir=ws, trainer_args=("--x",)),
                      Topology.hosts(got.cfg, ["127.0.0.1"]))
    assert plan.nodes[0].pservers[0].cmd.endswith("train.py --x")  # the script's arguments reach it as pserver
    got = entry.settle(builtin_default(), _ws(tmp_path, "train.py", 'r = "PSERVER"\n'), None, [], pserver="builtin")
    assert got.cfg.commands("py")[0] == "py -m paddle_cluster.ps" and "--pserver builtin" in got.notes[0]


def test_settle_names_the_choice_for_a_script_only_on_the_nodes(tmp_path):
    # --job_workspace whose script is only on the nodes: the built-in pserver, and how to choose otherwise
    got = entry.settle(builtin_default(), None, str(tmp_path / "elsewhere"), [])
    assert "run --pserver entry" in got.notes[0] and got.cfg.commands("py")[0] == "py -m paddle_cluster.ps"


def test_settle_refuses_a_missing_entry_and_bad_port_options(tmp_path):
    with pytest.raises(ConfigError, match="ENTRY.*nope.py.*no such file in the workspace"):
        entry.settle(parse_config({"HOSTS": ["localhost"], "ENTRY": "nope.py"}, "c"), str(tmp_path), None, [])
    _ws(tmp_path, "train.py", "")
    with pytest.raises(ConfigError, match="--ports_num 0: must be at least 1"):
        entry.settle(builtin_default(), str(tmp_path), None, ["--ports_num=0"])
    with pytest.raises(ConfigError, match="--trainer_id"):
        entry.settle(builtin_default(), str(tmp_path), None, ["--trainer_id=0"])


@pytest.mark.parametrize("bad", ["/abs/train.py", "../train.py", " "])
def test_entry_key_must_name_a_script_in_the_workspace(bad):
    with pytest.raises(ConfigError, match="ENTRY"):
        parse_config({"HOSTS": ["localhost"], "ENTRY": bad}, "conf.py")


def test_entry_is_quoted_into_the_commands():
    cfg = parse_config({"HOSTS": ["localhost"], "ENTRY": "my train.py", "TRAINER_COMMAND": "{python} {entry} -v"},
                       "c")
    assert cfg.commands("py")[1] == "py 'my train.py' -v"


# -- the same machine twice ----------------------------------------------------------------------------
def test_same_machine_is_the_machine_id_and_the_address():
    probes = [{"machine": "a", "address": "10.0.0.1"}, {"machine": "a", "address": "10.0.0.2"},
              {"machine": "b", "address": "10.0.0.1"}, {"machine": "a", "address": "10.0.0.1"}]
    labels = ["node0 (root@10.0.0.1)", "node1 (n1)", "node2 (n2)", "node3 (root@10.0.0.1:22)"]
    assert machines.same_machine_problems(labels, probes) == {
        3: "node0 (root@10.0.0.1) and node3 (root@10.0.0.1:22) are the same machine (same machine id, address "
           "10.0.0.1); list it once in HOSTS and raise PSERVERS_PER_NODE / TRAINERS_PER_NODE instead"}
    with pytest.raises(ConfigError, match="node0 .* and node3 .* are the same machine"):
        machines.refuse_same_machines(labels, probes, "conf.py")
    machines.refuse_same_machines(labels[:3], probes[:3], "conf.py")


def test_machine_id_is_stable_and_not_the_raw_file():
    # Stable across processes (a fresh interpreter computes it anew), not only across calls of one process.
    other = subprocess.run([sys.executable, "-c", "from paddle_cluster.node.probe import machine_id; "
                            "print(machine_id())"], capture_output=True, text=True, check=True, timeout=60,
                           env=checkout_env()).stdout.strip()
    assert machine_id() == other and len(other) == 16
    try:
        raw = open("/etc/machine-id").read().strip()
    except OSError:
        raw = ""
    assert not raw or raw[:16] != machine_id()


# -- the plan ------------------------------------------------------------------------------------------
def test_local_pservers_each_get_a_loopback_address_that_ips_times_port_reproduces():
    cfg = dataclasses.replace(builtin_default(), paddle_port=9100, python="py", entry="dist_train.py",
                              pserver_command="{python} {entry}")
    spec = JobSpec(cfg, "job1", dispatch_dir="/ws", trainer_args=("--num_passes", "2", "a b"),
                   init=(("num_passes", "2"),))
    plan = build_plan(spec, Topology.hosts(cfg, ["127.0.0.1"]))
    assert plan.env.pservers == (Endpoint("127.0.0.1", 9100), Endpoint("127.0.0.2", 9100))
    for p in plan.nodes[0].procs:
        env = {**plan.nodes[0].environ, **p.env}
        seed_eps = [f"{ip}:{env['PADDLE_PSERVER_PORT']}" for ip in env["PADDLE_PSERVER_IPS"].split(",")]
        assert seed_eps == env["PADDLE_PSERVER_ENDPOINTS"].split(",") == ["127.0.0.1:9100", "127.0.0.2:9100"]
        assert p.cmd == "py dist_train.py --num_passes 2 'a b'" and env["PADDLE_INIT_NUM_PASSES"] == "2"
        if p.role == PSERVER:
            assert f"{env['PADDLE_CURRENT_IP']}:{env['PADDLE_PSERVER_PORT']}" == env["PADDLE_CURRENT_ENDPOINT"]
    # a real NIC keeps one address and consecutive port ranges
    eth0 = dataclasses.replace(cfg, paddle_nic="eth0")
    plan = build_plan(dataclasses.replace(spec, cfg=eth0), Topology.hosts(eth0, ["10.0.0.1"]))
    assert plan.env.pservers == (Endpoint("10.0.0.1", 9100), Endpoint("10.0.0.1", 9102))


def test_transpile_refuses_endpoints_other_than_the_launchers(monkeypatch):
    from paddle_cluster.compat.paddle.fluid import DistributeTranspiler

    env = JobEnv("j", (Endpoint("10.0.0.1", 7164), Endpoint("10.0.0.1", 7166)), 1, secret="s" * 64)
    for k, v in env.for_process(TRAINER, 0, "10.0.0.1").to_environ().items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match="10.0.0.1:7164,10.0.0.1:7166 .PADDLE_PSERVER_ENDPOINTS"):
        DistributeTranspiler().transpile(trainer_id=0, pservers="10.0.0.2:7164,10.0.0.1:7166", trainers=1)


# -- the node layout ---------------------------------------------------------------------------------------
def test_layout_links_a_workspace_keeps_per_node_files_and_refuses_a_shared_job_dir(tmp_path):
    from paddle_cluster.node import layout

    ws, job = tmp_path / "ws", tmp_path / "root" / "job"
    (ws / "data").mkdir(parents=True)
    for name in ("train.py", "nodefile", "output"):
        (ws / name).write_text("x")
    job.mkdir(parents=True)
    layout.prepare(str(job), 1, str(ws))
    assert os.readlink(job / "train.py") == str(ws / "train.py") and os.readlink(job / "data") == str(ws / "data")
    assert (job / "nodefile").read_text() == "1\n" and (job / "output").is_dir() and (job / "log").is_dir()
    assert not (job / "output").is_symlink() and (ws / "nodefile").read_text() == "x"  # the workspace's untouched
    layout.prepare(str(job), 1, str(ws))  # a restart of the same node
    with pytest.raises(layout.LayoutError, match="already node 1's job directory: ROOT_DIR is on a filesystem"):
        layout.prepare(str(job), 2, str(ws))
    for log, info in (("train.log", "paddle_trainer.INFO"), ("server.3.log", "paddle_pserver2.3.INFO")):
        layout.info_link(str(job / "log"), log)
        assert os.readlink(job / "log" / info) == log
    layout.info_link(str(job / "log"), "metrics.trainer0.jsonl")
    assert sorted(os.listdir(job / "log")) == ["paddle_pserver2.3.INFO", "paddle_trainer.INFO"]
