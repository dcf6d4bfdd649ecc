"""``paddle-cluster run``: backend -> plan -> supervise -> result, and whatever happens -- success, a failed
process, a lost node, Ctrl+C -- the ``finally`` stops every process on every node (each node's agent also
stops on its own if the launcher disappears)."""

from __future__ import annotations

from typing import Callable, List, Optional

from . import journal
from .backends import Backend, backend_for
from .backends.base import LiveJob, Prepared
from .each_node import NodesInterrupted
from .errors import ClusterError, Interrupted
from .interrupt import stoppable
from .plan import JobSpec, build_plan
from .supervise import JobResult, supervise


def render_text(spec: JobSpec, be: Backend, say: Callable[[str], None]) -> str:
    """``run --dry-run``, ``render``: the request ``submit`` would be given, as text; nothing started or written."""
    preview = be.preview(spec, say)
    return be.render(build_plan(spec, preview.topology), preview).text()


def submit(spec: JobSpec, be: Backend, say: Callable[[str], None]) -> JobResult:
    """``run --detach``: submit the job and return; the journal keeps its handle for ``status``, ``logs``, ``kill``.
    (A submission that fails leaves nothing queued for nobody: ``submit`` stops what it started.)"""
    prepared: Optional[Prepared] = None
    try:
        with stoppable():
            prepared = be.prepare(spec, say)
            job = be.submit(be.render(build_plan(spec, prepared.topology), prepared), say)
        job.close()
    finally:
        if prepared is not None:
            prepared.close()
    journal.remember(spec.cfg, spec.name, spec.workspace, job.ref.handle)
    return JobResult(spec.name, 0, f"job {spec.name} submitted to {be.name}; follow it with `paddle-cluster status` "
                     f"and `paddle-cluster logs node0 -f`, stop it with `paddle-cluster kill` (add --job_name "
                     f"{spec.name} for an older job)")


def run_job(spec: JobSpec, out: Callable[[str], None], say: Callable[[str], None],
            backend: Optional[Backend] = None) -> JobResult:
    """``_run`` the job, and record how it ended for ``status`` (once it started)."""
    started = []
    result = _run(spec, out, lambda: started.append(True), say, backend)
    if started:
        journal.record_outcome(spec.cfg, spec.name, result.exit_code, result.outcome, result.message)
    return result


def _run(spec: JobSpec, out: Callable[[str], None], on_start: Callable[[], None], say: Callable[[str], None],
         backend: Optional[Backend] = None) -> JobResult:
    """Run the whole job and leave nothing running; ``out`` gets the processes' lines, ``say`` the launcher's.
    Every way the job can end is a ``JobResult``: exit codes as in ``errors.OUTCOMES``."""
    be = backend or backend_for(spec.cfg)
    jobs: List[LiveJob] = []  # each start of the job, as submitted: the last one is running
    prepared: Optional[Prepared] = None

    def skip_grace() -> None:
        say("second interrupt: killing without grace period")
        if jobs:
            jobs[-1].request_stop(0)

    with stoppable(skip_grace) as interrupts:
        try:
            prepared = be.prepare(spec, say)
            request = be.render(build_plan(spec, prepared.topology), prepared)
            journal.remember(spec.cfg, spec.name, spec.workspace, request.handle)
            plan = request.plan
            on_start()
            if spec.elastic:
                say("--elastic: a trainer that dies is reported and the others go on (async mode; in sync mode "
                    "the next barrier still waits for it and fails after BARRIER_TIMEOUT)")
            if not plan.env.integrity:
                say("INTEGRITY = False: frames between trainers and pservers carry no MAC (an isolated fabric only)")
            say(f"job {spec.name}: {len(plan.env.pservers)} pserver(s), {plan.env.trainers} trainer(s) in "
                f"{spec.job_dir}")
            return supervise(request, be, out, say, jobs.append)
        except KeyboardInterrupt as e:
            say(f"interrupted: stopping job {spec.name} on every node (Ctrl+C again to skip the grace period)")
            for line in e.lines() if isinstance(e, NodesInterrupted) else ():
                say(line)
            return JobResult(spec.name, Interrupted.exit_code, f"job {spec.name} interrupted; every process was "
                             "stopped")
        except ClusterError as e:
            return JobResult(spec.name, e.exit_code, str(e))
        finally:
            try:
                lost = jobs[-1].stop(0 if interrupts.count > 1 else spec.cfg.kill_grace) if jobs else []
                if lost:
                    say(jobs[-1].unstopped(lost))
            finally:
                for job in jobs:
                    job.close()
                if prepared is not None:
                    prepared.close()
