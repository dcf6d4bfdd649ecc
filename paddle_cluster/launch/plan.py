"""What a job is, decided once: ``JobSpec`` (what the user asked for) and ``JobPlan`` (which process runs on
which node, with which command and environment, and which ports the trainers wait for).

Pure: a plan is built from a spec and the nodes' addresses, with no host in sight, and every backend runs
the same plan. Node-major ids, pservers before trainers: pserver ``i * PSERVERS_PER_NODE + k`` and trainer
``i * TRAINERS_PER_NODE + j`` run on node ``i``.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import secrets
import shlex
from dataclasses import dataclass
from datetime import datetime
from typing import Dict, List, Optional, Sequence, Tuple

from paddle_cluster.contract import PSERVER, TRAINER, Endpoint, JobEnv
from paddle_cluster.node.messages import NodePlan, ProcPlan

from . import journal
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
            for flag, given, what in (("--resume_from", self.resume_from, "no pserver checkpoint to resume from"),
                                      ("--elastic", self.elastic, "--elastic is about async pservers")):
                if given:
                    raise ConfigError(flag, given, f"this job has no pservers ({why}): {what}")

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

    def node_pservers(self, node: int) -> Tuple[int, ...]:
        """The ids of the pservers node ``node`` runs (node-major, as ``_node_plans`` numbers them)."""
        per = self.cfg.pservers_per_node
        return tuple(range(node * per, (node + 1) * per))

    @property
    def checkpoint_root(self) -> str:
        """Where this job's pservers read and write checkpoints."""
        return self.resume_root or f"{self.job_dir}/checkpoints"


def default_job_name(cfg: ClusterConfig, reserve: bool = True) -> str:
    """``JOB<date><time>``, with ``-2``, ``-3``... when a job started from this machine (of any config: two may
    share hosts and ROOT_DIR) already has that name: two runs started within one second would otherwise meet in
    one job directory. ``reserve=False`` (a dry run, which writes nothing): the stamp, not kept as taken."""
    stamp = datetime.now().strftime("JOB%Y%m%d%H%M%S")
    return journal.reserve_name(cfg, stamp) if reserve else stamp


@dataclass(frozen=True)
class JobPlan:
    """The whole job: the contract every process shares (id, secret, pservers) and each node's share."""

    spec: JobSpec
    env: JobEnv
    addresses: Tuple[str, ...]
    nodes: Tuple[NodePlan, ...]
    pythons: Tuple[str, ...] = ()  # node i's interpreter, an absolute path (preflight's); "" or none: PYTHON

    @property
    def name(self) -> str:
        return self.spec.name

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
        return dataclasses.replace(self, env=env, nodes=_node_plans(self.spec, env, self.addresses, self.pythons))


def build_plan(spec: JobSpec, addresses: Sequence[str], job_id: str, secret: str,
               pythons: Sequence[str] = ()) -> JobPlan:
    """The plan for ``spec`` on nodes with these addresses (node ``i`` is ``HOSTS[i]``); ``pythons``: each node's
    interpreter as its preflight resolved it (an absolute path), which ``{python}`` of its commands becomes."""
    cfg = spec.cfg
    env = JobEnv(job_id=job_id, pservers=pserver_endpoints(cfg, addresses),
                 trainers=len(addresses) * cfg.trainers_per_node,
                 ports_num=cfg.paddle_ports_num, ports_num_for_sparse=cfg.paddle_ports_num_for_sparse, secret=secret,
                 job_dir=spec.job_dir, workspace=spec.workspace or spec.job_dir, barrier_timeout=cfg.barrier_timeout,
                 resume="latest" if spec.resume_from else "", checkpoint_dir=spec.resume_root, init=dict(spec.init),
                 extra=dict(cfg.env), integrity=cfg.integrity, trainer_endpoints=trainer_endpoints(cfg, addresses),
                 master_port=cfg.trainer_ports()[0], local_world_size=cfg.trainers_per_node, nic=cfg.paddle_nic)
    return JobPlan(spec, env, tuple(addresses), _node_plans(spec, env, addresses, pythons), tuple(pythons))


def pserver_endpoints(cfg: ClusterConfig, addresses: Sequence[str]) -> Tuple[Endpoint, ...]:
    """Each pserver's address and first port, node-major. The pservers of a node take consecutive port ranges;
    on a loopback address each takes its own address instead (127.0.0.1, 127.0.0.2, ...) and the same ports,
    so that ``PADDLE_PSERVER_IPS`` x ``PADDLE_PSERVER_PORT``, the way seed scripts name pservers, names each."""
    out = []
    for addr in addresses:
        ip = _loopback(addr)
        out += [Endpoint(str(ip + k), cfg.paddle_port) if ip else Endpoint(addr, cfg.pserver_ports(k)[0])
                for k in range(cfg.pservers_per_node)]
    return tuple(out)


def trainer_endpoints(cfg: ClusterConfig, addresses: Sequence[str]) -> Tuple[Endpoint, ...]:
    """Each trainer's address and port, node-major (PADDLE_TRAINER_ENDPOINTS; trainer 0's address is
    MASTER_ADDR): the trainers of a node take the ports after MASTER_PORT (``ClusterConfig.trainer_ports``)."""
    ports = cfg.trainer_ports()[1:]
    return tuple(Endpoint(addr, ports[j]) for addr in addresses for j in range(cfg.trainers_per_node))


def _loopback(addr: str) -> Optional[ipaddress.IPv4Address]:
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        return None
    return ip if isinstance(ip, ipaddress.IPv4Address) and ip.is_loopback else None


def mint_plan(spec: JobSpec, addresses: Sequence[str], pythons: Sequence[str] = ()) -> JobPlan:
    """``build_plan`` with a fresh job id and secret: once per job (restarts keep them)."""
    return build_plan(spec, addresses, f"{spec.name}-{secrets.token_hex(4)}", secrets.token_hex(32), pythons)


def _node_plans(spec: JobSpec, env: JobEnv, addresses: Sequence[str],
                pythons: Sequence[str] = ()) -> Tuple[NodePlan, ...]:
    cfg = spec.cfg
    common = env.to_environ()
    # The arguments after the workspace reach every process running the entry script, pservers too when they
    # run it (as paddle.py passed them to every process); the built-in pserver takes none.
    args = " " + shlex.join(spec.trainer_args) if spec.trainer_args else ""
    endpoints = tuple(Endpoint(e.host, port) for k, e in enumerate(env.pservers) for port in env.all_ports(k))

    def commands(node: int) -> Tuple[str, str]:
        # The absolute interpreter preflight checked there: a PATH lookup of "python3" differs under mpirun,
        # which puts its own prefix's bin first (docs/backends.md).
        pserver_cmd, trainer_cmd = cfg.commands(pythons[node] if node < len(pythons) else None)
        return pserver_cmd + (args if cfg.pserver_runs_entry else ""), trainer_cmd + args

    def proc(role: str, index: int, per_node: int, addr: str, node: int) -> ProcPlan:
        kind, log = ("pserver", "server") if role == PSERVER else ("trainer", "train")
        cmd = commands(node)[0 if role == PSERVER else 1]
        full = env.for_process(role, index, env.pservers[index].host if role == PSERVER else addr).to_environ()
        return ProcPlan(f"{kind}.{index}", role, index, cmd, f"{log}.log" if per_node == 1 else f"{log}.{index}.log",
                        {k: v for k, v in full.items() if common.get(k) != v})

    nodes = []
    for i, addr in enumerate(addresses):
        procs = [proc(PSERVER, i * cfg.pservers_per_node + k, cfg.pservers_per_node, addr, i)
                 for k in range(cfg.pservers_per_node)]
        procs += [proc(TRAINER, i * cfg.trainers_per_node + j, cfg.trainers_per_node, addr, i)
                  for j in range(cfg.trainers_per_node)]
        nodes.append(NodePlan(i, addr, spec.job_dir, spec.cwd, common, tuple(procs), endpoints, cfg.start_timeout,
                              cfg.ld_library_path, spec.workspace or ""))
    return tuple(nodes)
