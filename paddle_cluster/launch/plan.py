"""What a job is, decided once: ``JobSpec`` (what the user asked for) and ``JobPlan`` (which process runs on
which node, with which command and environment, and which ports the trainers wait for).

``build_plan`` makes the plan from a spec and the backend's ``Topology`` (the nodes' addresses, paths and the
values only the nodes learn, as data), with no host in sight, and returns each node's final share: backends
render and submit it as it is, and the node runs it as it is (filling in only the placeholders the topology
declared: ``node.messages.resolve``). Nothing here touches a host; the one thing not decided by its inputs is the
job id and secret, minted here once per job unless given (a restart keeps them). Node-major ids, pservers before
trainers (``Topology.pserver_ids``, the one numbering): pserver ``i * PSERVERS_PER_NODE + k`` and trainer
``i * TRAINERS_PER_NODE + j`` run on node ``i``.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import itertools
import secrets
import shlex
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from paddle_cluster.contract import PSERVER, TRAINER, Endpoint, JobEnv
from paddle_cluster.node.messages import NodePlan, ProcPlan

from .config import ClusterConfig
from .errors import ConfigError


@dataclass(frozen=True)
class JobSpec:
    """What the user asked for."""

    cfg: ClusterConfig
    name: str
    dispatch_dir: Optional[str] = None
    workspace: Optional[str] = None
    trainer_args: Tuple[str, ...] = ()
    resume_from: Optional[str] = None  # an earlier job's name, or a checkpoint root directory
    max_restarts: int = 0  # whole-job restarts from the latest complete checkpoint after a process dies
    elastic: bool = False  # a dead trainer is reported and the others go on (async mode)
    init: Tuple[Tuple[str, str], ...] = ()  # v2 options (launch/entry.py): PADDLE_INIT_* of every process
    verbose: bool = False  # also show the pservers' INFO log lines (they are always in the log files)

    def __post_init__(self) -> None:
        if self.cfg.collective:  # what needs pservers
            why = dict(self.cfg.options).get("PSERVERS_PER_NODE") or f"PSERVERS_PER_NODE = 0 in {self.cfg.source}"
            pservers = "or give the job pservers (drop --collective, or PSERVERS_PER_NODE >= 1 in the config)"
            if self.resume_from:
                raise ConfigError("--resume_from", self.resume_from, f"this job has no pservers ({why}), so no "
                                  "pserver checkpoint to resume from: drop --resume_from and have the script resume "
                                  f"from the state it saved itself (its own files under ROOT_DIR), {pservers}")
            if self.elastic:  # a flag: named, not its value
                raise ConfigError("--elastic", None, f"this job has no pservers ({why}), and --elastic keeps async "
                                  "pservers serving the trainers left after one dies: drop --elastic (a collective "
                                  f"job stops when a trainer fails; --max_restarts restarts it), {pservers}")

    @property
    def job_dir(self) -> str:
        return self.cfg.job_dir(self.name)

    @property
    def cwd(self) -> str:
        """Where processes run: the job directory, holding the workspace (copied, or linked: node/layout.py)."""
        return self.job_dir

    @property
    def resume_root(self) -> str:
        """Where ``--resume_from`` points pservers ("" without it): a job name means that job's checkpoints."""
        r = self.resume_from
        if not r:
            return ""
        return r if r.startswith("/") else f"{self.cfg.job_dir(r)}/checkpoints"

    @property
    def checkpoint_root(self) -> str:
        """Where this job's pservers read and write checkpoints."""
        return self.resume_root or f"{self.job_dir}/checkpoints"


@dataclass(frozen=True)
class Place:
    """One node of a topology: its address and how many pservers and trainers run there."""

    address: str  # as the processes reach it (a probed address, a pod's DNS name, or a placeholder)
    pservers: int
    trainers: int
    python: str = ""  # its interpreter, an absolute path (preflight's); "": PYTHON
    # Its own job directory, PADDLE_JOB_DIR of its processes ("": the job's): nodes sharing one filesystem keep
    # their agent state, logs and nodefile apart (Slurm's ``node<i>/``); with --job_workspace it is their cwd.
    job_dir: str = ""


@dataclass(frozen=True)
class Topology:
    """Where a job's processes run, as its backend supplies it (data: ``build_plan`` takes from it all it needs of
    the backend): the nodes, and where the job's files are on them ("": the spec's ``job_dir``, its workspace, its
    resume root; a workspace named here is where the processes run). Ids are node-major, pservers first."""

    nodes: Tuple[Place, ...]
    job_dir: str = ""
    workspace: str = ""
    checkpoint_dir: str = ""
    # With --resume_from, the checkpoint step every pserver resumes from, once ``prepare`` found it complete for
    # each (``launch/resume.py``); None: the pservers look for it themselves (and refuse to start without one).
    resume_step: Optional[int] = None
    # The interface gloo and NCCL bind to (SOCKET_IFNAME_VARS): None, the config's PADDLE_NIC (an interface of its
    # hosts); "" none, each process binding its host name's address (a pod's own).
    nic: Optional[str] = None
    # The placeholders among the addresses, standing for values only the nodes learn at run time (Slurm's
    # allocation: ``node.messages.address_placeholder``); every node's plan lists them, and the node fills them in
    # before running it (``node.messages.resolve``).
    pending: Tuple[str, ...] = ()

    @classmethod
    def hosts(cls, cfg: ClusterConfig, addresses: Sequence[str], pythons: Sequence[str] = (),
              resume_step: Optional[int] = None, job_dirs: Sequence[str] = ()) -> Topology:
        """PSERVERS_PER_NODE pservers and TRAINERS_PER_NODE trainers on each of these nodes (node ``i`` is
        ``HOSTS[i]``, or allocation node ``i``); ``pythons``: each node's interpreter as its preflight resolved it;
        ``job_dirs``: each node's own job directory (none: the job's)."""
        def at(seq: Sequence[str], i: int) -> str:
            return seq[i] if i < len(seq) else ""

        return cls(tuple(Place(a, cfg.pservers_per_node, cfg.trainers_per_node, at(pythons, i), at(job_dirs, i))
                         for i, a in enumerate(addresses)), resume_step=resume_step)

    def pserver_ids(self) -> Tuple[Tuple[int, ...], ...]:
        """Each node's pserver ids: the job's one numbering of pservers (node-major)."""
        return _numbered([n.pservers for n in self.nodes])

    def trainer_ids(self) -> Tuple[Tuple[int, ...], ...]:
        """Each node's trainer ids (node-major)."""
        return _numbered([n.trainers for n in self.nodes])

    @property
    def pservers(self) -> int:
        return sum(n.pservers for n in self.nodes)

    @property
    def trainers(self) -> int:
        return sum(n.trainers for n in self.nodes)


@dataclass(frozen=True)
class JobPlan:
    """The whole job: the contract every process shares (id, secret, pservers) and each node's share."""

    spec: JobSpec
    env: JobEnv
    topology: Topology
    nodes: Tuple[NodePlan, ...]
    start: int = 1  # which start of the job this is: 1, one more for each restart (a backend's files per start)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def addresses(self) -> Tuple[str, ...]:
        return tuple(n.address for n in self.topology.nodes)

    def pserver_ids(self) -> Dict[int, List[int]]:
        """The pserver ids on each node that runs any."""
        out: Dict[int, List[int]] = {}
        for n in self.nodes:
            if n.pservers:
                out[n.node] = [p.index for p in n.pservers]
        return out

    def resumed(self, step: Optional[int]) -> JobPlan:
        """The same job (id, secret, processes) again, its pservers resuming from ``step`` of the job's
        checkpoints, or from scratch when None: what a restart runs."""
        env = dataclasses.replace(self.env, resume="" if step is None else str(step),
                                  checkpoint_dir=self.spec.checkpoint_root if step is not None
                                  else self.env.checkpoint_dir)
        return dataclasses.replace(self, env=env, nodes=_node_plans(self.spec, env, self.topology))

    def restarted(self, step: Optional[int]) -> JobPlan:
        """What a restart runs: the job ``resumed`` from ``step``, as its next start."""
        return dataclasses.replace(self.resumed(step), start=self.start + 1)


def build_plan(spec: JobSpec, topology: Topology, job_id: Optional[str] = None,
               secret: Optional[str] = None) -> JobPlan:
    """The plan for ``spec`` on ``topology``, for every backend: the job id and secret (fresh ones unless given:
    once per job, restarts keep them), each process's ports and endpoints, and every process's environment."""
    cfg = spec.cfg
    if not topology.trainers:
        raise ConfigError("TRAINERS_PER_NODE", cfg.trainers_per_node, "a job needs at least one trainer")
    if cfg.collective != (topology.pservers == 0):  # a backend gave pservers to a collective job, or none to one
        raise ConfigError("PSERVERS_PER_NODE", cfg.pservers_per_node, f"{topology.pservers} pserver(s) placed for a "
                          f"{'collective ' if cfg.collective else ''}job: a job without pservers is a collective one")
    trainer_ports = cfg.trainer_ports()
    pservers: List[Endpoint] = []
    trainers: List[Endpoint] = []
    for n in topology.nodes:
        ip = _loopback(n.address)
        # The pservers of a node take consecutive port ranges; on a loopback address each takes its own address
        # instead (127.0.0.1, 127.0.0.2, ...) and the same ports, so that ``PADDLE_PSERVER_IPS`` x
        # ``PADDLE_PSERVER_PORT``, the way seed scripts name pservers, names each.
        pservers += [Endpoint(str(ip + k), cfg.paddle_port) if ip else Endpoint(n.address, cfg.pserver_ports(k)[0])
                     for k in range(n.pservers)]
        # The trainers of a node take the ports after MASTER_PORT (``ClusterConfig.trainer_ports``).
        trainers += [Endpoint(n.address, trainer_ports[1 + j]) for j in range(n.trainers)]
    env = JobEnv(job_id=job_id or f"{spec.name}-{secrets.token_hex(4)}", pservers=tuple(pservers),
                 trainers=len(trainers), ports_num=cfg.paddle_ports_num,
                 ports_num_for_sparse=cfg.paddle_ports_num_for_sparse, secret=secret or secrets.token_hex(32),
                 job_dir=topology.job_dir or spec.job_dir, workspace=topology.workspace or spec.workspace or
                 spec.job_dir, barrier_timeout=cfg.barrier_timeout, resume="latest" if spec.resume_from else "",
                 checkpoint_dir=topology.checkpoint_dir or spec.resume_root, init=dict(spec.init), extra=dict(cfg.env),
                 integrity=cfg.integrity, trainer_endpoints=tuple(trainers), master_port=trainer_ports[0],
                 local_world_size=max(n.trainers for n in topology.nodes),
                 nic=cfg.paddle_nic if topology.nic is None else topology.nic)
    plan = JobPlan(spec, env, topology, _node_plans(spec, env, topology))
    return plan.resumed(topology.resume_step) if topology.resume_step is not None else plan


def _numbered(counts: Sequence[int]) -> Tuple[Tuple[int, ...], ...]:
    return tuple(tuple(range(first, first + c)) for first, c in zip(itertools.accumulate(counts, initial=0), counts))


def _loopback(addr: str) -> Optional[ipaddress.IPv4Address]:
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        return None
    return ip if isinstance(ip, ipaddress.IPv4Address) and ip.is_loopback else None


def _node_plans(spec: JobSpec, env: JobEnv, topology: Topology) -> Tuple[NodePlan, ...]:
    cfg = spec.cfg
    # The arguments after the workspace reach every process running the entry script, pservers too when they
    # run it (as paddle.py passed them to every process); the built-in pserver takes none.
    args = " " + shlex.join(spec.trainer_args) if spec.trainer_args else ""
    endpoints = tuple(Endpoint(e.host, port) for k, e in enumerate(env.pservers) for port in env.all_ports(k))
    nodes = []
    for i, (n, ps, tr) in enumerate(zip(topology.nodes, topology.pserver_ids(), topology.trainer_ids())):
        here = env if not n.job_dir else dataclasses.replace(env, job_dir=n.job_dir)
        common = here.to_environ()
        # The absolute interpreter preflight checked there: a PATH lookup of "python3" differs under mpirun,
        # which puts its own prefix's bin first (docs/backends.md).
        pserver_cmd, trainer_cmd = cfg.commands(n.python or None)
        pserver_cmd += args if cfg.pserver_runs_entry else ""

        procs = [_proc(here, common, PSERVER, k, n.pservers, pserver_cmd, env.pservers[k].host) for k in ps]
        procs += [_proc(here, common, TRAINER, j, n.trainers, trainer_cmd + args, n.address) for j in tr]
        # Processes run in a workspace the topology names (a pod's, in its image); else in a dispatched workspace,
        # the job's directory (shared by nodes that share a filesystem), or in the node's own directory, where
        # --job_workspace is linked (node/layout.py).
        cwd = topology.workspace or (here.job_dir if spec.workspace else env.job_dir)
        nodes.append(NodePlan(i, n.address, here.job_dir, cwd, common, tuple(procs), endpoints, cfg.start_timeout,
                              cfg.ld_library_path, spec.workspace or "", topology.pending))
    return tuple(nodes)


def _proc(env: JobEnv, common: Dict[str, str], role: str, index: int, per_node: int, cmd: str, ip: str) -> ProcPlan:
    """Process ``index`` of ``role``: its command, its log, and its variables that are not the node's ``common``."""
    kind, log = ("pserver", "server") if role == PSERVER else ("trainer", "train")
    full = env.for_process(role, index, ip).to_environ()
    return ProcPlan(f"{kind}.{index}", role, index, cmd, f"{log}.log" if per_node == 1 else f"{log}.{index}.log",
                    {k: v for k, v in full.items() if common.get(k) != v})
