"""The messages between the launcher and a node agent: typed, frozen, one JSON line each.

Both sides use this one ``encode``/``decode``. The launcher sends a node its share of the job (``Start``
carrying a ``NodePlan``), ``Ping``s while it lives and ``Stop`` at the end; the agent answers with events,
each stamped with its node index, so events of many nodes can share one stream.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Tuple, Type, Union

from paddle_cluster.contract import PSERVER, TRAINER, Endpoint


class MessageError(ValueError):
    """A line that is not a message of this protocol."""


@dataclass(frozen=True)
class ProcPlan:
    """One process: its name (``pserver.0``), role and id, command line, log file name under ``log/``, and
    the per-process part of the environment contract."""

    name: str
    role: str
    index: int
    cmd: str
    log: str
    env: Dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class NodePlan:
    """A node's share of a job: enough for the node to run it alone.

    The agent starts the pservers, waits until every pserver port of the whole job (``endpoints``) accepts
    a connection (within ``start_timeout``), then starts the trainers.
    """

    node: int
    address: str
    job_dir: str
    cwd: str
    environ: Dict[str, str]  # the job-wide contract (no key: keys are per process)
    procs: Tuple[ProcPlan, ...]
    endpoints: Tuple[Endpoint, ...]
    start_timeout: float
    ld_library_path: str = ""
    workspace: str = ""  # --job_workspace: its entries are linked into job_dir, the cwd (node/layout.py)
    # The placeholders this plan holds for values only the nodes learn at run time (``address_placeholder``):
    # the node gives each its value with ``resolve`` before running the plan; none: the plan is run as it is.
    pending: Tuple[str, ...] = ()

    @property
    def pservers(self) -> Tuple[ProcPlan, ...]:
        return tuple(p for p in self.procs if p.role == PSERVER)

    @property
    def trainers(self) -> Tuple[ProcPlan, ...]:
        return tuple(p for p in self.procs if p.role == TRAINER)


def address_placeholder(node: int) -> str:
    """How a plan names node ``node``'s address where only the nodes learn it, once they run (Slurm's allocation:
    each publishes its own, node/bootstrap.py ``rendezvous``)."""
    return f"node{node}.address.pending"


def resolve(plan: NodePlan, values: Mapping[str, str]) -> NodePlan:
    """``plan`` with each of its ``pending`` placeholders given its value in ``values``, wherever the plan holds
    it (address, environment, endpoints): the one way a node completes its plan. ``MessageError`` names a
    placeholder left without a value."""
    missing = [p for p in plan.pending if p not in values]
    if missing:
        raise MessageError(f"node {plan.node}'s plan leaves {missing[0]} to be filled in, and no value was found "
                           "for it")

    def fill(text: str) -> str:
        for p in plan.pending:
            text = text.replace(p, values[p])
        return text

    def env(d: Dict[str, str]) -> Dict[str, str]:
        return {k: fill(v) for k, v in d.items()}

    return dataclasses.replace(
        plan, address=fill(plan.address), environ=env(plan.environ),
        procs=tuple(dataclasses.replace(p, env=env(p.env)) for p in plan.procs),
        endpoints=tuple(Endpoint(fill(e.host), e.port) for e in plan.endpoints), pending=())


# -- launcher -> agent --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Start:
    plan: NodePlan


@dataclass(frozen=True)
class Ping:
    """The launcher is alive (an agent that hears nothing for ORPHAN_TIMEOUT stops the job)."""


@dataclass(frozen=True)
class Stop:
    grace: Optional[float] = None  # seconds between SIGTERM and SIGKILL; None: the agent's own


# -- launcher -> node session (before the agent: node/session.py) -------------------------------------------
@dataclass(frozen=True)
class Go:
    """Say what this node holds of the workspace (nothing is written yet: the launcher may still refuse the job).
    ``token`` (hex) authenticates this dispatch's chain links (node/chain.py)."""

    token: str = ""


@dataclass(frozen=True)
class Fetch:
    """Receive an archive from ``source`` ("launcher": over SSH into the node's FIFO; "chain": from the node
    before it): the workspace archive itself, or with ``base``, a delta (``sha``, ``size``) against the tree of
    that hash. Where it goes on to, the launcher says with ``Forward``, when it knows."""

    source: str
    sha: str = ""
    size: int = 0
    base: str = ""


@dataclass(frozen=True)
class Forward:
    """Pass everything of the archive, what arrived already and what is still to come, to ``to`` (``host:port``
    of the next node's listener); ``to`` "": no node comes after this one."""

    to: str = ""


@dataclass(frozen=True)
class Seal:
    """The SHA-256 of an archive sent while it was made (``Fetch`` without ``sha``), known once its last byte was
    read: what the node checks it received, and the name its tree is kept under."""

    sha: str


@dataclass(frozen=True)
class PlaceWorkspace:
    """Every node has the workspace: put the tree in the cache and the job directory in place."""


@dataclass(frozen=True)
class Abort:
    """Stop receiving (the link into this node could not be made, or the dispatch failed elsewhere)."""

    why: str


# -- agent -> launcher --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Log:
    node: int
    proc: str
    line: str


@dataclass(frozen=True)
class Started:
    node: int
    proc: str
    pid: int


@dataclass(frozen=True)
class Exited:
    node: int
    proc: str
    code: Optional[int]
    signal: Optional[int]
    error: str = ""  # why it could not even start


@dataclass(frozen=True)
class Ready:
    """Every pserver of the job accepts connections; this node starts its trainers."""

    node: int


@dataclass(frozen=True)
class NotReady:
    """This node cannot run its share, so its trainers never start: a pserver of the job did not accept
    connections within START_TIMEOUT or exited first (or, under an engine, the agent could not become a node;
    on Kubernetes, a pod's entry failed). ``why`` says which; the launcher fails the job with it."""

    node: int
    why: str


@dataclass(frozen=True)
class Note:
    """A line from the agent itself (or, on the launcher side, an agent line that is not a message)."""

    node: int
    line: str


@dataclass(frozen=True)
class Heartbeat:
    node: int


@dataclass(frozen=True)
class Stopping:
    """The agent is stopping its processes (their exits follow, then ``Stopped``); ``by_kill``: because
    ``paddle-cluster kill`` asked, so the launcher names that outcome instead of a failure."""

    node: int
    reason: str
    by_kill: bool = False


@dataclass(frozen=True)
class Stopped:
    """The agent stopped every process it started (``killed``: those still running then) and exits."""

    node: int
    reason: str
    killed: Tuple[str, ...] = ()


COMMANDS = (Start, Ping, Stop)
SESSION = (Go, Fetch, Forward, Seal, PlaceWorkspace, Abort)
EVENTS = (Log, Started, Exited, Ready, NotReady, Note, Heartbeat, Stopping, Stopped)
Command = Union[Start, Ping, Stop]
SessionCommand = Union[Go, Fetch, Forward, Seal, PlaceWorkspace, Abort]
Event = Union[Log, Started, Exited, Ready, NotReady, Note, Heartbeat, Stopping, Stopped]
_TYPES: Dict[str, Type[Any]] = {c.__name__: c for c in COMMANDS + SESSION + EVENTS}


def encode(msg: Union[Command, SessionCommand, Event]) -> str:
    """One JSON line (without the newline)."""
    return json.dumps({"type": type(msg).__name__, **dataclasses.asdict(msg)}, separators=(",", ":"))


def decode(line: str) -> Union[Command, SessionCommand, Event]:
    """The message on ``line``; ``MessageError`` names what is wrong with it."""
    try:
        doc = json.loads(line)
        cls = _TYPES[doc.pop("type")]
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        raise MessageError(f"not a message: {line[:200]!r}") from None
    return _build(cls, doc)


def _build(cls: Type[Any], doc: Any) -> Any:
    if not isinstance(doc, dict):
        raise MessageError(f"{cls.__name__}: expected an object, got {doc!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    if not set(doc) <= names:
        raise MessageError(f"{cls.__name__}: unknown field(s) {sorted(set(doc) - names)}")
    try:
        return cls(**{k: _value(hints[k], v) for k, v in doc.items()})
    except TypeError as e:
        raise MessageError(f"{cls.__name__}: {e}") from None


def _value(hint: Any, v: Any) -> Any:
    """``v`` as the field type ``hint`` wants it: nested dataclasses and tuples rebuilt, the rest checked."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return _build(hint, v)
    if origin is Union:  # Optional[X]
        return None if v is None else _value(next(a for a in args if a is not type(None)), v)
    if origin is tuple:
        if not isinstance(v, list):
            raise MessageError(f"expected a list, got {v!r}")
        return tuple(_value(args[0], x) for x in v)
    if origin is dict:
        if not isinstance(v, dict) or not all(isinstance(x, str) for x in (*v.keys(), *v.values())):
            raise MessageError(f"expected an object of strings, got {v!r}")
        return v
    want = {float: (int, float)}.get(hint, hint)
    if not isinstance(v, want) or (isinstance(v, bool) and hint is not bool):
        raise MessageError(f"expected {getattr(hint, '__name__', hint)}, got {v!r}")
    return float(v) if hint is float else v
