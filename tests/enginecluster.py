"""Real Open MPI and a real Slurm cluster on the namespace test hosts of tests/sshcluster.py.

:meth:`MPIEnv.for_cluster` gives ``mpirun`` what it needs to start ranks over the hosts' own sshd.
:class:`SlurmCluster` runs ``munged`` and ``slurmctld`` inside node0 and one ``slurmd -N node{i}`` inside every
host, all in the foreground under the cluster's workdir, so the teardown of the :class:`~sshcluster.SSHCluster`
(or a later one's stale-cluster reaper, after ``kill -9``) removes every daemon with the hosts.

Shared filesystem: the hosts share the test machine's whole filesystem except ``/home/paddle``, which is private
to each host (``SSHCluster.root_dir(i)``).  So any directory outside ``/home/paddle`` -- e.g.
:attr:`SlurmCluster.shared_dir` -- plays the shared filesystem every Slurm site has (``/home`` there): what one
host writes there every other host reads at the same path.  Use it as a Slurm job's ``ROOT_DIR`` and working
directory; ``/home/paddle`` plays node-local disk (what ``sbcast`` or a per-host copy would fill).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from helpers import free_port_range
from sshcluster import SSHCluster, _comm, _ppid, unavailable_reason

# binary -> Debian package that provides it (scripts/test installs them as root).
MPI_BINARIES = {"mpirun": "openmpi-bin"}
MPICH_BINARIES = {"mpiexec.hydra": "mpich"}
SLURM_BINARIES = {"munged": "munge", "slurmctld": "slurmctld", "slurmd": "slurmd", "sbatch": "slurm-client",
                  "srun": "slurm-client", "scontrol": "slurm-client", "sinfo": "slurm-client", "squeue": "slurm-client",
                  "scancel": "slurm-client"}
KUBECTL_BINARIES = {"kubectl": "kubernetes-client"}  # the real client, talking to the stand-in (tests/kube/)
SUN_PATH_MAX = 107  # a Unix socket path longer than this cannot be bound


def which(name: str) -> Optional[str]:
    """Absolute path of a tool, also looking in the sbin directories a non-login PATH may lack."""
    return shutil.which(name, path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"]))


def _unavailable(binaries: Dict[str, str]) -> Optional[str]:
    base = unavailable_reason()
    if base:
        return base
    missing = sorted({pkg for tool, pkg in binaries.items() if which(tool) is None})
    if missing:
        return (f"engine packages missing ({' '.join(missing)}): run scripts/test as root, which installs them "
                f"(apt-get install --no-install-recommends {' '.join(missing)})")
    return None


def mpi_unavailable_reason() -> Optional[str]:
    """Why mpirun cannot run on a test cluster here (a skip reason), or None."""
    return _unavailable(MPI_BINARIES)


def mpich_unavailable_reason() -> Optional[str]:
    """Why MPICH's mpiexec cannot run on a test cluster here (a skip reason), or None."""
    return _unavailable(MPICH_BINARIES)


def kubectl_unavailable_reason() -> Optional[str]:
    """Why the Kubernetes stand-in cannot be used here (a skip reason), or None."""
    return _unavailable(KUBECTL_BINARIES)


def slurm_unavailable_reason() -> Optional[str]:
    """Why a Slurm cluster cannot be built here (a skip reason), or None."""
    return _unavailable(SLURM_BINARIES)


# -- Open MPI -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MPIEnv:
    """What ``mpirun`` needs to start one rank per host of an SSHCluster over the hosts' sshd.

    ``env`` is ``os.environ`` plus the ``OMPI_*`` variables of :meth:`for_cluster`; ``hostfile`` lists the
    hosts' IPs (``cluster.ips`` order, so rank i runs on node i) with ``slots`` each.  Ranks get nothing of the
    caller's environment or working directory beyond what mpirun forwards (``OMPI_*``, ``-x NAME``): give them
    absolute paths.
    """

    cluster: SSHCluster
    hostfile: str
    env: Dict[str, str]

    @classmethod
    def for_cluster(cls, cluster: SSHCluster, workdir: Optional[os.PathLike] = None, slots: int = 1) -> MPIEnv:
        """The environment and hostfile for ``cluster`` (hostfile in ``workdir``, default its workdir/mpi).

        Exported: ``OMPI_ALLOW_RUN_AS_ROOT(_CONFIRM)=1``; ``OMPI_MCA_plm_rsh_agent`` = ssh with the cluster's
        key, ``known_hosts``, strict host-key checking and ``BatchMode``; ``OMPI_MCA_plm_rsh_no_tree_spawn=1``
        (mpirun reaches every host itself, as a launcher holding the only SSH settings must; by default the
        first orted would ssh on to the others); ``OMPI_MCA_oob_tcp_if_include`` and
        ``OMPI_MCA_btl_tcp_if_include`` = the cluster subnet (otherwise the daemons are handed every address of
        the machine, other clusters' bridges included).
        """
        if " " in str(cluster.workdir):
            raise ValueError(f"Open MPI splits its rsh agent on spaces: cluster workdir {cluster.workdir} has one")
        workdir = Path(workdir or cluster.workdir / "mpi")
        workdir.mkdir(parents=True, exist_ok=True)
        hostfile = workdir / "hostfile"
        hostfile.write_text("".join(f"{ip} slots={slots}\n" for ip in cluster.ips))
        agent = (f"ssh -i {cluster.key_path} -o IdentitiesOnly=yes -o UserKnownHostsFile={cluster.known_hosts} "
                 "-o StrictHostKeyChecking=yes -o BatchMode=yes -o ConnectTimeout=5")
        env = {**os.environ,
               "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
               "OMPI_MCA_plm_rsh_agent": agent, "OMPI_MCA_plm_rsh_no_tree_spawn": "1",
               "OMPI_MCA_oob_tcp_if_include": cluster.subnet, "OMPI_MCA_btl_tcp_if_include": cluster.subnet}
        return cls(cluster=cluster, hostfile=str(hostfile), env=env)

    def argv(self, command: Sequence[str], np: Optional[int] = None, *options: str) -> List[str]:
        """``mpirun --hostfile H -np N [options] command`` (N defaults to one rank per host)."""
        return [which("mpirun") or "mpirun", "--hostfile", self.hostfile, "-np", str(np or self.cluster.n),
                *options, *command]


# -- Slurm --------------------------------------------------------------------------------------------------

_FIELD = re.compile(r"(\S+?)=(\S*)")


class SlurmCluster:
    """A real Slurm cluster on ``cluster``: node names ``node0..`` (the hosts' hostnames), NodeAddr = their IPs.

    ``munged`` (socket under ``workdir``) and ``slurmctld`` run inside node0, ``slurmd -N node{i}`` inside host
    i; partition :attr:`partition` (default) holds every node.  Ports are per cluster; nothing is read from or
    written to /etc/slurm or /run/munge, so several clusters can run at once.  Client commands need
    ``SLURM_CONF``: run them with :attr:`env` (``os.environ`` + ``SLURM_CONF``) or through :meth:`run`.
    ``close()`` cancels every job, stops the daemons (TERM, then KILL), reaps them, and kills any job process
    still left (a ``slurmstepd`` and its descendants).
    """

    partition = "debug"
    real_memory = 1024  # MB per node, as slurm.conf declares it (the machine has more; Slurm only checks that)
    feature = "paddle"  # every node's feature (sbatch --constraint)
    gpus = 2  # gpu GRES per node (sbatch --gres=gpu:N; stand-in devices, see _write_conf)

    def __init__(self, cluster: SSHCluster, workdir: Optional[os.PathLike] = None, *, timeout: float = 30.0):
        reason = slurm_unavailable_reason()
        if reason:
            raise RuntimeError(reason)
        self.cluster = cluster
        self.dir = Path(workdir or cluster.workdir / "slurm").resolve()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.nodes = [f"node{i}" for i in range(cluster.n)]
        self.conf = self.dir / "slurm.conf"
        self.munge_socket = self.dir / "munge" / "munge.sock"
        if len(str(self.munge_socket)) > SUN_PATH_MAX:
            raise ValueError(f"munge socket path {self.munge_socket} is over {SUN_PATH_MAX} bytes: "
                             "give SlurmCluster a shorter workdir")
        self.shared_dir = self.dir / "shared"
        self.shared_dir.mkdir(exist_ok=True)
        (self.dir / "log").mkdir(exist_ok=True)
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._munged: Optional[subprocess.Popen] = None
        self._ctld: Optional[subprocess.Popen] = None
        self._slurmds: List[subprocess.Popen] = []
        self._closed = False
        try:
            self._start(timeout)
        except BaseException:
            self.close()
            raise

    # -- bring-up ---------------------------------------------------------------------------------------

    def _start(self, timeout: float) -> None:
        t0 = time.monotonic()
        deadline = t0 + timeout
        munge = self.munge_socket.parent
        munge.mkdir(exist_ok=True)
        key = munge / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self._munged = self._daemon(0, "munged", [
            # --force: munged refuses a socket whose ancestors others cannot traverse (pytest's tmp dirs are
            # 0700); every client here is root, so that check protects nobody.
            which("munged"), "-F", "--force", f"--origin={self.cluster.ips[0]}", f"--key-file={key}",
            f"--socket={self.munge_socket}", f"--pid-file={munge / 'munged.pid'}",
            f"--seed-file={munge / 'munged.seed'}", f"--log-file={munge / 'munged.log'}"])
        self._wait(deadline, "munged's socket", lambda: self.munge_socket.exists(), [self._munged])

        # Daemons listen inside the hosts' own network namespaces, so clusters cannot collide on these ports;
        # they come from the free-port helper rather than being fixed numbers all the same.
        self.ctld_port = free_port_range(2)
        self.slurmd_port = self.ctld_port + 1
        self._write_conf()
        self._ctld = self._daemon(0, "slurmctld", [which("slurmctld"), "-D", "-f", str(self.conf)])
        self._wait(deadline, "slurmctld to answer scontrol ping", self._ctld_up, [self._munged, self._ctld])
        # slurmd only after slurmctld answers: a failed first registration leaves the node DOWN.
        for i, node in enumerate(self.nodes):
            self._slurmds.append(self._daemon(i, f"slurmd-{node}",
                                              [which("slurmd"), "-D", "-f", str(self.conf), "-N", node]))
        self._wait(deadline, "every node idle in sinfo", lambda: self.idle_nodes() == self.nodes,
                   [self._munged, self._ctld, *self._slurmds])
        self.startup_seconds = time.monotonic() - t0

    def _write_conf(self) -> None:
        d, ips = self.dir, self.cluster.ips
        for sub in ("state", "spool", "fakecg"):
            (d / sub).mkdir(exist_ok=True)
        cpus = os.cpu_count() or 1
        lines = [
            f"ClusterName={self.cluster.token}",
            f"SlurmctldHost=node0({ips[0]})",
            f"SlurmctldPort={self.ctld_port}", f"SlurmdPort={self.slurmd_port}",
            "SlurmUser=root", "SlurmdUser=root",
            "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={d / 'state'}", f"SlurmdSpoolDir={d / 'spool' / '%n'}",
            f"SlurmctldPidFile={d / 'slurmctld.pid'}", f"SlurmdPidFile={d / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={d / 'log' / 'slurmctld.log'}", f"SlurmdLogFile={d / 'log' / 'slurmd-%n.log'}",
            "SlurmctldDebug=info", "SlurmdDebug=info",
            # No cgroups inside the namespaces (see cgroup.conf); linuxproc finds setsid children too.
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none", "JobCompType=jobcomp/none",
            "SwitchType=switch/none", "MpiDefault=none", "PropagateResourceLimits=NONE",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
            "ReturnToService=2", "KillWait=2", "SchedulerParameters=batch_sched_delay=0",
            # What jobs may ask for besides CPUs: memory (not enforced: no cgroups), a node feature, and two
            # "gpu" GRES per node (gres.conf below: stand-in device files, Slurm grants and accounts them).
            "GresTypes=gpu",
            *(f"NodeName={node} NodeAddr={ip} CPUs={cpus} RealMemory={self.real_memory} Feature={self.feature} "
              f"Gres=gpu:{self.gpus} State=UNKNOWN" for node, ip in zip(self.nodes, ips)),
            f"PartitionName={self.partition} Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP",
        ]
        self.conf.write_text("\n".join(lines) + "\n")
        # slurmd always loads a cgroup plugin; an empty mount point makes it find nothing instead of failing
        # on the cgroup-less /sys that `ip netns exec` mounts.
        (d / "cgroup.conf").write_text(f"CgroupPlugin=cgroup/v1\nCgroupMountpoint={d / 'fakecg'}\n")
        # Slurm's gpu plugin counts device files; any character devices do (no cgroups: nothing is restricted),
        # and a task is then given CUDA_VISIBLE_DEVICES as on a GPU node.
        (d / "gres.conf").write_text("".join(f"Name=gpu File={dev}\n" for dev in ("/dev/null", "/dev/zero")))

    def _daemon(self, i: int, name: str, argv: Sequence[str]) -> subprocess.Popen:
        # Own log file, no inherited pipes (a daemon holding the test's stdout open would hang its reader).
        with open(self.dir / "log" / f"{name}.out", "ab") as out:
            return self.cluster.popen(i, list(argv), stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                      start_new_session=True)

    def _wait(self, deadline: float, what: str, ready, procs: Sequence[subprocess.Popen]) -> None:
        while not ready():
            for p in procs:
                if p.poll() is not None:
                    raise RuntimeError(f"Slurm cluster {self.dir}: {p.args[self._argv0(p)]} exited with "
                                       f"{p.returncode} while waiting for {what}; logs in {self.dir / 'log'}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"Slurm cluster {self.dir}: timed out waiting for {what}; "
                                   f"logs in {self.dir / 'log'}")
            time.sleep(0.05)

    @staticmethod
    def _argv0(p: subprocess.Popen) -> int:
        return list(p.args).index("--") + 1  # the command after cluster.popen's nsenter prefix

    def _ctld_up(self) -> bool:
        res = self.run(["scontrol", "ping"], check=False, timeout=10)
        return res.returncode == 0 and "is UP" in res.stdout

    # -- client side ------------------------------------------------------------------------------------

    def run(self, argv: Sequence[str], **kw) -> subprocess.CompletedProcess:
        """Run a Slurm client command (``sbatch``, ``scontrol``...) against this cluster, on the test machine.

        Defaults: ``capture_output=True, text=True, check=True, timeout=30, env=self.env``.
        """
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        kw.setdefault("check", True)
        kw.setdefault("timeout", 30)
        kw.setdefault("env", self.env)
        kw.setdefault("stdin", subprocess.DEVNULL)
        return subprocess.run([which(argv[0]) or argv[0], *argv[1:]], **kw)

    def idle_nodes(self) -> List[str]:
        """Nodes ``sinfo`` reports idle, sorted by name."""
        res = self.run(["sinfo", "-h", "-N", "-t", "idle", "-o", "%N"], check=False, timeout=10)
        return sorted(set(res.stdout.split())) if res.returncode == 0 else []

    def show_job(self, job_id: str) -> Dict[str, str]:
        """``scontrol show job -o ID`` as a dict (``JobState``, ``Reason``, ``NodeList``, ``ExitCode``...)."""
        out = self.run(["scontrol", "-o", "show", "job", str(job_id)]).stdout
        return dict(_FIELD.findall(out))

    def wait_job(self, job_id: str, states: Sequence[str], timeout: float = 20.0) -> Dict[str, str]:
        """Poll ``show_job`` until its ``JobState`` is one of ``states``; returns that record."""
        deadline = time.monotonic() + timeout
        while True:
            job = self.show_job(job_id)
            if job.get("JobState") in states:
                return job
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} still {job.get('JobState')} ({job.get('Reason')}) after "
                                     f"{timeout}s, waiting for {'/'.join(states)}")
            time.sleep(0.02)

    def active_jobs(self) -> List[str]:
        """Ids of jobs that are not finished (pending, running, completing...)."""
        res = self.run(["squeue", "-h", "-o", "%i"], check=False, timeout=10)
        return res.stdout.split() if res.returncode == 0 else []

    def daemon_pids(self) -> set:
        """Pids of this cluster's munged, slurmctld (and its slurmscriptd child) and slurmds."""
        pids = {p.pid for p in (self._munged, self._ctld, *self._slurmds) if p is not None}
        if self._ctld is not None:
            pids.update(pid for pid in self.cluster.pids(0) if _ppid(pid) == self._ctld.pid)
        return pids

    def job_pids(self, i: int) -> List[int]:
        """Processes in host i other than its sshd and the Slurm daemons: job steps (slurmstepd) and tasks."""
        daemons = self.daemon_pids()
        return [pid for pid in self.cluster.pids(i) if pid not in daemons]

    def wait_quiet(self, timeout: float = 20.0) -> None:
        """Until no job is active, every node is idle and no job process is left on any host."""
        deadline = time.monotonic() + timeout
        while True:
            left = {f"node{i}": self.job_pids(i) for i in range(self.cluster.n)}
            left = {k: v for k, v in left.items() if v}
            jobs, idle = self.active_jobs(), self.idle_nodes()
            if not jobs and idle == self.nodes and not left:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"Slurm cluster not quiet after {timeout}s: active jobs {jobs}, idle nodes "
                                     f"{idle}, processes left {left}")
            time.sleep(0.05)

    # -- teardown ---------------------------------------------------------------------------------------

    def close(self) -> None:
        """Cancel every job, TERM the daemons (slurmds, slurmctld, munged), KILL what outlives 10 s, reap."""
        if self._closed:
            return
        self._closed = True
        if self._ctld is not None and self._ctld.poll() is None:
            with contextlib.suppress(Exception):
                self.run(["scancel", "--user=root"], check=False, timeout=10)
                self.wait_quiet(10)
        for p in [*self._slurmds, self._ctld, self._munged]:
            if p is None:
                continue
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        # Only reached with a job that would not end (or no controller to end it): its steps outlive slurmd.
        for i in range(self.cluster.n):
            for pid in self._step_pids(i):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def _step_pids(self, i: int) -> List[int]:
        """Processes in host i that are a slurmstepd or descend from one."""
        pids = self.cluster.pids(i)
        steps = {pid for pid in pids if _comm(pid) == "slurmstepd"}
        out = []
        for pid in pids:
            p = pid
            while p > 1 and p not in steps:
                p = _ppid(p)
            if p in steps:
                out.append(pid)
        return out

    def __enter__(self) -> SlurmCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
