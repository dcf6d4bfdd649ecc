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
import math
import os
import select
import sys
import termios
import time
import tty
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple

from . import journal, nodecmd
from .access import nodes_with_lib
from .config import ClusterConfig
from .each_node import each_node
from .errors import JOB_NAME_FIX, ClusterError
from .shown import printable

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
    mode: Optional[str] = None  # a trainer's: "sync" or "async", as its client says
    bad: bool = False  # it ended badly (red)
    stalled: bool = False  # running, and not advanced for STALL_S (yellow)
    malformed: List[str] = field(default_factory=list)  # figures that were there but not of their kind

    @property
    def index(self) -> int:
        tail = self.name.rpartition(".")[2]
        return int(tail) if tail.isdigit() else 0


@dataclass
class Snapshot:
    job: str
    age_s: Optional[float]
    steps_per_s: Optional[float]  # the job's: sync, the rate every trainer shares; async, the trainers' sum
    samples_per_s: Optional[float]  # the trainers' sum
    slowest: Optional[str]  # the trainer the others wait for (see ``slowest``)
    outcome: Optional[Dict[str, Any]]  # how the job ended, as ``run`` recorded it; None while it runs
    rows: List[Row]
    notes: List[str] = field(default_factory=list)  # nodes that could not be read, figures not of their kind
    rate: str = ""  # how ``steps_per_s`` is made: "sync" (shared), "async" (summed), "sum" (mode not said)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, default=str)


def _num(x: Any) -> Optional[float]:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def _int(x: Any) -> Optional[int]:
    return x if isinstance(x, int) and not isinstance(x, bool) else None


class _Reader:
    """Figures of one process as a job's files gave them (any JSON, or none): each taken only when it is of its
    kind; one present but of another kind is noted (``bad``), so its row shows what is missing."""

    def __init__(self, doc: Any, what: str, bad: List[str]) -> None:
        self.bad, self.what = bad, what
        if doc is not None and not isinstance(doc, dict):
            bad.append(f"{what} is {type(doc).__name__}, not an object")
        self.doc: Dict[str, Any] = doc if isinstance(doc, dict) else {}

    def get(self, key: str, kind: Callable[[Any], Any] = _num) -> Any:
        v = self.doc.get(key)
        got = kind(v)
        if v is not None and got is None:
            self.bad.append(f"{self.what} {key} = {printable(json.dumps(v, default=str))[:40]}")
        return got


def _text(x: Any) -> Optional[str]:
    return x if isinstance(x, str) else None


def make_row(nd: NodeDoc, p: Any, now: float) -> Row:
    """A process's row from its node's answer (``now``: that node's clock). Nothing in it is trusted to be of its
    kind: the processes' own figures and metrics are files the job writes."""
    bad: List[str] = []
    rec = _Reader(p, "record", bad)
    fig, met = _Reader(rec.doc.get("figures"), "figures", bad), _Reader(rec.doc.get("metrics"), "metrics", bad)
    name, role = rec.get("name", _text) or "?", (rec.get("role", _text) or "?").lower()
    state = rec.get("state", _text) or "unknown"
    step = fig.get("step", _int)
    r = Row(nd.node, nd.host, name, role, state, step=step if step is not None else met.get("step", _int))
    age = rec.get("age")
    fresh = age is not None and age < 5 and state == "running"  # rates of a live writer only
    if fresh:
        r.steps_per_s, r.sent_per_s = fig.get("steps_per_s"), fig.get("sent_per_s")
        r.received_per_s, r.ps_share = fig.get("received_per_s"), fig.get("ps_share")
        r.wait_p50, r.wait_p99 = fig.get("wait_p50"), fig.get("wait_p99")
    r.rows, r.held, r.budget = fig.get("rows", _int), fig.get("held", _int), fig.get("budget", _int)
    r.mode = fig.get("mode", lambda v: v if v in ("sync", "async") else None)
    r.loss = met.get("loss")
    samples = met.get("samples_per_s")
    r.samples_per_s = samples if state == "running" else None
    r.metrics = {printable(k): v for k, v in met.doc.items() if k not in _NOT_METRICS and _num(v) is not None}
    r.cpu, r.rss = rec.get("cpu"), rec.get("rss", _int)
    advanced = fig.get("advanced_at")
    if advanced is not None:
        r.still_s = max(0.0, now - advanced)
    # Ended badly: a non-zero exit, a signal, or gone unrecorded; not one stopped by the launcher or kill, not a
    # pod still pending, not a Slurm process whose agent's figures are late.
    r.bad = state.startswith(("exited", "killed", "gone")) and state != "exited 0"
    r.stalled = state == "running" and r.role == "trainer" and r.still_s is not None and r.still_s > STALL_S
    r.malformed = bad
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


def job_rate(trainers: Sequence[Row]) -> Tuple[Optional[float], str]:
    """The job's steps per second and how it is made. Sync: every trainer makes the same steps, so the job's rate
    is the one they share (their median: one that has just slowed does not set it); async: each trainer steps on
    its own, so the sum; a client that does not say its mode: the sum, called so."""
    rates = sorted(r.steps_per_s for r in trainers if r.steps_per_s is not None)
    if not rates:
        return None, ""
    modes = {r.mode for r in trainers if r.steps_per_s is not None}
    if modes == {"sync"}:
        return rates[len(rates) // 2], "sync"
    return sum(rates), "async" if modes == {"async"} else "sum"


def snapshot(cfg: ClusterConfig, job_name: str, source: Source) -> Snapshot:
    rows: List[Row] = []
    notes: List[str] = []
    starts: List[float] = []
    for nd in source.read():
        if nd.error:
            notes.append(printable(f"{nd.node} ({nd.host}): {nd.error}"))
            continue
        doc = nd.doc if isinstance(nd.doc, dict) else {}
        now = _num(doc.get("time")) or time.time()
        procs = doc.get("procs") if isinstance(doc.get("procs"), list) else []
        for p in procs:
            if not isinstance(p, dict):  # not a process record: said, not drawn
                notes.append(f"{printable(nd.node)}: a process record that is {type(p).__name__}, not an object")
                continue
            row = make_row(nd, p, now)
            rows.append(row)
            if row.malformed:
                notes.append(f"{printable(row.name)} ({printable(nd.node)}): figures not of their kind, shown as "
                             f"missing: {'; '.join(row.malformed)}")
            started = _num(p.get("started_at"))
            if started is not None:
                starts.append(now - started)
    rows.sort(key=lambda r: (r.role != "pserver", r.index))
    trainers = [r for r in rows if r.role == "trainer" and r.state == "running"]
    samples = [r.samples_per_s for r in trainers if r.samples_per_s is not None]
    if not rows and not notes:
        raise ClusterError(f"job {job_name} has no recorded processes under {cfg.job_dir(job_name)} on any node; "
                           f"{JOB_NAME_FIX}")
    rate, how = job_rate(trainers)
    return Snapshot(job_name, max(starts) if starts else None, rate, sum(samples) if samples else None,
                    slowest(rows), journal.outcome(cfg, job_name), rows, notes, how)


# -- drawing ---------------------------------------------------------------------------------------------------

SORTS = {"n": ("name", lambda r: (r.role != "pserver", r.index)), "c": ("cpu", lambda r: -(r.cpu or 0)),
         "m": ("rss", lambda r: -(r.rss or 0)), "s": ("step", lambda r: (r.step is None, r.step or 0)),
         "w": ("node", lambda r: (r.node, r.role != "pserver", r.index))}


def size(n: Optional[float]) -> str:
    """Bytes for reading: ``36.9M``, ``512``."""
    if n is None:
        return "-"
    for unit, shift in (("T", 40), ("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f}{unit}"
    return f"{n:.0f}"


def count(x: Optional[float]) -> str:
    """A rate or count for reading: ``1.1k``, ``36.9M``, ``3.3``, ``0.25``; never ``1.14e+03``."""
    if x is None:
        return "-"
    a = abs(x)
    for unit, at in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if a >= at * 0.9995:
            return f"{x / at:.1f}{unit}"
    if a >= 100 or x == int(x):
        return f"{x:.0f}"
    return f"{x:.2g}" if a < 1 else f"{x:.1f}"


def value(x: Optional[float]) -> str:
    """A loss or metric: four significant digits, large ones as ``count`` does."""
    if x is None:
        return "-"
    return count(x) if abs(x) >= 1e4 else f"{x:.4g}"


def _ms(x: Optional[float]) -> str:
    return "-" if x is None else f"{x * 1000:.0f}ms"


def _dur(s: Optional[float]) -> str:
    if s is None:
        return "-"
    s = int(s)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


RATE_LABEL = {"sync": "steps/s (sync: every trainer's)", "async": "steps/s (async: the trainers' sum)",
              "sum": "steps/s (the trainers' sum)", "": "steps/s"}


def header(s: Snapshot) -> str:
    how = (f"{s.outcome.get('outcome')} (exit {s.outcome.get('exit_code')})" if s.outcome else
           "running" if any(r.state == "running" for r in s.rows) else "ended")
    parts = [f"job {s.job}: {printable(how)}", f"age {_dur(s.age_s)}", f"{count(s.steps_per_s)} {RATE_LABEL[s.rate]}"]
    if s.samples_per_s is not None:
        parts.append(f"{count(s.samples_per_s)} samples/s (sum)")
    parts.append(f"slowest {s.slowest}" if s.slowest else "slowest -")
    return "  ".join(parts)


@dataclass(frozen=True)
class Column:
    """A column of the frame: its heading, its cell of a row, and its rank (0 is kept longest: when the terminal
    is too narrow, the column of the highest rank goes first, whole; node and process never go)."""

    title: str
    rank: int
    cell: Callable[[Row], str]
    right: bool = False  # numbers: aligned right


def _pserver(r: Row, text: str) -> str:
    return text if r.role == "pserver" else "-"


def _state(r: Row) -> str:
    return r.state.split(" (")[0]  # "unknown (its agent's figures are old or missing)": its first words


COLUMNS = (
    Column("node", 0, lambda r: r.node),
    Column("process", 0, lambda r: r.name),
    Column("state", 1, _state),
    Column("step", 2, lambda r: "-" if r.step is None else str(r.step), True),
    Column("steps/s", 3, lambda r: count(r.steps_per_s), True),
    Column("loss", 4, lambda r: value(r.loss), True),
    Column("cpu%", 5, lambda r: "-" if r.cpu is None else f"{r.cpu:.0f}", True),
    Column("rss", 6, lambda r: size(r.rss), True),
    Column("in ps", 7, lambda r: "-" if r.ps_share is None else f"{r.ps_share:.0%}", True),
    Column("held/budget", 8, lambda r: _pserver(r, f"{size(r.held)}/{size(r.budget)}" if r.budget else "-")),
    Column("sent/s", 9, lambda r: size(r.sent_per_s), True),
    Column("recv/s", 10, lambda r: size(r.received_per_s), True),
    Column("metrics", 11, lambda r: " ".join(f"{k}={value(v)}" for k, v in sorted(r.metrics.items())) or "-"),
    Column("rows", 12, lambda r: _pserver(r, count(r.rows) if r.rows is not None else "-"), True),
    Column("wait p50/p99", 13, lambda r: _pserver(r, f"{_ms(r.wait_p50)}/{_ms(r.wait_p99)}"
                                                  if r.wait_p50 is not None else "-")),
)
GAP = 2  # between two columns: a cell's right padding and the table's column divider


def fitting(rows: Sequence[Row], width: int) -> Tuple[List[Column], List[List[str]]]:
    """The columns that fit ``width`` whole, taken by rank (one too wide for what is left is dropped, whole; a
    narrower one of a higher rank may still fit), in their order, and each row's cells of them."""
    from rich.cells import cell_len

    cells = [[printable(c.cell(r)) for c in COLUMNS] for r in rows]
    widths = [max([cell_len(c.title), *(cell_len(row[i]) for row in cells)]) for i, c in enumerate(COLUMNS)]
    kept: List[int] = []
    used = -GAP
    for i in sorted(range(len(COLUMNS)), key=lambda k: COLUMNS[k].rank):  # a wide one skipped, narrower ones kept
        if COLUMNS[i].rank == 0 or used + GAP + widths[i] <= width:
            kept.append(i)
            used += GAP + widths[i]
    kept.sort()
    return [COLUMNS[k] for k in kept], [[row[k] for k in kept] for row in cells]


def frame(s: Snapshot, sort: str = "n", only: str = "", width: int = 200) -> Any:
    """The frame as a rich renderable ``width`` columns wide: the header, a row per process shown (``only``: a
    role or a node), the columns that fit whole. Everything the job wrote is shown as text (``shown``)."""
    from rich import box
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    key = SORTS.get(sort, SORTS["n"])
    rows = sorted((r for r in s.rows if not only or only in (r.role, r.node)), key=key[1])
    cols, cells = fitting(rows, width)
    t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1, 0, 0))
    for c in cols:
        t.add_column(c.title, no_wrap=True, overflow="fold", justify="right" if c.right else "left")
    for r, row in zip(rows, cells):
        t.add_row(*(Text(c) for c in row), style="red" if r.bad else "yellow" if r.stalled else None)
    parts: List[Any] = [Text(header(s), style="bold")]
    if s.outcome and s.outcome.get("message"):
        parts.append(Text(printable(s.outcome["message"])))
    parts += [Text(n, style="red") for n in s.notes]
    parts.append(t)
    dropped = [c.title for c in COLUMNS if c not in cols]
    filt = f" only {only}" if only else ""
    more = f"  (wider for: {', '.join(dropped)})" if dropped else ""
    parts.append(Text(f"sort: {key[0]}{filt}   keys: n c m s w sort  t trainers  p pservers  0-9 node  a all  "
                      f"q quit (the job goes on){more}", style="dim"))
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
        with Live(frame(s, sort, only, console.width), console=console, screen=True, auto_refresh=False) as live:
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
                live.update(frame(s, sort, only, console.width), refresh=True)
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

    console = Console(width=200 if not sys.stdout.isatty() else None)
    console.print(frame(s, width=console.width))


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
