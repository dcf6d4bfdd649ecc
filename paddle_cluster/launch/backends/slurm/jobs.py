"""Slurm's client commands (``sbatch``, ``scontrol``, ``squeue``, ``scancel``) as functions, and ``kill``,
``status`` and ``logs`` of a job found again: Slurm knows the job, the shared filesystem holds each node's records
and logs (``backend.py`` for the layout)."""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import os
import re
import shlex
import shutil
import subprocess
import time
from typing import Callable, Dict, List, Mapping, Optional, Tuple

from paddle_cluster.node import jobdir, private, procs

from ... import journal
from ...config import ClusterConfig, HostSpec
from ...errors import JOB_NAME_FIX, ClusterError, UsageError
from ...interrupt import stoppable
from ...preflight import CheckLine, EngineRow, check_cluster
from ..base import ProcRow

_FIELD = re.compile(r"(\S+?)=(\S*)")
JOB_ID_FILE = "slurm_job"
CLIENT_HINT = ("run on a machine with the Slurm client commands (a login node), or install them (Debian: apt-get "
               "install slurm-client)")
FORGOTTEN = "Invalid job id"  # what scontrol and squeue say of a job Slurm no longer keeps


def slurm(argv: List[str], what: str, timeout: float = 60) -> str:
    """A Slurm client command's output; ``ClusterError`` naming it and Slurm's message when it fails."""
    exe = shutil.which(argv[0])
    if exe is None:
        raise ClusterError(f"--backend slurm: {argv[0]} not found; {CLIENT_HINT}")
    try:
        res = subprocess.run([exe, *argv[1:]], capture_output=True, text=True, timeout=timeout,
                             stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise ClusterError(f"{what}: {argv[0]} gave no answer within {timeout:.0f} s") from None
    if res.returncode != 0:
        raise ClusterError(f"{what}: {shlex.join(argv)} failed: {(res.stderr or res.stdout).strip()}")
    return res.stdout


def job_info(job_id: str) -> Dict[str, str]:
    """``scontrol show job`` as a dict (``JobState``, ``Reason``, ``NodeList``...); {} once Slurm forgot it.
    ``ClusterError`` when Slurm gives no answer now (a busy controller times out): that says nothing of the job."""
    try:
        out = slurm(["scontrol", "-o", "show", "job", job_id], f"looking up Slurm job {job_id}", 30)
    except ClusterError as e:
        if FORGOTTEN in str(e):
            return {}
        raise
    return dict(_FIELD.findall(out))

def node_dir(job_dir: str, node: int) -> str:
    return f"{job_dir}/node{node}"

def saved_job_id(job_dir: str) -> Optional[str]:
    try:
        with open(f"{job_dir}/.paddle_cluster/{JOB_ID_FILE}") as f:
            return f.read().strip() or None
    except OSError:
        return None

def steps(job_id: str, name: Optional[str] = None) -> List[str]:
    """The ids (``JOB.STEP``) of the job's steps ``squeue`` lists, of that name only if given; [] once Slurm
    forgot the job. ``ClusterError`` when Slurm gives no answer now."""
    try:
        out = slurm(["squeue", "-h", "-s", "-j", job_id, "-o", "%i %j"], f"listing the steps of Slurm job {job_id}",
                    30)
    except ClusterError as e:
        if FORGOTTEN in str(e):
            return []
        raise
    rows = [ln.split(None, 1) + [""] for ln in out.splitlines() if ln.strip()]
    return [r[0] for r in rows if name is None or r[1].strip() == name]


def write_id(job_dir: str, job_id: str) -> None:
    """The Slurm job (or step) id for status, logs and kill, replaced whole."""
    path = f"{job_dir}/.paddle_cluster/{JOB_ID_FILE}"
    with open(f"{path}.tmp", "w") as f:
        f.write(job_id + "\n")
    os.replace(f"{path}.tmp", path)


def srun_in_allocation(srun: List[str], adir: str, job_dir: str, name: str, cwd: str, say: Callable[[str], None],
                       start_timeout: float) -> subprocess.Popen:
    """Inside an allocation (``SLURM_JOB_ID``): ``srun`` started here, and the id (``JOB.STEP``) of the step it
    started recorded for status, logs and kill (which then stop that step, never the whole allocation): the step
    of the job's name Slurm lists that it did not list before; none recorded when srun ended first or Slurm did
    not list it within ``start_timeout``."""
    alloc = os.environ["SLURM_JOB_ID"]
    with contextlib.suppress(FileNotFoundError):  # a stale id would let kill reach another job
        os.unlink(f"{job_dir}/.paddle_cluster/{JOB_ID_FILE}")
    before = steps(alloc, name)  # a step of that name from before is not ours
    proc = subprocess.Popen(srun, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=open(f"{adir}/srun.out", "ab"), cwd=cwd, start_new_session=True)
    deadline = time.monotonic() + start_timeout
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            new = [s for s in steps(alloc, name) if s not in before]
        except ClusterError:  # no answer this time: ask again
            new = []
        if new:
            write_id(job_dir, new[0])
            say(f"Slurm step {new[0]} runs job {name}")
            return proc
        time.sleep(0.1)
    if proc.poll() is None:
        say(f"Slurm did not list the step of job {name} in allocation {alloc} within START_TIMEOUT; status, logs "
            "and kill cannot find it (Ctrl+C here stops it)")
    return proc


def active(job_id: str) -> Optional[bool]:
    """Slurm still has the job queued, running or completing (``squeue`` lists it), or the step (``JOB.STEP``)
    runs; None when Slurm gives no answer now."""
    try:
        if "." in job_id:
            return job_id in steps(job_id.split(".")[0])
        return bool(slurm(["squeue", "-h", "-j", job_id, "-o", "%T"], "", 30).strip())
    except ClusterError as e:
        return False if FORGOTTEN in str(e) else None

def cancel_job(job_id: str, timeout: float) -> str:
    """``scancel`` (a pending job too; a ``JOB.STEP``: that step only) and wait until ``squeue`` no longer lists
    it; its last state. Slurm not answering for a moment is waited out, up to ``timeout``."""
    deadline = time.monotonic() + timeout
    cancelled, why = False, "still listed by squeue"
    while True:
        listed = active(job_id)
        if listed is False:
            break
        if listed and not cancelled:
            try:
                slurm(["scancel", job_id], f"cancelling Slurm job {job_id}")
                cancelled = True
            except ClusterError as e:
                why = str(e)
        if listed is None:
            why = "no answer from squeue"
        if time.monotonic() > deadline:
            raise ClusterError(f"Slurm job {job_id}: {why} after {timeout:.0f} s of cancelling it; check "
                               f"`squeue -j {job_id}` and `scancel {job_id}` by hand")
        time.sleep(0.2)
    if "." in job_id:  # a step's state is not kept once it ended
        return "ended"
    try:
        return job_info(job_id).get("JobState", "gone")
    except ClusterError:
        return "gone"


def _known(cfg: ClusterConfig, name: str, handle: Mapping[str, str]) -> None:
    """A job this machine started, or whose directory is on the shared filesystem; else most likely a mistyped
    name, said so (not 'unknown node', 'no metrics', 'no Slurm job recorded')."""
    if not handle and not journal.outcome(cfg, name) and not os.path.isdir(cfg.job_dir(name)):
        raise ClusterError(f"job {name}: no {cfg.job_dir(name)}; {JOB_NAME_FIX}; or is ROOT_DIR the shared "
                           "filesystem it was started with?")


def _job_id(cfg: ClusterConfig, name: str, handle: Mapping[str, str]) -> str:
    """The Slurm job id, or ``JOB.STEP`` for a job that ran as a step of an existing allocation."""
    _known(cfg, name, handle)
    job_id = handle.get("slurm_job") or saved_job_id(cfg.job_dir(name))
    if not job_id:
        ended = journal.outcome(cfg, name)
        if ended:  # run ended it before sbatch gave it an id (sbatch refused it): what run said then
            raise ClusterError(f"job {name} never reached Slurm: run ended it {ended['outcome']} (exit "
                               f"{ended['exit_code']}): {ended['message']}")
        raise ClusterError(f"no Slurm job recorded for job {name} in {cfg.job_dir(name)}/.paddle_cluster; is "
                           "ROOT_DIR the shared filesystem it was started with?")
    return job_id


def _node_dirs(cfg: ClusterConfig, name: str) -> List[str]:
    """Each node's directory, in node order. Only ``node<N>`` directories: a dispatched workspace is the
    shared job directory, and its own files may start with "node" too."""
    top = cfg.job_dir(name)
    try:
        found = [(int(e.name[4:]), e.path) for e in os.scandir(top)
                 if re.fullmatch(r"node\d+", e.name) and e.is_dir()]
    except OSError:
        return []
    return [path for _, path in sorted(found)]


def node_dirs_by_name(cfg: ClusterConfig, name: str) -> Dict[str, str]:
    """Each node's directory by its node name (``node0``), for ``top``."""
    return {os.path.basename(d): d for d in _node_dirs(cfg, name)}


def remove_plans(adir: str) -> None:
    """The plan files of start ``adir`` that no node read (and so removed): they hold the job secret."""
    for path in glob.glob(f"{glob.escape(adir)}/plan.*.jsonl"):
        private.remove(path)


def kill(cfg: ClusterConfig, name: str, handle: Mapping[str, str]) -> str:
    job_id = _job_id(cfg, name, handle)
    for d in _node_dirs(cfg, name):
        if procs.load_records(d) is not None:  # its agent then says "stopped by paddle-cluster kill", as on ssh
            procs.request_kill(d)
    if "." in job_id:  # a step: scancel would SIGKILL it; its agents stop their processes on TERM, with grace
        _term_step(job_id, cfg.kill_grace + 10)
    state = cancel_job(job_id, cfg.kill_grace + 60)
    for adir in glob.glob(f"{glob.escape(cfg.job_dir(name))}/.paddle_cluster/attempt-*"):  # a job that never ran
        remove_plans(adir)
    what = f"Slurm step {job_id}" if "." in job_id else f"Slurm job {job_id}"
    return f"{what} (job {name}): {state}; nothing of it is left in squeue"


def _term_step(step: str, timeout: float) -> None:
    """SIGTERM to every task of the step (each node's agent then stops its processes within KILL_GRACE, saying
    it was a kill), and wait up to ``timeout`` for the step to end; ``cancel_job`` does the rest."""
    try:
        slurm(["scancel", "--signal=TERM", step], f"signalling Slurm step {step}")
    except ClusterError:  # ended already, or no answer: cancel_job tells and retries
        return
    deadline = time.monotonic() + timeout
    while active(step) is not False and time.monotonic() < deadline:
        time.sleep(0.2)


def status(cfg: ClusterConfig, name: str, handle: Mapping[str, str]) -> Tuple[str, List[ProcRow]]:
    """(Slurm's line about the job, a row per process from every node's records)."""
    job_id = _job_id(cfg, name, handle)
    alloc, _, step = job_id.partition(".")
    info = job_info(alloc)
    state = info.get("JobState", "unknown to Slurm (finished long ago?)")
    head = f"Slurm job {job_id}: {state}"
    if step:  # a step of an allocation: its own state, the allocation's besides
        runs = active(job_id)
        state = "RUNNING" if runs else "ENDED" if runs is False else "unknown (no answer from squeue)"
        head = f"Slurm step {job_id}: {state} (allocation {alloc}: {info.get('JobState', 'ended')})"
    elif info.get("Reason") not in (None, "None"):
        head += f" ({info['Reason']})"
    if info.get("NodeList") not in (None, "(null)"):
        head += f" on {info['NodeList']}"
    rows: List[ProcRow] = []
    for d in _node_dirs(cfg, name):
        rec = procs.load_records(d)
        for p in (rec or {}).get("procs", []):
            # The pids are on the nodes, not here: while the record says nothing, Slurm's state tells.
            st = jobdir.ended_state(p) or ("running" if state == "RUNNING" else f"ended ({state})")
            rows.append(ProcRow(os.path.basename(d), "", "", p["name"], p["role"], p["pid"], st,
                                jobdir.progress(d, p["name"]), jobdir.last_line(p["log"])))
    return head, rows


def logs(cfg: ClusterConfig, name: str, handle: Mapping[str, str], node_text: str, role: str, n: int,
         follow: bool) -> None:
    """``logs``: a node's log files on the shared filesystem; ``ClusterError`` when it has none (yet)."""
    _known(cfg, name, handle)
    t = node_text.strip()
    idx: Optional[int] = int(t[4:]) if t.startswith("node") and t[4:].isdigit() else int(t) if t.isdigit() else None
    d = node_dir(cfg.job_dir(name), idx if idx is not None else -1)
    if idx is None or not os.path.isdir(d):
        have = ", ".join(os.path.basename(x) for x in _node_dirs(cfg, name))
        # A node name among the ones there are is a usage error; before any node wrote its logs, it is not.
        error = UsageError if idx is None or have else ClusterError
        raise error(f"unknown node {node_text!r} of Slurm job {name}; its nodes: {have or 'none yet'}")
    job_id = _job_id(cfg, name, handle)
    with stoppable():
        try:
            missing = jobdir.print_logs(d, role, n, follow, ended=lambda: active(job_id) is False,
                                        watch_stdin=False)
        except KeyboardInterrupt:
            return
    if missing:  # (what is missing is said above)
        raise ClusterError(f"no {'' if role == 'all' else role + ' '}logs of {node_text} of Slurm job {name} yet: "
                           "its processes have not started there (status says where the job stands)")


TOOLS = ("sbatch", "srun", "squeue", "scancel", "scontrol")  # what run, status, logs and kill call


def check_here(cfg: ClusterConfig) -> List[CheckLine]:
    """``check --backend slurm``: the nodes are not known before the allocation, so this machine is checked (srun
    runs the nodes with its environment, on the shared ROOT_DIR), for the interpreter and ROOT_DIR only: its
    NIC and ports are not the nodes'; then Slurm's client commands and whether the controller answers."""
    rows: List[CheckLine] = list(check_cluster(dataclasses.replace(cfg, hosts=(HostSpec.parse("localhost"),)),
                                               ignore=("PADDLE_NIC", "port(")))
    return [*rows, _engine_row()]


def _engine_row() -> EngineRow:
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return EngineRow("slurm", False, "MISSING: " + ", ".join(missing),
                         f"{', '.join(missing)} not found on this machine (PATH); {CLIENT_HINT}")
    try:
        ping = slurm(["scontrol", "ping"], "asking the Slurm controller", 30).strip()
        version = slurm(["scontrol", "--version"], "asking scontrol its version", 30).strip()
    except ClusterError as e:
        said = str(e).splitlines()  # scontrol's errors, then its fatal one: the first line and the last
        return EngineRow("slurm", False, f"{', '.join(TOOLS)}; the controller: NO ANSWER",
                         f"{said[0]}{' ... ' + said[-1] if len(said) > 1 else ''}; check SLURM_CONF (or "
                         "/etc/slurm/slurm.conf) and that slurmctld runs")
    if "DOWN" in ping or "UP" not in ping:  # older scontrol says DOWN with status 0
        return EngineRow("slurm", False, f"{', '.join(TOOLS)} ({version}); the controller: DOWN",
                         f"'scontrol ping' says: {ping}; start slurmctld or check SLURM_CONF")
    return EngineRow("slurm", True, f"{', '.join(TOOLS)} ({version}); the controller: {' '.join(ping.split())}")


def metrics(cfg: ClusterConfig, job_name: str) -> Dict[str, List[dict]]:
    """``plot``: each trainer's metrics records, from every node's directory on the shared filesystem."""
    _known(cfg, job_name, {})
    job_dir = cfg.job_dir(job_name)
    merged: Dict[str, List[dict]] = {}
    nodes = sorted(d for d in (os.listdir(job_dir) if os.path.isdir(job_dir) else ()) if re.fullmatch(r"node\d+", d))
    for d in nodes:
        for trainer, recs in jobdir.metrics(f"{job_dir}/{d}").items():
            merged.setdefault(trainer, []).extend(recs)
    if not any(merged.values()):
        raise ClusterError(f"job {job_name} has no metrics records in {job_dir}/node*/log (on the shared "
                           "filesystem); trainers write them with paddle_cluster.train.metrics.MetricsWriter")
    return merged
