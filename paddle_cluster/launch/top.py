"""``paddle-cluster top``: a live view of a running job, one row per process, from the figures its nodes keep.

Each node's agent writes the CPU % and RSS of its processes, and each process its own counters (``node/top.py``,
``ps/counters.py``); a backend's ``figures`` source reads them per node once a frame: ``HostsSource`` (``node
top`` on the hosts of HOSTS, as ``status`` reaches them), ``DirsSource`` (Slurm: the nodes' directories on the
shared filesystem), ``CallSource`` (Kubernetes: the pods' logs, where each pod's entry point writes them).
``snapshot`` makes one ``Snapshot`` of them; ``frame`` draws it as a rich table; ``view`` is the full-screen
loop with its keys.
"""

from __future__ import annotations

import json
import os
import select
import sys
import termios
import time
import tty
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence

from . import journal, nodecmd
from .access import nodes_with_lib
from .config import ClusterConfig
from .each_node import each_node
from .errors import JOB_NAME_FIX, ClusterError

STALL_S = 10.0  # a running process whose step has not moved for this long is shown yellow
_NOT_METRICS = {"pass", "step", "loss", "samples_per_s", "time", "trainer", "samples"}


@dataclass(frozen=True)
class NodeDoc:
    """What one node's ``node top`` answered (``error``: why it could not be read)."""

    node: str
    host: str
    doc: Dict[str, Any]
    error: str = ""


class Source(Protocol):
    """A job's figures per node, read again each frame; ``close`` when done."""

    def read(self) -> List[NodeDoc]: ...

    def close(self) -> None: ...


class HostsSource:
    """The nodes of HOSTS (ssh, local, mpi): one connection each, opened once, ``node top`` on it per frame."""

    def __init__(self, cfg: ClusterConfig, job_name: str) -> None:
        self.nodes, self.lib, _ = nodes_with_lib(cfg)
        self.job_dir = cfg.job_dir(job_name)

    def read(self) -> List[NodeDoc]:
        res = each_node(self.nodes, lambda n: nodecmd.agent_json(n, self.lib, "top", "--job-dir", self.job_dir,
                                                               what="reading the job's figures", timeout=30))
        return [NodeDoc(n.name, n.spec.text, res.values.get(n.index, {}),
                        str(res.errors[n.index]) if n.index in res.errors else "") for n in self.nodes]

    def close(self) -> None:
        each_node(self.nodes, lambda n: n.close())


class DirsSource:
    """Node job directories this machine reads itself, whose processes run elsewhere (a Slurm job's on the
    shared filesystem): ``dirs()`` gives ``{node: directory}`` each frame (a node's may appear later)."""

    def __init__(self, dirs: Callable[[], Dict[str, str]], host: str = "") -> None:
        self.dirs, self.host = dirs, host

    def read(self) -> List[NodeDoc]:
        from paddle_cluster.node import top as node_top

        return [NodeDoc(node, self.host, node_top.snapshot(d, here=False)) for node, d in self.dirs().items()]

    def close(self) -> None:
        pass


class CallSource:
    """Figures a backend reads its own way each frame (Kubernetes: from its pods' logs)."""

    def __init__(self, nodes: Callable[[], List[NodeDoc]]) -> None:
        self.nodes = nodes

    def read(self) -> List[NodeDoc]:
        return self.nodes()

    def close(self) -> None:
        pass


@dataclass
class Row:
    """One process in a frame. Rates are over the last second as the process or its agent measured them;
    None where a figure is not known (a process not using the native client has no traffic figures)."""

    node: str
    host: str
    name: str
    role: str
    state: str
    step: Optional[int] = None
    steps_per_s: Optional[float] = None
    loss: Optional[float] = None
    metrics: Dict[str, float] = field(default_factory=dict)
    samples_per_s: Optional[float] = None
    cpu: Optional[float] = None  # percent of one core, the process with its descendants
    rss: Optional[int] = None  # bytes
    sent_per_s: Optional[float] = None
    received_per_s: Optional[float] = None
    ps_share: Optional[float] = None  # a trainer's share of the last second spent in pserver calls
    rows: Optional[int] = None  # a pserver's table rows
    held: Optional[int] = None  # bytes a pserver holds against ``budget``
    budget: Optional[int] = None
    wait_p50: Optional[float] = None  # a pserver's barrier waits over the last second, seconds
    wait_p99: Optional[float] = None
    still_s: Optional[float] = None  # seconds since its step last moved
    bad: bool = False  # it ended badly (red)
    stalled: bool = False  # running, and not advanced for STALL_S (yellow)

    @property
    def index(self) -> int:
        tail = self.name.rpartition(".")[2]
        return int(tail) if tail.isdigit() else 0


@dataclass
class Snapshot:
    job: str
    age_s: Optional[float]
    steps_per_s: Optional[float]  # the trainers' together
    samples_per_s: Optional[float]
    slowest: Optional[str]  # the trainer the others wait for (see ``slowest``)
    outcome: Optional[Dict[str, Any]]  # how the job ended, as ``run`` recorded it; None while it runs
    rows: List[Row]
    notes: List[str] = field(default_factory=list)  # nodes that could not be read

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, default=str)


def _num(x: Any) -> Optional[float]:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def make_row(nd: NodeDoc, p: Dict[str, Any], now: float) -> Row:
    """A process's row from its node's answer (``now``: that node's clock)."""
    fig = p.get("figures") or {}
    met = p.get("metrics") or {}
    state = p["state"]
    step = fig.get("step") if isinstance(fig.get("step"), int) else met.get("step")
    r = Row(nd.node, nd.host, p["name"], p["role"].lower(), state, step=step if isinstance(step, int) else None)
    fresh = p.get("age") is not None and p["age"] < 5 and state == "running"  # rates of a live writer only
    if fresh:
        r.steps_per_s, r.sent_per_s = _num(fig.get("steps_per_s")), _num(fig.get("sent_per_s"))
        r.received_per_s, r.ps_share = _num(fig.get("received_per_s")), _num(fig.get("ps_share"))
        r.wait_p50, r.wait_p99 = _num(fig.get("wait_p50")), _num(fig.get("wait_p99"))
    r.rows, r.held, r.budget = fig.get("rows"), fig.get("held"), fig.get("budget")
    r.loss = _num(met.get("loss"))
    r.samples_per_s = _num(met.get("samples_per_s")) if state == "running" else None
    r.metrics = {k: v for k, v in met.items() if k not in _NOT_METRICS and _num(v) is not None}
    r.cpu, r.rss = _num(p.get("cpu")), p.get("rss")
    if "advanced_at" in fig:
        r.still_s = max(0.0, now - fig["advanced_at"])
    # Ended badly: a non-zero exit, a signal, or gone unrecorded; not one stopped by the launcher or kill, not a
    # pod still pending, not a Slurm process whose agent's figures are late.
    r.bad = state.startswith(("exited", "killed", "gone")) and state != "exited 0"
    r.stalled = state == "running" and r.role == "trainer" and r.still_s is not None and r.still_s > STALL_S
    return r


def slowest(rows: Sequence[Row]) -> Optional[str]:
    """The running trainer the job waits for: the one spending the most time outside pserver calls per step
    (in sync mode every trainer makes the same steps/s, and the slow one is the one the others wait for); a
    trainer without that figure compared by its step. None with fewer than two."""
    ts = [r for r in rows if r.role == "trainer" and r.state == "running"]
    if len(ts) < 2:
        return None
    timed = [r for r in ts if r.ps_share is not None and r.steps_per_s]
    if len(timed) == len(ts):
        return max(timed, key=lambda r: (1 - r.ps_share) / r.steps_per_s).name  # type: ignore[operator]
    stepped = [r for r in ts if r.step is not None]
    if len({r.step for r in stepped}) < 2:  # none behind (a job that holds, or has not stepped yet)
        return None
    return min(stepped, key=lambda r: r.step).name  # type: ignore[arg-type,return-value]


def snapshot(cfg: ClusterConfig, job_name: str, source: Source) -> Snapshot:
    rows: List[Row] = []
    notes: List[str] = []
    starts: List[float] = []
    for nd in source.read():
        if nd.error:
            notes.append(f"{nd.node} ({nd.host}): {nd.error}")
            continue
        now = nd.doc.get("time", time.time())
        for p in nd.doc.get("procs", []):
            rows.append(make_row(nd, p, now))
            if isinstance(p.get("started_at"), (int, float)):
                starts.append(now - p["started_at"])
    rows.sort(key=lambda r: (r.role != "pserver", r.index))
    trainers = [r for r in rows if r.role == "trainer" and r.state == "running"]
    rates = [r.steps_per_s for r in trainers if r.steps_per_s is not None]
    samples = [r.samples_per_s for r in trainers if r.samples_per_s is not None]
    if not rows and not notes:
        raise ClusterError(f"job {job_name} has no recorded processes under {cfg.job_dir(job_name)} on any node; "
                           f"{JOB_NAME_FIX}")
    return Snapshot(job_name, max(starts) if starts else None, sum(rates) if rates else None,
                    sum(samples) if samples else None, slowest(rows), journal.outcome(cfg, job_name), rows, notes)


# -- drawing ---------------------------------------------------------------------------------------------------

SORTS = {"n": ("name", lambda r: (r.role != "pserver", r.index)), "c": ("cpu", lambda r: -(r.cpu or 0)),
         "m": ("rss", lambda r: -(r.rss or 0)), "s": ("step", lambda r: (r.step is None, r.step or 0)),
         "w": ("node", lambda r: (r.node, r.role != "pserver", r.index))}


def _b(n: Optional[float]) -> str:
    if n is None:
        return "-"
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f}{unit}"
    return f"{n:.0f}"


def _f(x: Optional[float], fmt: str = ".3g") -> str:
    return "-" if x is None else format(x, fmt)


def _ms(x: Optional[float]) -> str:
    return "-" if x is None else f"{x * 1000:.0f}ms"


def _dur(s: Optional[float]) -> str:
    if s is None:
        return "-"
    s = int(s)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def header(s: Snapshot) -> str:
    how = (f"{s.outcome.get('outcome')} (exit {s.outcome.get('exit_code')})" if s.outcome else
           "running" if any(r.state == "running" for r in s.rows) else "ended")
    parts = [f"job {s.job}: {how}", f"age {_dur(s.age_s)}", f"{_f(s.steps_per_s)} steps/s"]
    if s.samples_per_s is not None:
        parts.append(f"{_f(s.samples_per_s)} samples/s")
    parts.append(f"slowest {s.slowest}" if s.slowest else "slowest -")
    return "  ".join(parts)


COLUMNS = ("node", "process", "state", "step", "steps/s", "loss", "metrics", "cpu%", "rss", "sent/s", "recv/s",
           "in ps", "rows", "held/budget", "wait p50/p99")


def cells(r: Row) -> List[str]:
    mets = " ".join(f"{k}={v:.4g}" for k, v in sorted(r.metrics.items()))
    ps = r.role == "pserver"
    return [r.node, r.name, r.state, _f(r.step, "d") if r.step is not None else "-", _f(r.steps_per_s),
            _f(r.loss, ".4g"), mets or "-", _f(r.cpu, ".0f"), _b(r.rss), _b(r.sent_per_s), _b(r.received_per_s),
            "-" if r.ps_share is None else f"{r.ps_share:.0%}", _f(r.rows, "d") if ps and r.rows is not None else "-",
            f"{_b(r.held)}/{_b(r.budget)}" if ps and r.budget else "-",
            f"{_ms(r.wait_p50)}/{_ms(r.wait_p99)}" if ps and r.wait_p50 is not None else "-"]


def frame(s: Snapshot, sort: str = "n", only: str = "", width: Optional[int] = None) -> Any:
    """The frame as a rich renderable: the header, a row per process shown (``only``: a role or a node)."""
    from rich import box
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    key = SORTS.get(sort, SORTS["n"])
    rows = [r for r in s.rows if not only or only in (r.role, r.node)]
    t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1, 0, 0), width=width)
    for c in COLUMNS:
        t.add_column(c, no_wrap=c != "metrics", overflow="fold")
    for r in sorted(rows, key=key[1]):
        t.add_row(*cells(r), style="red" if r.bad else "yellow" if r.stalled else None)
    parts: List[Any] = [Text(header(s), style="bold")]
    if s.outcome and s.outcome.get("message"):
        parts.append(Text(str(s.outcome["message"])))
    parts += [Text(n, style="red") for n in s.notes]
    parts.append(t)
    filt = f" only {only}" if only else ""
    parts.append(Text(f"sort: {key[0]}{filt}   keys: n c m s w sort  t trainers  p pservers  0-9 node  a all  "
                      "q quit (the job goes on)", style="dim"))
    return Group(*parts)


# -- the full-screen view --------------------------------------------------------------------------------------

def _keys(timeout: float) -> str:
    """What was typed within ``timeout`` s ("" when nothing)."""
    r, _, _ = select.select([sys.stdin], [], [], timeout)
    return os.read(sys.stdin.fileno(), 64).decode(errors="replace") if r else ""


def view(cfg: ClusterConfig, job_name: str, source: Source, interval: float = 1.0) -> None:
    """Redraw a frame every ``interval`` s (and at once on a key) until ``q`` or Ctrl+C; it only reads, so
    leaving never touches the job. A job that ended stays shown, with its outcome, until ``q``."""
    from rich.console import Console
    from rich.live import Live

    console = Console()
    sort, only = "n", ""
    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd) if os.isatty(fd) else None
    try:
        if saved is not None:
            tty.setcbreak(fd)  # keys without Enter; Ctrl+C still raises KeyboardInterrupt
        s = snapshot(cfg, job_name, source)
        with Live(frame(s, sort, only), console=console, screen=True, auto_refresh=False) as live:
            next_read = time.monotonic() + interval
            while True:
                typed = _keys(max(0.0, next_read - time.monotonic()))
                for ch in typed:
                    if ch in "qQ":
                        return
                    if ch in SORTS:
                        sort = ch
                    elif ch in "tp":
                        only = {"t": "trainer", "p": "pserver"}[ch]
                    elif ch.isdigit():
                        only = f"node{ch}"
                    elif ch == "a":
                        only = ""
                if time.monotonic() >= next_read:  # an ended job too: its outcome is recorded after its end
                    try:
                        s = snapshot(cfg, job_name, source)
                    except ClusterError as e:  # its processes gone (Kubernetes deletes the pods): the last frame
                        s = replace(s, outcome=journal.outcome(cfg, job_name), notes=[str(e)])
                    next_read = time.monotonic() + interval
                live.update(frame(s, sort, only), refresh=True)
    except KeyboardInterrupt:
        return
    finally:
        if saved is not None:
            termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def once(cfg: ClusterConfig, job_name: str, source: Source, out: Callable[[str], None], as_json: bool) -> None:
    """One snapshot, as JSON or as a frame printed once (no screen of its own)."""
    s = snapshot(cfg, job_name, source)
    if as_json:
        out(s.to_json())
        return
    from rich.console import Console

    Console(width=200 if not sys.stdout.isatty() else None).print(frame(s))


def run_top(cfg: ClusterConfig, job_name: str, source_of: Callable[[], Source], out: Callable[[str], None],
            once_only: bool, as_json: bool) -> None:
    source = source_of()
    try:
        if once_only or as_json:
            once(cfg, job_name, source, out, as_json)
        else:
            view(cfg, job_name, source)
    finally:
        source.close()
