"""Making the hosts of HOSTS ready for a job, all at once, one session per node (``launch/session.py``): the node
library, the probe, the workspace down a chain of the nodes that lack it, and (``agent``) the agent that waits
for its ``Start``. The ssh backend's ``prepare``; the mpi backend prepares its hosts with it too."""

from __future__ import annotations

import contextlib
import dataclasses
import secrets
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

from paddle_cluster.node import messages as m
from paddle_cluster.node.session import SessionRequest

from ... import dispatch, machines, preflight, progress, relay, resume
from ...config import ClusterConfig
from ...each_node import each_node
from ...errors import HostConfigError, HostError
from ...hosts import CommandStream, Node
from ...plan import JobSpec, Topology
from ...session import NodeSession
from ..base import Prepared

PING_S = 2.0  # how often the launcher tells an agent it is there
NO_LIBRARY = dispatch.Package("", "<node library sha256>", 0, 0)  # a dry run's: nothing installed
Archive = Union[dispatch.Package, dispatch.Packing, None]  # the workspace's: cached, packed as sent, or none


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


def archive(spec: Optional[JobSpec], say: Callable[[str], None], hold: contextlib.ExitStack) -> Archive:
    """The archive of ``--job_dispatch_package``, held by ``hold`` (no concurrent launch evicts it meanwhile): a new
    workspace is packed while it is sent (its hash comes last), an unchanged one is cached."""
    if spec is None or not spec.dispatch_dir:
        return None
    pkg = dispatch.workspace_archive(spec.dispatch_dir, dispatch.workspace_cache_dir(), hold=hold)
    if isinstance(pkg, dispatch.Packing):
        hold.callback(pkg.close)
    say(f"workspace {spec.dispatch_dir}: {pkg.files} files, {pkg.size / 1e6:.1f} MB, "
        + (f"sha256 {pkg.sha256[:12]}" if isinstance(pkg, dispatch.Package) else "new: packed as sent"))
    return pkg


def session_request(cfg: ClusterConfig, spec: Optional[JobSpec], pkg: Archive, check_ports: bool,
                    agent: bool) -> SessionRequest:
    """What every node's session is asked: the probe, the workspace, and whether it becomes the agent."""
    return SessionRequest(cfg.paddle_nic, cfg.root_dir, tuple(cfg.node_ports()) if check_ports else (),
                          workspace_new=isinstance(pkg, dispatch.Packing),
                          workspace_sha=pkg.sha256 if isinstance(pkg, dispatch.Package) else "",
                          job_dir=spec.job_dir if spec else "",
                          max_members=pkg.files if pkg else 0, workspace_size=pkg.size if pkg else 0,
                          workspace_dir=(spec.workspace or "") if spec else "",
                          workspace_script=(preflight.trainer_script(spec.cfg.commands()[1]) or "") if spec else "",
                          agent=agent, orphan_timeout=cfg.orphan_timeout, grace=cfg.kill_grace,
                          checkpoints=spec.resume_root if spec is not None and spec.resume_from else "")


class WorkspaceWay:
    """A job's workspace on its way to the nodes: the archive, the chain of the nodes that lack it (fed by the
    launcher, each later one linked in at its end) and what each node held."""

    def __init__(self, spec: Optional[JobSpec], pkg: Archive, job_dir: str, nodes: int,
                 hold: contextlib.ExitStack) -> None:
        self.spec, self.pkg = spec, pkg
        self.token = secrets.token_hex(32)  # authenticates this dispatch's node-to-node links
        self.sent_to: Dict[int, bool] = {}  # node -> whether it was sent the archive (False: it held it)
        self.damaged: List[str] = []  # nodes whose cached tree of this workspace a job wrote into
        self.chain: Optional[relay.Dispatch] = None
        if pkg is not None and spec is not None and spec.dispatch_dir:
            self.chain = relay.Dispatch(pkg, spec.dispatch_dir, job_dir, nodes,
                                        hold.enter_context(progress.upload_progress()),
                                        hold.enter_context(tempfile.TemporaryDirectory(prefix="paddle-cluster-delta-")))

    def offer(self, n: Node, s: NodeSession, doc: dict) -> None:
        """What node ``n`` holds of the workspace; the archive sent to it down the chain when it lacks it."""
        spec, pkg, chain = self.spec, self.pkg, self.chain
        ws = s.go(self.token)
        if spec is not None and spec.workspace and not ws.get("exists"):
            raise HostConfigError(n.label, f"--job_workspace {spec.workspace}: no such directory there; copy the "
                                  "workspace to every node first, or use --job_dispatch_package")
        if spec is not None:
            preflight.check_node(n.label, spec, {**doc, "workspace": ws}, pkg.size if pkg else 0)
        if pkg is None:
            return
        if ws.get("damaged"):
            self.damaged.append(n.name)
        if chain is not None and "need" in ws:
            self.sent_to[n.index] = True
            chain.join(relay.Recipient(s, ws["need"], f"{doc['address']}:{ws['port']}", str(ws.get("base") or "")))
            return
        if not ws.get("held"):
            raise HostError(n.label, f"unpacking the workspace into {spec.job_dir if spec else ''} refused: "
                            f"{ws.get('error')}")
        self.sent_to[n.index] = False
        if chain is not None:
            chain.settled()

    def abort(self, n: Node, e: BaseException) -> None:
        """Node ``n`` failed: the chain stops, its other nodes told why."""
        if self.chain is not None:
            self.chain.abort(f"{n.name} failed: {e}")

    def changed(self) -> None:
        """The workspace changed while it was sent: that, not the nodes' aborts, is the error."""
        if isinstance(self.pkg, dispatch.Packing) and self.pkg.failed() is not None:
            raise self.pkg.failed()

    def sending_seconds(self, done: float) -> float:
        return done - self.chain.started if self.chain is not None and self.chain.started else 0.0

    def said(self, nodes: Sequence[Node]) -> List[str]:
        """What the dispatch tells the user once it is over."""
        out = self.chain.lines() if self.chain is not None else []
        skipped = [nodes[i].name for i, s in sorted(self.sent_to.items()) if not s]
        if self.pkg is not None and skipped:
            out.append(f"{', '.join(skipped)} already held this package: not sent again")
        if self.damaged:
            out.append(f"{', '.join(sorted(self.damaged))}: a job wrote into its cached copy of this workspace in "
                       "place (the workspace is read-only input; write outputs to new files): dropped and sent again")
        return out


class Preparation:
    """One preparation of ``nodes`` for ``spec`` (None: the library and the probe only): each node's session,
    opened all at once, probed, given the workspace and (``agent``) kept as the agent waiting for its ``Start``;
    the agents that are ready are pinged while the others are still prepared."""

    def __init__(self, cfg: ClusterConfig, nodes: Sequence[Node], spec: Optional[JobSpec],
                 say: Callable[[str], None], check_ports: bool, agent: bool) -> None:
        self.cfg, self.nodes, self.spec, self.say = cfg, list(nodes), spec, say
        self.check_ports, self.agent = check_ports, agent
        self.sessions: Dict[int, NodeSession] = {}
        self.waiting: Dict[int, CommandStream] = {}  # agents that wait for the others' preparation (a slow upload)
        self.probed: List[float] = []  # when each probe came in (time.perf_counter)
        self.needs = preflight.frameworks_needed(preflight.entry_source(spec)) if spec is not None else ()
        # Each node's pserver ids, numbered as the plan numbers them (its addresses are not known yet).
        self.pserver_ids = Topology.hosts(cfg, [n.spec.host for n in self.nodes]).pserver_ids()

    def run(self) -> SSHPrepared:
        cfg, spec, say = self.cfg, self.spec, self.say
        with dispatch.library_archive() as lib, open(lib.path, "rb") as f:
            self.lib, self.lib_data = lib, f.read()
        # What this preparation holds: the cached workspace archive, the progress bars, where deltas are made.
        stack = contextlib.ExitStack()
        try:
            pkg = archive(spec, say, stack)
            self.req = session_request(cfg, spec, pkg, self.check_ports, self.agent)
            self.way = WorkspaceWay(spec, pkg, self.req.job_dir, len(self.nodes), stack)
        except BaseException:
            stack.close()
            raise
        prepared = threading.Event()
        threading.Thread(target=keep_alive, args=(self.waiting, prepared), daemon=True, name="keepalive").start()
        resume_step: Optional[int] = None  # with --resume_from: the step every node holds complete
        held: Dict[int, CommandStream] = {}
        early: Dict[int, Tuple[str, ...]] = {}  # lines of the prepared sessions that were not their answers
        ok = False
        try:
            # Each node says what it holds of the workspace as soon as it is up, and the nodes that lack it get it
            # down a chain that starts with the first; nothing is written before every node's probe is in and
            # agrees (no machine twice) and every node has the workspace (``place``).
            res = each_node(self.nodes, self.open)
            self.way.changed()
            docs = res.ok("preparing the nodes")
            machines.refuse_same_machines(tuple(n.label for n in self.nodes), docs, cfg.source)
            if self.req.checkpoints and spec is not None:  # before anything is written: a refusal leaves no job dir
                resume_step = resume.common_step(spec, [(n.label, d.get("checkpoints")) for n, d in
                                                        zip(self.nodes, docs) if self.pserver_ids[n.index]], say)
            if pkg is not None:
                each_node(self.nodes, self.place).ok("preparing the nodes")
            done = time.perf_counter()
            workspace_seconds = done - max(self.probed) if self.req.wants_workspace else 0.0
            sending_seconds = self.way.sending_seconds(done)
            ok = True
        finally:
            prepared.set()
            stack.close()
            if ok and self.agent:
                held = {i: s.stream for i, s in self.sessions.items()}
                early = {i: tuple(s.other) for i, s in self.sessions.items() if s.other}
            else:
                for s in self.sessions.values():
                    s.close()
        # The interpreter each probe ran as (the login shell's PYTHON, resolved to an absolute path): every process
        # on that node runs it, whoever starts them (mpirun puts its own prefix first on PATH).
        pythons = [d.get("python_path") or cfg.python for d in docs]
        addresses = [d["address"] for d in docs]
        say(f"{len(self.nodes)} node(s): " + ", ".join(f"{n.name}={a}" for n, a in zip(self.nodes, addresses)))
        for line in self.way.said(self.nodes):
            say(line)
        return SSHPrepared(Topology.hosts(cfg, addresses, pythons, resume_step), tuple(n.name for n in self.nodes),
                           tuple(n.label for n in self.nodes), tuple(self.nodes), self.lib,
                           tuple(d.get("network") for d in docs), held, early, workspace_seconds, sending_seconds)

    def open(self, n: Node) -> Optional[dict]:
        """Node ``n``'s session: the library, its probe (checked), and its part of the workspace's way."""
        req = self.req
        try:
            mine = req if not req.checkpoints else dataclasses.replace(req, pservers=self.pserver_ids[n.index])
            s = self.sessions[n.index] = NodeSession(n, self.lib, self.lib_data, mine)
            doc = s.open()
            self.check_probe(n, doc)
            self.probed.append(time.perf_counter())
            if req.wants_workspace:
                self.way.offer(n, s, doc)
            elif self.agent:  # the session is the agent now
                self.waiting[n.index] = s.stream
            return doc
        except relay.Aborted:
            return None  # another node failed: that one's error is the one to say
        except BaseException as e:
            self.way.abort(n, e)
            raise

    def place(self, n: Node) -> None:
        """Node ``n`` keeps the workspace's tree and makes the job directory of it."""
        ws = self.sessions[n.index].place()
        if not ws.get("ok"):
            raise HostError(n.label, f"unpacking the workspace into {self.req.job_dir} refused: {ws.get('error')}")
        if self.agent:
            self.waiting[n.index] = self.sessions[n.index].stream

    def check_probe(self, n: Node, doc: dict) -> None:
        problems = preflight.probe_problems(self.cfg, doc) + preflight.framework_problems(self.cfg, doc, self.needs)
        if problems:
            raise HostError(n.label, "; ".join(problems))


def keep_alive(waiting: Dict[int, CommandStream], done: threading.Event) -> None:
    """Ping the agents that are ready while others are still being prepared: an agent that hears nothing for
    ORPHAN_TIMEOUT stops, and uploading a large workspace to one node can take longer than that."""
    while not done.wait(PING_S):
        for s in list(waiting.values()):
            try:
                s.write_line(m.encode(m.Ping()))
            except Exception:  # noqa: BLE001 - a dead stream is reported when the job starts
                pass
