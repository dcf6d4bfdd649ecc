"""The Slurm backend: the nodes are an allocation of ``--nodes N``, not ``HOSTS``.

``ROOT_DIR`` is on the filesystem every Slurm node and this login machine share. The launcher installs the node
library and the workspace there, writes the plan (node ``i``'s address is a placeholder) and a batch script,
and submits it with ``sbatch`` (inside an allocation, ``SLURM_JOB_ID`` set, it runs the ``srun`` itself: the job
is then that step, ``JOB.STEP``, for status, logs and kill). The script's ``srun`` starts one ``node bootstrap``
per node: each takes its index from ``SLURM_NODEID``, publishes its ``PADDLE_NIC`` address in the job directory,
gives the plan's address placeholders every node's (``node.messages.resolve``), and runs its share. Its events
are appended to a file per node, which the launcher follows; ``scancel`` stops everything (Slurm's proctrack
kills every process of the job, ``setsid`` ones included) and removes a pending job.

Layout: ``ROOT_DIR/<job>/`` the workspace and ``checkpoints/``; ``node<i>/`` node i's agent state, logs,
metrics and ``nodefile`` (``PADDLE_JOB_DIR`` of its processes); ``.paddle_cluster/`` the Slurm job id and,
per start, ``attempt-<k>/`` with the plan, the script, the addresses and the events.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional, Tuple, cast

from paddle_cluster.node import messages as m
from paddle_cluster.node import private
from paddle_cluster.node.bootstrap import RankVars

from ... import dispatch, nodecmd, resume
from ...access import probe_nodes
from ...config import ClusterConfig, HostSpec
from ...errors import ClusterError, ConfigError
from ...hosts import LocalNode
from ...plan import JobPlan, JobSpec, Topology
from ...preflight import CheckLine
from ...top import DirsSource

if TYPE_CHECKING:
    from ...fetch import Outputs
from ..base import (
    Backend,
    BackendHelp,
    BackendOption,
    Description,
    Event,
    EventQueue,
    JobRef,
    LiveJob,
    Prepared,
    Request,
    plan_text,
)
from ..ssh.prepare import NO_LIBRARY
from . import jobs
from .jobs import cancel_job, job_info, node_dir, slurm
from .options import SlurmOptions, batch_script

POLL_S = 0.5
# SLURM_NNODES: what Slurm before SLURM_JOB_NUM_NODES set
RANKS = RankVars("srun", "SLURM_NODEID", "SLURM_JOB_NUM_NODES|SLURM_NNODES", "SLURM_LOCALID", "SLURMD_NODENAME")
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL",
         "DEADLINE")
PLAN = "plan.{node}.jsonl"  # in a start's directory: node {node}'s share, which holds the job secret
LEASE = "launcher.lease"  # rewritten every second by the launcher that follows the job (see node bootstrap)


def topology(cfg: ClusterConfig, spec: JobSpec, nodes: int, pythons: Tuple[str, ...] = (),
             resume_step: Optional[int] = None) -> Topology:
    """The allocation's ``nodes`` nodes as the plan sees them: each address a placeholder its node fills in once
    it runs (``--rendezvous``), each node a directory of its own (a shared job directory would mix their agent
    state, logs and nodefile), the checkpoints shared under the job directory."""
    addresses = [m.address_placeholder(i) for i in range(nodes)]
    hosts = Topology.hosts(cfg, addresses, pythons, resume_step, [node_dir(spec.job_dir, i) for i in range(nodes)])
    return dataclasses.replace(hosts, checkpoint_dir=spec.checkpoint_root, pending=tuple(addresses))


@dataclass(frozen=True)
class SlurmPrepared(Prepared):
    """The node library installed under the shared ROOT_DIR (a dry run's: a placeholder)."""

    lib: dispatch.Package = NO_LIBRARY


@dataclass(frozen=True)
class SlurmRequest(Request):
    """A start of the job as Slurm gets it, in its directory ``adir`` (``attempt-<k>``): the batch script and the
    ``sbatch`` command line submitting it (inside an allocation: its ``srun`` step alone); each node reads its
    share of the plan, as ``build_plan`` made it, from ``adir``."""

    adir: str
    script: str
    sbatch: Tuple[str, ...]
    srun: Tuple[str, ...]


class SlurmBackend(Backend):
    name = "slurm"
    help = BackendHelp("an allocation of --nodes", "the sbatch script",
                       "this machine, whose environment srun gives the nodes: the interpreter and its numpy, ROOT_DIR "
                       "(the nodes are not known before the allocation); Slurm's client commands (sbatch, srun, "
                       "squeue, scancel, scontrol) and that the controller answers (scontrol ping)")
    detach = ""
    needs_hosts = False  # the allocation gives the nodes (--nodes; default: as many as HOSTS lists)
    options = (
        BackendOption("--nodes", "nodes", "How many nodes (default: as many as HOSTS lists).", int, "N", 1),
        BackendOption("--partition", "partition", "The partition (sbatch --partition).", metavar="P"),
        BackendOption("--time", "time", "The time limit (sbatch --time), e.g. 2:00:00.", metavar="T"),
        BackendOption("--account", "account", "The account to charge (sbatch --account).", metavar="A"),
        BackendOption("--gres", "gres", "Generic resources per node, e.g. gpu:2 (sbatch --gres).", metavar="LIST"),
        BackendOption("--cpus-per-task", "cpus_per_task", "CPUs for each node's task (sbatch and srun "
                      "--cpus-per-task).", int, "N", 1),
        BackendOption("--mem", "mem", "Memory per node, e.g. 16G (sbatch --mem).", metavar="SIZE"),
        BackendOption("--exclusive", "exclusive", "The nodes are not shared with other jobs.", bool),
        BackendOption("--constraint", "constraint", "Node features required (sbatch --constraint).",
                      metavar="FEATURES"),
        BackendOption("--qos", "qos", "Quality of service (sbatch --qos).", metavar="Q"),
        BackendOption("--reservation", "reservation", "Run in this reservation (sbatch --reservation).", metavar="R"),
        BackendOption("--sbatch-arg", "sbatch_args", "Any other sbatch option, as written, e.g. "
                      "--sbatch-arg=--mail-type=END (repeatable).", metavar="OPT", multiple=True),
    )

    @classmethod
    def create(cls, cfg: ClusterConfig, opts: Mapping[str, Any], detach: bool = False) -> SlurmBackend:
        nodes = opts.get("nodes") or len(cfg.hosts)
        if not nodes:
            raise ConfigError("--nodes", None, "give --nodes N, how many nodes to allocate (or list the hosts in "
                              "HOSTS: their count is the default)")
        return cls(cfg, SlurmOptions(nodes, opts.get("partition"), opts.get("time"), opts.get("account"), detach,
                                     opts.get("gres"), opts.get("cpus_per_task"), opts.get("mem"),
                                     bool(opts.get("exclusive")), opts.get("constraint"), opts.get("qos"),
                                     opts.get("reservation"), tuple(opts.get("sbatch_args") or ())))

    def __init__(self, cfg: ClusterConfig, opts: SlurmOptions) -> None:
        self.cfg, self.opts = cfg, opts
        self.names = tuple(f"node{i}" for i in range(opts.nodes))
        self.labels = tuple(f"node{i} (Slurm)" for i in range(opts.nodes))
        self.local = LocalNode(0, HostSpec.parse("localhost"), cfg)

    # -- preparing ------------------------------------------------------------------------------------
    def prepare(self, spec: JobSpec, say: Callable[[str], None]) -> SlurmPrepared:
        for tool in ("sbatch", "srun", "scontrol", "scancel"):
            if shutil.which(tool) is None:
                slurm([tool], "")  # raises the install hint
        if spec.workspace and not os.path.isdir(spec.workspace):  # before the job directory is made
            raise ConfigError("--job_workspace", spec.workspace, "no such directory on this machine; with --backend "
                              "slurm it must be on the filesystem the nodes share")
        step = None
        if spec.resume_from:  # the checkpoints are on the shared filesystem: looked at here, before anything
            ids = [k for node in topology(self.cfg, spec, self.opts.nodes).pserver_ids() for k in node]
            step = resume.common_step(spec, [("the shared filesystem", _survey(spec.resume_root, ids))], say)
        os.makedirs(spec.job_dir, mode=0o700, exist_ok=True)
        os.chmod(spec.job_dir, 0o700)
        lib, res = probe_nodes([self.local], self.cfg)  # the node library under the shared ROOT_DIR
        (doc,) = res.ok("installing paddle_cluster under ROOT_DIR")
        self.local.close()
        pythons = (self.interpreter(doc),) * self.opts.nodes  # every node's: this machine's PYTHON, resolved
        if spec.dispatch_dir:
            dispatch.deliver_workspace([self.local], lib, spec, say)
        return SlurmPrepared(topology(self.cfg, spec, self.opts.nodes, pythons, step), self.names, self.labels, lib)

    def interpreter(self, doc: Dict[str, Any]) -> str:
        """PYTHON resolved to an absolute path on this machine (``doc``: its probe), numpy checked: srun runs the
        nodes with this machine's environment (--export=ALL) and ROOT_DIR is shared, so every process runs it."""
        if doc.get("numpy") is None:
            raise ClusterError(f"PYTHON = {self.cfg.python!r} ({doc.get('python_path')}) has no numpy; install it "
                               f"there ({self.cfg.python} -m pip install numpy) or set PYTHON to one that has it")
        return doc.get("python_path") or self.cfg.python

    def preview(self, spec: JobSpec, say: Callable[[str], None]) -> SlurmPrepared:
        return SlurmPrepared(topology(self.cfg, spec, self.opts.nodes), self.names, self.labels)

    def render(self, plan: JobPlan, prepared: Prepared) -> SlurmRequest:
        spec, lib = plan.spec, cast(SlurmPrepared, prepared).lib  # rendered by this backend
        adir = f"{spec.job_dir}/.paddle_cluster/attempt-{plan.start}"
        srun = self.srun_argv(plan, lib, adir)
        script = batch_script(spec.name, plan.start, [
            f"--nodes={self.opts.nodes}", "--ntasks-per-node=1", f"--job-name={spec.name}",
            f"--output={adir}/slurm-%j.out", f"--chdir={spec.cwd}",
            # A requeued job would find its nodes' plans gone (each is removed once read: it holds the job's
            # secret) and fail at bootstrap; the launcher restarts a job itself (--max_restarts).
            "--no-requeue", *self.opts.sbatch_options()], srun)
        sbatch = ("sbatch", "--parsable", f"{adir}/job.sh")
        return SlurmRequest(plan, (
            (f"Slurm batch script of job {spec.name}, to {adir}/job.sh. Nothing was submitted or written.", script),
            ("submitted with:", shlex.join(sbatch)),
            ("each node's share of the plan (its address: the node's on PADDLE_NIC, published when it starts):",
             plan_text(plan, prepared.labels))),
            {"backend": self.name}, prepared, adir, script, sbatch, tuple(srun))

    @classmethod
    def describe(cls, job: JobRef) -> Description:
        return Description(*jobs.status(job.cfg, job.name, job.handle))

    @classmethod
    def logs(cls, job: JobRef, node: str, role: str, lines: int, follow: bool, out: Callable[[str], None]) -> None:
        jobs.logs(job.cfg, job.name, job.handle, node, role, lines, follow)

    @classmethod
    def cancel(cls, job: JobRef, say: Callable[[str], None]) -> List[str]:
        return [jobs.kill(job.cfg, job.name, job.handle)]

    @classmethod
    def check(cls, cfg: ClusterConfig, opts: Mapping[str, Any]) -> List[CheckLine]:
        return jobs.check_here(cfg)

    @classmethod
    def metrics(cls, job: JobRef) -> Dict[str, List[dict]]:
        return jobs.metrics(job.cfg, job.name)

    @classmethod
    def figures(cls, job: JobRef) -> DirsSource:
        """``top``: every node's directory on the shared filesystem, read here (the agents write the figures)."""
        return DirsSource(lambda: jobs.node_dirs_by_name(job.cfg, job.name))

    @classmethod
    def outputs(cls, job: JobRef) -> Outputs:
        """``fetch``: every node's directory on the shared filesystem, read here."""
        from ...fetch import DirFiles, Outputs

        dirs = jobs.node_dirs_by_name(job.cfg, job.name)
        if not dirs:
            try:
                there = sorted(e.name for e in os.scandir(job.cfg.root_dir) if e.is_dir() and e.name[:1] != ".")
            except OSError:
                there = []
            raise ClusterError(f"job {job.name} has no node directories in {job.cfg.job_dir(job.name)}; jobs in "
                               f"ROOT_DIR {job.cfg.root_dir}: {', '.join(there) or 'none'}")
        # A dispatched workspace is the job directory every node shares, where its processes write output/:
        # that one is fetched as "shared", beside each node's own (its log/, nodefile).
        shared = DirFiles(-1, job.cfg.job_dir(job.name), "shared")
        return Outputs([shared, *(DirFiles(int(n[4:]), d) for n, d in dirs.items())])

    @classmethod
    def outputs_at(cls, cfg: ClusterConfig, name: str) -> str:
        return f"{cfg.job_dir(name)}/output/ on the shared filesystem (fetched as ./{name}/shared/output)"

    # -- rendering --------------------------------------------------------------------------------------
    def bootstrap_argv(self, plan: JobPlan, lib: dispatch.Package, adir: str, attached: bool) -> List[str]:
        cfg, spec = self.cfg, plan.spec
        # After a failure a following launcher decides (fail-fast, restarts), for as long as its lease shows it
        # follows; a job no launcher follows (--detach, or its launcher died) fails fast inside the allocation:
        # the failed node's agent exits 1 and srun --kill-on-bad-exit ends the step and so the job. --elastic
        # keeps going either way.
        if spec.elastic:
            keep: tuple = ("--keep-going",)
        elif attached:
            keep = ("--keep-going-while", f"{adir}/{LEASE}", "--lease-timeout", str(cfg.orphan_timeout))
        else:
            keep = ()
        argv = nodecmd.agent_argv(self.local, lib, "bootstrap", "--ranks", RANKS.text(), "--plan",
                                  f"{adir}/{PLAN}", "--remove-plan", "--events", f"{adir}/events.{{node}}.jsonl",
                                  "--rendezvous", f"{adir}/addresses", "--nic", cfg.paddle_nic,
                                  "--timeout", str(cfg.start_timeout), "--grace", str(cfg.kill_grace), *keep)
        python = plan.topology.nodes[0].python  # this machine's PYTHON, resolved (``interpreter``); a dry run: ""
        return [python, *argv[1:]] if python else argv

    def srun_argv(self, plan: JobPlan, lib: dispatch.Package, adir: str) -> List[str]:
        opts, spec = self.opts, plan.spec
        # srun takes --cpus-per-task from no variable since Slurm 22.05: the step asks for it again.
        cpus = [f"--cpus-per-task={opts.cpus_per_task}"] if opts.cpus_per_task else []
        return ["srun", f"--nodes={opts.nodes}", "--ntasks-per-node=1", *cpus, f"--job-name={spec.name}",
                "--kill-on-bad-exit=1", "--export=ALL", *self.bootstrap_argv(plan, lib, adir, not opts.detach)]

    # -- running --------------------------------------------------------------------------------------
    def submit(self, request: Request, say: Callable[[str], None]) -> SlurmLiveJob:
        job = SlurmLiveJob(cast(SlurmRequest, request), self.cfg, self.opts, say)  # rendered by this backend
        try:
            job.start()
        except BaseException:
            job.stop(self.cfg.kill_grace)  # a job queued for nobody is cancelled
            raise
        return job


def write_plans(adir: str, plan: JobPlan) -> None:
    """Each node's share of ``plan``, as ``build_plan`` made it, into its file in the start's directory ``adir``
    (the node's bootstrap reads it: ``node.bootstrap.read_plan``). Each holds the secret: 0600, and its node
    removes it once read."""
    for n in plan.nodes:
        private.write_private(f"{adir}/{PLAN}".replace("{node}", str(n.node)), m.encode(m.Start(n)).encode())


class SlurmLiveJob(LiveJob):
    """One start on Slurm: the Slurm job (or, inside an allocation, the ``srun`` step), followed through the nodes'
    events files in the start's directory while the launcher's lease there shows it follows."""

    def __init__(self, request: SlurmRequest, cfg: ClusterConfig, opts: SlurmOptions,
                 say: Callable[[str], None]) -> None:
        super().__init__(request)
        self.slurm_request, self.cfg, self.opts, self.say = request, cfg, opts, say
        self.job_id: Optional[str] = None
        self.srun: Optional[subprocess.Popen] = None  # inside an existing allocation
        self.adir = request.adir
        self.events = EventQueue(range(opts.nodes), cfg.orphan_timeout)
        self._done = threading.Event()

    def start(self) -> None:
        request, spec, opts, adir = self.slurm_request, self.plan.spec, self.opts, self.adir
        write_plans(adir, self.plan)
        srun = list(request.srun)
        if os.environ.get("SLURM_JOB_ID") and not opts.detach:
            self.say(f"inside Slurm allocation {os.environ['SLURM_JOB_ID']}: running srun")
            if [o for o in opts.sbatch_options() if not o.startswith("--cpus-per-task=")]:
                self.say("the allocation's resources apply: sbatch options are for a new allocation (--detach, "
                         "or run outside it)")
            self.srun = jobs.srun_in_allocation(srun, adir, spec.job_dir, spec.name, spec.cwd, self.say,
                                               self.cfg.start_timeout)
        else:
            with open(f"{adir}/job.sh", "w") as f:
                f.write(request.script)
            out = slurm(list(request.sbatch), "submitting the job")
            self.job_id = out.strip().split(";")[0]
            jobs.write_id(spec.job_dir, self.job_id)
            self.say(f"submitted Slurm job {self.job_id} ({opts.nodes} node(s))")
        if self.job_id:  # the Slurm job id once submitted (the job directory keeps it too)
            self.ref = dataclasses.replace(self.ref, handle={**self.ref.handle, "slurm_job": self.job_id})
        if opts.detach:  # the nodes fail fast on their own (no launcher follows)
            self.say(f"job {spec.name} is Slurm job {self.job_id}")
            return
        threading.Thread(target=self._follow, args=(adir, self.events, self._done), daemon=True,
                         name="slurm").start()
        self._wait_running()

    def _wait_running(self) -> None:
        """Until the job runs (Slurm's reason printed while it is pending); Ctrl+C here cancels it."""
        if self.job_id is None:
            return
        reason = ""
        while True:
            try:
                info = job_info(self.job_id)
            except ClusterError as e:  # no answer this time: ask again (Ctrl+C cancels the job)
                info = {"JobState": "PENDING", "Reason": f"no answer from Slurm ({e})"}
            state = info.get("JobState", "")
            if state != "PENDING":
                self.events.starting(self.cfg.start_timeout)
                if state == "RUNNING":
                    self.say(f"Slurm job {self.job_id} running on {info.get('NodeList', '?')}")
                return
            if info.get("Reason") != reason:
                reason = info.get("Reason", "")
                self.say(f"Slurm job {self.job_id} pending" + (f": {reason}" if reason not in ("", "None") else ""))
            for i in self.events.last_heard:  # a queued job is not a silent agent
                self.events.last_heard[i] = time.monotonic()
            time.sleep(POLL_S)

    def _follow(self, adir: str, events: EventQueue, done: threading.Event) -> None:
        """Tail every node's events file until the job or step has ended and the files are drained."""
        offsets = {i: 0 for i in range(self.opts.nodes)}
        partial = {i: b"" for i in offsets}
        next_check, beat = 0.0, 0
        while True:
            ended = False
            if time.monotonic() >= next_check:  # Slurm is asked once a second; the files are read more often
                beat += 1
                _renew(f"{adir}/{LEASE}", beat)
                ended, next_check = self._ended(), time.monotonic() + POLL_S * 2
            for i in offsets:
                try:
                    with open(f"{adir}/events.{i}.jsonl", "rb") as f:
                        f.seek(offsets[i])
                        chunk = f.read()
                except OSError:
                    continue
                offsets[i] += len(chunk)
                *lines, partial[i] = (partial[i] + chunk).split(b"\n")
                for raw in lines:
                    line = raw.decode(errors="replace")
                    try:
                        ev = m.decode(line)
                    except m.MessageError:
                        ev = m.Note(i, line)
                    events.put(i, ev if isinstance(ev, m.EVENTS) else m.Note(i, line))
            if ended or done.is_set():
                break
            time.sleep(0.1)
        if not done.is_set():
            for i in offsets:
                events.channel_closed(i)

    def _ended(self) -> bool:
        if self.srun is not None:
            return self.srun.poll() is not None
        if self.job_id is None:
            return True
        try:
            return job_info(self.job_id).get("JobState", "COMPLETED") in ENDED
        except ClusterError:  # no answer now; the nodes' events files still tell what runs
            return False

    def next_event(self, timeout: float) -> Optional[Event]:
        return self.events.get(timeout)

    def request_stop(self, grace: float) -> None:
        if self.srun is not None and self.srun.poll() is None:
            self.srun.terminate()  # srun forwards it to every task and ends the step
        elif self.job_id is not None and shutil.which("scancel"):
            subprocess.Popen([shutil.which("scancel") or "scancel", self.job_id], stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def stop(self, grace: float) -> List[int]:
        if self.job_id is None and self.srun is None:
            jobs.remove_plans(self.adir)  # a start that failed before submitting, or stopped already
            return []
        self._done.set()
        if self.srun is not None:
            self.request_stop(grace)
            try:
                self.srun.wait(timeout=grace + 30)
            except subprocess.TimeoutExpired:
                self.srun.kill()
                self.srun.wait()
            self.srun = None
            jobs.remove_plans(self.adir)
            return []
        job_id, self.job_id = self.job_id, None
        cancel_job(job_id, grace + 60)
        jobs.remove_plans(self.adir)  # the nodes that never read theirs
        return []

    def complete_steps(self, root: str, pservers: Dict[int, List[int]]) -> List[List[int]]:
        from paddle_cluster.ps.checkpoint import complete_steps  # the checkpoints are on the shared filesystem

        return [complete_steps(root, ids) for _, ids in sorted(pservers.items())]

    def log_of(self, node: int, proc: m.ProcPlan) -> str:
        return f"{node_dir(self.plan.spec.job_dir, node)}/log/{proc.log}"

    def close(self) -> None:
        self._done.set()  # (a detached job's nodes have yet to read their plans: only stop removes them)


def _renew(path: str, beat: int) -> None:
    """The lease: new content each time (the nodes watch it change, not its time stamp), replaced whole."""
    try:
        with open(f"{path}.tmp", "w") as f:
            f.write(f"{os.getpid()} {beat}\n")
        os.replace(f"{path}.tmp", path)
    except OSError:  # the shared filesystem hiccuped: the nodes wait ORPHAN_TIMEOUT before they take it as gone
        pass


def _survey(root: str, pservers: List[int]) -> Dict[str, Any]:
    """``ps.checkpoint.survey`` of the shared checkpoint root, or why it cannot be told."""
    from paddle_cluster.ps.checkpoint import survey  # numpy: only this needs it
    from paddle_cluster.ps.errors import CheckpointError

    try:
        return survey(root, pservers)
    except CheckpointError as e:
        return {"error": str(e)}
