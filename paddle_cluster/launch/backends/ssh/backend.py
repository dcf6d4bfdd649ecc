"""The SSH backend: the hosts of ``HOSTS``, each reached over SSH (Fabric), or as a subprocess for ``localhost``.

Each node gets the node library and the workspace (``dispatch``), then one long-lived command stream running
``python -m paddle_cluster.node supervise``: the launcher writes the node's ``Start`` (its share of the plan)
and a ``Ping`` every 2 s into it, the agent writes its events back. A closed stream or a silent agent is a
lost node; a silent launcher makes every agent stop on its own.
"""

from __future__ import annotations

import threading
from typing import Callable, Dict, List, Optional, cast

from paddle_cluster.node import messages as m

from ... import nodecmd
from ...access import make_nodes
from ...config import ClusterConfig
from ...each_node import each_node
from ...errors import HostError
from ...hosts import CommandStream, Node
from ...plan import JobPlan, JobSpec, Topology
from ..base import Backend, BackendHelp, Description, Event, EventQueue, JobRef, LiveJob, Prepared, Request, plan_text
from ..on_hosts import CHECKS, OnHosts
from . import jobs
from .prepare import PING_S, Preparation, SSHPrepared

NOTE_MAX = 4096  # characters of a line that is not an event shown to the user
SECOND_STOP_S = 2.0  # after a second interrupt, how long the stop still waits for the nodes' confirmations
LOOPBACK_NIC, LOOPBACK = "lo", "127.0.0.1"  # Linux's loopback interface and the address its probe finds


class SSHBackend(OnHosts, Backend):
    name = "ssh"
    help = BackendHelp("HOSTS over SSH; localhost as a subprocess", "the plan each node is given", CHECKS)

    def __init__(self, cfg: ClusterConfig) -> None:
        self.cfg = cfg
        self.nodes = make_nodes(cfg)
        self.names = tuple(n.name for n in self.nodes)
        self.labels = tuple(n.label for n in self.nodes)

    # -- preparing ------------------------------------------------------------------------------------
    def probe_cluster(self, say: Callable[[str], None], check_ports: bool = True) -> List[str]:
        """Install the node library everywhere and probe every node (NIC address, free ports, numpy, ROOT_DIR);
        each node's address on PADDLE_NIC."""
        return [p.address for p in self._prepare(None, say, check_ports).topology.nodes]

    def prepare(self, spec: JobSpec, say: Callable[[str], None]) -> SSHPrepared:
        return self._prepare(spec, say, True, agent=True)

    def prepare_nodes(self, spec: JobSpec, say: Callable[[str], None]) -> SSHPrepared:
        """``prepare`` for an engine that starts the agents itself (mpirun): each session ends once prepared."""
        return self._prepare(spec, say, True)

    def preview(self, spec: JobSpec, say: Callable[[str], None]) -> SSHPrepared:
        """Each address a placeholder until the hosts are probed, except on the loopback interface, whose address
        is known (and decides the pservers' endpoints: ``plan.build_plan``)."""
        nic = self.cfg.paddle_nic
        return SSHPrepared(Topology.hosts(self.cfg, [LOOPBACK if nic == LOOPBACK_NIC else f"<{n.spec.host}:{nic}>"
                                                     for n in self.nodes]), self.names, self.labels, tuple(self.nodes))

    def render(self, plan: JobPlan, prepared: Prepared) -> Request:
        # The native request is each node's share of the plan, its ``Start``.
        return Request(plan, ((f"ssh plan of job {plan.name}: one agent per host ({self.cfg.python} -m "
                               "paddle_cluster.node supervise, over SSH; localhost as a subprocess) runs its "
                               f"processes. Nothing was started.\nAddresses are each host's on PADDLE_NIC "
                               f"({self.cfg.paddle_nic}), found when the job starts.",
                               plan_text(plan, prepared.labels)),), {"backend": self.name}, prepared)

    @classmethod
    def describe(cls, job: JobRef) -> Description:
        return Description("", jobs.job_status(job.cfg, job.name, dict(job.ended) if job.ended else None))

    @classmethod
    def logs(cls, job: JobRef, node: str, role: str, lines: int, follow: bool, out: Callable[[str], None]) -> None:
        jobs.stream_logs(job.cfg, job.name, node, role, lines, follow, out)

    @classmethod
    def cancel(cls, job: JobRef, say: Callable[[str], None]) -> List[str]:
        nodes = jobs.kill_job(job.cfg, job.name)
        say(jobs.kill_summary(job.cfg, job.name, nodes))
        return [r.line(job.name) for r in nodes]

    def deliver(self, spec: JobSpec, say: Callable[[str], None]) -> SSHPrepared:
        """Only the workspace (and the probe that comes with it), as ``prepare`` does."""
        return self._prepare(spec, say, False)

    def close(self) -> None:
        """The connections of ``probe_cluster`` and ``deliver`` (a job's are its ``SSHPrepared``'s)."""
        each_node(self.nodes, lambda n: n.close())

    def _prepare(self, spec: Optional[JobSpec], say: Callable[[str], None], check_ports: bool,
                 agent: bool = False) -> SSHPrepared:
        """One session per node, all at once (``prepare.Preparation``). Failing, it closes the nodes' connections."""
        try:
            return Preparation(self.cfg, self.nodes, spec, say, check_ports, agent).run()
        except BaseException:
            self.close()
            raise

    # -- running --------------------------------------------------------------------------------------
    def submit(self, request: Request, say: Callable[[str], None]) -> SSHLiveJob:
        """Each node's ``Start``: its share of the plan (the request's), to its prepared session's agent, or a new
        agent's on a restart."""
        job = SSHLiveJob(request, self.cfg)
        try:
            job.start()
        except BaseException:
            lost = job.stop(self.cfg.kill_grace)  # the agents that did start
            if lost:
                say(job.unstopped(lost))
            raise
        return job


class SSHLiveJob(LiveJob):
    """One start over SSH: each node's agent stream, the events read from them, the pings that keep them."""

    def __init__(self, request: Request, cfg: ClusterConfig) -> None:
        super().__init__(request)
        self.prepared, self.cfg = cast(SSHPrepared, request.prepared), cfg  # a request this backend rendered
        self.streams: Dict[int, CommandStream] = {}
        self.events = EventQueue([n.node for n in self.plan.nodes], cfg.orphan_timeout)
        self._pinging = threading.Event()

    def start(self) -> None:
        prepared, cfg, plan, events = self.prepared, self.cfg, self.plan, self.events
        lib = prepared.lib
        held = dict(prepared.waiting)  # the prepared sessions' agents take the first start; a restart starts new ones
        prepared.waiting.clear()
        for i in held:  # what the nodes printed before their agents spoke is shown as theirs
            for line in prepared.early.get(i, ()):
                events.put(i, m.Note(i, line[:NOTE_MAX]))

        def start(n: Node) -> CommandStream:
            s = held.pop(n.index, None) or n.stream(nodecmd.agent_argv(
                n, lib, "supervise", "--orphan-timeout", str(cfg.orphan_timeout), "--grace", str(cfg.kill_grace)))
            try:
                s.write_line(m.encode(m.Start(plan.nodes[n.index])))
            except (OSError, EOFError) as e:  # its session ended between preparing and starting
                raise HostError(n.label, f"its agent ended before the job started ({e}); run again") from None
            return s

        res = each_node(prepared.nodes, start)
        self.streams = dict(res.values)
        for i, s in self.streams.items():
            threading.Thread(target=_read, args=(i, s, events), daemon=True, name=f"agent{i}").start()
        threading.Thread(target=self._ping, args=(self._pinging,), daemon=True, name="pinger").start()
        res.ok("starting the node agents")

    def _ping(self, done: threading.Event) -> None:
        while not done.wait(PING_S):
            self._send_all(m.Ping())

    def _send_all(self, msg: m.Command) -> None:
        for i, s in list(self.streams.items()):
            if i not in self.events.stopped:
                try:
                    s.write_line(m.encode(msg))
                except Exception:  # noqa: BLE001 - a dead stream is noticed by its reader
                    pass

    def next_event(self, timeout: float) -> Optional[Event]:
        return self.events.get(timeout)

    def request_stop(self, grace: float) -> None:
        if grace == 0 and self.events.closing:  # a second interrupt during the stop: end it now, not after a silent
            self.events.hurry(SECOND_STOP_S)   # node's confirmation time; what it may have left is named
        self._send_all(m.Stop(grace))

    def stop(self, grace: float) -> List[int]:
        if not self.streams:
            return []
        self.events.closing = True
        self.request_stop(grace)
        unconfirmed = self.events.wait_stopped(sorted(self.streams), self.cfg.kill_grace + 15)
        self._pinging.set()
        for s in self.streams.values():
            try:
                s.close()
            except Exception:  # noqa: BLE001 - that agent stops on its own when the stream closes
                pass
        self.streams = {}
        return unconfirmed

    def complete_steps(self, root: str, pservers: Dict[int, List[int]]) -> List[List[int]]:
        return hosts_complete_steps(self.prepared, root, pservers)


def hosts_complete_steps(prepared: SSHPrepared, root: str, pservers: Dict[int, List[int]]) -> List[List[int]]:
    """``LiveJob.complete_steps`` on the hosts of HOSTS: ``node checkpoints`` on each holding pservers."""
    lib = prepared.lib

    def steps(n: Node) -> List[int]:
        doc = nodecmd.agent_json(n, lib, "checkpoints", "--root", root, "--pservers",
                                 ",".join(map(str, pservers[n.index])), what=f"listing checkpoints in {root}",
                                 timeout=300)
        if not doc.get("ok"):
            raise HostError(n.label, f"listing checkpoints in {root}: {doc.get('error')}")
        return doc["steps"]

    return each_node([n for n in prepared.nodes if n.index in pservers], steps).ok("looking for the latest checkpoint")


def _read(i: int, stream: CommandStream, events: EventQueue) -> None:
    for line in stream.lines():  # bounded: an over-long line arrives as a note saying it was dropped
        try:
            ev = m.decode(line)
        except Exception:  # noqa: BLE001 - whatever a line is, it is shown, never the end of this reader
            ev = None  # e.g. a Python error before the agent could speak
        events.put(i, ev if isinstance(ev, m.EVENTS) else m.Note(i, line[:NOTE_MAX]))
    events.channel_closed(i)
