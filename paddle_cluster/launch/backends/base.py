"""The launch backend contract: a job's whole life on one engine, as a scheduler in TorchX's sense.

A ``Backend`` is the scheduler: ``prepare(spec)`` makes the nodes ready and returns what it made (a ``Prepared``:
where the processes run, its ``Topology``, and what submitting needs; ``preview(spec)`` says the same with
nothing touched, for a dry run), ``plan.build_plan`` makes the job of the topology, ``render(plan, prepared)``
makes the native ``Request`` with no side effect, and ``submit(request)`` submits exactly that request and
returns the live job (a ``LiveJob``). ``run --dry-run`` and ``render`` print the
``Request`` that ``submit`` would be given.

A ``LiveJob`` owns that one submission: its events (``node.messages`` events, plus ``NodeLost``) read with
``next_event``, its stop and what it holds open; a restart is another submission. On most backends a node agent
(``python -m paddle_cluster.node supervise`` or ``bootstrap``) runs each node's share of the plan, so a backend
only carries plans in and events out. A job is found again by its handle (``JobRef``: the journal's for a job
started earlier, a live job's ``ref``) to ``describe``, ``logs`` and ``cancel`` it. Supervision (``supervise``:
fail-fast, elastic, restarts, the result) does not know which backend runs the job.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from paddle_cluster.node import messages as m

from ..config import ClusterConfig, ConfKey
from ..errors import ClusterError
from ..plan import JobPlan, JobSpec, Topology

if TYPE_CHECKING:
    from ..fetch import Outputs
    from ..preflight import CheckLine
    from ..top import Source


@dataclass(frozen=True)
class BackendOption:
    """An option of ``run`` (and ``render``) that one backend declares; given with another backend it is an error."""

    flag: str  # "--partition"
    dest: str  # the keyword the backend's ``create`` gets: "partition"
    help: str
    kind: type = str  # str, int (at least ``minimum``) or bool (a flag)
    metavar: str = ""
    minimum: Optional[int] = None
    multiple: bool = False  # may be given more than once: a tuple of values
    check: bool = False  # ``check`` takes it too (its ``check`` gets it)


@dataclass(frozen=True)
class BackendHelp:
    """What ``--help`` says of a backend, beside its options."""

    summary: str  # where its jobs run: "HOSTS over SSH"
    renders: str  # what ``render`` prints: "the sbatch script"
    checks: str = ""  # what ``check`` looks at ("": it has no check of its own)
    render_hint: str = ""  # what to do with ``render``'s output, for ``render <name> --help``
    node_hint: str = ""  # what else ``logs NODE`` takes: "a pod, fit-trainer-0"


@dataclass(frozen=True)
class ProcRow:
    """One process of a job as ``status`` shows it."""

    node: str
    host: str
    address: str
    name: str
    role: str
    pid: Optional[int]  # None where there is no pid of ours to show (see ``process``)
    state: str
    progress: str
    last_line: str
    process: str = ""  # without a pid, the engine's name for the process: "pod/fit-trainer-0-x7k2p"

    @property
    def pid_text(self) -> str:
        """What the ``pid`` column shows: the pid, or the engine's name for the process."""
        return str(self.pid) if self.pid is not None else self.process or "-"


def status_json(job_name: str, ended: Optional[Mapping[str, Any]], rows: List[ProcRow]) -> str:
    """``status --json``: the job, how it ended (null fields while it runs or when it ended elsewhere), its rows."""
    ended = ended or {}
    return json.dumps({"job": job_name, "outcome": ended.get("outcome"), "exit_code": ended.get("exit_code"),
                       "message": ended.get("message"), "processes": [r.__dict__ for r in rows]}, indent=1)


@dataclass(frozen=True)
class Description:
    """What ``describe`` finds of a job: the engine's own line about it ("" when it has none), and its processes."""

    head: str
    rows: List[ProcRow]


@dataclass(frozen=True)
class JobRef:
    """A job started earlier, as the journal knows it: the config, its name, and its backend's handle (``submit``'s:
    a Slurm job id, a Kubernetes namespace); ``ended``, the outcome ``run`` recorded."""

    cfg: ClusterConfig
    name: str
    handle: Mapping[str, str]
    ended: Optional[Mapping[str, Any]] = None


@dataclass(frozen=True)
class Prepared:
    """What ``prepare`` made ready for a job, or (``preview``) what it would, nothing made: where the processes run
    and each node's names. A backend's own adds what its ``render`` and ``submit`` need (the node library, the
    sessions waiting to become agents, ...); it travels in every ``Request`` rendered from it, and ``close``
    releases what is left of it once the job is over."""

    topology: Topology
    names: Tuple[str, ...]  # node i's short name in output prefixes: "node1"
    labels: Tuple[str, ...]  # and in messages: "node1 (root@10.0.0.2)"

    def close(self) -> None:
        """Release what it holds (connections, files) that no submission took; nothing by default."""


@dataclass(frozen=True)
class Request:
    """The native request a backend makes of its engine for one start of a plan: ``submit`` submits it as it is,
    with what ``prepare`` made (``prepared``), and ``text`` -- each part with a comment saying what it is, no
    credential but a manifest's Secret -- is what ``run --dry-run`` and ``render`` print. A backend's own request
    adds its native fields (the sbatch script, the mpirun command line and files, the manifests)."""

    plan: JobPlan
    parts: Tuple[Tuple[str, str], ...]  # (comment, text)
    handle: Mapping[str, str]  # what ``describe``, ``logs`` and ``cancel`` need besides the config to find it
    prepared: Prepared

    def text(self) -> str:
        out = []
        for comment, body in self.parts:
            out += [f"# {line}" for line in comment.splitlines()]
            out.append(body.rstrip("\n"))
        return "\n".join(out) + "\n"


@dataclass(frozen=True)
class NodeLost:
    """A node's agent can no longer be heard (its channel closed, or silent for ORPHAN_TIMEOUT)."""

    node: int
    why: str


@dataclass(frozen=True)
class JobRefused:
    """The cluster will not run the job as it is: it refused to create its processes, or ended it itself (a
    deadline). ``why`` names the object and the cluster's reason."""

    why: str


@dataclass(frozen=True)
class Requeued:
    """The cluster took the whole job back to start it again later (Kueue preempted it): every process it stopped
    is forgotten, and the job is followed anew once its new processes start. ``why``: the cluster's reason."""

    why: str


Event = Union[m.Log, m.Started, m.Exited, m.Ready, m.NotReady, m.Note, m.Stopping, m.Stopped, NodeLost, JobRefused,
              Requeued]


class Backend(ABC):
    """The scheduler of one engine: prepares the nodes, renders and submits a plan's request, finds its jobs. What
    every engine provides; ``check``, ``metrics``, ``figures`` and ``outputs`` refuse unless it offers them (the
    engines on the machines of HOSTS share theirs: ``hosts.OnHosts``)."""

    name: ClassVar[str]  # as BACKEND and --backend say it
    help: ClassVar[BackendHelp]
    options: ClassVar[Tuple[BackendOption, ...]] = ()
    conf_keys: ClassVar[Tuple[ConfKey, ...]] = ()  # its keys of conf.py, beside ClusterConfig's (``cfg.<key>``)
    needs_workspace: ClassVar[bool] = True  # --job_dispatch_package or --job_workspace (k8s: in the image)
    needs_hosts: ClassVar[bool] = True  # its nodes are the machines of HOSTS (False: the engine gives the nodes)
    detach: ClassVar[str] = "its node agents stop when no launcher follows them (ORPHAN_TIMEOUT)"  # "": submit
    # may return at once (a backend created with ``detach``): the job then runs with no launcher following it

    @classmethod
    def create(cls, cfg: ClusterConfig, opts: Mapping[str, Any], detach: bool = False) -> Backend:
        """The backend for a job with the declared ``options`` given (absent ones None)."""
        return cls(cfg)  # type: ignore[call-arg]

    @abstractmethod
    def preview(self, spec: JobSpec, say: Callable[[str], None]) -> Prepared:
        """What ``prepare`` would make, with no side effect (addresses not known yet: placeholders)."""

    @abstractmethod
    def prepare(self, spec: JobSpec, say: Callable[[str], None]) -> Prepared:
        """Make every node ready to run ``spec`` (node library, preflight, workspace); where its processes run
        and what submitting needs. On failure it releases what it made."""

    @abstractmethod
    def render(self, plan: JobPlan, prepared: Prepared) -> Request:
        """The native request of ``plan`` on ``prepared``, with no side effect: nothing started or written, the
        backend as it was."""

    @abstractmethod
    def submit(self, request: Request, say: Callable[[str], None]) -> LiveJob:
        """Submit ``request`` as it is; the live job. Followed (not ``--detach``): its events flow from now until
        its ``stop``. Restarts submit the request of the resumed plan. On failure nothing of it is left running."""

    @classmethod
    @abstractmethod
    def describe(cls, job: JobRef) -> Description:
        """Where the job stands, each process a row."""

    @classmethod
    @abstractmethod
    def logs(cls, job: JobRef, node: str, role: str, lines: int, follow: bool, out: Callable[[str], None]) -> None:
        """The last ``lines`` lines of ``node``'s logs (and, with ``follow``, new ones until the job ends)."""

    @classmethod
    def metrics(cls, job: JobRef) -> Dict[str, List[dict]]:
        """Each trainer's metrics records, for ``plot``."""
        raise ClusterError(f"plot: backend {cls.name} keeps no metrics of its jobs where plot can read them")

    @classmethod
    def figures(cls, job: JobRef) -> Source:
        """Where ``top`` reads the job's figures each frame."""
        raise ClusterError(f"top: backend {cls.name} has no figures of its jobs to show")

    @classmethod
    def outputs(cls, job: JobRef) -> Outputs:
        """Where ``fetch`` copies the job's files from."""
        raise ClusterError(f"fetch: backend {cls.name} has no files of its jobs to copy here")

    @classmethod
    def outputs_at(cls, cfg: ClusterConfig, name: str) -> str:
        """Where the job's outputs are, for the line ``run`` ends with."""
        return f"{cfg.job_dir(name)}/output/ on each node (trainer 0's on node0)"

    @classmethod
    def check(cls, cfg: ClusterConfig, opts: Mapping[str, Any]) -> Sequence[CheckLine]:
        """``paddle-cluster check``: whether what its jobs run on is ready (``help.checks``), a row per thing
        checked, with the declared options marked ``check`` given (absent ones None)."""
        raise ClusterError(f"check --backend {cls.name}: nothing to check here (backend {cls.name} has no check of "
                           "its own)")

    @classmethod
    @abstractmethod
    def cancel(cls, job: JobRef, say: Callable[[str], None]) -> List[str]:
        """Stop everything of the job; what was done, a line each (``say``: the launcher's own summary)."""


class LiveJob(ABC):
    """One submitted request, as ``submit`` returns it: the handle of that one start of the job (``ref``, for
    ``describe``, ``logs`` and ``cancel``) and all its state: its events, its stop, what it holds open."""

    def __init__(self, request: Request) -> None:
        self.request, self.plan = request, request.plan
        self.names, self.labels = request.prepared.names, request.prepared.labels
        self.ref = JobRef(request.plan.spec.cfg, request.plan.name, dict(request.handle))

    @abstractmethod
    def next_event(self, timeout: float) -> Optional[Event]:
        """The next event of the job within ``timeout`` s, or None."""

    def holding(self) -> bool:
        """The cluster holds the job back (queued for admission, pulling its image): the start timeout waits."""
        return False

    def why_waiting(self) -> str:
        """What the cluster last said of the processes not started yet (an image it cannot pull, ...), for the
        start timeout's error; "" when it said nothing."""
        return ""

    @abstractmethod
    def request_stop(self, grace: float) -> None:
        """Ask every node to stop its processes now; returns at once (safe from a signal handler)."""

    @abstractmethod
    def stop(self, grace: float) -> List[int]:
        """Stop every process started (SIGTERM, ``grace`` s, SIGKILL) and wait for each node to confirm;
        returns the nodes that did not. Stopped already: nothing to do."""

    @abstractmethod
    def complete_steps(self, root: str, pservers: Dict[int, List[int]]) -> List[List[int]]:
        """For each node holding pservers (``{node: [pserver ids]}``), the checkpoint steps under ``root``
        whose shards of those pservers are complete."""

    def close(self) -> None:  # noqa: B027 - a job whose stop released everything holds nothing more
        """Release what following it holds (readers, watches); the job itself runs on unless stopped."""

    def log_of(self, node: int, proc: m.ProcPlan) -> str:
        """Where the whole log of ``proc`` on ``node`` is, for a failure report."""
        return f"{self.plan.spec.job_dir}/log/{proc.log}"

    def unstopped(self, nodes: List[int]) -> str:
        """What to tell the user about ``nodes``, whose stop ``stop`` could not confirm."""
        return (f"no stop confirmation from {', '.join(self.labels[i] for i in nodes)}: the job's processes there "
                f"may still run (their agents stop them on their own within ORPHAN_TIMEOUT); `paddle-cluster kill "
                f"--job_name {self.plan.name}` stops them")


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
        self.closed: set = set()  # nodes whose channel ended: nothing more can come from them
        self._lock = threading.Lock()
        self.closing = False  # set when the job is being stopped: from then on a full queue drops, never blocks
        self.hurried = float("inf")  # when a wait for stop confirmations ends at the latest (``hurry``)
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
        self.closed.add(node)
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

    def hurry(self, seconds: float) -> None:
        """A wait for stop confirmations (under way or to come) ends ``seconds`` from now at the latest."""
        self.hurried = min(self.hurried, time.monotonic() + seconds)

    def wait_stopped(self, nodes: Sequence[int], seconds: float) -> List[int]:
        """Wait up to ``seconds`` for every one of ``nodes`` that can still be heard to confirm its stop; the
        nodes without a confirmation. (One silent for ORPHAN_TIMEOUT stops on its own, and one whose channel
        ended can say nothing more: waiting for either would only stall the stop.)"""
        silent = self.silent()
        reachable = [i for i in nodes if i not in silent and i not in self.closed]
        deadline = time.monotonic() + seconds
        while time.monotonic() < min(deadline, self.hurried) and any(i not in self.stopped for i in reachable):
            time.sleep(0.05)
        return [i for i in nodes if i not in self.stopped]


def plan_text(plan: JobPlan, labels: Sequence[str]) -> str:
    """What each node of ``plan`` runs, for a dry run: its processes' commands, logs and own variables (keys and
    the job secret shown as <set>: a dry run prints no credential)."""
    def shown(k: str, v: str) -> str:
        return f"{k}=<set>" if k.endswith(("SECRET", "KEY")) else f"{k}={v}"

    out = ["job-wide environment: " + " ".join(shown(k, v) for k, v in sorted(plan.nodes[0].environ.items()))
           if plan.nodes else "no nodes"]
    for n, label in zip(plan.nodes, labels):
        out.append(f"{label}: address {n.address}, in {n.cwd}")
        for p in n.procs:
            env = " ".join(shown(k, v) for k, v in sorted(p.env.items()))
            out.append(f"  {p.name}: {p.cmd}" + (f"  > log/{p.log}" if p.log else "") + (f"\n    {env}" if env else ""))
    return "\n".join(out)
