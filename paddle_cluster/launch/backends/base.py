"""The launch backend interface: how a job's planned processes get started somewhere, watched and stopped.

A backend (a) prepares the nodes and delivers the workspace, (b) starts each node's share of a ``JobPlan``,
(c) yields what happens as typed events (``node.messages`` events, plus ``NodeLost``) and (d) stops it all.
The node side is the same everywhere: ``python -m paddle_cluster.node supervise`` receives its ``NodePlan`` and
runs it alone (pservers, readiness, trainers), so a backend only carries plans in and events out. Planning
(``plan``) and supervision (``supervise``: fail-fast, elastic, restarts, the result) do not know which
backend runs the job.
"""

from __future__ import annotations

import queue
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Union

from paddle_cluster.node import messages as m

from ..plan import JobPlan, JobSpec, mint_plan


@dataclass(frozen=True)
class NodeLost:
    """A node's agent can no longer be heard (its channel closed, or silent for ORPHAN_TIMEOUT)."""

    node: int
    why: str


Event = Union[m.Log, m.Started, m.Exited, m.Ready, m.NotReady, m.Note, m.Stopping, m.Stopped, NodeLost]


class Backend(ABC):
    """Runs the nodes' shares of a plan and reports their events."""

    names: List[str]  # node i's short name in output prefixes: "node1"
    labels: List[str]  # and in messages: "node1 (root@10.0.0.2)"
    pythons: List[str] = []  # node i's interpreter as ``prepare`` resolved it (absolute), for every process there
    # With --resume_from, the checkpoint step every pserver resumes from, once ``prepare`` found it complete for
    # each (``launch/resume.py``); None: the pservers look for it themselves (and refuse to start without one).
    resume_step: Optional[int] = None

    @abstractmethod
    def prepare(self, spec: JobSpec, say: Callable[[str], None]) -> List[str]:
        """Make every node ready to run ``spec`` (node library, preflight, workspace); each node's address."""

    def plan(self, spec: JobSpec, addresses: List[str]) -> JobPlan:
        """The job's plan on the prepared nodes, with a fresh id and secret. A backend whose nodes are not
        the hosts of HOSTS (Kubernetes: one per pod) makes its own."""
        plan = mint_plan(spec, addresses, self.pythons)
        return plan.resumed(self.resume_step) if self.resume_step is not None else plan

    def remember(self) -> Dict[str, str]:
        """What ``kill``, ``status`` and ``logs`` need besides the config to find this job again."""
        return {}

    def log_of(self, plan: JobPlan, node: int, proc: m.ProcPlan) -> str:
        """Where the whole log of ``proc`` on ``node`` is, for a failure report."""
        return f"{plan.spec.job_dir}/log/{proc.log}"

    def unstopped(self, nodes: List[int]) -> str:
        """What to tell the user about ``nodes``, whose stop ``stop`` could not confirm."""
        return (f"no stop confirmation from {', '.join(self.labels[i] for i in nodes)}; their agents stop on their "
                f"own within ORPHAN_TIMEOUT")

    @abstractmethod
    def start(self, plan: JobPlan) -> None:
        """Hand every node its share of ``plan``; events flow from now until ``stop``."""

    @abstractmethod
    def next_event(self, timeout: float) -> Optional[Event]:
        """The next event of the started job within ``timeout`` s, or None."""

    @abstractmethod
    def request_stop(self, grace: float) -> None:
        """Ask every node to stop its processes now; returns at once (safe from a signal handler)."""

    @abstractmethod
    def stop(self, grace: float) -> List[int]:
        """Stop every process started (SIGTERM, ``grace`` s, SIGKILL) and wait for each node to confirm;
        returns the nodes that did not. Nothing started: nothing to do."""

    @abstractmethod
    def complete_steps(self, root: str, pservers: Dict[int, List[int]]) -> List[List[int]]:
        """For each node holding pservers (``{node: [pserver ids]}``), the checkpoint steps under ``root``
        whose shards of those pservers are complete."""

    @abstractmethod
    def close(self) -> None:
        """Release connections; the backend is not used afterwards."""


EVENTS_MAX = 10_000  # events waiting for the launcher's main loop (a few MB at most)


class EventQueue:
    """The events of one start of a job, from every node, and the watch every backend needs: a node that is
    silent for ``orphan_timeout`` s (its agent sends heartbeats) or whose channel ends unasked is lost."""

    def __init__(self, nodes: Sequence[int], orphan_timeout: float) -> None:
        self.orphan_timeout = orphan_timeout
        self.last_heard: Dict[int, float] = {i: time.monotonic() for i in nodes}
        self.stopped: Dict[int, m.Stopped] = {}
        self._q: queue.Queue[Event] = queue.Queue(maxsize=EVENTS_MAX)
        self._lost: set = set()
        self._lock = threading.Lock()
        self.closing = False  # set when the job is being stopped: from then on a full queue drops, never blocks
        self.dropped = 0

    def put(self, node: int, ev: Union[m.Event, NodeLost]) -> None:
        """An event that arrived on node ``node``'s channel."""
        self.last_heard[node] = time.monotonic()
        if isinstance(ev, m.Heartbeat):
            return
        if isinstance(ev, m.Stopped):
            self.stopped[node] = ev
        self._enqueue(ev, node)

    def _enqueue(self, ev: Event, node: Optional[int] = None) -> None:
        """Back-pressure: while the queue is full the node's reader waits here, so its channel and in the end
        the process writing the output wait too; once the job is being stopped an event that does not fit is
        dropped instead, so the stop confirmations (recorded before queueing) always get through."""
        while True:
            try:
                self._q.put(ev, block=not self.closing, timeout=0.2)
                return
            except queue.Full:
                if node is not None:
                    self.last_heard[node] = time.monotonic()  # it is waiting for us, not silent
                if self.closing:
                    self.dropped += 1
                    return

    def starting(self, seconds: float) -> None:
        """The agents are being started by an engine (ssh to every node, its daemons, Python), which takes a
        while: a node's silence counts from its first word, or after ``seconds``."""
        for i in self.last_heard:
            self.last_heard[i] = time.monotonic() + seconds

    def channel_closed(self, node: int) -> None:
        if node not in self.stopped:
            self._report_lost(NodeLost(node, "its agent's connection closed"))

    def silent(self) -> List[int]:
        """The nodes not heard from for ``orphan_timeout`` s (an agent that said it stopped is not silent)."""
        now = time.monotonic()
        return [i for i, t in self.last_heard.items() if now - t > self.orphan_timeout and i not in self.stopped]

    def get(self, timeout: float) -> Optional[Event]:
        try:
            return self._q.get(timeout=timeout)
        except queue.Empty:
            pass
        for i in self.silent():
            self._report_lost(NodeLost(i, f"no word from its agent for {self.orphan_timeout:.0f} s (ORPHAN_TIMEOUT)"))
        try:
            return self._q.get_nowait()
        except queue.Empty:
            return None

    def _report_lost(self, ev: NodeLost) -> None:
        with self._lock:
            if ev.node in self._lost:
                return
            self._lost.add(ev.node)
        self._enqueue(ev)

    def wait_stopped(self, nodes: Sequence[int], seconds: float) -> List[int]:
        """Wait up to ``seconds`` for every one of ``nodes`` that can still be heard to confirm its stop; the
        nodes without a confirmation. (One silent for ORPHAN_TIMEOUT stops on its own: waiting would stall.)"""
        reachable = [i for i in nodes if i not in self.silent()]
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and any(i not in self.stopped for i in reachable):
            time.sleep(0.05)
        return [i for i in nodes if i not in self.stopped]
