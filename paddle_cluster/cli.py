"""``paddle-cluster``: parse the command line, call one function of ``launch``, turn errors into messages."""

from __future__ import annotations

import functools
import logging
import os
import sys
import traceback
import warnings
from typing import Callable, Dict, List, Optional, Tuple, Type

import click

from .contract import ContractError, check_job_name
from .launch import cmdline, journal, preflight
from .launch.backends import (
    REGISTRY,
    backend_class,
    backend_for,
    backend_of,
    declared_conf_keys,
    find_job,
    foreign_options,
    option_owners,
    run_options,
)
from .launch.backends.base import Backend, BackendOption, status_json
from .launch.config import ClusterConfig, load_config, origin_line, override, refuse_line_break
from .launch.entry import PSERVER_CHOICES, job_spec
from .launch.errors import OUTCOMES, ClusterError, ConfigError
from .launch.plan import JobSpec
from .launch.registry import DEFAULT
from .launch.run import render_text, run_job, submit
from .launch.supervise import JobResult


def _say(msg: str) -> None:
    try:
        click.echo(f"paddle-cluster: {msg}", err=True)
    except OSError:  # the terminal is gone (SIGHUP): the command still stops what it started
        pass


def _out(line: str) -> None:
    click.echo(line)


def _warn(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ANN001
    click.echo(f"paddle-cluster: warning: {message}", err=True)


def _handled(fn):
    """A command given the click context (its config); every ClusterError becomes one clean message and its
    exit code, never a bare traceback; so does a returned ``JobResult``."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        warnings.showwarning = _warn
        try:
            result = fn(*args, **kwargs)
        except ClusterError as e:
            _debug_trace(e)
            result = JobResult("", e.exit_code, str(e))
        except KeyboardInterrupt:
            click.echo("paddle-cluster: interrupted", err=True)
            sys.exit(130)
        if isinstance(result, JobResult):
            _say(f"error: {result.message}" if result.is_error else result.message)
            if not result.ok:
                sys.exit(result.exit_code)

    return click.pass_context(wrapper)


def _debug_trace(e: ClusterError) -> None:
    """With ``--debug``, the tracebacks behind a message (every host's, for a fan-out)."""
    ctx = click.get_current_context(silent=True)
    if not (ctx and (ctx.find_root().obj or {}).get("debug")):
        return
    for err in [e, *getattr(e, "failures", {}).values()]:
        click.echo("".join(traceback.format_exception(type(err), err, err.__traceback__)), err=True)


def _config(ctx: click.Context, announce: bool = False) -> ClusterConfig:
    """The config of the command line; with ``announce``, the first line says which (a command about a job)."""
    cfg = load_config(ctx.obj["conf"], keys=declared_conf_keys())
    if announce:
        _say(origin_line(cfg))
    if ctx.obj["accept_new_host_keys"]:
        cfg = override(cfg, {"ssh_accept_new_host_keys": ("--accept-new-host-keys", True)})
    return cfg


def _checked_name(_ctx: click.Context, _param: click.Parameter, value: Optional[str]) -> Optional[str]:
    """``--job_name`` must be a plain directory name: it becomes ``ROOT_DIR/<name>`` on every node."""
    try:
        return None if value is None else check_job_name(value)
    except ContractError as e:
        raise click.BadParameter(str(e)) from None


def _checked_resume(ctx: click.Context, param: click.Parameter, value: Optional[str]) -> Optional[str]:
    """``--resume_from`` is a checkpoint directory (absolute) or an earlier job's name."""
    try:
        refuse_line_break("--resume_from", value)
        return value if value is None or value.startswith("/") else check_job_name(value)
    except ContractError as e:
        raise click.BadParameter(f"{e}; or give an absolute checkpoint directory") from None
    except ConfigError as e:
        raise click.BadParameter(e.fix) from None


class _ScriptArgsCommand(click.Command):
    """A command whose arguments after ``--`` go to the entry script; an option before it must be its own."""

    def parse_args(self, ctx: click.Context, args: list) -> list:
        try:
            return super().parse_args(ctx, list(args))
        except click.NoSuchOption as e:
            names, c = [], ctx
            while c.parent is not None:  # "render <backend>", not the program's name (python -m paddle_cluster ...)
                names.insert(0, c.info_name or "")
                c = c.parent
            raise click.UsageError(cmdline.unknown_option(" ".join(names), e.option_name, _opts(self, ctx), args,
                                                          _opts(c.command, c)), ctx) from None


def _opts(cmd: click.Command, ctx: click.Context) -> list:
    return [o for p in cmd.get_params(ctx) for o in [*p.opts, *p.secondary_opts] if o.startswith("-")]


_SCRIPT_ARGS = click.argument("trainer_args", nargs=-1, type=click.UNPROCESSED, metavar="[-- SCRIPT_ARGS...]")


def _options(*decorators):
    """One decorator applying ``decorators`` as if written one above the other."""
    def apply(fn):
        for d in reversed(decorators):
            fn = d(fn)
        return fn
    return apply


def _backend_options(only: Optional[str] = None, check: bool = False):
    """The options each backend declares (``only``: that backend's; ``check``: those ``check`` takes), as click
    options."""
    def option(o: BackendOption):
        if o.kind is bool:
            return click.option(o.flag, o.dest, is_flag=True, help=o.help)
        kind = str if o.kind is not int else click.INT if o.minimum is None else click.IntRange(min=o.minimum)
        return click.option(o.flag, o.dest, type=kind,
                            metavar=o.metavar or None, multiple=o.multiple, help=o.help)

    return _options(*[option(o) for o in run_options(only, check)])


def _each_backend(what: Callable[[Type[Backend]], str], sep: str = ", ") -> str:
    """What each backend says of itself (a class attribute), for a help text: "a and b: text, c: other"."""
    said: Dict[str, List[str]] = {}
    for b in REGISTRY:
        if what(backend_class(b)):
            said.setdefault(what(backend_class(b)), []).append(b)
    return sep.join(f"{' and '.join(names)}: {text}" for text, names in said.items())


class _ByBackend(_ScriptArgsCommand):
    """``run --help`` lists the options of every backend first, then each backend's own under its name."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        owners = option_owners()
        records = [(owners.get(p.name or "", [None]), p.get_help_record(ctx)) for p in self.get_params(ctx)]
        for title, who in [("Options", None), *((f"Options of --backend {b}", b) for b in REGISTRY)]:
            rows = [r for o, r in records if who in o and r]
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)


def _job(cfg: ClusterConfig, job_name: Optional[str], dispatch_dir: Optional[str], workspace: Optional[str],
         trainer_args: Tuple[str, ...], entry_script: Optional[str], pserver: Optional[str], opts: dict,
         detach: bool = False, notes: bool = True, origin: Optional[str] = None, dry: bool = False,
         **spec) -> Tuple[JobSpec, Backend]:
    """The job's spec, and its backend (``cfg.backend``) with the options given; ``notes``: say which pserver runs
    (first), ``origin`` (the config's line), then how the entry script and the v2 options were taken (``render``
    prints only the request); ``dry``: for a dry run, which writes nothing (no job name reserved)."""
    js, settled = job_spec(cfg, job_name, dispatch_dir, workspace, trainer_args, entry_script, pserver,
                           reserve=not dry, **spec)
    lines = [*settled.notes[:1], *([origin] if origin else []), *settled.notes[1:]]
    for line in lines if notes else ():
        _say(line)
    return js, backend_for(settled.cfg, opts, detach)


_COLLECTIVE = click.option(
    "--collective", is_flag=True, help="No pservers (PSERVERS_PER_NODE = 0): trainers only, each with the variables "
    "torchrun and paddle.distributed.launch set (MASTER_ADDR, RANK, PADDLE_TRAINER_ENDPOINTS, ...), for a "
    "torch.distributed or paddle.distributed script.")


def _with_collective(cfg: ClusterConfig, collective: bool) -> ClusterConfig:
    return override(cfg, {"pservers_per_node": ("--collective", 0)}) if collective else cfg


_PORT = click.option("--port", type=int, metavar="N", help="The job's first port (PADDLE_PORT; the built-in local "
                     "cluster has no conf.py to set it in): each node's pservers and trainers take the ports from N "
                     "on (docs/environment.md#port-layout). Default: PADDLE_PORT of the config, 7164.")


def _with_port(cfg: ClusterConfig, port: Optional[int]) -> ClusterConfig:
    return cfg if port is None else override(cfg, {"paddle_port": ("--port", port)})


def _earlier_job(what: str):
    """``--job_name`` of a command about a job started earlier: ``what`` it names, the latest by default."""
    return click.option("--job_name", metavar="NAME", callback=_checked_name,
                        help=f"{what} (default: the latest started with this config).")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--conf", metavar="FILE", help="conf.py or cluster.yaml (default: $PADDLE_CLUSTER_CONF, ./conf.py, "
              "./cluster.yaml, else a local two-pserver/two-trainer cluster on this machine).")
@click.option("--accept-new-host-keys", is_flag=True, help="Trust and remember SSH host keys not yet known "
              "(known keys are still checked).")
@click.option("--debug", is_flag=True, help="Show the tracebacks behind error messages and SSH's own log.")
@click.version_option(package_name="paddle-cluster")
@click.pass_context
def main(ctx: click.Context, conf: Optional[str], accept_new_host_keys: bool, debug: bool) -> None:
    """Launch parameter-server training jobs on the hosts of conf.py over SSH."""
    ctx.obj = {"conf": conf, "accept_new_host_keys": accept_new_host_keys, "debug": debug}
    if debug:
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
        logging.getLogger("paramiko").propagate = True


@main.command(cls=_ByBackend,
              epilog="Exit status: " + ", ".join(f"{code} {what}" for code, what in OUTCOMES.items()) + ".")
@click.option("--job_dispatch_package", "dispatch_dir", metavar="DIR", help="Local workspace to copy to every node.")
@click.option("--job_workspace", "workspace", metavar="PATH", help="Workspace already present at PATH on every node.")
@click.option("--job_name", metavar="NAME", callback=_checked_name,
              help="Job directory name under ROOT_DIR: letters, digits, '-_.' (default JOB<yyyymmddHHMMSS>).")
@click.option("--resume_from", metavar="JOB|DIR", callback=_checked_resume,
              help="Pservers resume from the latest complete checkpoint of an earlier job (its name) or of a "
              "checkpoint directory on every node.")
@click.option("--max_restarts", type=click.IntRange(min=0), default=None, metavar="N",
              help="When a pserver or trainer dies, restart the whole job from its latest complete checkpoint, "
              "up to N times (default: MAX_RESTARTS of the config, 0).")
@click.option("--elastic", is_flag=True, help="Async mode: a trainer that dies is reported and the others go on.")
@click.option("--backend", type=click.Choice(list(REGISTRY)), help="Where the job runs: " + ", ".join(
              f"{b} ({backend_class(b).help.summary})" for b in REGISTRY) + f"; default: BACKEND of the config, "
              f"{DEFAULT}. See docs/backends.md.")
@click.option("--detach", is_flag=True, help="Submit and return (backends " + ", ".join(
              b for b in REGISTRY if not backend_class(b).detach) + "): the job runs on its own, status, logs and "
              "kill find it later.")
@click.option("--dry-run", is_flag=True, help="Print what the backend would be given (" +
              _each_backend(lambda c: c.help.renders) + ") and start nothing.")
@_backend_options()
@click.option("--entry", "entry_script", metavar="SCRIPT", help="The script trainers run, in the workspace "
              "(default: ENTRY of the config, train.py).")
@click.option("--pserver", type=click.Choice(sorted(PSERVER_CHOICES)), help="What pservers run: builtin (python "
              "-m paddle_cluster.ps) or entry (the entry script, as PADDLE_TRAINING_ROLE=PSERVER). Default: "
              "PSERVER_COMMAND of the config when set, else the entry script when it handles the PSERVER role "
              "(compares it with \"PSERVER\"), else builtin.")
@_COLLECTIVE
@_PORT
@click.option("--fetch", is_flag=True, help="When the job finishes, copy trainer 0's output/ (node0's) to "
              "./<job name>/node0/ (paddle-cluster fetch does it for every node and any path, later).")
@click.option("-v", "--verbose", is_flag=True, help="Also show the pservers' INFO log lines (always in their log "
              "files; warnings and errors are always shown).")
@_SCRIPT_ARGS
@_handled
def run(ctx: click.Context, dispatch_dir: Optional[str], workspace: Optional[str], job_name: Optional[str],
        resume_from: Optional[str], max_restarts: Optional[int], elastic: bool, backend: Optional[str], detach: bool,
        dry_run: bool, entry_script: Optional[str], pserver: Optional[str], collective: bool, port: Optional[int],
        fetch: bool, verbose: bool, trainer_args: Tuple[str, ...],
        **backend_opts) -> Optional[JobResult]:
    """Start a job: pservers first, trainers once every pserver listens.

    \b
    The arguments after -- reach the entry script of trainers and pservers alike:
      paddle-cluster run --job_dispatch_package ./ws -- --num_passes 10 --data /data
    Before --, every option must be one of run's own: a misspelt one is refused (with the closest one) and
    nothing starts; a word that is not an option is the script's too.
    PaddlePaddle v2 options among the script's arguments also set the variables paddle.init reads:
      --trainer_count N, --num_passes N, --saving_period N, --log_period N, --dot_period N, --test_period N,
      --use_gpu BOOL, --local BOOL, --save_dir DIR   ->  PADDLE_INIT_TRAINER_COUNT, ... (every process)
      --port N, --ports_num N, --ports_num_for_sparse N  ->  the job's ports (as PADDLE_PORT, ... in conf.py)
    (a script that does not accept --port: give run --port N before --).
    --num_gradient_servers and --trainer_id are the launcher's and refused (docs/migrating.md).
    """
    cfg = _with_port(_with_collective(_config(ctx), collective), port)
    if backend:
        cfg = override(cfg, {"backend": ("--backend", backend)})
    foreign = foreign_options(cfg.backend, backend_opts)
    if foreign:
        raise click.UsageError(cmdline.not_for_this_job(cfg, foreign, bool(backend)))
    cls = backend_of(cfg)
    if detach and cls.detach:
        raise click.UsageError(f"--detach is not offered by backend {cfg.backend}: {cls.detach}")
    if cls.needs_workspace and bool(dispatch_dir) == bool(workspace):
        raise click.UsageError("give exactly one of --job_dispatch_package DIR and --job_workspace PATH")
    origin = origin_line(cfg) if cls.needs_workspace and cfg.is_builtin_default else None
    spec, be = _job(cfg, job_name, dispatch_dir, workspace, trainer_args, entry_script, pserver, backend_opts, detach,
                    origin=origin, resume_from=resume_from, elastic=elastic, verbose=verbose, dry=dry_run,
                    max_restarts=cfg.max_restarts if max_restarts is None else max_restarts)
    if dry_run:
        click.echo(render_text(spec, be, _say), nl=False)
        return None
    if fetch and detach:
        raise click.UsageError("--fetch needs run to follow the job: without --detach, or `paddle-cluster fetch` "
                               "once it has finished")
    return submit(spec, be, _say) if detach else run_job(spec, _out, _say, backend=be, fetch=fetch)


def _earlier(ctx: click.Context, name: Optional[str]):
    """The backend class and journal entry of job ``name`` (default: the latest of this config)."""
    cfg = _config(ctx, announce=True)
    return find_job(cfg, name or journal.latest_job(cfg))


@main.command()
@_earlier_job("Job to stop")
@_handled
def kill(ctx: click.Context, job_name: Optional[str]) -> None:
    """Stop a job on every node (only the processes recorded for that job) and say what was stopped where."""
    cls, job = _earlier(ctx, job_name)
    for line in cls.cancel(job, _say):
        _out(line)


@main.command(help="Show a node's logs; NODE is node0, 0, or a host from HOSTS (" +
              _each_backend(lambda c: c.help.node_hint, "; ") + ").")
@click.argument("node")
@click.option("--role", type=click.Choice(["trainer", "pserver", "all"]), default="all", show_default=True,
              help="Whose logs: the trainers', the pservers' or both.")
@click.option("-f", "--follow", is_flag=True, help="Keep printing new lines until the job ends or Ctrl+C.")
@click.option("-n", "lines", type=int, default=50, show_default=True, help="How many last lines to show.")
@_earlier_job("Job whose logs to show")
@_handled
def logs(ctx: click.Context, node: str, role: str, follow: bool, lines: int, job_name: Optional[str]) -> None:
    cls, job = _earlier(ctx, job_name)
    cls.logs(job, node, role, lines, follow, _out)


@main.command()
@_earlier_job("Job to show")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@_handled
def status(ctx: click.Context, job_name: Optional[str], as_json: bool) -> None:
    """A table of every process of a job: node, host, address, pid, state, training progress, last log line."""
    cls, job = _earlier(ctx, job_name)
    d = cls.describe(job)
    ended, rows = job.ended, d.rows
    if d.head:
        _say(d.head)
    if as_json:
        _out(status_json(job.name, ended, rows))
        return
    how = f"{ended['outcome']} (exit {ended['exit_code']})" if ended else (
        "in progress" if any(r.state == "running" for r in rows) else "ended (no outcome recorded on this machine)")
    _table(["process", "node", "address", "pid", "state", "progress", "last log line"],
           [[r.name, r.node, r.address, r.pid_text, r.state, r.progress, r.last_line] for r in rows],
           title=f"job {job.name}: {how}", wrap=("address", "pid", "progress"),
           caption=ended["message"] if ended else None)


@main.command()
@_earlier_job("Job to watch")
@click.option("--once", "once_only", is_flag=True, help="Print one frame and return.")
@click.option("--json", "as_json", is_flag=True, help="Print one machine-readable snapshot and return.")
@_handled
def top(ctx: click.Context, job_name: Optional[str], once_only: bool, as_json: bool) -> None:
    """A live view of a job, a row per process: step, steps/s, loss, CPU, memory, traffic, a pserver's rows,
    budget and barrier waits. Keys: n c m s w sort, t p 0-9 a filter, q quits (the job goes on)."""
    from .launch import top as view

    cls, job = _earlier(ctx, job_name)
    view.run_top(job.cfg, job.name, lambda: cls.figures(job), _out, once_only, as_json)


@main.command("fetch")
@_earlier_job("Job whose files to copy")
@click.option("--to", "dest", metavar="DIR", help="Where to put them: DIR/node0/..., a folder per node (default: "
              "./<job name>).")
@click.argument("paths", nargs=-1, metavar="[PATH...]")
@_handled
def fetch_cmd(ctx: click.Context, job_name: Optional[str], dest: Optional[str], paths: Tuple[str, ...]) -> None:
    """Copy each node's output/ of a job (or the PATHs, relative to its job directory) to this machine, a folder
    per node. A file already here with the same SHA-256 is skipped; an interrupted copy resumes."""
    from .launch import fetch as fetching

    cls, job = _earlier(ctx, job_name)
    fetching.fetch_job(lambda: cls.outputs(job), job.name, dest, paths, _say)


@main.command(help="Preflight what a job would run on; each backend checks its own: " +
              _each_backend(lambda c: c.help.checks, "; ") + ".")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--backend", type=click.Choice(list(REGISTRY)), help="The backend to check for (default: BACKEND of the "
              f"config, {DEFAULT}): each checks what its jobs run on (docs/backends.md).")
@_PORT
@_backend_options(check=True)
@_handled
def check(ctx: click.Context, as_json: bool, backend: Optional[str], port: Optional[int], **backend_opts) -> None:
    cfg = _with_port(_config(ctx), port)
    if backend:
        cfg = override(cfg, {"backend": ("--backend", backend)})
    foreign = foreign_options(cfg.backend, backend_opts)
    if foreign:
        raise click.UsageError(cmdline.not_for_this_check(cfg, foreign))
    rows = backend_of(cfg).check(cfg, backend_opts)
    if as_json:
        _out(preflight.as_json(rows))
    else:
        for k, same in enumerate(preflight.by_kind(rows)):
            if k:
                _out("")
            _table(list(same[0].HEADERS), [r.cells() for r in same], wrap=same[0].WRAP)
    preflight.verdict(rows)


@main.command()
@_earlier_job("Job to plot")
@click.option("-o", "--out", "out_path", metavar="FILE", help="PNG to write (default: <job name>.png here).")
@_handled
def plot(ctx: click.Context, job_name: Optional[str], out_path: Optional[str]) -> None:
    """Draw loss and every reported metric per trainer against step, as a PNG and in the terminal."""
    from .launch import plot as plots

    cls, job = _earlier(ctx, job_name)
    path = out_path or f"{job.name}.png"
    for line in plots.plot(cls.metrics(job), job.name, path):
        _out(line)
    _say(f"wrote {os.path.abspath(path)}")


@main.command()
def secret() -> None:
    """Print a new job secret (64 random hex digits) for pservers and trainers started by hand: give them all the
    same one as PADDLE_JOB_SECRET (`run` makes its own for every job)."""
    from .jobsecret import generate

    _out(generate())


@main.group(help="Print what a backend is given to run a job (" + _each_backend(lambda c: c.help.renders) +
            "), starting nothing: `run --dry-run` with one backend's options.")
def render() -> None:
    pass


def _render_command(backend: str) -> None:
    @render.command(backend, cls=_ScriptArgsCommand,
                    help=f"What --backend {backend} ({backend_class(backend).help.summary}) is given for a job, on "
                    f"stdout. {backend_class(backend).help.render_hint} The entry script's arguments go after --.")
    @click.option("--job_name", metavar="NAME", callback=_checked_name,
                  help="Job name (default JOB<yyyymmddHHMMSS>).")
    @click.option("--job_dispatch_package", "dispatch_dir", metavar="DIR", help="Local workspace to copy to every "
                  "node.")
    @click.option("--job_workspace", "workspace", metavar="PATH", help="Workspace already present at PATH on every "
                  "node (or in the image).")
    @click.option("--entry", "entry_script", metavar="SCRIPT", help="The script trainers run, in the workspace "
                  "(default: ENTRY of the config, train.py).")
    @click.option("--pserver", type=click.Choice(sorted(PSERVER_CHOICES)), help="What pservers run: builtin or "
                  "entry (as run --pserver).")
    @_COLLECTIVE
    @_PORT
    @_backend_options(backend)
    @_SCRIPT_ARGS
    @_handled
    def cmd(ctx: click.Context, job_name: Optional[str], dispatch_dir: Optional[str], workspace: Optional[str],
            entry_script: Optional[str], pserver: Optional[str], collective: bool, port: Optional[int],
            trainer_args: Tuple[str, ...], **opts) -> None:
        cfg = _with_port(_with_collective(_config(ctx), collective), port)
        cfg = override(cfg, {"backend": (f"render {backend}", backend)})
        spec, be = _job(cfg, job_name, dispatch_dir, workspace, trainer_args, entry_script, pserver, opts,
                        notes=False, dry=True)
        click.echo(render_text(spec, be, _say), nl=False)


for _name in REGISTRY:
    _render_command(_name)


def _table(headers, rows, title: Optional[str] = None, wrap: Tuple[str, ...] = (),
           caption: Optional[str] = None) -> None:
    """A table as wide as the terminal, or unwrapped up to 200 columns for a pipe. To fit, the ``wrap`` columns
    and the last one wrap; the others stay whole. ``caption``: a line below it. Every cell is text, never markup,
    with control characters made visible: a job's log line or a host's answer cannot style or drive the terminal."""
    from rich import box
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from .launch.shown import printable

    t = Table(title=Text(printable(title)) if title else None, title_justify="left",
              caption=Text(printable(caption)) if caption else None, caption_justify="left", box=box.SIMPLE_HEAD,
              show_edge=False, pad_edge=False, padding=(0, 1, 0, 0))
    for h in headers:
        t.add_column(h, overflow="fold", no_wrap=h not in wrap and h != headers[-1])
    for r in rows:
        t.add_row(*(Text(printable(c)) for c in r))
    Console(width=200 if not sys.stdout.isatty() else None).print(t)


if __name__ == "__main__":
    main()
