"""The SSH backend: the hosts of ``HOSTS``, each reached over SSH (Fabric), or as a subprocess for ``localhost``.

Each node gets the node library and the workspace (``dispatch``), then one long-lived command stream running
``python -m paddle_cluster.node supervise``: the launcher writes the node's ``Start`` (its share of the plan)
and a ``Ping`` every 2 s into it, the agent writes its events back. A closed stream or a silent agent is a
lost node; a silent launcher makes every agent stop on its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import secrets
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union, cast

from paddle_cluster.node import messages as m
from paddle_cluster.node.session import SessionRequest

from ... import dispatch, machines, nodecmd, preflight, progress, relay, resume
from ...access import make_nodes
from ...config import ClusterConfig
from ...each_node import each_node
from ...errors import HostConfigError, HostError
from ...hosts import CommandStream, Node
from ...plan import JobPlan, JobSpec, Topology
from ...session import NodeSession
from ..base import Backend, BackendHelp, Description, Event, EventQueue, JobRef, LiveJob, Prepared, Request, plan_text
from ..on_hosts import CHECKS, OnHosts
from . import jobs

NOTE_MAX = 4096  # characters of a line that is not an event shown to the user

PING_S = 2.0
SECOND_STOP_S = 2.0  # after a second interrupt, how long the stop still waits for the nodes' confirmations
LOOPBACK_NIC, LOOPBACK = "lo", "127.0.0.1"  # Linux's loopback interface and the address its probe finds
NO_LIBRARY = dispatch.Package("", "<node library sha256>", 0, 0)  # a dry run's: nothing installed


@dataclass(frozen=True)
class SSHPrepared(Prepared):
    """The hosts made ready: their connections, the node library on each, each one's network and, after
    ``prepare``, each one's session waiting to become the agent of the job's first start (``waiting``, which that
    start takes, with what the nodes printed meanwhile)."""

    nodes: Tuple[Node, ...] = ()
    lib: dispatch.Package = NO_LIBRARY
    networks: Tuple[Optional[str], ...] = ()  # each node's PADDLE_NIC network (CIDR), from the probe
    waiting: Dict[int, CommandStream] = field(default_factory=dict)
    early: Dict[int, Tuple[str, ...]] = field(default_factory=dict)
    # The workspace step: what it took after the last node was up, and from the first byte sent
    workspace_seconds: float = 0.0
    sending_seconds: float = 0.0

    def close(self) -> None:
        for s in self.waiting.values():  # prepared, never started: their agents end with their stdin
            s.close()
        self.waiting.clear()
        each_node(self.nodes, lambda n: n.close())


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
        """One session per node, all at once: library, probe, workspace (and with ``agent``, the agent that
        waits for its ``Start``): see ``launch/session.py``. Failing, it closes the nodes' connections."""
        try:
            return self._sessions(spec, say, check_ports, agent)
        except BaseException:
            self.close()
            raise

    def _sessions(self, spec: Optional[JobSpec], say: Callable[[str], None], check_ports: bool,
                  agent: bool) -> SSHPrepared:
        cfg = self.cfg
        with dispatch.library_archive() as lib, open(lib.path, "rb") as f:
            lib_data = f.read()
        # What this preparation holds: the cached workspace archive (no concurrent launch evicts it meanwhile),
        # the progress bars, where deltas are made.
        stack = contextlib.ExitStack()
        pkg = None
        try:
            if spec is not None and spec.dispatch_dir:
                # A new workspace is packed while it is sent (its hash comes last); an unchanged one is cached.
                pkg = dispatch.workspace_archive(spec.dispatch_dir, dispatch.workspace_cache_dir(), hold=stack)
                if isinstance(pkg, dispatch.Packing):
                    stack.callback(pkg.close)
                say(f"workspace {spec.dispatch_dir}: {pkg.files} files, {pkg.size / 1e6:.1f} MB, "
                    + (f"sha256 {pkg.sha256[:12]}" if isinstance(pkg, dispatch.Package) else "new: packed as sent"))
            req = SessionRequest(cfg.paddle_nic, cfg.root_dir, tuple(cfg.node_ports()) if check_ports else (),
                          workspace_new=isinstance(pkg, dispatch.Packing),
                          workspace_sha=pkg.sha256 if isinstance(pkg, dispatch.Package) else "",
                          job_dir=spec.job_dir if spec else "",
                          max_members=pkg.files if pkg else 0, workspace_size=pkg.size if pkg else 0,
                          workspace_dir=(spec.workspace or "") if spec else "",
                          workspace_script=(preflight.trainer_script(spec.cfg.commands()[1]) or "") if spec else "",
                          agent=agent, orphan_timeout=cfg.orphan_timeout, grace=cfg.kill_grace,
                          checkpoints=spec.resume_root if spec is not None and spec.resume_from else "")
        except BaseException:
            stack.close()
            raise
        sessions: Dict[int, NodeSession] = {}
        sent_to: Dict[int, bool] = {}
        token = secrets.token_hex(32)  # authenticates this dispatch's node-to-node links
        damaged: List[str] = []  # nodes whose cached tree of this workspace a job wrote into
        waiting: Dict[int, CommandStream] = {}  # agents that wait for the others' preparation (a slow upload)
        prepared = threading.Event()
        threading.Thread(target=_keep_alive, args=(waiting, prepared), daemon=True, name="keepalive").start()
        probed: List[float] = []  # when each probe came in (time.perf_counter)
        resume_step: Optional[int] = None  # with --resume_from: the step every node holds complete
        held: Dict[int, CommandStream] = {}
        early: Dict[int, Tuple[str, ...]] = {}  # lines of the prepared sessions that were not their answers
        chain = None
        if pkg is not None and spec is not None and spec.dispatch_dir:
            chain = relay.Dispatch(pkg, spec.dispatch_dir, req.job_dir, len(self.nodes),
                                   stack.enter_context(progress.upload_progress()),
                                   stack.enter_context(tempfile.TemporaryDirectory(prefix="paddle-cluster-delta-")))

        needs = preflight.frameworks_needed(preflight.entry_source(spec)) if spec is not None else ()

        def open_one(n: Node) -> Optional[dict]:
            try:
                mine = req if not req.checkpoints else dataclasses.replace(req, pservers=spec.node_pservers(n.index))
                s = sessions[n.index] = NodeSession(n, lib, lib_data, mine)
                doc = s.open()
                self._check_probe(n, doc, needs)
                probed.append(time.perf_counter())
                if req.wants_workspace:
                    self._workspace(n, s, doc, spec, pkg, token, chain, sent_to, damaged)
                elif agent:  # the session is the agent now
                    waiting[n.index] = s.stream
                return doc
            except relay.Aborted:
                return None  # another node failed: that one's error is the one to say
            except BaseException as e:
                if chain is not None:
                    chain.abort(f"{n.name} failed: {e}")
                raise

        def place(n: Node) -> None:
            ws = sessions[n.index].place()
            if not ws.get("ok"):
                raise HostError(n.label, f"unpacking the workspace into {req.job_dir} refused: {ws.get('error')}")
            if agent:
                waiting[n.index] = sessions[n.index].stream

        ok = False
        try:
            # Each node says what it holds of the workspace as soon as it is up, and the nodes that lack it get it
            # down a chain that starts with the first; nothing is written before every node's probe is in and
            # agrees (no machine twice) and every node has the workspace (``place``).
            res = each_node(self.nodes, open_one)
            if isinstance(pkg, dispatch.Packing) and pkg.failed() is not None:
                raise pkg.failed()  # the workspace changed while it was sent: that, not the nodes' aborts
            docs = res.ok("preparing the nodes")
            machines.refuse_same_machines(self.labels, docs, cfg.source)
            if req.checkpoints and spec is not None:  # before anything is written: a refusal leaves no job directory
                resume_step = resume.common_step(spec, [(n.label, d.get("checkpoints")) for n, d in
                                                        zip(self.nodes, docs) if spec.node_pservers(n.index)], say)
            if pkg is not None:
                each_node(self.nodes, place).ok("preparing the nodes")
            done = time.perf_counter()
            workspace_seconds = done - max(probed) if req.wants_workspace else 0.0
            sending_seconds = done - chain.started if chain is not None and chain.started else 0.0
            ok = True
        finally:
            prepared.set()
            stack.close()
            if ok and agent:
                held = {i: s.stream for i, s in sessions.items()}
                early = {i: tuple(s.other) for i, s in sessions.items() if s.other}
            else:
                for s in sessions.values():
                    s.close()
        told = chain.lines() if chain is not None else []
        # The interpreter each probe ran as (the login shell's PYTHON, resolved to an absolute path): every process
        # on that node runs it, whoever starts them (mpirun puts its own prefix first on PATH).
        pythons = [d.get("python_path") or cfg.python for d in docs]
        addresses = [d["address"] for d in docs]
        say(f"{len(self.nodes)} node(s): " + ", ".join(f"{n.name}={a}" for n, a in zip(self.nodes, addresses)))
        for line in told:
            say(line)
        skipped = [self.nodes[i].name for i, s in sorted(sent_to.items()) if not s]
        if pkg is not None and skipped:
            say(f"{', '.join(skipped)} already held this package: not sent again")
        if damaged:
            say(f"{', '.join(sorted(damaged))}: a job wrote into its cached copy of this workspace in place (the "
                "workspace is read-only input; write outputs to new files): dropped and sent again")
        return SSHPrepared(Topology.hosts(cfg, addresses, pythons, resume_step), self.names, self.labels,
                           tuple(self.nodes), lib, tuple(d.get("network") for d in docs), held, early,
                           workspace_seconds, sending_seconds)

    def _workspace(self, n: Node, s: NodeSession, doc: dict, spec: Optional[JobSpec],
                   pkg: Union[dispatch.Package, dispatch.Packing, None], token: str, chain: Optional[relay.Dispatch],
                   sent_to: Dict[int, bool], damaged: List[str]) -> None:
        """What node ``n`` holds of the workspace; the archive sent to it down the chain when it lacks it."""
        ws = s.go(token)
        if spec is not None and spec.workspace and not ws.get("exists"):
            raise HostConfigError(n.label, f"--job_workspace {spec.workspace}: no such directory there; copy the "
                                  "workspace to every node first, or use --job_dispatch_package")
        if spec is not None:
            preflight.check_node(n.label, spec, {**doc, "workspace": ws}, pkg.size if pkg else 0)
        if pkg is None:
            return
        if ws.get("damaged"):
            damaged.append(n.name)
        if chain is not None and "need" in ws:
            sent_to[n.index] = True
            chain.join(relay.Recipient(s, ws["need"], f"{doc['address']}:{ws['port']}", str(ws.get("base") or "")))
            return
        if not ws.get("held"):
            raise HostError(n.label, f"unpacking the workspace into {spec.job_dir if spec else ''} refused: "
                            f"{ws.get('error')}")
        sent_to[n.index] = False
        if chain is not None:
            chain.settled()

    def _check_probe(self, n: Node, doc: dict, needs: Sequence[str] = ()) -> None:
        problems = preflight.probe_problems(self.cfg, doc) + preflight.framework_problems(self.cfg, doc, needs)
        if problems:
            raise HostError(n.label, "; ".join(problems))

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


def _keep_alive(waiting: Dict[int, CommandStream], done: threading.Event) -> None:
    """Ping the agents that are ready while others are still being prepared: an agent that hears nothing for
    ORPHAN_TIMEOUT stops, and uploading a large workspace to one node can take longer than that."""
    while not done.wait(PING_S):
        for s in list(waiting.values()):
            try:
                s.write_line(m.encode(m.Ping()))
            except Exception:  # noqa: BLE001 - a dead stream is reported when the job starts
                pass


def _read(i: int, stream: CommandStream, events: EventQueue) -> None:
    for line in stream.lines():  # bounded: an over-long line arrives as a note saying it was dropped
        try:
            ev = m.decode(line)
        except Exception:  # noqa: BLE001 - whatever a line is, it is shown, never the end of this reader
            ev = None  # e.g. a Python error before the agent could speak
        events.put(i, ev if isinstance(ev, m.EVENTS) else m.Note(i, line[:NOTE_MAX]))
    events.channel_closed(i)
