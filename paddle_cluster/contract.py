"""The environment-variable contract between the launcher and every process it starts.

This module is the only place that reads or sets the variables, in both directions: the launcher builds a
``JobEnv`` and calls ``to_environ()``; a pserver or trainer calls ``JobEnv.from_environ()``. Other modules name a
variable only in a message, or through the constants below. It speaks
three dialects at once so seed scripts run unchanged: Fluid (``PADDLE_TRAINING_ROLE`` ...), v2
(``PADDLE_INIT_*``) and the job's own (``PADDLE_JOB_*``). Standard library only: it runs on every node.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tempfile
from dataclasses import dataclass, field
from typing import Dict, Mapping, Optional, Sequence, Tuple

# The trainer keys are re-exported: ``contract`` is their public home.
from .jobsecret import derive_trainer_key, secret_problem  # noqa: F401

PSERVER = "PSERVER"
TRAINER = "TRAINER"
ROLES = (PSERVER, TRAINER)
# The variables other modules need by name: the job secret (pservers only; a backend that keeps it apart, such as
# a Kubernetes Secret, asks for it by this name), a trainer's own key, and the role.
SECRET_VAR = "PADDLE_JOB_SECRET"
TRAINER_KEY_VAR = "PADDLE_TRAINER_KEY"
ROLE_VAR = "PADDLE_TRAINING_ROLE"

PORT_MAX = 65535
# What torchrun sets for each process (torch.distributed's env:// rendezvous): every trainer of every job gets them.
TORCH_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")
# The interface gloo and NCCL bind to (PADDLE_NIC): unset, gloo binds the address of the host name, often
# 127.0.0.1, and its full mesh fails across hosts. The only contract names ENV may override.
SOCKET_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
DEFAULT_MAX_FRAME_BYTES = 1 << 30
DEFAULT_MAX_CONNECTIONS = 256


class ContractError(ValueError):
    """A variable of the contract is missing or malformed; the message names it."""


def check_secret(value: str, var: str = SECRET_VAR) -> None:
    """Refuse an empty, short or obviously low-entropy secret (``var`` names its variable): ``ContractError``
    saying how to make a good one."""
    problem = secret_problem(value)
    if problem:
        raise ContractError(f"{var} {problem}: `paddle-cluster run` sets it for every process it starts; to start "
                            f"pservers and trainers by hand, give them all the same generated {SECRET_VAR}, e.g. "
                            f"export {SECRET_VAR}=$(paddle-cluster secret) (or $(python3 -c 'import secrets; "
                            "print(secrets.token_hex(32))'))")


def job_secret(environ: Optional[Mapping[str, str]] = None) -> str:
    """``PADDLE_JOB_SECRET`` alone, for a job described by arguments rather than the launcher's contract (a
    hand-started seed script names its pservers itself); "" when unset."""
    return (os.environ if environ is None else environ).get(SECRET_VAR, "")


@dataclass(frozen=True)
class Endpoint:
    """One pserver: the address it binds to and the first of its ports."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"

    @classmethod
    def parse(cls, text: str) -> Endpoint:
        host, sep, port = text.strip().rpartition(":")
        if not sep or not host or not (port.isascii() and port.isdigit()) or not 1 <= int(port) <= PORT_MAX:
            raise ContractError(f"bad endpoint {text.strip()!r}: expected HOST:PORT with a port in 1..{PORT_MAX}")
        return cls(host, int(port))


def pserver_ports(first: int, ports_num: int, ports_num_for_sparse: int, index: int = 0) -> Tuple[int, ...]:
    """The ports of the ``index``-th of pservers laid out back to back from port ``first``: each takes
    ``ports_num`` dense ports, then ``ports_num_for_sparse`` sparse ones. The one port model of the job."""
    per = ports_num + ports_num_for_sparse
    base = first + index * per
    return tuple(range(base, base + per))


def trainer_ports(first: int, pservers: int, ports_num: int, ports_num_for_sparse: int,
                  trainers: int) -> Tuple[int, ...]:
    """A node's collective ports, right after its ``pservers`` pservers' (``pserver_ports``): MASTER_PORT (rank
    0's store, used on trainer 0's node), then one port per trainer of the node (its PADDLE_TRAINER_ENDPOINTS
    entry). In a job without pservers MASTER_PORT is ``first`` (PADDLE_PORT)."""
    base = first + pservers * (ports_num + ports_num_for_sparse)
    return tuple(range(base, base + 1 + trainers))


@dataclass(frozen=True)
class JobEnv:
    """Everything a pserver or trainer needs to know about its job.

    Pserver *k* listens on ``ports_num + ports_num_for_sparse`` consecutive ports starting at
    ``pservers[k].port``: the first ``ports_num`` carry dense traffic, the rest sparse-table traffic.
    """

    job_id: str
    pservers: Tuple[Endpoint, ...]
    trainers: int
    ports_num: int = 1
    ports_num_for_sparse: int = 1
    # The job secret: pservers (and the launcher) only. A trainer gets ``trainer_key`` instead.
    secret: str = field(default="", repr=False)
    trainer_key: str = field(default="", repr=False)
    # Frames carry MACs (``INTEGRITY`` in the config; off only on an isolated fabric).
    integrity: bool = True
    # Dense data to a pserver on the trainer's node through shared memory (docs/architecture.md); off: TCP.
    lane: bool = True
    job_dir: str = ""
    workspace: str = ""
    barrier_timeout: float = 120.0
    # Where pservers resume from: "" (fresh), "latest", a step number or a step directory; and the
    # checkpoint root ("" = <job_dir>/checkpoints). Set by ``run --resume_from``.
    resume: str = ""
    checkpoint_dir: str = ""
    # Per process; None in the job-wide part every process of a node shares.
    role: Optional[str] = None
    trainer_id: Optional[int] = None
    pserver_id: Optional[int] = None
    current_ip: Optional[str] = None
    # v2 options given on the command line (``v2_options``): ``{"trainer_count": "4"}`` sets
    # PADDLE_INIT_TRAINER_COUNT=4 in every process.
    init: Dict[str, str] = field(default_factory=dict, compare=False)
    extra: Dict[str, str] = field(default_factory=dict, compare=False)
    # The trainers' collective side (torch.distributed, paddle.distributed): each trainer's address and port in
    # id order (trainer 0's address is MASTER_ADDR), MASTER_PORT, trainers per node (LOCAL_WORLD_SIZE: ids are
    # node-major, so LOCAL_RANK and GROUP_RANK follow from the id) and the interface gloo and NCCL bind to.
    trainer_endpoints: Tuple[Endpoint, ...] = ()
    master_port: int = 0
    local_world_size: int = 1
    nic: str = ""

    def __post_init__(self) -> None:
        if self.role is not None and self.role not in ROLES:
            raise ContractError(f"PADDLE_TRAINING_ROLE={self.role!r}: expected one of {', '.join(ROLES)}")
        if self.trainers < 1:
            raise ContractError(f"PADDLE_TRAINERS={self.trainers}: must be at least 1")
        if self.trainer_id is not None and not 0 <= self.trainer_id < self.trainers:
            raise ContractError(f"PADDLE_TRAINER_ID={self.trainer_id}: must be in [0, {self.trainers})")
        if self.pserver_id is not None and not 0 <= self.pserver_id < len(self.pservers):
            raise ContractError(f"PADDLE_PSERVER_ID={self.pserver_id}: must be in [0, {len(self.pservers)})")
        if self.ports_num < 1 or self.ports_num_for_sparse < 0:
            raise ContractError("PADDLE_INIT_PORTS_NUM must be >= 1 and PADDLE_INIT_PORTS_NUM_FOR_SPARSE >= 0")
        if self.trainer_endpoints and len(self.trainer_endpoints) != self.trainers:
            raise ContractError(f"PADDLE_TRAINER_ENDPOINTS names {len(self.trainer_endpoints)} trainers, "
                                f"PADDLE_TRAINERS {self.trainers}")
        if self.local_world_size < 1 or self.trainers % self.local_world_size:
            raise ContractError(f"LOCAL_WORLD_SIZE={self.local_world_size}: must divide WORLD_SIZE={self.trainers}")
        owned = sorted(set(self.init) - set(V2_INIT_OPTIONS))
        if owned:
            raise ContractError(f"--{owned[0]}: not a v2 option a job sets ({', '.join(V2_INIT_OPTIONS)})")

    # -- derived -------------------------------------------------------------------------------
    @property
    def ports_per_pserver(self) -> int:
        return self.ports_num + self.ports_num_for_sparse

    def dense_ports(self, k: int) -> Tuple[int, ...]:
        return self.all_ports(k)[: self.ports_num]

    def sparse_ports(self, k: int) -> Tuple[int, ...]:
        """Ports for sparse traffic; with no sparse ports configured, sparse shares the dense ones."""
        return self.all_ports(k)[self.ports_num:] or self.dense_ports(k)

    def all_ports(self, k: int) -> Tuple[int, ...]:
        return pserver_ports(self.pservers[k].port, self.ports_num, self.ports_num_for_sparse)

    @property
    def current_endpoint(self) -> Optional[Endpoint]:
        return None if self.pserver_id is None else self.pservers[self.pserver_id]

    def for_process(self, role: str, index: int, current_ip: str) -> JobEnv:
        """The contract of one process: trainer ``index`` (with its own key instead of the job secret) or
        pserver ``index`` on ``current_ip``."""
        if role == TRAINER:
            key = derive_trainer_key(self.secret, self.job_id, index) if self.secret else self.trainer_key
            return dataclasses.replace(self, role=role, trainer_id=index, pserver_id=None, current_ip=current_ip,
                                       secret="", trainer_key=key)
        return dataclasses.replace(self, role=role, pserver_id=index, trainer_id=None, current_ip=current_ip,
                                   trainer_key="")

    def key_of(self, trainer: int) -> str:
        """The key trainer ``trainer`` authenticates with: derived from the secret where this process holds
        it, else its own ``trainer_key``. Refuses a missing or short one (``ContractError``)."""
        if self.secret:
            check_secret(self.secret)
            return derive_trainer_key(self.secret, self.job_id, trainer)
        check_secret(self.trainer_key, f"{TRAINER_KEY_VAR} (or {SECRET_VAR})")
        return self.trainer_key

    # -- to and from the environment -----------------------------------------------------------
    def to_environ(self) -> Dict[str, str]:
        eps = ",".join(str(e) for e in self.pservers)
        ips = ",".join(e.host for e in self.pservers)
        first_port = str(self.pservers[0].port) if self.pservers else ""
        env = {
            # Fluid names (seed 003)
            "PADDLE_PSERVER_IPS": ips,
            "PADDLE_PSERVER_PORT": first_port,
            "PADDLE_TRAINERS": str(self.trainers),
            # v2 names (seed 000)
            "PADDLE_INIT_PSERVERS": ips,
            "PADDLE_INIT_PORT": first_port,
            "PADDLE_INIT_PORTS_NUM": str(self.ports_num),
            "PADDLE_INIT_PORTS_NUM_FOR_SPARSE": str(self.ports_num_for_sparse),
            "PADDLE_INIT_NUM_GRADIENT_SERVERS": str(self.trainers),
            "PADDLE_INIT_TRAINER_COUNT": "1",
            "PADDLE_INIT_USE_GPU": "0",
            # the job's own
            "PADDLE_JOB_ID": self.job_id,
            "PADDLE_PSERVER_ENDPOINTS": eps,
            "PADDLE_JOB_DIR": self.job_dir,
            "PADDLE_WORKSPACE": self.workspace,
            "PADDLE_BARRIER_TIMEOUT": repr(float(self.barrier_timeout)),
            # Unbuffered output so the launcher streams lines as they are printed.
            "PYTHONUNBUFFERED": "1",
        }
        # The secret goes to pservers only (the job-wide part, role None, reaches every process); a trainer
        # gets its own key.
        if self.role == PSERVER and self.secret:
            env[SECRET_VAR] = self.secret
        if self.role == TRAINER and self.trainer_key:
            env[TRAINER_KEY_VAR] = self.trainer_key
        if not self.integrity:
            env["PADDLE_INTEGRITY"] = "0"
        if not self.lane:
            env["PADDLE_LANE"] = "0"
        if self.resume:
            env["PADDLE_RESUME"] = self.resume
        if self.checkpoint_dir:
            env["PADDLE_CHECKPOINT_DIR"] = self.checkpoint_dir
        if self.role is not None:
            env[ROLE_VAR] = env["TRAINING_ROLE"] = self.role  # TRAINING_ROLE: Paddle fleet's
        if self.current_ip is not None:
            env["PADDLE_CURRENT_IP"] = self.current_ip
        if self.trainer_id is not None:
            env["PADDLE_TRAINER_ID"] = str(self.trainer_id)
            env["PADDLE_INIT_TRAINER_ID"] = str(self.trainer_id)
        if self.pserver_id is not None:
            me = self.pservers[self.pserver_id]
            env["PADDLE_PSERVER_ID"] = str(self.pserver_id)
            env["PADDLE_CURRENT_ENDPOINT"] = str(me)
            env.update(POD_IP=me.host, PADDLE_PORT=str(me.port))  # what Paddle fleet's role maker reads
        env.update(self.collective_environ())
        env.update({f"PADDLE_INIT_{k.upper()}": v for k, v in self.init.items()})
        env.update(self.extra)  # ENV: may set the SOCKET_IFNAME_VARS (the configuration refuses the rest)
        return env

    def collective_environ(self) -> Dict[str, str]:
        """torchrun's and ``paddle.distributed.launch``'s variables (and Paddle fleet's list of pservers): the
        job-wide ones, and a trainer's own rank, local rank, group rank and endpoint."""
        env: Dict[str, str] = {}
        if self.pservers:
            env["PADDLE_PSERVERS_IP_PORT_LIST"] = ",".join(str(e) for e in self.pservers)
        if self.nic:
            env.update({name: self.nic for name in SOCKET_IFNAME_VARS})
        if not self.trainer_endpoints:
            return env
        env.update(MASTER_ADDR=self.trainer_endpoints[0].host, MASTER_PORT=str(self.master_port),
                   WORLD_SIZE=str(self.trainers), LOCAL_WORLD_SIZE=str(self.local_world_size),
                   PADDLE_TRAINERS_NUM=str(self.trainers),
                   PADDLE_TRAINER_ENDPOINTS=",".join(str(e) for e in self.trainer_endpoints))
        if self.trainer_id is not None:
            env.update(RANK=str(self.trainer_id), LOCAL_RANK=str(self.trainer_id % self.local_world_size),
                       GROUP_RANK=str(self.trainer_id // self.local_world_size),
                       PADDLE_CURRENT_ENDPOINT=str(self.trainer_endpoints[self.trainer_id]))
        return env

    @classmethod
    def from_environ(cls, environ: Optional[Mapping[str, str]] = None) -> Optional[JobEnv]:
        """The contract from ``environ`` (default ``os.environ``); None when not started by a launcher."""
        env = os.environ if environ is None else environ
        eps_text = env.get("PADDLE_PSERVER_ENDPOINTS", "")
        eps_var = "PADDLE_PSERVER_ENDPOINTS"
        try:
            trainer_eps = tuple(Endpoint.parse(t) for t in env.get("PADDLE_TRAINER_ENDPOINTS", "").split(",")
                                if t.strip())
        except ContractError as e:
            raise ContractError(f"PADDLE_TRAINER_ENDPOINTS: {e}") from None
        if not eps_text:
            # A seed-style launch (Fluid names only): one pserver per IP, all on the same port.
            ips = env.get("PADDLE_PSERVER_IPS") or env.get("PADDLE_INIT_PSERVERS") or ""
            port = env.get("PADDLE_PSERVER_PORT") or env.get("PADDLE_INIT_PORT") or ""
            if not ips and not trainer_eps:  # trainer endpoints alone: a job without pservers
                return None
            if ips and not port:
                raise ContractError("PADDLE_PSERVER_IPS is set but PADDLE_PSERVER_PORT is not")
            eps_text = ",".join(f"{ip}:{port}" for ip in ips.split(",") if ip)
            eps_var = "PADDLE_PSERVER_IPS/PADDLE_PSERVER_PORT" if env.get("PADDLE_PSERVER_IPS") else \
                "PADDLE_INIT_PSERVERS/PADDLE_INIT_PORT"
        try:
            pservers = tuple(Endpoint.parse(t) for t in eps_text.split(",") if t.strip())
        except ContractError as e:
            raise ContractError(f"{eps_var}: {e}") from None
        if not pservers and not trainer_eps:
            raise ContractError(f"PADDLE_PSERVER_ENDPOINTS={eps_text!r} names no pserver")
        role = env.get(ROLE_VAR) or None
        pserver_id = _int(env, "PADDLE_PSERVER_ID")
        current_ip = env.get("PADDLE_CURRENT_IP") or None
        if role == PSERVER and pserver_id is None and current_ip:
            # Seed scripts identify a pserver by its address alone.
            matches = [k for k, e in enumerate(pservers) if e.host == current_ip]
            if len(matches) != 1:
                raise ContractError(
                    f"PADDLE_CURRENT_IP={current_ip} matches {len(matches)} pservers in "
                    f"{eps_text}; set PADDLE_PSERVER_ID to say which one this is"
                )
            pserver_id = matches[0]
        trainers = _int(env, "PADDLE_TRAINERS", "PADDLE_INIT_NUM_GRADIENT_SERVERS")
        trainer_id = _int(env, "PADDLE_TRAINER_ID", "PADDLE_INIT_TRAINER_ID")
        return cls(
            job_id=env.get("PADDLE_JOB_ID", "local"),
            pservers=pservers,
            trainers=1 if trainers is None else trainers,
            ports_num=_int(env, "PADDLE_INIT_PORTS_NUM") or 1,
            ports_num_for_sparse=_int(env, "PADDLE_INIT_PORTS_NUM_FOR_SPARSE") or 0,
            secret=env.get(SECRET_VAR, ""),
            trainer_key=env.get(TRAINER_KEY_VAR, ""),
            integrity=_bool(env, "PADDLE_INTEGRITY", True),
            lane=_bool(env, "PADDLE_LANE", True),
            job_dir=env.get("PADDLE_JOB_DIR", ""),
            workspace=env.get("PADDLE_WORKSPACE", ""),
            barrier_timeout=_float(env, "PADDLE_BARRIER_TIMEOUT", 120.0),
            resume=env.get("PADDLE_RESUME", ""),
            checkpoint_dir=env.get("PADDLE_CHECKPOINT_DIR", ""),
            role=role,
            trainer_id=trainer_id if role != PSERVER else None,
            pserver_id=pserver_id if role != TRAINER else None,
            current_ip=current_ip,
            trainer_endpoints=trainer_eps,
            master_port=_int(env, "MASTER_PORT") or 0 if trainer_eps else 0,
            local_world_size=_int(env, "LOCAL_WORLD_SIZE") or 1 if trainer_eps else 1,
            nic=env.get(SOCKET_IFNAME_VARS[0], ""),
        )


def node_defaults(env: Mapping[str, str], dev: str = "/dev") -> Dict[str, str]:
    """What a node adds to a process's variables ``env`` from what only it knows: a trainer with a collective
    side (``PADDLE_TRAINER_ENDPOINTS``) on a node without an NVIDIA GPU gets ``PADDLE_DISTRI_BACKEND=gloo``,
    what ``paddle.distributed.launch`` sets there (without it Paddle's ``init_parallel_env`` fails on CPU), unless
    ``ENV`` set it."""
    if "PADDLE_TRAINER_ENDPOINTS" not in env or "PADDLE_DISTRI_BACKEND" in env or env.get(ROLE_VAR) == PSERVER:
        return {}
    try:
        gpus = any(re.fullmatch(r"nvidia\d+", n) for n in os.listdir(dev))
    except OSError:
        gpus = False
    hidden = env.get("CUDA_VISIBLE_DEVICES") in ("", "-1")
    return {} if gpus and not hidden else {"PADDLE_DISTRI_BACKEND": "gloo"}


def reserved_env() -> Dict[str, str]:
    """The variables the launcher sets that ``ENV`` must not override (the job would disagree with itself), each
    with the processes that get it: "every pserver and trainer", "each pserver" or "each trainer". Every name
    ``to_environ`` sets, the secret, the trainer keys and ``PADDLE_INTEGRITY`` (``INTEGRITY = False``) included
    (ENV reaches every process: a trainer must never get the job secret); ``ENV`` may set the
    SOCKET_IFNAME_VARS, and ``PADDLE_RESUME`` and ``PADDLE_CHECKPOINT_DIR``, which the launcher sets only when
    resuming."""
    job = JobEnv("x", (Endpoint("h", 1),), 1, trainer_endpoints=(Endpoint("h", 2),), master_port=3, nic="lo",
                 integrity=False, secret="s")
    got = {role: set(job.for_process(role, 0, "h").to_environ()) for role in ROLES}
    free = set(SOCKET_IFNAME_VARS) | {"PYTHONUNBUFFERED"}
    return {name: "every pserver and trainer" if all(name in got[r] for r in ROLES) else
            "each pserver" if name in got[PSERVER] else "each trainer"
            for name in sorted(got[PSERVER] | got[TRAINER]) if name not in free}


def reserved_names() -> frozenset:
    """The names of ``reserved_env``."""
    return frozenset(reserved_env())


def job_id_of(environ: Mapping[str, str]) -> str:
    """The job id an environment carries ("" when none): how the node agent tells a job's processes apart."""
    return environ.get("PADDLE_JOB_ID", "")


def current_ip_of(environ: Mapping[str, str]) -> str:
    """The address a process's environment gives it ("" when none): where the node agent says it is reached."""
    return environ.get("PADDLE_CURRENT_IP", "")


def figures_path(job_dir: str, name: str) -> str:
    """Where process ``name`` of a job (its record's name: ``trainer.0``, ``pserver.1``) writes its own figures
    for ``paddle-cluster top`` (``ps.counters``) and the node's ``top`` reads them."""
    return os.path.join(job_dir, "log", f"figures.{name}.json")


JOB_NAME_MAX = 100
_JOB_NAME_RE = re.compile(r"[A-Za-z0-9_.-]+")


def check_job_name(name: str) -> str:
    """``name`` if it is a plain directory name (letters, digits, ``-_.``; no leading dot; at most
    JOB_NAME_MAX characters), else a ContractError saying what is wrong: it becomes ``ROOT_DIR/<name>``."""
    if not name or len(name) > JOB_NAME_MAX or not _JOB_NAME_RE.fullmatch(name):
        raise ContractError(f"job name {name!r}: use 1 to {JOB_NAME_MAX} letters, digits, '-', '_' or '.'")
    if name.startswith("."):
        raise ContractError(f"job name {name!r}: must not start with '.' (it names a directory under ROOT_DIR)")
    return name


@dataclass(frozen=True)
class ProcessEnv:
    """The variables a process reads that need no pserver endpoints: its job directory and trainer id (a
    trainer's metrics files) and a pserver's frame cap and log level. Companion of ``JobEnv``."""

    job_dir: str = ""
    trainer_id: Optional[int] = None
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    log_level: str = "INFO"
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    # Bytes a pserver may hold (dense blocks, table rows, buffers); 0 = its share of the node's memory.
    pserver_memory: int = 0
    # Accept NaN/Inf gradients (refused by default: one bad trainer would poison every trainer's parameters).
    allow_nonfinite: bool = False

    def __post_init__(self) -> None:
        if self.pserver_memory < 0:
            raise ContractError(f"PADDLE_PSERVER_MEMORY={self.pserver_memory}: must be a number of bytes, or 0")
        if self.trainer_id is not None and self.trainer_id < 0:
            raise ContractError(f"PADDLE_TRAINER_ID={self.trainer_id}: must be 0 or more")
        if self.max_frame_bytes < 1:
            raise ContractError(f"PADDLE_MAX_FRAME_BYTES={self.max_frame_bytes}: must be a positive number of bytes")
        if self.max_connections < 1:
            raise ContractError(f"PADDLE_MAX_CONNECTIONS={self.max_connections}: must be at least 1")

    def to_environ(self) -> Dict[str, str]:
        env = {"PADDLE_JOB_DIR": self.job_dir, "PADDLE_MAX_FRAME_BYTES": str(self.max_frame_bytes),
               "PADDLE_LOG_LEVEL": self.log_level, "PADDLE_MAX_CONNECTIONS": str(self.max_connections)}
        env.update({"PADDLE_PSERVER_MEMORY": str(self.pserver_memory)} if self.pserver_memory else {})
        env.update({"PADDLE_ALLOW_NONFINITE": "1"} if self.allow_nonfinite else {})
        if self.trainer_id is not None:
            env["PADDLE_TRAINER_ID"] = str(self.trainer_id)
        return env

    @classmethod
    def from_environ(cls, environ: Optional[Mapping[str, str]] = None) -> ProcessEnv:
        """From ``environ`` (default ``os.environ``); unset variables take their defaults."""
        env = os.environ if environ is None else environ
        frame = _int(env, "PADDLE_MAX_FRAME_BYTES")
        conns = _int(env, "PADDLE_MAX_CONNECTIONS")
        return cls(job_dir=env.get("PADDLE_JOB_DIR", ""),
                   trainer_id=_int(env, "PADDLE_TRAINER_ID", "PADDLE_INIT_TRAINER_ID"),
                   max_frame_bytes=DEFAULT_MAX_FRAME_BYTES if frame is None else frame,
                   log_level=env.get("PADDLE_LOG_LEVEL") or "INFO",
                   max_connections=DEFAULT_MAX_CONNECTIONS if conns is None else conns,
                   pserver_memory=_size(env, "PADDLE_PSERVER_MEMORY"),
                   allow_nonfinite=_bool(env, "PADDLE_ALLOW_NONFINITE", False))


def _int(env: Mapping[str, str], *names: str) -> Optional[int]:
    """The first of ``names`` that is set, as an integer; None if none is."""
    for name in names:
        text = env.get(name)
        if text is None or text == "":
            continue
        try:
            return int(text)
        except ValueError:
            raise ContractError(f"{name}={text!r}: expected an integer") from None
    return None


_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def _size(env: Mapping[str, str], name: str) -> int:
    """A byte count: ``1073741824``, ``512M``, ``8G`` (binary units, an optional ``B``/``iB``); 0 when unset."""
    text = (env.get(name) or "").strip()
    m = re.fullmatch(r"(\d+)\s*([KMGT]?)(?:I?B)?", text.upper())
    if not text:
        return 0
    if m is None:
        raise ContractError(f"{name}={text!r}: expected a number of bytes, e.g. 8G, 512M or 1073741824")
    return int(m.group(1)) * _UNITS[m.group(2)]


def _bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    text = (env.get(name) or "").strip().lower()
    if not text:
        return default
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ContractError(f"{name}={env.get(name)!r}: expected 1 or 0")


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    text = env.get(name)
    if text is None or text == "":
        return default
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise ContractError(f"{name}={text!r}: expected a positive number of seconds")
    return value


def init_flags(environ: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """The v2 ``PADDLE_INIT_<FLAG>`` variables as ``{"flag": value}``, the way ``paddle.init`` read them."""
    env = os.environ if environ is None else environ
    return {k[len("PADDLE_INIT_"):].lower(): v for k, v in env.items() if k.startswith("PADDLE_INIT_") and v != ""}


# The v2 options (``paddle.py`` / ``paddle_trainer`` flags) a job may pass after its workspace, each setting
# ``PADDLE_INIT_<OPTION>``: integers, booleans ("1"/"0") and paths. The port options change the job's port model
# (they are PADDLE_PORT / PADDLE_PORTS_NUM / PADDLE_PORTS_NUM_FOR_SPARSE); the ones the launcher derives per job
# (pservers, num_gradient_servers, trainer_id) cannot be given.
V2_INT_OPTIONS = ("trainer_count", "num_passes", "saving_period", "log_period", "dot_period", "test_period")
V2_BOOL_OPTIONS = ("use_gpu", "local")
V2_INIT_OPTIONS = V2_INT_OPTIONS + V2_BOOL_OPTIONS + ("save_dir",)
V2_PORT_OPTIONS = ("port", "ports_num", "ports_num_for_sparse")
V2_DERIVED_OPTIONS = ("pservers", "num_gradient_servers", "trainer_id")


def v2_options(args: Sequence[str]) -> Dict[str, str]:
    """The v2 options among a job's arguments (``--trainer_count=4`` or ``--trainer_count 4``; a boolean alone
    means true), validated, as ``{"trainer_count": "4"}``; other arguments are not looked at."""
    out: Dict[str, str] = {}
    known = V2_INIT_OPTIONS + V2_PORT_OPTIONS
    for i, arg in enumerate(args):
        name, eq, value = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        if name in V2_DERIVED_OPTIONS:
            raise ContractError(f"{arg}: the launcher sets PADDLE_INIT_{name.upper()} for every process; remove "
                                "the option (list the machines in HOSTS instead)")
        if name not in known:
            continue
        if not eq:
            nxt = args[i + 1] if i + 1 < len(args) else None
            value = nxt if nxt is not None and not nxt.startswith("--") else ("1" if name in V2_BOOL_OPTIONS else "")
        out[name] = _v2_value(name, value)
    return out


def _v2_value(name: str, value: str) -> str:
    text = value.strip()
    if name in V2_BOOL_OPTIONS:
        low = text.lower()
        if low in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            return "1" if low in ("1", "true", "yes", "on") else "0"
        raise ContractError(f"--{name}={value}: expected true or false (1 or 0)")
    if name in V2_INT_OPTIONS + V2_PORT_OPTIONS:
        if not (text.isascii() and text.isdigit()):
            raise ContractError(f"--{name}={value}: expected a whole number, e.g. --{name}=2")
        return str(int(text))
    if not text:
        raise ContractError(f"--{name}: give a value, e.g. --{name}=output")
    return text


def with_init_flags(flags: Mapping[str, object], environ: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """A copy of ``environ`` in which each ``paddle.init`` keyword replaces its ``PADDLE_INIT_<FLAG>``."""
    env = dict(os.environ if environ is None else environ)
    env.update({f"PADDLE_INIT_{k.upper()}": str(v) for k, v in flags.items()})
    return env


def dataset_home(environ: Optional[Mapping[str, str]] = None) -> str:
    """Where ``paddle.dataset`` readers cache their files: ``$PADDLE_DATA_HOME`` when set, else PaddlePaddle's
    ``~/.cache/paddle/dataset`` (PaddlePaddle itself had no variable for it), or the same under the temporary
    directory where the home directory is not writable."""
    env = os.environ if environ is None else environ
    if env.get("PADDLE_DATA_HOME"):
        return env["PADDLE_DATA_HOME"]
    home = os.path.expanduser("~")
    return os.path.join(home if os.access(home, os.W_OK) else tempfile.gettempdir(), ".cache", "paddle", "dataset")
