"""``python -m paddle_cluster.node bootstrap``: a node's agent started by an engine (``mpirun``, ``mpiexec``,
``srun``), not over the launcher's SSH channel. Standard library only.

It learns which node it is from the engine's variables (``rank_of``; which variables those are, ``RankVars``, the
launcher's backend declares beside itself and passes as ``--ranks``), reads its share of the job from the
plan file the launcher wrote (every node's ``Start`` line), and runs it with the same ``Supervisor`` as the
SSH backend: same processes, same environment contract, same events (JSON lines on stdout, or appended to
``--events``). Without a launcher to answer to, the agent ends by itself: when every process of its node has
finished (exit 0), or when one fails (exit 1, the engine then ends the other nodes).

With ``--rendezvous DIR`` (Slurm: the launcher cannot know the nodes' addresses before the allocation runs),
the plan names node ``i``'s address by a placeholder it declares (``messages.address_placeholder``); each node
writes its address on ``--nic`` to ``DIR/address.<i>`` on the shared filesystem, waits for every node's, and
gives the placeholders their values (``messages.resolve``). Nothing else of the plan changes.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Tuple

from . import MAIN, private, probe, supervisor
from . import messages as m

POLL_S = 0.05


class BootstrapError(Exception):
    """This process cannot become a node of the job; the message says why and what to fix."""


@dataclass(frozen=True)
class RankVars:
    """How an engine tells each process it started where it is: the variables holding its node index, the number
    of nodes, its index on its host and (optionally) the host's name. Each may be alternatives, ``A|B``: the first
    one set counts (Open MPI's names, else the PMI ones of MPICH's Hydra). ``--ranks`` carries it as ``text``."""

    engine: str  # who sets them, for messages: "mpirun", "srun"
    node: str
    nodes: str
    local: str
    host: str = ""  # "": HOSTNAME, else the kernel's node name

    def text(self) -> str:
        return f"{self.engine}:{self.node},{self.nodes},{self.local},{self.host}"

    @classmethod
    def parse(cls, text: str) -> RankVars:
        engine, _, names = text.partition(":")
        parts = names.split(",")
        if not engine or len(parts) != 4 or not all(parts[:3]):
            raise BootstrapError(f"--ranks {text!r}: expected ENGINE:NODE,NODES,LOCAL,HOST (variable names, "
                                 "A|B for alternatives; HOST may be empty)")
        return cls(engine, *parts)


@dataclass(frozen=True)
class Rank:
    """This process's rank as the engine started it (``RankVars``' values): node ``node`` of ``nodes``, on the host
    the engine calls ``host``. Not ``ps.placement``'s placing of parameter blocks."""

    engine: str
    node: int
    nodes: int
    host: str


def rank_of(ranks: RankVars, environ: Mapping[str, str]) -> Rank:
    """This process's node index from the engine's variables; one process per host is required."""
    def number(names: str) -> Tuple[str, int]:
        name = next((n for n in names.split("|") if n in environ), names.split("|")[-1])
        text = environ.get(name, "")
        if not (text.isascii() and text.isdigit()):
            raise BootstrapError(f"{name}={text!r}: expected a number set by {ranks.engine}; was this started by it?")
        return name, int(text)

    (_, node), (_, nodes), (local_name, local) = number(ranks.node), number(ranks.nodes), number(ranks.local)
    if local != 0:
        raise BootstrapError(f"{local_name}={local}: node {node} is not the only process {ranks.engine} started on "
                             "its host: start one per host (the command paddle-cluster renders does)")
    host = next((environ[n] for n in (*ranks.host.split("|"), "HOSTNAME") if n and environ.get(n)), "")
    return Rank(ranks.engine, node, nodes, host or os.uname().nodename)


def rendezvous(directory: str, where: Rank, nic: str, timeout: float) -> Dict[int, str]:
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
    """Node ``node``'s plan in ``path``, its address placeholders given ``addresses`` ({node: address})."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise BootstrapError(f"cannot read the plan {path}: {e.strerror or e}") from None
    plans = [msg.plan for msg in map(m.decode, filter(str.strip, text.splitlines())) if isinstance(msg, m.Start)]
    found = [p for p in plans if p.node == node]
    if len(found) != 1:
        raise BootstrapError(f"{path} holds {len(plans)} node plan(s), none for node {node}: the engine started "
                             "more processes than the job has nodes")
    return m.resolve(found[0], {m.address_placeholder(i): a for i, a in (addresses or {}).items()})


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


def main(ranks: str, plan_path: str, grace: float, events: str = "", rendezvous_dir: str = "", nic: str = "",
         timeout: float = 60.0, fail_fast: bool = True, environ: Optional[Mapping[str, str]] = None,
         lease: str = "", lease_timeout: float = 20.0, remove_plan: bool = False) -> int:
    """``ranks``: ``RankVars.text`` of the engine that started this process. ``remove_plan``: the plan file
    (``{node}`` in ``plan_path``: this node's index) is this node's alone and is removed once read, so the secret
    it holds stays on disk only until the agent has it."""
    env = os.environ if environ is None else environ
    try:
        where = rank_of(RankVars.parse(ranks), env)
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
