"""The job plan (launch/plan.py) and the launcher<->agent messages (node/messages.py), without any host."""

from __future__ import annotations

import dataclasses
import json

import pytest

from paddle_cluster.contract import PSERVER, TRAINER, Endpoint, JobEnv
from paddle_cluster.launch.config import ClusterConfig, HostSpec
from paddle_cluster.launch.plan import JobSpec, Topology, build_plan
from paddle_cluster.node import messages as m

ADDRS = ("10.0.0.1", "10.0.0.2", "10.0.0.3")


def spec(**over) -> JobSpec:
    cfg = ClusterConfig(hosts=tuple(HostSpec.parse(a) for a in ADDRS), root_dir="/r", paddle_port=9000,
                        paddle_ports_num=2, paddle_ports_num_for_sparse=1, pservers_per_node=2, trainers_per_node=1,
                        python="py", trainer_command="{python} train.py", ld_library_path="/x/lib",
                        env={"MY": "1"}, start_timeout=42.0)
    fields = {k: over.pop(k) for k in list(over) if k in {f.name for f in dataclasses.fields(ClusterConfig)}}
    return JobSpec(dataclasses.replace(cfg, **fields), "job1", **{"dispatch_dir": "/ws", **over})


def plan_on(sp: JobSpec, addresses, job_id=None, secret=None):
    """``build_plan`` of ``sp`` on the hosts of its config, at these addresses."""
    return build_plan(sp, Topology.hosts(sp.cfg, addresses), job_id, secret)


def test_processes_are_placed_node_major_pservers_first_on_each_node():
    plan = plan_on(spec(), ADDRS, "job1-abcd", "s" * 64)
    assert [[p.name for p in n.procs] for n in plan.nodes] == [
        ["pserver.0", "pserver.1", "trainer.0"], ["pserver.2", "pserver.3", "trainer.1"],
        ["pserver.4", "pserver.5", "trainer.2"]]
    n1 = plan.nodes[1]
    assert (n1.node, n1.address, n1.job_dir, n1.cwd) == (1, "10.0.0.2", "/r/job1", "/r/job1")
    assert [p.log for p in n1.procs] == ["server.2.log", "server.3.log", "train.log"]
    assert [p.cmd for p in n1.procs] == ["py -m paddle_cluster.ps"] * 2 + ["py train.py"]
    assert (n1.start_timeout, n1.ld_library_path) == (42.0, "/x/lib")
    assert plan.pserver_ids() == {0: [0, 1], 1: [2, 3], 2: [4, 5]}


def test_every_node_waits_for_every_pserver_port_of_the_job():
    plan = plan_on(spec(), ADDRS, "job1-abcd", "s" * 64)
    # 2 pservers per node, 3 ports each (2 dense + 1 sparse), the second pserver after the first's ports
    want = tuple(Endpoint(a, p) for a in ADDRS for p in range(9000, 9006))
    assert all(n.endpoints == want for n in plan.nodes)
    assert plan.env.pservers == tuple(Endpoint(a, p) for a in ADDRS for p in (9000, 9003))


def test_the_environment_is_the_contract_split_into_job_wide_and_per_process():
    plan = plan_on(spec(), ADDRS, "job1-abcd", "s" * 64)
    n2 = plan.nodes[2]
    assert n2.environ["MY"] == "1" and "PADDLE_JOB_SECRET" not in n2.environ  # the job-wide part holds no key
    assert all(n.environ == n2.environ for n in plan.nodes)  # job-wide: the same everywhere
    for p in n2.procs:
        # Only pservers hold the job secret; a trainer holds its own key and nothing else.
        assert ("PADDLE_JOB_SECRET" in p.env) == (p.role == PSERVER)
        assert ("PADDLE_TRAINER_KEY" in p.env) == (p.role == TRAINER)
        got = JobEnv.from_environ({**n2.environ, **p.env})
        assert got.role == p.role and got.current_ip == "10.0.0.3"
        assert (got.pserver_id if p.role == PSERVER else got.trainer_id) == p.index
        assert got.trainers == 3 and len(got.pservers) == 6 and got.job_id == "job1-abcd"


def test_trainer_arguments_are_quoted_and_workspace_is_the_cwd():
    plan = plan_on(spec(trainer_args=("--name", "a b"), workspace="/shared/ws", dispatch_dir=None), ADDRS,
                      "j", "s")
    tr = plan.nodes[0].trainers[0]
    assert tr.cmd == "py train.py --name 'a b'"
    # the workspace is linked into the job directory, where nodefile, log/ and output/ are the node's own
    assert plan.nodes[0].cwd == "/r/job1" and plan.nodes[0].workspace == plan.env.workspace == "/shared/ws"


def test_a_restart_is_the_same_job_resuming_from_a_step():
    plan = plan_on(spec(), ADDRS)
    again = plan.resumed(30)
    assert (again.env.job_id, again.env.secret) == (plan.env.job_id, plan.env.secret)
    assert again.env.resume == "30" and again.env.checkpoint_dir == "/r/job1/checkpoints"
    assert again.nodes[0].environ["PADDLE_RESUME"] == "30"
    assert [[p.name for p in n.procs] for n in again.nodes] == [[p.name for p in n.procs] for n in plan.nodes]
    resume_vars = ("PADDLE_RESUME", "PADDLE_CHECKPOINT_DIR")
    assert {k: v for k, v in again.nodes[0].environ.items() if k not in resume_vars} == \
        {k: v for k, v in plan.nodes[0].environ.items() if k not in resume_vars}
    scratch = plan.resumed(None)
    assert scratch.env.resume == "" and "PADDLE_RESUME" not in scratch.nodes[0].environ
    assert plan_on(spec(), ADDRS).env.secret != plan.env.secret  # a new job gets a new secret


def test_resume_from_an_earlier_job_or_a_directory():
    by_name = plan_on(spec(resume_from="old"), ADDRS, "j", "s")
    assert by_name.env.resume == "latest" and by_name.env.checkpoint_dir == "/r/old/checkpoints"
    assert by_name.spec.checkpoint_root == "/r/old/checkpoints"
    by_dir = plan_on(spec(resume_from="/data/ck"), ADDRS, "j", "s")
    assert by_dir.env.checkpoint_dir == "/data/ck"
    assert plan_on(spec(), ADDRS, "j", "s").spec.checkpoint_root == "/r/job1/checkpoints"


def test_nodes_without_pservers_or_trainers():
    plan = plan_on(spec(pservers_per_node=0, trainers_per_node=2), ("a", "b"), "j", "s")
    assert plan.env.pservers == () and plan.nodes[0].endpoints == () and plan.pserver_ids() == {}
    assert [p.log for p in plan.nodes[1].trainers] == ["train.2.log", "train.3.log"]


def test_every_trainer_gets_its_collective_place():
    plan = plan_on(spec(trainers_per_node=2), ADDRS, "j", "s" * 64)
    # The trainer ports follow the pservers' 9000..9005 on every node: MASTER_PORT, then one per local trainer.
    assert plan.env.master_port == 9006
    assert plan.env.trainer_endpoints == tuple(Endpoint(a, p) for a in ADDRS for p in (9007, 9008))
    for n in plan.nodes:
        for p in n.trainers:
            env = {**n.environ, **p.env}
            assert (env["MASTER_ADDR"], env["MASTER_PORT"], env["WORLD_SIZE"]) == ("10.0.0.1", "9006", "6")
            assert (env["RANK"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"], env["GROUP_RANK"]) == (
                str(p.index), str(p.index % 2), "2", str(n.node))
            assert env["PADDLE_CURRENT_ENDPOINT"] == f"{n.address}:{9007 + p.index % 2}"
            assert env["GLOO_SOCKET_IFNAME"] == "eth0"


def test_a_collective_plan_is_trainers_only_from_paddle_port():
    plan = plan_on(spec(pservers_per_node=0), ADDRS, "j", "s" * 64)
    assert all(n.procs == n.trainers and n.endpoints == () for n in plan.nodes)
    assert (plan.env.master_port, plan.env.trainer_endpoints[2]) == (9000, Endpoint("10.0.0.3", 9001))
    assert plan.spec.cfg.node_ports() == (9000, 9001)  # what preflight checks is free: the trainers' ports


def test_a_collective_job_refuses_what_needs_pservers():
    from paddle_cluster.launch.errors import ConfigError

    # Each says the option (the value where it has one, not a flag's True) and the fix.
    for kw, head, fix in ((dict(resume_from="JOB1"), "--resume_from JOB1: ", "drop --resume_from and have the "
                           "script resume from the state it saved itself"),
                          (dict(elastic=True), "--elastic: ", "drop --elastic (a collective job stops when a trainer "
                           "fails")):
        with pytest.raises(ConfigError) as e:
            spec(pservers_per_node=0, **kw)
        assert str(e.value).startswith(head + "this job has no pservers") and fix in str(e.value), e.value
        assert "or give the job pservers (drop --collective, or PSERVERS_PER_NODE >= 1" in str(e.value)


# -- messages -----------------------------------------------------------------------------------------
def test_every_message_survives_encode_and_decode():
    plan = plan_on(spec(), ADDRS, "job1-abcd", "s" * 64)
    msgs = [m.Start(plan.nodes[1]), m.Ping(), m.Stop(), m.Stop(0.0), m.Log(1, "trainer.1", "x \u00e9 \"q\""),
            m.Started(1, "pserver.2", 123), m.Exited(1, "trainer.1", 3, None), m.Exited(0, "pserver.0", None, 9),
            m.Exited(0, "pserver.0", 127, None, "cannot start"), m.Ready(2), m.NotReady(2, "why"),
            m.Note(0, "n"), m.Heartbeat(0), m.Stopped(1, "stopped by the launcher", ("trainer.1",))]
    for msg in msgs:
        line = m.encode(msg)
        assert "\n" not in line
        back = m.decode(line)
        assert back == msg and type(back) is type(msg)
    start = m.decode(m.encode(msgs[0]))
    assert isinstance(start.plan.endpoints[0], Endpoint) and isinstance(start.plan.procs, tuple)
    assert start.plan.trainers[0].role == TRAINER


@pytest.mark.parametrize("line, what", [
    ("", "not a message"), ("{}", "not a message"), ("[1]", "not a message"), ('{"type": "Nope"}', "not a message"),
    ('{"type": "Log", "node": 0, "proc": "p"}', "Log"),
    ('{"type": "Log", "node": 0, "proc": "p", "line": "l", "extra": 1}', "unknown field"),
    ('{"type": "Started", "node": "0", "proc": "p", "pid": 1}', "expected int"),
    ('{"type": "Started", "node": true, "proc": "p", "pid": 1}', "expected int"),
    ('{"type": "Stopped", "node": 0, "reason": "r", "killed": "ab"}', "expected a list"),
    ('{"type": "Start", "plan": 5}', "expected an object"),
])
def test_malformed_lines_are_refused_with_the_reason(line, what):
    with pytest.raises(m.MessageError, match=what):
        m.decode(line)


def test_plan_with_wrong_types_is_refused():
    plan = plan_on(spec(), ADDRS, "j", "s")
    doc = json.loads(m.encode(m.Start(plan.nodes[0])))
    doc["plan"]["environ"]["PADDLE_X"] = 1
    with pytest.raises(m.MessageError, match="object of strings"):
        m.decode(json.dumps(doc))


def test_default_job_names_of_one_config_never_repeat(tmp_path, monkeypatch):
    """Two runs started within one second get two job directories, not one refused as "already exists"."""
    from paddle_cluster.launch import journal
    from paddle_cluster.launch.journal import default_job_name

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    cfg = spec().cfg
    names = []
    for _ in range(3):
        names.append(default_job_name(cfg))
        journal.remember(cfg, names[-1], None)
        journal.record_outcome(cfg, names[-1], 0, "finished", "")
    assert len(set(names)) == 3 and all(n.startswith("JOB") for n in names), names
    if names[0][:17] == names[2][:17]:  # all three within one second
        assert names[1:] == [names[0] + "-2", names[0] + "-3"], names


def test_default_job_names_of_two_configs_on_the_same_hosts_never_repeat(tmp_path, monkeypatch):
    """Two configs (two conf files) naming the same hosts and ROOT_DIR, run within one second: two job names."""
    from paddle_cluster.launch import journal
    from paddle_cluster.launch.journal import default_job_name

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    a = spec().cfg
    b = dataclasses.replace(a, source=a.source + ".other")
    first = default_job_name(a)
    journal.remember(a, first, None)
    second = default_job_name(b)
    assert second != first, (first, second)
    if second[:17] == first[:17]:  # within one second
        assert second == first + "-2"
