"""The small things a new user noticed in the first hour (issue 24, item 8): a trainer's ``PWD`` is its working
directory, no trainer line comes before "all N pserver(s) listening", and a local pserver's ``PSERVER_READY``
address is the one ``status`` shows."""

from __future__ import annotations

import json
from typing import List, Optional

import pytest
from helpers import cli, local_conf

from paddle_cluster.contract import PSERVER, TRAINER
from paddle_cluster.launch.backends.base import LiveJob, Prepared, Request
from paddle_cluster.launch.config import builtin_default
from paddle_cluster.launch.plan import JobSpec, Topology, build_plan
from paddle_cluster.launch.supervise import Attempt
from paddle_cluster.node import messages as m

WHERE = '''
import os
print("PWD", os.environ.get("PWD"), "CWD", os.getcwd(), flush=True)
'''

TINY = '''
import numpy as np
from paddle_cluster.ps import OptimizerSpec, connect

ps = connect(mode="sync", optimizer=OptimizerSpec("sgd", lr=0.1))
v = ps.register_dense({"w": np.zeros(2, dtype=np.float32)})
for _ in range(3):
    v = ps.push_pull({"w": np.ones(2, dtype=np.float32)})
ps.close()
'''


def test_a_trainers_pwd_is_its_working_directory(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "train.py").write_text(WHERE)
    conf = local_conf(tmp_path, PSERVERS_PER_NODE=1, TRAINERS_PER_NODE=1)
    res = cli(conf, "run", "--job_dispatch_package", str(ws), "--job_name", "pwd")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    line = next(x for x in res.stdout.splitlines() if "] PWD " in x)
    _, pwd, _, cwd = line.split("] ", 1)[1].split(" ")
    assert pwd == cwd == str(tmp_path / "root" / "pwd"), line


def test_local_pserver_ready_line_and_status_name_the_same_address(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "train.py").write_text(TINY)
    conf = local_conf(tmp_path, PSERVERS_PER_NODE=2, TRAINERS_PER_NODE=1)  # the local demo's layout
    res = cli(conf, "run", "--job_dispatch_package", str(ws), "--job_name", "addr")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    st = cli(conf, "status", "--job_name", "addr", "--json")
    assert st.returncode == 0, st.stderr
    shown = {p["name"]: p["address"] for p in json.loads(st.stdout)["processes"]}
    for k in (0, 1):
        log = (tmp_path / "root" / "addr" / "log" / f"server.{k}.log").read_text()
        ready = next(x for x in log.splitlines() if x.startswith("PSERVER_READY"))
        assert ready.split()[2] == shown[f"pserver.{k}"] == f"127.0.0.{k + 1}", (ready, shown)
    assert shown["trainer.0"] == "127.0.0.1"


class _Replay(LiveJob):
    """The events of two nodes in the order seen on the 3-host cluster: node 0's pservers' readiness and its
    trainer's first line arrive before node 1's readiness (its agent's word travels on another connection)."""

    def __init__(self, request: Request, events: List[object]) -> None:
        super().__init__(request)
        self.events = list(events)

    def next_event(self, timeout: float) -> Optional[object]:
        return self.events.pop(0) if self.events else None

    def request_stop(self, grace: float) -> None:
        pass

    def stop(self, grace: float) -> List[int]:
        return []

    def complete_steps(self, root, pservers):  # noqa: ANN001
        return []


def test_no_trainer_line_is_shown_before_every_pserver_listens():
    spec = JobSpec(builtin_default(), "order")
    plan = build_plan(spec, Topology.hosts(spec.cfg, ["10.0.0.1", "10.0.0.2"]))
    t0 = next(p.name for p in plan.nodes[0].procs if p.role == TRAINER)
    assert any(p.role == PSERVER for p in plan.nodes[1].procs)
    shown: List[str] = []
    events = [m.Ready(0), m.Log(0, t0, "epoch 0 loss 1.0"), m.Ready(1)]
    events += [m.Exited(n.node, p.name, 0, None) for n in plan.nodes for p in n.procs if p.role == TRAINER]
    request = Request(plan, (), {}, Prepared(plan.topology, ("node0", "node1"), ("node0 (a)", "node1 (b)")))
    Attempt(request, _Replay(request, events), shown.append, lambda _s: None).run(None)
    listening = next(i for i, x in enumerate(shown) if x.startswith("all 4 pserver(s) listening"))
    trainer = shown.index(f"[{t0}@node0] epoch 0 loss 1.0")
    assert listening < trainer, shown


@pytest.mark.timeout(30)
def test_stop_does_not_wait_for_a_node_whose_channel_ended():
    """A node whose agent's connection closed (the agent was killed) can never confirm its stop: ``stop`` must
    not wait KILL_GRACE + 15 s for it. The others' confirmations are still waited for and counted. (Broken,
    this call waits its hour and the timeout fails the test.)"""
    from paddle_cluster.launch.backends.base import EventQueue

    events = EventQueue([0, 1, 2], orphan_timeout=3600)
    events.put(0, m.Stopped(0, reason="stopped"))
    events.channel_closed(1)
    assert events.wait_stopped([0, 1, 2], 0) == [1, 2]
    events.put(2, m.Stopped(2, reason="stopped"))
    assert events.wait_stopped([0, 1, 2], 3600) == [1]
