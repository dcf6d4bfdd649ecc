"""``python -m paddle_cluster.node bootstrap``: a node's agent started by an engine (``mpirun``, ``mpiexec``,
``srun``), not over the launcher's SSH channel. Standard library only.

It learns which node it is from the engine's variables (``placement``), reads its share of the job from the
plan file the launcher wrote (every node's ``Start`` line), and runs it with the same ``Supervisor`` as the
SSH backend: same processes, same environment contract, same events (JSON lines on stdout, or appended to
``--events``). Without a launcher to answer to, the agent ends by itself: when every process of its node has
finished (exit 0), or when one fails (exit 1, the engine then ends the other nodes).

With ``--rendezvous DIR`` (Slurm: the launcher cannot know the nodes' addresses before the allocation runs),
the plan names node ``i``'s address as ``placeholder(i)``; each node writes its address on ``--nic`` to
``DIR/address.<i>`` on the shared filesystem, waits for every node's, and completes the plan with them.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional

from . import MAIN, private, probe, supervisor
from . import messages as m

ENGINES = ("mpi", "slurm")
# A rank's index, the number of ranks and its index on its host, as each MPI family names them.
MPI_VARS = {"openmpi": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
            "mpich": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID")}
POLL_S = 0.05


class BootstrapError(Exception):
    """This process cannot become a node of the job; the message says why and what to fix."""


def _int(environ: Mapping[str, str], name: str, engine: str) -> int:
    text = environ.get(name, "")
    if not (text.isascii() and text.isdigit()):
        raise BootstrapError(f"{name}={text!r}: expected a number set by {engine}; was this started by it?")
    return int(text)


def slurm_hostnames(nodelist: str) -> List[str]:
    """``SLURM_JOB_NODELIST`` expanded (``node[0-2]`` -> node0 node1 node2) by ``scontrol show hostnames``."""
    scontrol = shutil.which("scontrol")
    if not nodelist or scontrol is None:
        return []
    try:
        res = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return res.stdout.split() if res.returncode == 0 else []


@dataclass(frozen=True)
class Placement:
    """Where the engine put this process: node ``node`` of ``nodes``, on the host the engine calls ``host``."""

    engine: str
    node: int
    nodes: int
    host: str


def placement(engine: str, environ: Mapping[str, str]) -> Placement:
    """This process's node index from the engine's variables; one process per host is required."""
    if engine == "mpi":
        # Open MPI's names, else the PMI ones of MPICH's Hydra (and Intel MPI, MVAPICH, Cray MPICH).
        names = MPI_VARS["openmpi"] if "OMPI_COMM_WORLD_RANK" in environ else MPI_VARS["mpich"]
        rank, size, local = (_int(environ, name, "mpirun/mpiexec") for name in names)
        if local != 0:
            raise BootstrapError(f"rank {rank} is not the only rank on its host ({names[2]}={local}): give every "
                                 "host one slot (Open MPI: hostfile 'slots=1', --map-by node; MPICH: 'host:1', "
                                 "-ppn 1)")
        return Placement(engine, rank, size, environ.get("HOSTNAME", "") or os.uname().nodename)
    if engine == "slurm":
        node = _int(environ, "SLURM_NODEID", "srun")
        nodes = _int(environ, "SLURM_JOB_NUM_NODES" if "SLURM_JOB_NUM_NODES" in environ else "SLURM_NNODES", "srun")
        if _int(environ, "SLURM_LOCALID", "srun") != 0:
            raise BootstrapError(f"task {environ.get('SLURM_PROCID')} is not the only task on its node: run "
                                 "srun with --ntasks-per-node=1")
        names = slurm_hostnames(environ.get("SLURM_JOB_NODELIST", ""))
        host = names[node] if node < len(names) else environ.get("SLURMD_NODENAME", "") or os.uname().nodename
        return Placement(engine, node, nodes, host)
    raise BootstrapError(f"unknown engine {engine!r}; one of {', '.join(ENGINES)}")


def placeholder(node: int) -> str:
    """How a plan names node ``node``'s address until the node itself fills it in (``--rendezvous``)."""
    return f"node{node}.address.pending"


def rendezvous(directory: str, where: Placement, nic: str, timeout: float) -> Dict[int, str]:
    """Publish this node's address on ``nic`` and wait for every node's; {node: address}. A node that
    cannot find its address publishes why, so every node fails with that reason instead of a timeout."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    ifaces = probe.interfaces()
    addr = ifaces.get(nic)
    text = addr or (f"error: {where.host} has no IPv4 address on PADDLE_NIC={nic!r}; it has: "
                    + ", ".join(f"{k} ({v or 'no IPv4'})" for k, v in ifaces.items()))
    tmp = os.path.join(directory, f".address.{where.node}.{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, os.path.join(directory, f"address.{where.node}"))
    deadline = time.monotonic() + timeout
    while True:
        got: Dict[int, str] = {}
        for i in range(where.nodes):
            try:
                with open(os.path.join(directory, f"address.{i}")) as f:
                    got[i] = f.read().strip()
            except OSError:
                pass
        bad = [v for v in got.values() if v.startswith("error:")]
        if bad:
            raise BootstrapError(bad[0][len("error: "):])
        if len(got) == where.nodes:
            return got
        if time.monotonic() > deadline:
            missing = sorted(set(range(where.nodes)) - set(got))
            raise BootstrapError(f"no address from node(s) {missing} in {directory} within {timeout:.0f} s: is "
                                 "that directory on a filesystem every node shares (ROOT_DIR)?")
        time.sleep(POLL_S)


def read_plan(path: str, node: int, addresses: Optional[Dict[int, str]] = None) -> m.NodePlan:
    """Node ``node``'s plan in ``path``, with the placeholders replaced by ``addresses``."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise BootstrapError(f"cannot read the plan {path}: {e.strerror or e}") from None
    for i, addr in sorted((addresses or {}).items(), reverse=True):
        text = text.replace(placeholder(i), addr)
    plans = [msg.plan for msg in map(m.decode, filter(str.strip, text.splitlines())) if isinstance(msg, m.Start)]
    found = [p for p in plans if p.node == node]
    if len(found) != 1:
        raise BootstrapError(f"{path} holds {len(plans)} node plan(s), none for node {node}: the engine started "
                             "more processes than the job has nodes")
    return found[0]


def shielded(argv: List[str]) -> int:
    """Run ``python -m paddle_cluster.node`` ``argv`` as a child in a POSIX session of its own (``setsid``) that gets
    SIGTERM when this process dies (even by SIGKILL), and pass it our signals; its exit status. For engines that
    SIGKILL the ranks they started (MPICH's Hydra, once its ``mpiexec`` is stopped): the agent still gets its
    teardown, stopping its processes (``setsid`` ones included) within the grace period, instead of dying and
    leaving them."""
    libc = ctypes.CDLL(None, use_errno=True)  # loaded before the fork: the child must not take the loader's lock
    parent = os.getpid()

    def die_with_parent() -> None:
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # already gone before the line above
            os._exit(1)

    # The child runs this library, the one the launcher dispatched: the host's python may have no paddle_cluster
    # (``-m paddle_cluster.node`` then fails) or another version of it.
    lib = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    child = subprocess.Popen([sys.executable, "-c", MAIN, lib, *argv], start_new_session=True,
                             preexec_fn=die_with_parent)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, _frame: child.send_signal(signum))
    code = child.wait()
    return 128 - code if code < 0 else code


def _events_to(path: str) -> None:
    """Our stdout and stderr (events, and any traceback) appended to ``path``."""
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def main(engine: str, plan_path: str, grace: float, events: str = "", rendezvous_dir: str = "", nic: str = "",
         timeout: float = 60.0, fail_fast: bool = True, environ: Optional[Mapping[str, str]] = None,
         lease: str = "", lease_timeout: float = 20.0, remove_plan: bool = False) -> int:
    """``remove_plan``: the plan file (``{node}`` in ``plan_path``: this node's index) is this node's alone and
    is removed once read, so the secret it holds stays on disk only until the agent has it."""
    env = os.environ if environ is None else environ
    try:
        where = placement(engine, env)
    except BootstrapError as e:
        print(f"paddle-cluster bootstrap: error: {e}", flush=True)
        return 2
    if events:
        _events_to(events.replace("{node}", str(where.node)))
    emit = supervisor.Emitter()
    emit.node = where.node
    plan_path = plan_path.replace("{node}", str(where.node))
    try:
        addresses = rendezvous(rendezvous_dir, where, nic, timeout) if rendezvous_dir else None
        plan = read_plan(plan_path, where.node, addresses)
    except (BootstrapError, m.MessageError) as e:
        emit(m.NotReady, why=f"{where.host}: {e}")
        emit(m.Stopped, reason=f"bootstrap failed: {e}")
        return 2
    finally:
        if remove_plan:
            private.remove(plan_path)
    return supervisor.supervise(lease_timeout, grace, plan, fail_fast=fail_fast and not lease, lease=lease)
