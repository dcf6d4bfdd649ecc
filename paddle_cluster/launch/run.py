"""``paddle-cluster run``: backend -> plan -> supervise -> result, and whatever happens -- success, a failed
process, a lost node, Ctrl+C -- the ``finally`` stops every process on every node (each node's agent also
stops on its own if the launcher disappears)."""

from __future__ import annotations

import os
import sys
import threading
from typing import Callable, List, Optional

from . import journal
from .backends import Backend, backend_for
from .backends.base import LiveJob, Prepared
from .each_node import NodesInterrupted
from .errors import ClusterError, Interrupted
from .interrupt import stoppable
from .plan import JobSpec, build_plan
from .supervise import JobResult, supervise

LAST_WAIT_S = 5.0  # after a second interrupt, the launcher ends within this, whatever it still waits on


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
                     f"and `paddle-cluster logs node0 -f`, stop it with `paddle-cluster kill`, copy its outputs here "
                     f"with `paddle-cluster fetch` once it has finished (add --job_name {spec.name} for an older job)")


def run_job(spec: JobSpec, out: Callable[[str], None], say: Callable[[str], None],
            backend: Optional[Backend] = None, fetch: bool = False) -> JobResult:
    """``_run`` the job, and record how it ended for ``status`` (once it started); then say where its outputs
    are and (``fetch``, after a success) copy trainer 0's ``output/`` here."""
    started = []

    def record(result: JobResult) -> None:
        if started:
            journal.record_outcome(spec.cfg, spec.name, result.exit_code, result.outcome, result.message)

    be = backend or backend_for(spec.cfg)
    result = _run(spec, out, lambda: started.append(True), say, be, record)
    record(result)
    if started:
        _outputs(spec, be, result, fetch, say)
    return result


def _outputs(spec: JobSpec, be: Backend, result: JobResult, fetch: bool, say: Callable[[str], None]) -> None:
    """Where the job's outputs are and how to fetch them; with ``fetch`` (a job that finished), trainer 0's
    ``output/`` (node0's; Slurm: the shared job directory's) fetched into ``./<job>/node0`` (``shared``)."""
    from . import fetch as fetching
    from .backends.base import JobRef

    try:
        outputs = be.outputs(JobRef(spec.cfg, spec.name, {})) if fetch and result.ok else None
    except ClusterError as e:  # a backend whose outputs fetch cannot reach (Kubernetes): its line says how
        say(str(e))
        return
    if outputs is None:
        say(fetching.hint(spec.name, be.outputs_at(spec.cfg, spec.name)))
        return
    try:
        outputs.keep(["node0", "shared"])  # trainer 0's node, and a shared job directory (Slurm)
        fetching.fetch_job(lambda: outputs, spec.name, None, fetching.DEFAULT_PATHS, say)
    except ClusterError as e:
        say(f"--fetch: {e}; the job's outcome stands (exit {result.exit_code})")


def _run(spec: JobSpec, out: Callable[[str], None], on_start: Callable[[], None], say: Callable[[str], None],
         backend: Optional[Backend] = None, record: Callable[[JobResult], None] = lambda r: None) -> JobResult:
    """Run the whole job and leave nothing running; ``out`` gets the processes' lines, ``say`` the launcher's.
    Every way the job can end is a ``JobResult``: exit codes as in ``errors.OUTCOMES``. After a second interrupt
    it ends within ``LAST_WAIT_S`` (``record``-ing that end), whatever it still waits on."""
    be = backend or backend_for(spec.cfg)
    jobs: List[LiveJob] = []  # each start of the job, as submitted: the last one is running
    prepared: Optional[Prepared] = None
    last_wait: List[threading.Timer] = []  # armed by a second interrupt

    def give_up() -> None:
        result = JobResult(spec.name, Interrupted.exit_code, f"job {spec.name} interrupted before its stop was "
                           f"confirmed: its processes may still run; `paddle-cluster kill --job_name {spec.name}` "
                           "stops them")
        say(f"still stopping {LAST_WAIT_S:.0f} s after the second interrupt: leaving now")
        say(result.message)
        try:
            record(result)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(result.exit_code)  # the main thread is blocked on a node or an engine: no unwinding

    def skip_grace() -> None:
        say("second interrupt: killing without grace period")
        if jobs:
            jobs[-1].request_stop(0)
        if not last_wait:
            last_wait.append(threading.Timer(LAST_WAIT_S, give_up))
            last_wait[0].daemon = True
            last_wait[0].start()

    stopped: List[List[int]] = []

    def stop() -> List[int]:
        """Stop the running start of the job, once; the nodes that did not confirm it (said)."""
        if not stopped:
            stopped.append(jobs[-1].stop(0 if interrupts.count > 1 else spec.cfg.kill_grace) if jobs else [])
            if stopped[0]:
                say(jobs[-1].unstopped(stopped[0]))
        return stopped[0]

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
            lost = stop()
            return JobResult(spec.name, Interrupted.exit_code, f"job {spec.name} interrupted; " + (
                "every process was stopped" if not lost else "what may still run is named above"))
        except ClusterError as e:
            return JobResult(spec.name, e.exit_code, str(e))
        finally:
            try:
                stop()
            finally:
                for job in jobs:
                    job.close()
                if prepared is not None:
                    prepared.close()
                for t in last_wait:  # ended in time
                    t.cancel()
