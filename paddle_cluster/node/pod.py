"""``python -m paddle_cluster.node pod [--start-timeout S] -- CMD...``: the entry point of a Kubernetes pod.

One pod runs one process, and Kubernetes is its supervisor (it keeps the logs, stops the pod, and its Job
counts the exit code), so this only makes the pod that process of the job: the role is in the environment
(``PADDLE_TRAINING_ROLE``, set per Job), the id is the pod's completion index (``JOB_COMPLETION_INDEX``, set
by the Job controller of an Indexed Job), and the pservers are the stable DNS names of the job's headless
Service, already in ``PADDLE_PSERVER_ENDPOINTS``. Nobody asks the API server for addresses.

Before starting CMD, a pserver waits until its own name resolves to an address of this pod (DNS records
appear shortly after a pod starts), a trainer until every pserver port accepts a connection; both within
``--start-timeout`` seconds. Then CMD runs as this process's child, with the process's contract added to the
environment; its output is the pod's log (relayed: ``podlog.py``, so the lines the launcher reads as this
entry point's are this entry point's alone), its exit code the pod's, and SIGTERM (the pod being deleted) is
passed on to it. What the job's processes leave in the pod's job-dir volume goes with the pod, so a trainer's
metrics records are also printed to the log once it exits (``METRICS`` lines: the launcher keeps them).

The whole job ends on the cluster itself, without a launcher watching: a pserver pod given the trainers' names
(``--trainer-names``) stops its pserver and fails once its trainers are gone without the pserver having finished
(``trainerwatch.py``: from their connections to its ports, and the cluster DNS while none is connected; trainers
not scheduled yet are never counted). When the trainers finish, the pserver ends on its own (every trainer
closed). A pserver pod of a run whose pservers started before (Kueue evicted the job and admitted it again: its
mark in the checkpoint directory) resumes from the newest checkpoint complete for every pserver
(``resume_after_eviction``). Standard library only, but for that checkpoint survey (the pserver's own module).
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from typing import Dict, List, Mapping, Optional

from paddle_cluster.contract import PSERVER, SECRET_VAR, ContractError, Endpoint, JobEnv, node_defaults

from .podlog import LOG, not_dumpable
from .trainerwatch import CHECK_S, TrainersGone, lookup

INDEX_VAR = "JOB_COMPLETION_INDEX"  # Kubernetes' own, set in every pod of an Indexed Job
# This entry point's own lines in the pod's log; the k8s backend reads "ready"/"error" ones as events.
PREFIX = "paddle-cluster pod: "
READY = PREFIX + "ready: "
ERROR = PREFIX + "error: "
IMAGE = PREFIX + "image: "
METRICS = PREFIX + "metrics "  # + "trainer<N> " + one JSON record of log/metrics.trainer<N>.jsonl
FIGURES = PREFIX + "figures "  # + one JSON object: the process's figures for ``top``, every FIGURES_S
QUIET = (METRICS, FIGURES)  # the entry point's lines that are not the process's output (``logs`` leaves them out)
FIGURES_S = 2.0  # a line of ~400 bytes: ~17 MB of pod log a day
POLL_S = 0.2
STARTING = b"paddle-cluster pod: starting\n"  # a pserver pod's port, before its pserver listens there
STARTING_MIN_S = 1.0  # how long at least it says so: a trainer polling every POLL_S sees it
PROBE_S = 0.3  # how long a trainer waits for STARTING from a port that accepted
STOP_GRACE_S = 10.0  # as a launcher's KILL_GRACE: SIGTERM, then SIGKILL
EXIT_NOT_READY = 3  # like a pserver that cannot use its checkpoint: nothing ran, nothing to retry here
EXIT_TRAINERS_GONE = 5  # a pserver stopped because its trainers ended without finishing


class PodError(Exception):
    """This pod cannot become its process of the job; the message says why and what to check."""


def completion_index(environ: Mapping[str, str]) -> int:
    text = environ.get(INDEX_VAR, "")
    if not (text.isascii() and text.isdigit()):
        raise PodError(f"{INDEX_VAR}={text!r}: expected the pod's completion index; this entry point runs in "
                       "the pods of an Indexed Job (completionMode: Indexed)")
    return int(text)


def _addresses(host: str) -> List[str]:
    return lookup(host)[0]


def _is_mine(address: str) -> bool:
    """``address`` belongs to this pod: a socket can be bound to it."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as s:
            s.bind((address, 0))
        return True
    except OSError:
        return False


def wait_own_name(host: str, deadline: float) -> str:
    """Until ``host`` resolves to an address of this pod; that address."""
    seen: List[str] = []
    while True:
        seen = _addresses(host)
        mine = [a for a in seen if _is_mine(a)]
        if mine:
            return mine[0]
        if time.monotonic() > deadline:
            got = f"resolves to {', '.join(seen)}, not an address of this pod" if seen else "does not resolve"
            raise PodError(f"{host} {got}: is the pod's subdomain the job's headless Service, and does the "
                           "Service select this pod (publishNotReadyAddresses: true)?")
        time.sleep(POLL_S)


def _probe(host: str, port: int) -> str:
    """``ready`` (a pserver listens), ``starting`` (the pod's entry point runs: ``Starting``), ``refused`` (the
    pod has an address, nothing listens) or ``unresolved``."""
    try:
        s = socket.create_connection((host, port), timeout=1.0)
    except socket.gaierror:
        return "unresolved"
    except OSError:
        return "refused"
    with s:
        s.settimeout(PROBE_S)
        try:
            said = s.recv(len(STARTING))
        except OSError:  # (a pserver says nothing first)
            said = b""
    return "starting" if said == STARTING else "ready"


def wait_pservers(env: JobEnv, start_timeout: float) -> None:
    """Until every port of every pserver accepts a connection (names resolved afresh each round), within
    ``start_timeout`` s, which do not run while a pserver pod has an address but its entry point never answered:
    its container is not running yet (its image being pulled, which can take minutes on a node)."""
    pending = [(k, e.host, p) for k, e in enumerate(env.pservers) for p in env.all_ports(k)]
    alive: set = set()  # the pservers whose entry point was seen running
    counted, last, held = 0.0, time.monotonic(), False
    while True:
        left, pulling = [], []
        for k, host, port in pending:
            state = _probe(host, port)
            alive |= {k} if state in ("starting", "ready") else set()
            if state != "ready":
                left.append((k, host, port))
            if state == "refused" and k not in alive:
                pulling.append(host)
        pending = left
        if not pending:
            return
        now = time.monotonic()
        if not pulling:
            counted += now - last
        elif not held:
            say(f"{PREFIX}{pulling[0]} has an address but its container does not run yet (pulling its image?): "
                "the start timeout waits")
        held, last = bool(pulling), now
        if counted > start_timeout:
            raise PodError(f"no pserver listening on {', '.join(f'{h}:{p}' for _, h, p in pending)} within the "
                           "start timeout (START_TIMEOUT): see the pserver pods' logs and events")
        time.sleep(POLL_S)


class Starting:
    """A pserver pod's first port while its entry point prepares: it answers ``STARTING`` and waits for the prober
    to close first (so the port is free at once for the pserver), for ``STARTING_MIN_S`` at least."""

    def __init__(self, port: int) -> None:
        self.since = time.monotonic()
        self.stop = threading.Event()
        try:
            self.sock: Optional[socket.socket] = socket.create_server(("", port))
        except OSError:  # taken: the trainers then count their start timeout as they did
            self.sock = None
            return
        self.sock.settimeout(POLL_S)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        assert self.sock is not None
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            with conn:
                try:
                    conn.settimeout(1.0)
                    conn.sendall(STARTING)
                    conn.recv(1)
                except OSError:
                    pass

    def close(self) -> None:
        if self.sock is None:
            return
        time.sleep(max(0.0, STARTING_MIN_S - (time.monotonic() - self.since)))
        self.stop.set()
        self.thread.join()
        self.sock.close()


def resolve_trainers(env: JobEnv, deadline: float) -> JobEnv:
    """``env`` with the trainer pods' names (PADDLE_TRAINER_ENDPOINTS, trainer 0's is MASTER_ADDR) replaced by
    their addresses, once every one resolves, in a job without pservers. With pservers, a name that does not
    resolve now stays (a trainer that already finished is no longer published): that job's trainers need not
    meet."""
    resolved = []
    for e in env.trainer_endpoints:
        while not _addresses(e.host):
            if env.pservers:
                break
            if time.monotonic() > deadline:
                raise PodError(f"trainer pod {e.host} does not resolve within the start timeout (START_TIMEOUT): "
                               "see the trainer pods' events; is the job's headless Service there?")
            time.sleep(POLL_S)
        resolved.append(Endpoint((_addresses(e.host) or [e.host])[0], e.port))
    return dataclasses.replace(env, trainer_endpoints=tuple(resolved))


MAX_SECRET_FILE = 4096  # bytes: a secret is 64 hex digits


def read_secret(path: str) -> str:
    """The job secret from the Secret mounted at ``path`` (read once: it is kept in this process's memory, never
    in its environment, where ``/proc/1/environ`` would show it to every process of the pod's user)."""
    try:
        with open(path, "rb") as f:
            text = f.read(MAX_SECRET_FILE + 1)
    except OSError as e:
        raise PodError(f"cannot read the job secret from {path} (the job's Secret, mounted): {e.strerror or e}; "
                       "was the pod rendered by paddle-cluster render k8s?") from None
    if len(text) > MAX_SECRET_FILE:
        raise PodError(f"the job secret file {path} holds more than {MAX_SECRET_FILE} bytes; not a job secret")
    return text.decode("utf-8", "replace").strip()


def become(cmd: List[str], start_timeout: float, environ: Optional[Mapping[str, str]] = None,
           trainer_names: str = "", pack: str = "", secret_file: str = "") -> int:
    """Wait as this pod's role requires, then run ``cmd`` with the process's contract; its exit code.
    ``secret_file``: where the job secret is (it is then not in the environment)."""
    base: Dict[str, str] = dict(os.environ if environ is None else environ)
    if secret_file:
        base[SECRET_VAR] = read_secret(secret_file)
    env = JobEnv.from_environ(base)
    if env is None:
        raise PodError("no pserver endpoints in the environment (PADDLE_PSERVER_ENDPOINTS): the pod was not "
                       "rendered by paddle-cluster render k8s")
    if env.role is None:
        raise PodError("PADDLE_TRAINING_ROLE is not set: the pod was not rendered by paddle-cluster render k8s")
    index = completion_index(base)
    # This is the container's PID 1, which the kernel shields from a SIGTERM it does not handle: a pod deleted
    # while it waits would stay until its grace period ran out.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _end_waiting)
    if env.job_dir:
        writable_dir(env.job_dir, "the job directory (PADDLE_JOB_DIR)")
    if env.role == PSERVER and env.checkpoint_dir:
        writable_dir(env.checkpoint_dir, "the checkpoint directory (PADDLE_CHECKPOINT_DIR)")
        env = resume_after_eviction(env, index)
    if pack:
        unpack_workspace(pack, env.workspace)
    env.for_process(env.role, index, "")  # an index beyond the job's count fails now, not after waiting
    if env.workspace and os.path.isdir(env.workspace) and not _can_write(env.workspace):
        say(f"{PREFIX}note: the workspace {env.workspace} is not writable by this pod's user ({_user()}; "
            f"{_owner(env.workspace)}): a script that writes into it (output/) fails; in the image, COPY "
            f"--chown={os.getuid()}:{os.getgid()} it")
    deadline = time.monotonic() + start_timeout
    starting = None
    if env.role == PSERVER:
        starting = Starting(env.pservers[index].port)
        host = env.pservers[index].host
        address = wait_own_name(host, deadline)
        say(f"{READY}pserver {index}: {host} is this pod ({address}); starting {' '.join(cmd)}")
        current = host  # the name the pserver binds to and the trainers dial
    else:
        if env.pservers:
            say(f"{PREFIX}trainer {index}: waiting for {len(env.pservers)} pserver(s) to listen")
            wait_pservers(env, start_timeout)
        env = resolve_trainers(env, deadline)
        say(f"{READY}trainer {index}: {'every pserver listens' if env.pservers else 'no pservers'}, MASTER_ADDR "
            f"{env.trainer_endpoints[0].host if env.trainer_endpoints else '-'}; starting {' '.join(cmd)}")
        # The pod's address: its hostname resolves to it (the kubelet's /etc/hosts entry).
        current = (_addresses(socket.gethostname()) or [socket.gethostname()])[0]
    proc_env = process_environ(base, env, index, current)
    if env.job_dir:
        os.makedirs(os.path.join(env.job_dir, "log"), exist_ok=True)
    if starting is not None:
        starting.close()  # the pserver's port, for the pserver
    not_dumpable()  # the process cannot write into the log past the relay (/proc/1/fd/1), nor read our environment
    out, err = os.pipe(), os.pipe()
    try:
        child = subprocess.Popen(cmd, env=proc_env, stdout=out[1], stderr=err[1])
    except OSError as e:
        raise PodError(f"cannot start {cmd[0]!r} in {os.getcwd()}: {e.strerror or e}") from None
    finally:
        os.close(out[1])
        os.close(err[1])
    LOG.relay(out[0], 1)  # its output into the pod's log, with our prefix made inert: our lines are ours alone
    LOG.relay(err[0], 2)
    stopped: List[int] = []

    def stop(signum: int, _frame: object) -> None:
        stopped.append(signum)
        child.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    figures = threading.Event()
    threading.Thread(target=report_figures, args=(child.pid, f"{env.role.lower()}.{index}", env.job_dir, figures),
                     daemon=True, name="figures").start()
    watch = None
    if env.role == PSERVER and trainer_names:
        watch = TrainersGone([trainer_names.format(j) for j in range(env.trainers)], env.all_ports(index),
                             lambda line: say(PREFIX + line))
    code = _wait(child, watch)
    figures.set()
    LOG.drain()
    if stopped and code == 0:
        # Stopped (a pserver ends cleanly on SIGTERM), not finished: a pod that exits 0 completes its index, which a
        # Job suspended by Kueue's eviction would then not run again when it is admitted again.
        say(f"{PREFIX}stopped by signal {stopped[0]}: exiting {128 + stopped[0]}, as a process it ends")
        code = 128 + stopped[0]
    if env.role != PSERVER and env.job_dir:
        print_metrics(os.path.join(env.job_dir, "log", f"metrics.trainer{index}.jsonl"), f"trainer{index}")
    return code


def process_environ(base: Mapping[str, str], env: JobEnv, index: int, current: str) -> Dict[str, str]:
    """The environment of the pod's process: the container's (``base``: the plan's job-wide part for the role, the
    secret read from its file) with the process's own part of the plan, which one template cannot hold for every
    index: the same ``JobEnv.for_process`` as ``build_plan``'s, for the pod's index and ``current`` address (a
    trainer's is its pod's own, known once it runs; ``env`` may carry the trainers' addresses for their names)."""
    proc_env = {**base, **env.for_process(env.role or "", index, current).to_environ()}
    proc_env.update(node_defaults(proc_env))
    if env.role != PSERVER:
        proc_env.pop(SECRET_VAR, None)  # a trainer gets its own key (PADDLE_TRAINER_KEY), never the job secret
    return proc_env


def report_figures(pid: int, name: str, job_dir: str, stop: threading.Event, period: float = FIGURES_S) -> None:
    """``top``'s figures of the pod's process, a ``FIGURES`` line in the pod's log every ``period`` s until
    ``stop`` (a pod has no agent, and its log is what the launcher reads of it, as ``status`` does): CPU % and
    RSS of the process with its descendants, its own counters and (a trainer) its last metrics record."""
    from . import procs, top

    usage, started = top.Usage(), time.time()
    while True:
        found = procs.subtree(os.getpid())  # this entry point's processes: the pod's (it is their parent)
        doc: Dict[str, object] = {"time": time.time(), "started_at": started,
                                  **usage.of([{"name": name, "pid": pid}], found[0] if found else procs.process_table())
                                  .get(name, {})}
        if job_dir:
            doc.update(top.own(job_dir, name))
        if "cpu" in doc:  # from the second look on (the first one only starts the CPU count)
            LOG.line(f"{FIGURES}{json.dumps(doc, separators=(',', ':'))}")
        if stop.wait(period):
            return


def _end_waiting(signum: int, _frame: object) -> None:
    say(f"{PREFIX}stopped by signal {signum} before starting the process")
    raise SystemExit(128 + signum)


def _wait(child: subprocess.Popen, watch: Optional[TrainersGone]) -> int:
    """``child``'s exit code; with ``watch`` (a pserver's trainers), stop it (and fail) once they are gone."""
    while True:
        why = watch.check() if watch is not None else ""
        if why:
            return _stop_pserver(child, why)
        try:
            return child.wait(timeout=CHECK_S)
        except subprocess.TimeoutExpired:
            pass


def _stop_pserver(child: subprocess.Popen, why: str) -> int:
    say(f"{ERROR}no trainer pod is left ({why}) and not every trainer closed its connection (a trainer failed, or "
        "its Job was stopped): stopping this pserver")
    child.terminate()
    try:
        child.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        say(f"{PREFIX}the pserver did not stop within {STOP_GRACE_S:g} s of SIGTERM: killing it")
        child.kill()
        child.wait()
    return EXIT_TRAINERS_GONE


def resume_after_eviction(env: JobEnv, index: int) -> JobEnv:
    """``env`` for pserver ``index``: the first start of this run's pserver marks the checkpoint directory (its
    job id, its index); a later start of the same run is the job admitted again after Kueue evicted it, whose
    pods have the same command, so it resumes from the newest step complete for every pserver there (none
    saved yet: as first asked, fresh or ``--resume_from``'s)."""
    mark = os.path.join(env.checkpoint_dir, f".started-{env.job_id}-pserver-{index}")
    if not os.path.exists(mark):
        with open(mark, "w") as f:
            f.write("this run's pserver started; a start of it again resumes from the newest complete checkpoint\n")
        return env
    from paddle_cluster.ps.checkpoint import complete_steps

    steps = complete_steps(env.checkpoint_dir, range(len(env.pservers)))
    if not steps:
        say(f"{PREFIX}pserver {index} started before in this run (the job was evicted), and no checkpoint in "
            f"{env.checkpoint_dir} is complete for all {len(env.pservers)} pserver(s): starting "
            + (f"as first asked (resume {env.resume})" if env.resume else "fresh"))
        return env
    say(f"{PREFIX}pserver {index} started before in this run (the job was evicted): resuming from step {steps[-1]}, "
        f"the newest checkpoint in {env.checkpoint_dir} complete for all {len(env.pservers)} pserver(s)")
    return dataclasses.replace(env, resume=str(steps[-1]))


def writable_dir(path: str, what: str) -> None:
    """``path``, made if missing, must take this pod's files: a volume the pod's user (``runAsUser``) may not write
    fails the pod now, naming the directory, the user and the owner, rather than the first checkpoint later."""
    try:
        os.makedirs(path, exist_ok=True)
        if _can_write(path):
            return
        blocker = path
    except OSError:
        blocker = path
        while not os.path.exists(blocker) and os.path.dirname(blocker) != blocker:
            blocker = os.path.dirname(blocker)
    raise PodError(f"{what} {path} is not writable by this pod's user ({_user()}): {blocker} has "
                   f"{_owner(blocker)}; give the pods a volume their user may write (storage that applies the pods' "
                   f"fsGroup, {os.getgid()}, or one prepared for that user), or --run-as-user its owner")


def _can_write(path: str) -> bool:
    """Whether a file can be made in ``path``: tried, since ``os.access`` answers for the real uid without the
    capabilities a container may have."""
    try:
        fd, probe = tempfile.mkstemp(dir=path, prefix=".paddle-cluster-probe-")
    except OSError:
        return False
    os.close(fd)
    os.unlink(probe)
    return True


def _user() -> str:
    return f"uid {os.getuid()}, gid {os.getgid()}, groups {','.join(map(str, os.getgroups())) or '-'}"


def _owner(path: str) -> str:
    st = os.stat(path)
    return f"owner {st.st_uid}:{st.st_gid}, mode {st.st_mode & 0o7777:04o}"


def unpack_workspace(pack: str, workspace: str) -> None:
    """The dispatched workspace (``--unpack``: a gzipped tar from the job's ConfigMap) into ``workspace``, which
    becomes the working directory; the same checks as on every other backend (``node/unpack.py``)."""
    from .unpack import UnsafeArchive, safe_extract

    tmp = f"{workspace}.tar"
    try:
        with gzip.open(pack) as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        n = safe_extract(tmp, workspace)
    except (OSError, EOFError, UnsafeArchive, tarfile.TarError) as e:
        raise PodError(f"cannot unpack the workspace {pack} into {workspace}: {e}") from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    os.chdir(workspace)
    say(f"{PREFIX}workspace: {n} entries unpacked into {workspace}")


def image_check() -> str:
    """What the image offers the job's processes, in one line; ``PodError`` when it lacks numpy."""
    try:
        import numpy
    except ImportError as e:
        raise PodError(f"the image has no numpy ({e}): install numpy in it (pip install numpy)") from None
    try:
        from importlib.metadata import version

        ours = version("paddle-cluster")
    except Exception:  # noqa: BLE001 - not installed as a distribution (PYTHONPATH): still usable
        ours = "from PYTHONPATH"
    return f"Python {sys.version.split()[0]}, numpy {numpy.__version__}, paddle-cluster {ours}"


def print_metrics(path: str, trainer: str) -> None:
    """A trainer's metrics records into the pod's log, one ``METRICS`` line each."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.strip():
                    LOG.line(f"{METRICS}{trainer} {line.strip()}", 1)
    except OSError:
        pass


def say(line: str) -> None:
    LOG.line(line)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m paddle_cluster.node pod", description=__doc__.split("\n")[0])
    ap.add_argument("--start-timeout", type=float, default=60.0)
    ap.add_argument("--trainer-names", default="", help="pserver: the trainers' DNS names, {} for the index")
    ap.add_argument("--first-trainer-timeout", type=float, default=None,
                    help="ignored (manifests of earlier versions): trainers not seen yet are waited for without bound")
    ap.add_argument("--unpack", default="", help="a gzipped tar of the workspace to unpack into it first")
    ap.add_argument("--secret-file", default="", help="the job secret's file (the mounted Secret), read once")
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:
        ap.error("give the command to run after --")
    try:
        say(f"{IMAGE}{image_check()}")
        return become(cmd, a.start_timeout, trainer_names=a.trainer_names, pack=a.unpack,
                      secret_file=a.secret_file)
    except (PodError, ContractError) as e:
        say(f"{ERROR}{e}")
        return EXIT_NOT_READY
