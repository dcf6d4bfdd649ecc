"""Watching a running job: events -> per-process state -> fail-fast, ``--elastic``, ``--max_restarts`` -> a
``JobResult``. Knows the plan and the events, not how a backend starts or reaches the processes."""

from __future__ import annotations

import collections
import re
import signal
import time
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, List, Optional

from paddle_cluster.contract import PSERVER, ROLE_VAR, TRAINER
from paddle_cluster.node import messages as m
from paddle_cluster.node.messages import ProcPlan

from . import resume
from .backends.base import Backend, Event, JobRefused, LiveJob, NodeLost, Request, Requeued
from .config import BUILTIN_PSERVER
from .entry import refused_arguments
from .errors import OUTCOMES, ClusterError, JobFailed, LostContact, StoppedByKill

TAIL_LINES = 20
# A pserver's own INFO/DEBUG log line (ps/server/pserver.py's format): kept in its log file, shown only with --verbose.
RUNTIME_CHATTER = re.compile(r"^\S+ \S+ pserver\[\d+\] (DEBUG|INFO) ")


@dataclass
class ProcState:
    """What is known about one process of the job."""

    node: int
    plan: ProcPlan
    pid: Optional[int] = None
    exit_code: Optional[int] = None
    signal: Optional[int] = None
    tail: Deque[str] = field(default_factory=lambda: collections.deque(maxlen=TAIL_LINES))

    @property
    def finished(self) -> bool:
        return self.exit_code is not None or self.signal is not None

    @property
    def failed(self) -> bool:
        return self.finished and self.exit_code != 0

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
    """How a job ended: ``exit_code`` (``errors.OUTCOMES``: 0 finished, 1 failed, 3 stopped by
    ``paddle-cluster kill``, 4 lost contact with a node, 130 interrupted) and what to tell the user."""

    name: str
    exit_code: int
    message: str
    restarts: int = 0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    @property
    def outcome(self) -> str:
        return OUTCOMES.get(self.exit_code, "failed")

    @property
    def is_error(self) -> bool:
        """Finished, stopped by ``kill`` and interrupted are what the user asked for, not errors."""
        return self.exit_code not in (0, StoppedByKill.exit_code, 130)


class Attempt:
    """One start of a plan, submitted (``job``), from the first event to the last trainer's exit."""

    def __init__(self, request: Request, job: LiveJob, out: Callable[[str], None],
                 say: Callable[[str], None]) -> None:
        self.request, self.plan, self.job, self.out, self.say = request, request.plan, job, out, say
        plan = request.plan
        every = [ProcState(n.node, p) for n in plan.nodes for p in n.procs]
        # All pservers first, then all trainers, each node-major: the order of the report's lines.
        every.sort(key=lambda s: (s.plan.role != PSERVER, s.plan.index))
        self.procs: Dict[str, ProcState] = {s.plan.name: s for s in every}
        self.ready: Dict[int, str] = {}  # node -> "" (ready) or why not
        self.abandoned: List[str] = []  # trainers that died under --elastic
        self.stopping = False  # a stop confirmation is then expected, not a failure
        # Trainers' lines that arrive before the launcher has said every pserver listens (another node's word
        # that its pservers listen can come after a ready node's trainers spoke): shown right after it says so.
        self.held: Optional[List[str]] = []

    def role(self, role: str) -> List[ProcState]:
        return [p for p in self.procs.values() if p.plan.role == role]

    def handle(self, ev: Event) -> None:
        if isinstance(ev, m.Log):
            p = self.procs.get(ev.proc)
            if p is not None:
                p.tail.append(ev.line)
                if p.plan.role == PSERVER and not self.plan.spec.verbose and RUNTIME_CHATTER.match(ev.line):
                    return
            line = f"[{ev.proc}@{self.job.names[ev.node]}] {ev.line}"
            if self.held is not None and p is not None and p.plan.role == TRAINER:
                self.held.append(line)
                return
            self.out(line)
        elif isinstance(ev, m.Started):
            self.procs[ev.proc].pid = ev.pid
        elif isinstance(ev, m.Exited):
            p = self.procs[ev.proc]
            p.exit_code, p.signal = ev.code, ev.signal
            if ev.error:
                p.tail.append(ev.error)
        elif isinstance(ev, m.Ready):
            self.ready[ev.node] = ""
        elif isinstance(ev, m.NotReady):
            self.ready[ev.node] = ev.why
        elif isinstance(ev, m.Note):
            self.out(f"[agent@{self.job.names[ev.node]}] {ev.line}")
        elif isinstance(ev, JobRefused) and not self.stopping:
            raise JobFailed(ev.why)
        elif isinstance(ev, Requeued):  # its processes were stopped, new ones start later: wait for those
            for p in self.procs.values():
                p.pid = p.exit_code = p.signal = None
            self.ready.clear()
        elif isinstance(ev, NodeLost):
            raise LostContact(f"lost contact with {self.job.labels[ev.node]}: {ev.why}; the job was stopped")
        elif isinstance(ev, (m.Stopping, m.Stopped)) and not self.stopping:
            if getattr(ev, "by_kill", False) or ev.reason == "stopped by paddle-cluster kill":
                raise StoppedByKill(f"job {self.plan.spec.name} stopped by paddle-cluster kill")
            if isinstance(ev, m.Stopped) and not self.node_done(ev.node):
                raise JobFailed(f"the agent on {self.job.labels[ev.node]} stopped the job: {ev.reason}")

    def node_done(self, node: int) -> bool:
        """Every process of ``node`` exited 0: an agent an engine started (no launcher to wait for) then ends,
        which is no failure while other nodes' processes are still finishing (their events may come later)."""
        mine = [p for p in self.procs.values() if p.node == node]
        return bool(mine) and all(p.finished and not p.failed for p in mine)

    def pump(self, until: Callable[[], bool], timeout: Optional[float] = None,
             check: Optional[Callable[[], None]] = None) -> bool:
        """Handle events until ``until()``: True; False when ``timeout`` s passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        last = time.monotonic()
        while not until():
            now = time.monotonic()
            if deadline is not None and self.job.holding():
                deadline += now - last  # the cluster holds the job (queued, pulling): not the job's slowness
            last = now
            if deadline is not None and now > deadline:
                return False
            ev = self.job.next_event(0.2)
            if ev is not None:
                self.handle(ev)
                if check is not None:
                    check()
        return True

    def failure_report(self, p: ProcState, what: str) -> str:
        lines = [f"{p.plan.name} on {self.job.labels[p.node]} {p.how()}{what}"]
        if p.tail:
            lines.append(f"last lines of its log ({self.job.log_of(p.node, p.plan)}):")
            lines.extend("  | " + t for t in p.tail)
        refused = refused_arguments(self.plan.spec.cfg, self.plan.spec.trainer_args)
        if p.plan.role == TRAINER and p.exit_code == 2 and refused:
            lines.append(refused)
        return "\n".join(lines)

    def headline(self, p: ProcState) -> str:
        line = f"{p.plan.name} on {self.job.labels[p.node]} {p.how()}"
        if p.plan.role == TRAINER and p.exit_code is not None and p.tail:
            line += f" ({p.tail[-1].strip()[:200]})"  # a trainer's last words usually name the pserver it lost
        return line

    def _pserver_failed(self) -> Optional[ProcessFailed]:
        # A pserver exits 0 by itself once every trainer has closed; anything else is a failure.
        for p in self.role(PSERVER):
            if p.failed:
                return ProcessFailed(self.failure_report(p, " while trainers were still running"), p,
                                     self.headline(p))
        return None

    def check_failures(self) -> None:
        trainers = self.role(TRAINER)
        for p in trainers:
            if p.failed:
                if not self.plan.spec.elastic:
                    raise ProcessFailed(self.failure_report(p, ""), p, self.headline(p))
                if p.plan.name not in self.abandoned:
                    self.abandoned.append(p.plan.name)
                    left = len(trainers) - len(self.abandoned)
                    if not left:
                        raise ProcessFailed(self.failure_report(p, " (the last trainer left)"), p, self.headline(p))
                    self.say(f"{self.headline(p)}; --elastic: continuing with the other {left} trainer(s)")
        if not all(p.finished for p in trainers):
            failed = self._pserver_failed()
            if failed is not None:
                raise failed

    def _cause(self, failed: ProcessFailed) -> ProcessFailed:
        """A trainer failing right after a pserver died is a symptom: wait a moment and blame the pserver."""
        if failed.proc.plan.role != TRAINER:
            return failed
        try:
            self.pump(lambda: False, timeout=1.0)
        except JobFailed:
            pass
        return self._pserver_failed() or failed

    def wait_ready(self) -> None:
        """Until every node reports its pservers' readiness; the first node that is not ready fails the job."""
        n_nodes = len(self.plan.nodes)
        start_timeout = self.plan.spec.cfg.start_timeout
        if not self.pump(lambda: len(self.ready) == n_nodes or any(self.ready.values()), timeout=start_timeout + 30):
            why = self.job.why_waiting()
            raise JobFailed(f"pservers not ready within START_TIMEOUT={start_timeout:.0f} s"
                            + (f": {why}" if why else ""))
        bad = {i: why for i, why in self.ready.items() if why}
        if bad:
            # A trainer that failed already is the cause, not a node it took down: on Kubernetes a failed trainer
            # fails its Job, which stops the trainer pods still waiting for the pservers ("exited before its
            # process started").
            failed = next((p for p in self.role(TRAINER) if p.failed and p.node not in bad), None)
            if failed is not None and not self.plan.spec.elastic:
                raise ProcessFailed(self.failure_report(failed, ""), failed, self.headline(failed))
            lines = [f"pservers did not start listening on {self.job.labels[i]}: {why}" for i, why in bad.items()]
            for p in self.role(PSERVER):
                if p.node in bad and p.tail:
                    lines.append(self.failure_report(p, "") if p.finished else f"{p.plan.name} output:\n" +
                                 "\n".join("  | " + t for t in p.tail))
            cfg = self.plan.spec.cfg
            ended = [p for p in self.role(PSERVER) if p.node in bad and p.finished]
            refused = refused_arguments(cfg, self.plan.spec.trainer_args)
            if cfg.pserver_runs_entry and refused and any(p.exit_code == 2 for p in ended):
                lines.append(refused)
            elif cfg.pserver_runs_entry and ended:
                lines.append(f"pservers ran {cfg.entry} as {ROLE_VAR}=PSERVER and it exited before listening; if "
                             f"{cfg.entry} is a trainer-only script, run the built-in pserver: run --pserver builtin, "
                             f'or PSERVER_COMMAND = "{BUILTIN_PSERVER}" in conf.py')
            raise JobFailed("\n".join(lines))

    def run(self, failed_at: Optional[float]) -> None:
        """Watch the submitted plan until every trainer has finished; raises ``JobFailed`` on failure."""
        try:
            self.wait_ready()
            n = len(self.plan.env.pservers)
            self.out(f"{f'all {n} pserver(s) listening' if n else 'no pservers (a collective job)'}; starting "
                     f"{self.plan.env.trainers} trainer(s)")
        finally:
            held, self.held = self.held or [], None
            for line in held:
                self.out(line)
        if failed_at is not None:
            self.say(f"job running again {time.monotonic() - failed_at:.1f} s after the failure")
        try:
            self.pump(lambda: all(p.finished for p in self.role(TRAINER)), check=self.check_failures)
            self.check_failures()
        except ProcessFailed as e:
            raise self._cause(e) from None


def supervise(request: Request, backend: Backend, out: Callable[[str], None], say: Callable[[str], None],
              started: Callable[[LiveJob], None]) -> JobResult:
    """Submit ``request`` to ``backend`` and follow its plan to the end, restarting it from the newest common
    checkpoint after a process failure up to ``--max_restarts`` times; ``started`` gets each submission (the
    caller stops the last one). A failure is a ``JobResult``, not an exception."""
    plan = request.plan
    spec, restarts, failed_at = plan.spec, 0, None
    try:
        while True:
            job = backend.submit(request, say)
            started(job)
            attempt = Attempt(request, job, out, say)
            try:
                attempt.run(failed_at)
                break
            except ProcessFailed as e:
                if restarts >= spec.max_restarts:
                    left = f"\n(no restarts left: all {spec.max_restarts} used)" if spec.max_restarts else ""
                    return JobResult(spec.name, e.exit_code, f"{e}{left}", restarts)
                failed_at = time.monotonic()
                attempt.stopping = True
                lost = job.stop(spec.cfg.kill_grace)
                if lost:
                    raise JobFailed(f"{e}\ncannot restart: no stop confirmation from "
                                    f"{', '.join(job.labels[i] for i in lost)}") from None
                try:
                    step = resume.newest_common(job.complete_steps(plan.spec.checkpoint_root, plan.pserver_ids()))
                except ClusterError as err:  # e.g. a checkpoint there but unreadable: never restart from scratch
                    raise JobFailed(f"{e}\ncannot restart: {err}") from None
                restarts += 1
                where = f"checkpoint step {step}" if step is not None else "scratch (no complete checkpoint yet)"
                say(f"{e.headline}; restarting the job from {where} (restart {restarts} of {spec.max_restarts})")
                plan = plan.restarted(step)
                request = backend.render(plan, request.prepared)
    except JobFailed as e:
        return JobResult(spec.name, e.exit_code, str(e), restarts)
    left = len(attempt.role(TRAINER)) - len(attempt.abandoned)
    what = f"all {left} remaining" if attempt.abandoned else f"all {left}"
    return JobResult(spec.name, 0, f"job {spec.name} finished: {what} trainer(s) exited 0"
                     + (f" after {restarts} restart(s)" if restarts else ""), restarts)
