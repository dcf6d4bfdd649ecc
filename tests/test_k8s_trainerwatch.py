"""How a pserver pod decides its trainers are gone (``node/trainerwatch.py``), with the pod's connections and the
resolver's answers as inputs and the clock given: trainers never seen are never gone, connected ones need no DNS,
NXDOMAIN for the grace ends the pserver, and a resolver failing for ever does not hide trainers that left."""

from __future__ import annotations

from typing import List, Set, Tuple

import pytest

from paddle_cluster.node import trainerwatch as tw
from paddle_cluster.node.trainerwatch import GONE_GRACE_S, NXDOMAIN, UNANSWERED_GONE_S, TrainersGone, peers

NAMES = ["fit-trainer-0.fit.ml.svc", "fit-trainer-1.fit.ml.svc"]


class Cluster:
    """What the pod sees: its connections and the resolver's answer for every name (``asked`` counts the queries)."""

    def __init__(self) -> None:
        self.conns: Set[str] = set()
        self.answer: Tuple[List[str], str] = ([], NXDOMAIN)
        self.asked = 0

    def lookup(self, name: str) -> Tuple[List[str], str]:
        self.asked += 1
        return self.answer


@pytest.fixture
def cluster(monkeypatch) -> Cluster:
    c = Cluster()
    monkeypatch.setattr(tw, "lookup", c.lookup)
    monkeypatch.setattr(tw, "cluster_domain", lambda host: "")
    return c


def run(w: TrainersGone, start: float, until: float, step: float = 0.5) -> Tuple[float, str]:
    t = start
    while t <= until:
        why = w.check(t)
        if why:
            return t, why
        t += step
    return t, ""


def test_trainers_never_seen_are_never_gone(cluster: Cluster) -> None:
    w = TrainersGone(NAMES, [9000], lambda line: None, connected=lambda: cluster.conns)
    assert run(w, 0, 3600, 5)[1] == ""  # an hour of NXDOMAIN: not scheduled yet (a node being added, a quota)
    assert cluster.asked < 2 * 3600 / tw.IDLE_ASK_S + 4  # asked every IDLE_ASK_S, not every second


def test_connected_trainers_need_no_dns_and_nxdomain_after_they_left_ends_the_pserver(cluster: Cluster) -> None:
    w = TrainersGone(NAMES, [9000], lambda line: None, connected=lambda: cluster.conns)
    cluster.conns = {"0A000007"}
    assert run(w, 0, 600)[1] == "" and cluster.asked == 0
    cluster.conns = set()  # the trainer pods ended: their names go from the DNS
    t, why = run(w, 601, 700)
    assert why.startswith("the cluster DNS has answered NXDOMAIN for every trainer's name") and t >= 601 + GONE_GRACE_S
    assert t < 601 + GONE_GRACE_S + 2 * tw.ASK_S


def test_an_address_breaks_the_nxdomain_run(cluster: Cluster) -> None:
    w = TrainersGone(NAMES, [9000], lambda line: None, connected=lambda: cluster.conns)
    cluster.conns = {"0A000007"}
    w.check(0)
    cluster.conns = set()
    run(w, 1, 1 + GONE_GRACE_S - 2)
    cluster.answer = (["10.0.0.7"], "")  # a stale negative answer: the trainer is still there
    assert run(w, GONE_GRACE_S, GONE_GRACE_S + 4)[1] == ""
    cluster.answer = ([], NXDOMAIN)
    t, why = run(w, GONE_GRACE_S + 5, 100)
    assert why and t >= GONE_GRACE_S + 5 + GONE_GRACE_S


def test_a_resolver_failing_for_ever_does_not_hide_trainers_that_left(cluster: Cluster) -> None:
    said: List[str] = []
    w = TrainersGone(NAMES, [9000], said.append, connected=lambda: cluster.conns)
    cluster.conns = {"0A000007"}
    w.check(0)
    cluster.conns, cluster.answer = set(), ([], "Temporary failure in name resolution")
    t, why = run(w, 1, 1000)
    assert "has not answered" in why and "Temporary failure in name resolution" in why, why
    assert 1 + UNANSWERED_GONE_S <= t < 1 + UNANSWERED_GONE_S + 2 * tw.ASK_S
    assert said == ["cannot resolve the trainers' names (Temporary failure in name resolution): asking again; a "
                    "resolver failure does not count as the trainers being gone"]


def test_a_resolver_failing_while_trainers_only_resolved_ends_nothing(cluster: Cluster) -> None:
    """Trainers that resolve but never connected may wait for another pserver (one waiting for a node): a DNS
    outage then says nothing of them."""
    w = TrainersGone(NAMES, [9000], lambda line: None, connected=lambda: cluster.conns)
    cluster.answer = (["10.0.0.7"], "")
    run(w, 0, 20)
    cluster.answer = ([], "Temporary failure in name resolution")
    assert run(w, 21, 2000, 5)[1] == ""


def test_peers_are_the_established_connections_to_the_ports_from_elsewhere(tmp_path) -> None:
    """/proc/net/tcp as the kernel writes it (one of each: a peer on the port, the pod itself, loopback, a listener,
    another port); the stand-in's runs (tests/test_k8s_run.py) read the real one."""
    table = tmp_path / "tcp"
    table.write_text(
        "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
        "   0: 00000000:2328 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 1\n"
        "   1: 0500000A:2328 0700000A:D431 01 00000000:00000000 00:00000000 00000000  1000        0 2\n"
        "   2: 0500000A:2328 0500000A:D432 01 00000000:00000000 00:00000000 00000000  1000        0 3\n"
        "   4: 0100007F:2328 0200007F:D434 01 00000000:00000000 00:00000000 00000000  1000        0 5\n"
        "   3: 0500000A:1F90 0800000A:D433 01 00000000:00000000 00:00000000 00000000  1000        0 4\n")
    assert peers([9000], (str(table),)) == {"0700000A"}
    assert peers([9000, 8080], (str(table),)) == {"0700000A", "0800000A"}
