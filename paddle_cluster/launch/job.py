"""``paddle-cluster run``: dispatch, start pservers, wait until they listen, start trainers, stream, stop.

One agent per node (``python -m paddle_cluster.node supervise``) owns that node's processes; this module talks to every
agent over one command stream each, and whatever happens -- success, a failed process, a lost node,
Ctrl+C -- the ``finally`` of ``run_job`` tells every agent to stop, and each agent stops on its own if the
launcher disappears.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import queue
import secrets
import shlex
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Callable, Deque, Dict, List, Optional, Sequence, Tuple

from paddle_cluster.contract import PSERVER, TRAINER, Endpoint, JobEnv

from . import dispatch
from .config import ClusterConfig
from .errors import ClusterError, HostError, Interrupted, JobFailed
from .hosts import Node, Stream, fanout, make_nodes

TAIL_LINES = 20


@dataclass(frozen=True)
class JobSpec:
    """What the user asked for."""

    cfg: ClusterConfig
    name: str
    dispatch_dir: Optional[str] = None
    workspace: Optional[str] = None
    trainer_args: Tuple[str, ...] = ()
    resume_from: Optional[str] = None  # an earlier job's name, or a checkpoint root directory
    max_restarts: int = 0  # whole-job restarts from the latest complete checkpoint after a process dies
    elastic: bool = False  # a dead trainer is reported and the others go on (async mode)

    @property
    def job_dir(self) -> str:
        return f"{self.cfg.root_dir}/{self.name}"

    @property
    def cwd(self) -> str:
        return self.workspace or self.job_dir


def default_job_name() -> str:
    return datetime.now().strftime("JOB%Y%m%d%H%M%S")


@dataclass(frozen=True)
class ProcSpec:
    node: int
    name: str
    role: str
    index: int
    cmd: str
    log: str


@dataclass
class ProcState:
    spec: ProcSpec
    pid: Optional[int] = None
    exit_code: Optional[int] = None
    signal: Optional[int] = None
    error: str = ""
    tail: Deque[str] = field(default_factory=lambda: collections.deque(maxlen=TAIL_LINES))

    @property
    def finished(self) -> bool:
        return self.exit_code is not None or self.signal is not None

    def how(self) -> str:
        if self.signal is not None:
            try:
                return f"killed by {signal.Signals(self.signal).name}"
            except ValueError:
                return f"killed by signal {self.signal}"
        return f"exited with code {self.exit_code}"


class ProcessFailed(JobFailed):
    """A process of the job failed: what ``--max_restarts`` recovers from."""

    def __init__(self, message: str, proc: ProcState, headline: str) -> None:
        super().__init__(message)
        self.proc, self.headline = proc, headline


@dataclass(frozen=True)
class JobResult:
    name: str
    exit_code: int
    message: str


@dataclass
class Cluster:
    """The job's nodes, as found by the probe."""

    nodes: List[Node]
    addresses: List[str]
    lib: dispatch.Package


def plan(spec: JobSpec, addresses: Sequence[str]) -> Tuple[JobEnv, List[ProcSpec]]:
    """The contract and the process list: node-major ids, pservers before trainers."""
    cfg = spec.cfg
    pservers: List[Endpoint] = []
    procs: List[ProcSpec] = []
    n_nodes = len(addresses)
    for i, addr in enumerate(addresses):
        for k in range(cfg.pservers_per_node):
            gid = i * cfg.pservers_per_node + k
            pservers.append(Endpoint(addr, cfg.pserver_ports(k)[0]))
            log = "server.log" if cfg.pservers_per_node == 1 else f"server.{gid}.log"
            procs.append(ProcSpec(i, f"pserver.{gid}", PSERVER, gid, cfg.pserver_command.format(python=cfg.python),
                                  log))
    trainer_cmd = cfg.trainer_command.format(python=cfg.python)
    if spec.trainer_args:
        trainer_cmd += " " + shlex.join(spec.trainer_args)
    for i in range(n_nodes):
        for j in range(cfg.trainers_per_node):
            tid = i * cfg.trainers_per_node + j
            log = "train.log" if cfg.trainers_per_node == 1 else f"train.{tid}.log"
            procs.append(ProcSpec(i, f"trainer.{tid}", TRAINER, tid, trainer_cmd, log))
    env = JobEnv(job_id=f"{spec.name}-{secrets.token_hex(4)}", pservers=tuple(pservers),
                 trainers=n_nodes * cfg.trainers_per_node, ports_num=cfg.paddle_ports_num,
                 ports_num_for_sparse=cfg.paddle_ports_num_for_sparse, secret=secrets.token_hex(32),
                 job_dir=spec.job_dir, workspace=spec.cwd, barrier_timeout=cfg.barrier_timeout,
                 resume="latest" if spec.resume_from else "", checkpoint_dir=checkpoint_root(spec),
                 extra=dict(cfg.env))
    return env, procs


def job_checkpoint_root(spec: JobSpec) -> str:
    """Where this job's pservers read and write checkpoints."""
    return checkpoint_root(spec) or f"{spec.job_dir}/checkpoints"


# Runs on a node with nothing but Python: the steps under ROOT (argv 1) whose shards of every pserver id in
# argv 2 are complete (manifest present, every file's sha256 as recorded), ascending.
_COMPLETE_STEPS = r"""
import hashlib, json, os, re, sys
root, ids = sys.argv[1], [int(x) for x in sys.argv[2].split(",") if x]
def complete(d):
    try:
        with open(os.path.join(d, "manifest.json"), "rb") as f:
            files = json.loads(f.read().decode("utf-8"))["files"]
        for name, info in files.items():
            h = hashlib.sha256()
            with open(os.path.join(d, name), "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
            if h.hexdigest() != info["sha256"]:
                return False
        return True
    except Exception:
        return False
try:
    names = os.listdir(root)
except OSError:
    names = []
steps = []
for n in names:
    m = re.match(r"^step-([0-9]{8,})$", n)
    if m and all(complete(os.path.join(root, n, "pserver-%d" % k)) for k in ids):
        steps.append(int(m.group(1)))
print(json.dumps(sorted(steps)))
"""


def latest_common_checkpoint(cluster: Cluster, procs: Sequence[ProcSpec], root: str) -> Optional[int]:
    """The newest step whose checkpoint is complete for every pserver (on its own node); None if none is.

    Pservers on different hosts see only their own shards, so each would pick its own "latest": the
    launcher picks the one step all of them hold, which rolls every shard back to the same step.
    """
    by_node: Dict[int, List[int]] = {}
    for p in procs:
        if p.role == PSERVER:
            by_node.setdefault(p.node, []).append(p.index)

    def steps(n: Node) -> set:
        ids = ",".join(map(str, by_node[n.index]))
        out = n.check([n.cfg.python, "-c", _COMPLETE_STEPS, root, ids], what=f"listing checkpoints in {root}",
                      timeout=300)
        return set(json.loads(out.strip().splitlines()[-1]))

    found = fanout([n for n in cluster.nodes if n.index in by_node], steps).ok("looking for the latest checkpoint")
    common = set.intersection(*found) if found else set()
    return max(common) if common else None


def checkpoint_root(spec: JobSpec) -> str:
    """Where ``--resume_from`` points pservers: a job name means that job's checkpoints under ROOT_DIR."""
    r = spec.resume_from
    if not r:
        return ""
    return r if r.startswith("/") else f"{spec.cfg.root_dir}/{r}/checkpoints"


# -- preparing the nodes ------------------------------------------------------------------------------
def connect(cfg: ClusterConfig, say: Callable[[str], None], check_ports: bool = True) -> Cluster:
    """Install the node library everywhere and probe every node (NIC address, free ports, numpy)."""
    nodes = make_nodes(cfg)
    lib = dispatch.install_library(nodes)
    ports = ",".join(map(str, cfg.node_ports())) if check_ports else ""

    def probe(n: Node) -> str:
        doc = dispatch.agent_json(n, lib, "probe", "--nic", cfg.paddle_nic, "--ports", ports, "--root",
                                  cfg.root_dir, what="probing the node")
        if not doc["address"]:
            have = ", ".join(f"{k} ({v or 'no IPv4'})" for k, v in doc["interfaces"].items())
            raise HostError(n.label, f"PADDLE_NIC = {cfg.paddle_nic!r} has no IPv4 address there"
                            f"{'' if cfg.paddle_nic in doc['interfaces'] else ' (no such interface)'}; "
                            f"it has: {have}. Set PADDLE_NIC to one of them")
        if doc["numpy"] is None:
            raise HostError(n.label, f"numpy is not installed for {cfg.python} ({doc['python_path']}); "
                            f"install it there: {cfg.python} -m pip install numpy")
        if doc["ports_taken"]:
            raise HostError(n.label, f"port(s) {', '.join(map(str, doc['ports_taken']))} on {doc['address']} "
                            "are already in use (another job?); choose another PADDLE_PORT or stop that job")
        if not doc["root"].get("writable"):
            raise HostError(n.label, f"ROOT_DIR {cfg.root_dir} is not writable: {doc['root'].get('error')}")
        return doc["address"]

    addresses = fanout(nodes, probe).ok("probing the nodes")
    say(f"{len(nodes)} node(s): " + ", ".join(f"{n.name}={a}" for n, a in zip(nodes, addresses)))
    return Cluster(nodes, addresses, lib)


def deliver(spec: JobSpec, cluster: Cluster, say: Callable[[str], None]) -> None:
    """Dispatch the workspace (``--job_dispatch_package``) or check it exists (``--job_workspace``)."""
    nodes = cluster.nodes
    if spec.workspace:
        def has(n: Node) -> None:
            res = n.run(["test", "-d", spec.workspace], timeout=60)
            if res.exit_code != 0:
                raise HostError(n.label, f"--job_workspace {spec.workspace} does not exist there; copy the "
                                "workspace to every node first, or use --job_dispatch_package")
        fanout(nodes, has).ok(f"checking --job_workspace {spec.workspace}")
        return
    assert spec.dispatch_dir is not None
    pkg = dispatch.pack_workspace(spec.dispatch_dir, dispatch.workspace_cache_dir())
    say(f"workspace {spec.dispatch_dir}: {pkg.files} files, {pkg.size / 1e6:.1f} MB, sha256 {pkg.sha256[:12]}")
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    sent: Dict[int, bool] = {}
    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  transient=not sys.stderr.isatty(), console=_stderr_console()) as bar:
        tasks = {n.index: bar.add_task(f"upload {n.name}", total=pkg.size) for n in nodes}

        def send(n: Node) -> None:
            archive, sent[n.index] = dispatch.ensure_package(
                n, pkg, "workspace", lambda done, total: bar.update(tasks[n.index], completed=done))
            dispatch.unpack(n, cluster.lib, archive, spec.job_dir)

        fanout(nodes, send).ok("dispatching the workspace")
    skipped = [nodes[i].name for i, s in sorted(sent.items()) if not s]
    if skipped:
        say(f"{', '.join(skipped)} already held this package: not sent again")


def _stderr_console():
    from rich.console import Console

    return Console(stderr=True)


# -- running ------------------------------------------------------------------------------------------
class Agents:
    """One supervising agent per node and the queue of everything they report."""

    def __init__(self, spec: JobSpec, cluster: Cluster) -> None:
        self.spec, self.cluster = spec, cluster
        self.events: queue.Queue[Tuple[int, dict]] = queue.Queue()
        self.streams: Dict[int, Stream] = {}
        self.last_heard: Dict[int, float] = {}
        self.stopped: Dict[int, dict] = {}
        self._pinger = threading.Event()

    def open(self) -> None:
        cfg = self.spec.cfg

        def start(n: Node) -> Stream:
            # Owner-only: the job directory holds the secret (env file), logs and checkpoints.
            n.check(["sh", "-c", 'mkdir -p "$1" && chmod 700 "$1"', "sh", self.spec.job_dir],
                    what=f"creating {self.spec.job_dir}", timeout=60)
            return n.stream(dispatch.agent_argv(n, self.cluster.lib, "supervise", "--job-dir", self.spec.job_dir,
                                                "--orphan-timeout", str(cfg.orphan_timeout),
                                                "--grace", str(cfg.kill_grace)))

        res = fanout(self.cluster.nodes, start)
        self.streams = dict(res.values)
        for i, s in self.streams.items():
            self.last_heard[i] = time.monotonic()
            threading.Thread(target=self._read, args=(i, s), daemon=True, name=f"agent{i}").start()
        threading.Thread(target=self._ping, daemon=True, name="pinger").start()
        res.ok("starting the node agents")

    def _read(self, i: int, stream: Stream) -> None:
        for line in stream.lines():
            self.last_heard[i] = time.monotonic()
            try:
                ev = json.loads(line)
            except ValueError:
                ev = {"ev": "agent_output", "line": line}
            if ev.get("ev") == "hb":
                continue
            if ev.get("ev") == "stopped":
                self.stopped[i] = ev
            self.events.put((i, ev))
        self.events.put((i, {"ev": "eof"}))

    def _ping(self) -> None:
        while not self._pinger.wait(2.0):
            for s in list(self.streams.values()):
                try:
                    s.write_line('{"op": "ping"}')
                except Exception:  # noqa: BLE001 - a dead stream is noticed by its reader
                    pass

    def send(self, i: int, msg: dict) -> None:
        self.streams[i].write_line(json.dumps(msg))

    def broadcast(self, make: Callable[[int], Optional[dict]]) -> None:
        def one(n: Node) -> None:
            msg = make(n.index)
            if msg is not None:
                self.send(n.index, msg)
        fanout([n for n in self.cluster.nodes if n.index in self.streams], one).ok("messaging the agents")

    def stop(self, grace: float, wait: float) -> None:
        """Tell every agent to stop its processes; wait for each to confirm."""
        for i, s in self.streams.items():
            if i not in self.stopped:
                try:
                    s.write_line(json.dumps({"op": "stop", "grace": grace}))
                except Exception:  # noqa: BLE001 - that agent stops on its own when the stream closes
                    pass
        # An agent silent for ORPHAN_TIMEOUT is cut off (it stops on its own): waiting for it would only stall.
        reachable = [i for i in self.streams
                     if time.monotonic() - self.last_heard.get(i, 0.0) < self.spec.cfg.orphan_timeout]
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(i not in self.stopped for i in reachable):
            time.sleep(0.05)
        self._pinger.set()
        for s in self.streams.values():
            try:
                s.close()
            except Exception:  # noqa: BLE001
                pass


class _Run:
    def __init__(self, spec: JobSpec, cluster: Cluster, out: Callable[[str], None],
                 say: Callable[[str], None] = lambda _m: None, env: Optional[JobEnv] = None,
                 failed_at: Optional[float] = None) -> None:
        self.spec, self.cluster, self.out, self.say = spec, cluster, out, say
        self.env, specs = plan(spec, cluster.addresses)
        if env is not None:  # a restart: the same job (id, secret), resuming from a checkpoint
            self.env = env
        self.failed_at = failed_at
        self.abandoned: List[str] = []  # trainers that died under --elastic
        self.procs: Dict[str, ProcState] = {p.name: ProcState(p) for p in specs}
        self.agents = Agents(spec, cluster)
        self.ready: Dict[int, Optional[str]] = {}

    def node_name(self, i: int) -> str:
        return self.cluster.nodes[i].name

    def start(self, role: str) -> None:
        cfg = self.spec.cfg

        def msg(i: int) -> Optional[dict]:
            procs = [p.spec for p in self.procs.values() if p.spec.node == i and p.spec.role == role]
            if not procs:
                return None
            addr = self.cluster.addresses[i]
            return {"op": "start", "cwd": self.spec.cwd, "ld_library_path": cfg.ld_library_path,
                    "procs": [{"name": p.name, "role": p.role, "log": p.log, "cmd": p.cmd,
                               "env": _process_env(self.env, p, addr)} for p in procs]}
        self.agents.broadcast(msg)

    def handle(self, i: int, ev: dict) -> None:
        kind = ev.get("ev")
        if kind == "log":
            p = self.procs.get(ev["proc"])
            if p is not None:
                p.tail.append(ev["line"])
            self.out(f"[{ev['proc']}@{self.node_name(i)}] {ev['line']}")
        elif kind == "started":
            self.procs[ev["proc"]].pid = ev["pid"]
        elif kind == "exit":
            p = self.procs[ev["proc"]]
            p.exit_code, p.signal = ev["code"], ev["signal"]
            if ev.get("error"):
                p.error = ev["error"]
                p.tail.append(ev["error"])
        elif kind in ("ready", "not_ready"):
            self.ready[i] = None if kind == "ready" else ev["why"] + f" (ports {ev['ports']})"
        elif kind == "agent_output":
            self.out(f"[agent@{self.node_name(i)}] {ev['line']}")
        elif kind == "eof" and i not in self.agents.stopped:
            raise JobFailed(f"lost contact with {self.cluster.nodes[i].label}: its agent's connection closed")

    def pump(self, until: Callable[[], bool], timeout: Optional[float] = None,
             check: Optional[Callable[[], None]] = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not until():
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError
            try:
                i, ev = self.agents.events.get(timeout=0.2)
            except queue.Empty:
                silent = [i for i, t in self.agents.last_heard.items()
                          if time.monotonic() - t > self.spec.cfg.orphan_timeout]
                if silent:
                    raise JobFailed(f"lost contact with {self.cluster.nodes[silent[0]].label}: no word from its "
                                    f"agent for {self.spec.cfg.orphan_timeout:.0f} s (ORPHAN_TIMEOUT)") from None
                continue
            self.handle(i, ev)
            if check is not None:
                check()

    def failure_report(self, p: ProcState, what: str) -> str:
        lines = [f"{p.spec.name} on {self.cluster.nodes[p.spec.node].label} {p.how()}{what}"]
        if p.tail:
            lines.append(f"last lines of its log ({self.spec.job_dir}/log/{p.spec.log}):")
            lines.extend("  | " + t for t in p.tail)
        return "\n".join(lines)

    def headline(self, p: ProcState) -> str:
        line = f"{p.spec.name} on {self.cluster.nodes[p.spec.node].label} {p.how()}"
        if p.spec.role == TRAINER and p.exit_code is not None and p.tail:
            line += f" ({p.tail[-1].strip()[:200]})"  # a trainer's last words usually name the pserver it lost
        return line

    def check_failures(self) -> None:
        trainers = [p for p in self.procs.values() if p.spec.role == TRAINER]
        for p in trainers:
            if p.finished and p.exit_code != 0:
                if not self.spec.elastic:
                    raise ProcessFailed(self.failure_report(p, ""), p, self.headline(p))
                if p.spec.name not in self.abandoned:
                    self.abandoned.append(p.spec.name)
                    left = len(trainers) - len(self.abandoned)
                    if not left:
                        raise ProcessFailed(self.failure_report(p, " (the last trainer left)"), p, self.headline(p))
                    self.say(f"{self.headline(p)}; --elastic: continuing with the other {left} trainer(s)")
        if all(p.finished for p in trainers):
            return
        for p in self.procs.values():
            # A pserver exits 0 by itself once every trainer has closed; anything else is a failure.
            if p.spec.role == PSERVER and p.finished and p.exit_code != 0:
                raise ProcessFailed(self.failure_report(p, " while trainers were still running"), p,
                                    self.headline(p))

    def _cause(self, failed: ProcessFailed) -> ProcessFailed:
        """A trainer failing right after a pserver died is a symptom: wait a moment and blame the pserver."""
        if failed.proc.spec.role != TRAINER:
            return failed
        try:
            self.pump(lambda: False, timeout=1.0)
        except (TimeoutError, JobFailed):
            pass
        for p in self.procs.values():
            if p.spec.role == PSERVER and p.finished and p.exit_code != 0:
                return ProcessFailed(self.failure_report(p, " while trainers were still running"), p,
                                     self.headline(p))
        return failed

    def run(self) -> None:
        cfg = self.spec.cfg
        self.agents.open()
        self.agents.broadcast(lambda i: {"op": "prepare", "node": i, "env": self.env.to_environ(),
                                         "address": self.cluster.addresses[i]})
        self.start(PSERVER)

        def wait_msg(i: int) -> Optional[dict]:
            ps = [p.spec for p in self.procs.values() if p.spec.node == i and p.spec.role == PSERVER]
            if not ps:
                self.ready[i] = None
                return None
            ports = [port for p in ps for port in self.env.all_ports(p.index)]
            return {"op": "wait_ports", "host": self.cluster.addresses[i], "ports": ports,
                    "procs": [p.name for p in ps], "timeout": cfg.start_timeout}
        self.agents.broadcast(wait_msg)
        try:
            self.pump(lambda: len(self.ready) == len(self.cluster.nodes), timeout=cfg.start_timeout + 30)
        except TimeoutError:
            raise JobFailed(f"pservers not ready within START_TIMEOUT={cfg.start_timeout:.0f} s") from None
        bad = {i: why for i, why in self.ready.items() if why}
        if bad:
            lines = [f"pservers did not start listening on {self.cluster.nodes[i].label}: {why}"
                     for i, why in bad.items()]
            # Drain what the failed pservers printed, so the report shows why.
            try:
                self.pump(lambda: all(p.finished for p in self.procs.values()
                                      if p.spec.role == PSERVER and p.spec.node in bad), timeout=3)
            except TimeoutError:
                pass
            for p in self.procs.values():
                if p.spec.role == PSERVER and p.spec.node in bad and p.tail:
                    lines.append(self.failure_report(p, "") if p.finished else f"{p.spec.name} output:\n" +
                                 "\n".join("  | " + t for t in p.tail))
            raise JobFailed("\n".join(lines))
        self.out(f"all {len(self.env.pservers)} pserver(s) listening; starting {self.env.trainers} trainer(s)")
        self.start(TRAINER)
        if self.failed_at is not None:
            self.say(f"job running again {time.monotonic() - self.failed_at:.1f} s after the failure")
        trainers = [p for p in self.procs.values() if p.spec.role == TRAINER]
        try:
            self.pump(lambda: all(p.finished for p in trainers), check=self.check_failures)
            self.check_failures()
        except ProcessFailed as e:
            raise self._cause(e) from None


def _restart(spec: JobSpec, cluster: Cluster, run: _Run, failure: ProcessFailed, n: int,
             out: Callable[[str], None], say: Callable[[str], None]) -> _Run:
    """Stop every process of the job, then a new run resuming from the newest checkpoint every pserver holds."""
    run.agents.stop(spec.cfg.kill_grace, wait=spec.cfg.kill_grace + 15)
    lost = [cluster.nodes[i].label for i in run.agents.streams if i not in run.agents.stopped]
    if lost:
        raise JobFailed(f"{failure}\ncannot restart: no stop confirmation from {', '.join(lost)}")
    root = job_checkpoint_root(spec)
    step = latest_common_checkpoint(cluster, [p.spec for p in run.procs.values()], root)
    where = f"checkpoint step {step}" if step is not None else "scratch (no complete checkpoint yet)"
    say(f"{failure.headline}; restarting the job from {where} (restart {n} of {spec.max_restarts})")
    env = dataclasses.replace(run.env, resume="" if step is None else str(step),
                              checkpoint_dir=root if step is not None else run.env.checkpoint_dir)
    return _Run(spec, cluster, out, say, env=env)


def _process_env(env: JobEnv, p: ProcSpec, addr: str) -> Dict[str, str]:
    """The per-process variables; the job-wide ones (with the secret) reach the agent in ``prepare``."""
    full = env.for_process(p.role, p.index, addr).to_environ()
    common = env.to_environ()
    return {k: v for k, v in full.items() if common.get(k) != v}


def run_job(spec: JobSpec, out: Callable[[str], None], say: Callable[[str], None]) -> JobResult:
    """Run the whole job; always leaves nothing running. Ctrl+C raises ``Interrupted`` after the stop."""
    cluster = connect(spec.cfg, say)
    run: Optional[_Run] = None
    interrupts = {"n": 0}

    def on_signal(signum: int, _frame) -> None:
        interrupts["n"] += 1
        if interrupts["n"] == 1:
            raise KeyboardInterrupt
        say("second interrupt: killing without grace period")
        if run is not None:
            for s in run.agents.streams.values():
                try:
                    s.write_line(json.dumps({"op": "stop", "grace": 0}))
                except Exception:  # noqa: BLE001
                    pass

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        deliver(spec, cluster, say)
        _remember(spec)
        if spec.elastic:
            say("--elastic: a trainer that dies is reported and the others go on (async mode; in sync mode the "
                "next barrier still waits for it and fails after BARRIER_TIMEOUT)")
        run = _Run(spec, cluster, out, say)
        say(f"job {spec.name}: {len(run.env.pservers)} pserver(s), {run.env.trainers} trainer(s) in {spec.job_dir}")
        restarts = 0
        while True:
            try:
                run.run()
                break
            except ProcessFailed as e:
                if restarts >= spec.max_restarts:
                    if spec.max_restarts:
                        raise ProcessFailed(f"{e}\n(no restarts left: all {spec.max_restarts} used)", e.proc,
                                            e.headline) from None
                    raise
                failed_at = time.monotonic()
                run = _restart(spec, cluster, run, e, restarts + 1, out, say)
                run.failed_at = failed_at
                restarts += 1
        what = f"all {run.env.trainers - len(run.abandoned)} remaining" if run.abandoned else \
            f"all {run.env.trainers}"
        say(f"job {spec.name} finished: {what} trainer(s) exited 0"
            + (f" after {restarts} restart(s)" if restarts else ""))
        return JobResult(spec.name, 0, "ok")
    except KeyboardInterrupt:
        say(f"interrupted: stopping job {spec.name} on every node (Ctrl+C again to skip the grace period)")
        raise Interrupted(f"job {spec.name} interrupted; every process was stopped") from None
    finally:
        try:
            if run is not None:
                grace = 0 if interrupts["n"] > 1 else spec.cfg.kill_grace
                run.agents.stop(grace, wait=spec.cfg.kill_grace + 15)
                lost = [cluster.nodes[i].label for i in run.agents.streams if i not in run.agents.stopped]
                if lost:
                    say(f"no stop confirmation from {', '.join(lost)}; their agents stop on their own within "
                        f"ORPHAN_TIMEOUT={spec.cfg.orphan_timeout:.0f} s")
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            fanout(cluster.nodes, lambda n: n.close())


# -- remembering jobs, for kill/status/logs ------------------------------------------------------------
def _state_file(cfg: ClusterConfig) -> Path:
    import hashlib

    source = cfg.source if cfg.is_builtin_default else os.path.abspath(cfg.source)
    key = hashlib.sha1(json.dumps([source, [h.text for h in cfg.hosts], cfg.root_dir]).encode()).hexdigest()[:16]
    base = Path(os.environ.get("XDG_STATE_HOME", Path.home() / ".local" / "state")) / "paddle-cluster"
    return base / f"{key}.json"


def _remember(spec: JobSpec) -> None:
    path = _state_file(spec.cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"latest": spec.name, "workspace": spec.workspace}))
    tmp.replace(path)


def latest_job(cfg: ClusterConfig) -> str:
    try:
        return json.loads(_state_file(cfg).read_text())["latest"]
    except (OSError, ValueError, KeyError):
        raise ClusterError("no job of this configuration was started from this machine; "
                           "name one with --job_name") from None
