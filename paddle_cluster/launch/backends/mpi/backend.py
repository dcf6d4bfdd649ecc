"""The MPI backend: the hosts of ``HOSTS`` prepared by the SSH backend (composed, not inherited), then one
``mpirun`` (or MPICH's ``mpiexec``) that starts one rank per host running ``node bootstrap``.

Each rank takes its node index from ``OMPI_COMM_WORLD_RANK`` and its share from the plan file the launcher put
on every host; its events come back on mpirun's standard output, which mpirun gathers from every rank.
``mpirun`` reaches the hosts with ``ssh -F`` and a config written for the job (each host's user and port from
HOSTS, the key, known_hosts and host-key policy of the config, the user's ssh_config included), and wires
itself over the network of ``PADDLE_NIC`` (``oob``/``btl_tcp_if_include``).

Stopping: ``node kill`` on every host (the agent stops its processes within the grace period, then anything
left, ``setsid`` ones included: Open MPI itself only kills its ranks' process groups); mpirun then ends with its
ranks, or gets SIGTERM, which it forwards to every rank. A second interrupt runs ``node kill --grace 0`` on every
host, which cuts short an agent waiting out the grace period. mpirun dies with the launcher
(``PR_SET_PDEATHSIG``), so a killed launcher still stops every rank.
"""

from __future__ import annotations

import ctypes
import os
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, cast

from paddle_cluster.node import messages as m
from paddle_cluster.node.bootstrap import RankVars

from ... import dispatch, nodecmd
from ...config import ClusterConfig, ConfKey
from ...each_node import each_node
from ...errors import ClusterError, HostError
from ...hosts import Node
from ...plan import JobPlan, JobSpec
from ...preflight import CheckLine, EngineRow
from ..base import Backend, BackendHelp, Description, Event, EventQueue, JobRef, LiveJob, Prepared, Request, plan_text
from ..on_hosts import OnHosts
from ..ssh.backend import SSHBackend, hosts_complete_steps
from ..ssh.prepare import SSHPrepared

# Open MPI's names, else the PMI ones of MPICH's Hydra (and Intel MPI, MVAPICH, Cray MPICH)
RANKS = RankVars("mpirun", "OMPI_COMM_WORLD_RANK|PMI_RANK", "OMPI_COMM_WORLD_SIZE|PMI_SIZE",
                 "OMPI_COMM_WORLD_LOCAL_RANK|MPI_LOCALRANKID")
INSTALL_HINT = "install Open MPI on this machine and every host (Debian/Ubuntu: apt-get install openmpi-bin)"
MPICH_HINT = "install MPICH on this machine and every host (Debian/Ubuntu: apt-get install mpich)"
HINTS = {"openmpi": INSTALL_HINT, "mpich": MPICH_HINT}  # by implementation
# Which MPI it runs with: "openmpi" (mpirun), "mpich" (Hydra's mpiexec: MPICH, Intel MPI, MVAPICH), or "auto":
# what `mpirun --version` says, else whichever is installed.
IMPL = ConfKey("MPI_IMPL", "auto", ("auto", "openmpi", "mpich"))


@dataclass(frozen=True)
class MPISettings:
    """What a config's ``MPI_IMPL`` says (its default where it sets none)."""

    impl: str

    @classmethod
    def of(cls, cfg: ClusterConfig) -> MPISettings:
        return cls(IMPL.of(cfg))


def mpi_launcher(choice: str) -> Tuple[str, str]:
    """(implementation, its launcher's path) for ``MPI_IMPL``: ``openmpi`` runs ``mpirun``, ``mpich`` Hydra's
    ``mpiexec`` (MPICH, Intel MPI, MVAPICH); ``auto`` goes by what ``mpirun --version`` says, else by which one is
    installed. ``ClusterError`` with the package to install when the one asked for is missing."""
    mpirun = shutil.which("mpirun")
    said = _version(mpirun) if mpirun else ""
    openmpi = shutil.which("mpirun.openmpi") or (mpirun if "Open MPI" in said else None)
    hydra = shutil.which("mpiexec.hydra") or shutil.which("mpiexec.mpich")
    if choice == "auto":
        if "Open MPI" in said:
            return "openmpi", mpirun or ""
        if any(w in said for w in ("HYDRA", "Intel(R) MPI", "MPICH")):
            choice, hydra = "mpich", hydra or mpirun
        else:  # no mpirun, or one that does not say: whichever is installed
            choice = "mpich" if hydra and not openmpi else "openmpi"  # neither: Open MPI's hint names both
    if choice == "mpich":
        if hydra is None:
            raise ClusterError(f"--backend mpi with MPI_IMPL = 'mpich': mpiexec.hydra not found on this machine; "
                               f"{MPICH_HINT}")
        return "mpich", hydra
    if openmpi is None:
        raise ClusterError(f"--backend mpi: Open MPI's mpirun not found on this machine; {INSTALL_HINT} (or "
                           f"{MPICH_HINT} and set MPI_IMPL = 'mpich')")
    return "openmpi", openmpi


def _version(exe: str) -> str:
    try:
        return subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30,
                              stdin=subprocess.DEVNULL).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def launcher_row(choice: str) -> EngineRow:
    """``check --backend mpi``: the launcher ``run`` would use for ``MPI_IMPL`` and its version, or why none."""
    try:
        impl, path = mpi_launcher(choice)
    except ClusterError as e:
        return EngineRow("mpi", False, f"MPI_IMPL = {choice!r}: MISSING", str(e))
    said = _version(path)
    lines = [ln.strip() for ln in said.splitlines() if ln.strip()]
    if not lines:  # it did not run (a broken install), or ran past 30 s
        return EngineRow("mpi", False, f"MPI_IMPL = {choice!r}: {path}",
                         f"'{path} --version' printed nothing: run it to see why, or {HINTS[impl]}")
    if impl == "openmpi":  # "mpirun (Open MPI) 4.1.4", "mpirun.openmpi (OpenRTE) 4.1.4"
        version = next((f"Open MPI {ln.split()[-1]}" for ln in lines if "(Open MPI)" in ln or "(OpenRTE)" in ln),
                       lines[0])
    else:  # Hydra: "Version:   4.0.2"; others (Intel MPI) say it their way: their first line
        version = next((f"MPICH (Hydra) {ln.split(':', 1)[1].strip()}" for ln in lines
                        if ln.startswith("Version:")), lines[0])
    return EngineRow("mpi", True, f"MPI_IMPL = {choice!r}: {path} ({version})")


def local_address(peer: str) -> Optional[str]:
    """This machine's address on the way to ``peer`` (the kernel's choice of source; nothing is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((peer, 9))
            return s.getsockname()[0]
    except OSError:
        return None


@dataclass(frozen=True)
class MPIPrepared(Prepared):
    """The hosts as the SSH backend prepared them (``hosts``), and this job's directory on this machine for the
    files mpirun reads (``tmp``, removed by ``close``)."""

    hosts: SSHPrepared
    tmp: str = ""

    def close(self) -> None:
        self.hosts.close()
        if self.tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)


@dataclass(frozen=True)
class MPIRequest(Request):
    """``mpirun`` (or Hydra's ``mpiexec``) as it is run: its command line, and the files it reads, by name, in
    ``where`` (the job's temporary directory); each host gets the plan at ``plan_path``."""

    argv: Tuple[str, ...]
    impl: str  # "openmpi" or "mpich"
    where: str
    files: Tuple[Tuple[str, str], ...]
    plan_path: str


class MPIBackend(OnHosts, Backend):
    name = "mpi"
    help = BackendHelp("mpirun or mpiexec over HOSTS", "the mpirun or mpiexec command",
                       "the hosts of HOSTS as ssh does, then on this machine the launcher run uses (mpirun or "
                       "mpiexec.hydra, by MPI_IMPL) and its version")
    conf_keys = (IMPL,)

    def __init__(self, cfg) -> None:  # noqa: ANN001 - ClusterConfig, as SSHBackend
        self.cfg, self.settings = cfg, MPISettings.of(cfg)
        self.ssh = SSHBackend(cfg)  # the hosts and their preparation (library, probe, workspace)
        self.nodes = self.ssh.nodes

    def prepare(self, spec: JobSpec, say: Callable[[str], None]) -> MPIPrepared:
        impl, launcher = mpi_launcher(self.settings.impl)  # refused here, before anything, when it is missing
        tmp = tempfile.mkdtemp(prefix="paddle-cluster-mpi-")  # this job's hostfile and ssh config
        try:
            hosts = self.ssh.prepare_nodes(spec, say)  # mpirun starts the agents
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        say(f"starting one rank per host with {'MPICH' if impl == 'mpich' else 'Open MPI'} ({launcher})")
        return MPIPrepared(hosts.topology, hosts.names, hosts.labels, hosts, tmp)

    def preview(self, spec: JobSpec, say: Callable[[str], None]) -> MPIPrepared:
        try:
            mpi_launcher(self.settings.impl)
        except ClusterError as e:  # what this machine lacks: said, and the command shown for Open MPI
            say(f"{e}; shown for Open MPI's mpirun")
        hosts = self.ssh.preview(spec, say)
        return MPIPrepared(hosts.topology, hosts.names, hosts.labels, hosts)

    def render(self, plan: JobPlan, prepared: Prepared) -> MPIRequest:
        mine = cast(MPIPrepared, prepared)  # prepared by this backend
        try:
            impl, launcher = mpi_launcher(self.settings.impl)
        except ClusterError:  # a dry run on a machine without it (``preview`` said so); ``prepare`` refuses it
            impl, launcher = "openmpi", "mpirun"
        where = mine.tmp or "<job-tmp>"
        files = self.files(where, impl)
        plan_path = self.plan_file(plan.name, plan.start)
        argv = self.argv(plan, impl, launcher, plan_path, {k: f"{where}/{k}" for k in files}, mine.hosts)
        return MPIRequest(plan, (
            (f"{launcher} command of job {plan.name} ({'MPICH' if impl == 'mpich' else 'Open MPI'}; run from /, one "
             "rank per host). Nothing was started.", shlex.join(argv)),
            *((f"{where}/{k}", text) for k, text in files.items()),
            ("each rank runs its node's share of the plan (node bootstrap):", plan_text(plan, prepared.labels))),
            {"backend": self.name}, prepared, tuple(argv), impl, where, tuple(files.items()), plan_path)

    @classmethod
    def check(cls, cfg: ClusterConfig, opts: Mapping[str, Any]) -> Sequence[CheckLine]:
        return [*super().check(cfg, opts), launcher_row(MPISettings.of(cfg).impl)]

    @classmethod
    def describe(cls, job: JobRef) -> Description:
        return SSHBackend.describe(job)  # each host's agent keeps the records, as over SSH

    @classmethod
    def logs(cls, job: JobRef, node: str, role: str, lines: int, follow: bool, out: Callable[[str], None]) -> None:
        SSHBackend.logs(job, node, role, lines, follow, out)

    @classmethod
    def cancel(cls, job: JobRef, say: Callable[[str], None]) -> List[str]:
        return SSHBackend.cancel(job, say)

    # -- what mpirun is given -------------------------------------------------------------------------
    def files(self, where: str, impl: str) -> Dict[str, str]:
        """The files the launcher gives mpirun (and Hydra's ssh wrapper), by name, to be written to ``where``."""
        hosts = [n.spec.host for n in self.nodes]
        if len(set(hosts)) != len(hosts):
            raise ClusterError("--backend mpi: HOSTS lists the same host twice (different users or ports); "
                               "mpirun's hostfile names hosts only. List each host once")
        out = {"hostfile": "".join(f"{h} slots=1\n" if impl == "openmpi" else f"{h}:1\n" for h in hosts),
               "ssh_config": self.ssh_config()}
        if impl == "mpich":  # -launcher-exec takes one path: a wrapper holding the job's ssh config
            out["ssh"] = (f"#!/bin/sh\nexec {shlex.quote(shutil.which('ssh') or 'ssh')} -F "
                          f"{shlex.quote(where + '/ssh_config')} \"$@\"\n")
        return out

    def ssh_config(self) -> str:
        """An OpenSSH config for mpirun's rsh agent: HOSTS' users and ports, our key and host-key policy."""
        cfg = self.cfg
        lines = []
        for n in self.nodes:
            lines.append(f"Host {n.spec.host}")
            if n.spec.user:
                lines.append(f"  User {n.spec.user}")
            if n.spec.port:
                lines.append(f"  Port {n.spec.port}")
        lines += ["Host *", "  BatchMode yes", f"  UserKnownHostsFile {cfg.known_hosts}",
                  f"  StrictHostKeyChecking {'accept-new' if cfg.ssh_accept_new_host_keys else 'yes'}",
                  f"  ConnectTimeout {int(max(1, cfg.ssh_connect_timeout))}"]
        if cfg.ssh_identity_file:
            lines += [f"  IdentityFile {cfg.ssh_identity_file}", "  IdentitiesOnly yes"]
        user_config = cfg.ssh_config_file or os.path.expanduser("~/.ssh/config")
        if os.path.isfile(user_config):
            lines.append(f"  Include {user_config}")  # fills in what HOSTS does not say (aliases, proxies)
        return "\n".join(lines) + "\n"

    def argv(self, plan: JobPlan, impl: str, launcher: str, plan_path: str, paths: Dict[str, str],
             hosts: SSHPrepared) -> List[str]:
        """The launcher's command line, given the paths of ``files``."""
        hostfile, config = paths["hostfile"], paths["ssh_config"]
        agent = self._agent(plan, plan_path, hosts.lib)
        if impl == "mpich":
            return self._hydra_argv(plan, launcher, hostfile, paths["ssh"], agent)
        if any(" " in p for p in (config, self.cfg.known_hosts, self.cfg.ssh_identity_file or "")):
            raise ClusterError(f"--backend mpi: Open MPI splits its ssh command on spaces, and {config} or "
                               "SSH_KNOWN_HOSTS / SSH_IDENTITY_FILE contains one; use paths without spaces")
        networks = {net for net in hosts.networks if net}
        wire = ",".join(sorted(networks)) if networks else self.cfg.paddle_nic
        return [launcher, "--hostfile", hostfile, "-np", str(len(self.nodes)),
                "--map-by", "node", "--mca", "plm_rsh_agent", f"{shutil.which('ssh') or 'ssh'} -F {config}",
                "--mca", "plm_rsh_no_tree_spawn", "1",  # mpirun reaches every host itself, with our settings
                "--mca", "oob_tcp_if_include", wire, "--mca", "btl_tcp_if_include", wire,
                # Each orted, told to stop its ranks (mpirun SIGTERMed: a killed launcher), sends SIGCONT, sleeps
                # this, SIGTERM, sleeps it again, SIGKILL, whether the ranks are gone or not. The agent runs beside
                # its rank (--own-session) and stops its processes on the rank's SIGTERM or death, so 1 s will do:
                # KILL_GRACE + 3 s held the job ~2 KILL_GRACE + 6 s past the launcher's death.
                "--mca", "odls_base_sigkill_timeout", "1",
                # A rank exiting non-zero (a process of its node failed) is the launcher's to act on (--keep-going).
                # Open MPI's abort on it blocks each orted in a sleep of the timeout above before its SIGTERM and
                # another before its SIGKILL, even once the launcher's sweep has ended the ranks: mpirun outlived
                # them until the launcher SIGTERMed it.
                "--mca", "orte_abort_on_non_zero_status", "0",
                *agent]

    def _agent(self, plan: JobPlan, plan_path: str, lib: dispatch.Package) -> List[str]:
        # --keep-going: the launcher follows the job and decides (fail-fast, --elastic, restarts, the culprit).
        # --own-session: Hydra SIGKILLs its ranks once mpiexec is stopped (a killed launcher), Open MPI's orted
        # a second after its SIGTERM: the agent runs beside the rank and gets SIGTERM instead, so it still stops
        # its processes within the grace period, setsid ones included.
        agent = nodecmd.agent_argv(self.nodes[0], lib, "bootstrap", "--ranks", RANKS.text(), "--plan", plan_path,
                                   "--remove-plan", "--grace", str(self.cfg.kill_grace), "--keep-going",
                                   "--own-session")
        pythons = {n.python for n in plan.topology.nodes}
        if len(pythons) == 1 and "" not in pythons:  # one command for every rank: the agent too runs what
            agent[0] = pythons.pop()  # preflight checked
        return agent

    def _hydra_argv(self, plan: JobPlan, launcher: str, hostfile: str, wrapper: str, agent: List[str]) -> List[str]:
        """Hydra's ``mpiexec``: ssh through a wrapper holding the job's ssh config (``-launcher-exec`` takes one
        path); ``-localhost``: the address on the hosts' network the proxies call back to (this machine's own
        name may resolve to one they cannot reach); ``-genvnone``: ranks get their host's environment, as under
        Open MPI, not this machine's (Hydra's default passes it all)."""
        here = local_address(plan.addresses[0]) if plan.addresses else None
        return [launcher, "-f", hostfile, "-n", str(len(self.nodes)), "-ppn", "1", "-launcher", "ssh",
                "-launcher-exec", wrapper, *(("-localhost", here) if here else ()), "-genvnone", *agent]

    def plan_file(self, job: str, start: int) -> str:
        """Where start ``start`` puts the plan on every host (its own copy on each)."""
        return f"{self.cfg.root_dir}/.paddle_cluster/plans/{job}.{start}.jsonl"

    # -- running --------------------------------------------------------------------------------------
    def submit(self, request: Request, say: Callable[[str], None]) -> MPILiveJob:
        job = MPILiveJob(cast(MPIRequest, request), self.cfg)  # rendered by this backend
        try:
            job.start()
        except BaseException:
            job.stop(self.cfg.kill_grace)
            raise
        return job


def plan_file(plan: JobPlan) -> str:
    """The plan file every host gets: each node's share as ``build_plan`` made it, a ``Start`` line each (the
    rank's bootstrap reads its own: ``node.bootstrap.read_plan``)."""
    return "".join(m.encode(m.Start(n)) + "\n" for n in plan.nodes)


class MPILiveJob(LiveJob):
    """One start under mpirun: the plan on every host, mpirun itself and the events on its output."""

    def __init__(self, request: MPIRequest, cfg: ClusterConfig) -> None:
        super().__init__(request)
        self.mpi_request, self.cfg = request, cfg
        self.hosts = cast(MPIPrepared, request.prepared).hosts
        self.mpirun: Optional[subprocess.Popen] = None
        self.plan_path = ""  # the plan on every host, until removed
        self.events = EventQueue([n.node for n in request.plan.nodes], cfg.orphan_timeout)
        self.no_grace = False  # a second interrupt: stop without the grace period

    def start(self) -> None:
        request, plan, lib = self.mpi_request, self.plan, self.hosts.lib
        self.plan_path = plan_path = request.plan_path
        text = plan_file(plan)

        def put(n: Node) -> None:
            # It holds the job secret: written by the node itself, 0600 from its first byte in a directory it
            # checks (another user's refused) and makes 0700; the rank removes it once read (--remove-plan).
            doc = nodecmd.agent_json(n, lib, "private", "--write", plan_path, what="writing the plan", timeout=60,
                                     stdin=text)
            if not doc.get("ok"):
                raise HostError(n.label, f"cannot write the plan: {doc.get('error')}")

        each_node(self.hosts.nodes, put).ok("sending the plan")
        self.events.starting(self.cfg.start_timeout)
        for name, body in request.files:  # the request's files, where it says (this job's temporary directory)
            path = os.path.join(request.where, name)
            with open(path, "w") as f:
                f.write(body)
            if name == "ssh":
                os.chmod(path, 0o700)
        argv = list(request.argv)
        env = dict(os.environ)
        if os.geteuid() == 0 and request.impl == "openmpi":  # it refuses root unless told; HOSTS say who logs in
            env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        try:
            self.mpirun = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                           stderr=subprocess.STDOUT, env=env, cwd="/", preexec_fn=_own_session)
        except OSError as e:
            raise ClusterError(f"cannot start {argv[0]}: {e.strerror or e}; {HINTS[request.impl]}") from None
        threading.Thread(target=_read, args=(self.mpirun, self.events, len(plan.nodes)), daemon=True,
                         name="mpirun").start()

    def next_event(self, timeout: float) -> Optional[Event]:
        return self.events.get(timeout)

    def request_stop(self, grace: float) -> None:
        p = self.mpirun
        if p is None or p.poll() is not None:
            return
        if grace > 0:
            p.send_signal(signal.SIGTERM)  # mpirun forwards it to every rank
            return
        # Without grace (a second Ctrl+C): ``node kill --grace 0`` on every host, also where an agent is waiting
        # out the grace period of the first stop (it SIGKILLs its processes at once); mpirun ends with its ranks.
        # SIGKILL to mpirun instead left the agents waiting (Hydra's or Open MPI's teardown of the ranks is not
        # theirs), and the run with them.
        self.no_grace = True
        threading.Thread(target=self._stop_now, args=(p,), daemon=True, name="no-grace").start()

    def _stop_now(self, p: subprocess.Popen) -> None:
        self.sweep(0)
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()

    def stop(self, grace: float) -> List[int]:
        p = self.mpirun
        if p is None:
            self.remove_plan()  # a start that failed before mpirun ran
            return []
        self.events.closing = True
        # The agents first, over the hosts' SSH connections: each stops its processes within ``grace`` and
        # exits, and mpirun ends with its ranks. A SIGTERM to mpirun first took ~10 s of its own teardown.
        unswept = self.sweep(grace)
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.request_stop(grace)
            try:
                p.wait(timeout=(0 if self.no_grace else grace) + 15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.mpirun = None
        self.remove_plan()
        return unswept

    def complete_steps(self, root: str, pservers: Dict[int, List[int]]) -> List[List[int]]:
        return hosts_complete_steps(self.hosts, root, pservers)

    def remove_plan(self) -> None:
        """The plan file gone from every host, where a rank did not remove it (it never started, or failed before
        reading it): it holds the job secret. A host that cannot be reached keeps it (0600, in a 0700 directory)."""
        path, lib, self.plan_path = self.plan_path, self.hosts.lib, ""
        if path:
            each_node(self.hosts.nodes, lambda n: nodecmd.agent_json(n, lib, "private", "--remove", path,
                                                                   what="removing the plan", timeout=60))

    def sweep(self, grace: float) -> List[int]:
        """``node kill`` on every host: anything of the job still running there (Open MPI kills its ranks'
        process groups only). The hosts where that failed."""
        lib, job_dir = self.hosts.lib, self.plan.spec.job_dir

        def kill(n: Node) -> None:
            nodecmd.agent_json(n, lib, "kill", "--job-dir", job_dir, "--grace", str(grace),
                               what="sweeping the job's processes", timeout=grace + 60)

        return sorted(each_node(self.hosts.nodes, kill).errors)


def _own_session() -> None:
    """mpirun's pre-exec: out of the terminal's process group (Ctrl+C is the launcher's to handle), and
    SIGTERM when the launcher dies, even by SIGKILL (mpirun then stops every rank)."""
    os.setsid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _read(proc: subprocess.Popen, events: EventQueue, nodes: int) -> None:
    """mpirun's output: the agents' events (each stamped with its node), and mpirun's own lines as notes."""
    assert proc.stdout is not None
    for raw in iter(proc.stdout.readline, b""):
        line = raw.decode(errors="replace").rstrip("\n")
        try:
            ev = m.decode(line)
        except m.MessageError:
            ev = None
        if isinstance(ev, m.EVENTS) and 0 <= ev.node < nodes:
            events.put(ev.node, ev)
        elif line.strip():
            events.put(0, m.Note(0, f"{os.path.basename(proc.args[0])}: {line}" if ev is None else line))
    code = proc.wait()
    for i in range(nodes):
        if i not in events.stopped:
            events.channel_closed(i)
    if code:
        events.put(0, m.Note(0, f"mpirun exited with status {code} ({shlex.join(proc.args[:1])})"))
