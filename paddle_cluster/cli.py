"""``paddle-cluster``: parse the command line, call one function of ``launch``, turn errors into messages."""

from __future__ import annotations

import functools
import logging
import os
import sys
import traceback
import warnings
from typing import Any, Dict, Optional, Tuple

import click

from .contract import ContractError, check_job_name
from .launch import cmdline, journal
from .launch.backends.k8s import manifests as k8s
from .launch.backends.k8s import pod_options as k8s_pod
from .launch.backends.slurm import ops as slurm_ops
from .launch.backends.ssh import ops
from .launch.config import BACKENDS, ClusterConfig, load_config, origin_line, override
from .launch.entry import PSERVER_CHOICES, settle
from .launch.errors import OUTCOMES, ClusterError
from .launch.plan import JobSpec, default_job_name
from .launch.run import run_job
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
    cfg = load_config(ctx.obj["conf"])
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
        return value if value is None or value.startswith("/") else check_job_name(value)
    except ContractError as e:
        raise click.BadParameter(f"{e}; or give an absolute checkpoint directory") from None


class _ScriptArgsCommand(click.Command):
    """A command whose arguments after ``--`` go to the entry script; an option before it must be its own."""

    def parse_args(self, ctx: click.Context, args: list) -> list:
        try:
            return super().parse_args(ctx, list(args))
        except click.NoSuchOption as e:
            names, c = [], ctx
            while c.parent is not None:  # "render k8s", not the program's name (python -m paddle_cluster ...)
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


# The pods of a Kubernetes job, for `run --backend k8s` and `render k8s` alike (K8sOptions.from_config).
_k8s_pods = _options(
    click.option("--image", metavar="IMAGE", help="k8s: the image holding Python 3, numpy, paddle-cluster and the "
                 "workspace (docs/backends.md; default: K8S_IMAGE)."),
    click.option("--namespace", metavar="NS", help="k8s: the namespace (default: K8S_NAMESPACE, default)."),
    click.option("--pservers", type=click.IntRange(min=1), metavar="N", help="k8s: pserver pods (default: HOSTS x "
                 "PSERVERS_PER_NODE)."),
    click.option("--trainers", type=click.IntRange(min=1), metavar="M", help="k8s: trainer pods (default: HOSTS x "
                 "TRAINERS_PER_NODE)."),
)


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


@main.command(cls=_ScriptArgsCommand,
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
@click.option("--backend", type=click.Choice(BACKENDS), help="Where the job runs: ssh (HOSTS over SSH), mpi (mpirun "
              "over HOSTS), slurm (an allocation of --nodes), k8s (Kubernetes Jobs); default: BACKEND of the "
              "config, ssh. See docs/backends.md.")
@click.option("--nodes", type=click.IntRange(min=1), metavar="N", help="slurm: how many nodes (default: as many as "
              "HOSTS lists).")
@click.option("--partition", metavar="P", help="slurm: the partition (sbatch --partition).")
@click.option("--time", "time_limit", metavar="T", help="slurm: the time limit (sbatch --time), e.g. 2:00:00.")
@click.option("--account", metavar="A", help="slurm: the account to charge (sbatch --account).")
@click.option("--detach", is_flag=True, help="slurm, k8s: submit and return; the job runs and fails fast on its "
              "own, status, logs and kill find it later.")
@_options(
    click.option("--gres", metavar="LIST", help="slurm: generic resources per node, e.g. gpu:2 (sbatch --gres)."),
    click.option("--cpus-per-task", type=click.IntRange(min=1), metavar="N", help="slurm: CPUs for each node's "
                 "task (sbatch and srun --cpus-per-task)."),
    click.option("--mem", metavar="SIZE", help="slurm: memory per node, e.g. 16G (sbatch --mem)."),
    click.option("--exclusive", is_flag=True, help="slurm: the nodes are not shared with other jobs."),
    click.option("--constraint", metavar="FEATURES", help="slurm: node features required (sbatch --constraint)."),
    click.option("--qos", metavar="Q", help="slurm: quality of service (sbatch --qos)."),
    click.option("--reservation", metavar="R", help="slurm: run in this reservation (sbatch --reservation)."),
    click.option("--sbatch-arg", "sbatch_args", multiple=True, metavar="OPT", help="slurm: any other sbatch option, "
                 "as written, e.g. --sbatch-arg=--mail-type=END (repeatable)."),
)
@_k8s_pods
@k8s_pod.flags
@click.option("--entry", "entry_script", metavar="SCRIPT", help="The script trainers run, in the workspace "
              "(default: ENTRY of the config, train.py).")
@click.option("--pserver", type=click.Choice(sorted(PSERVER_CHOICES)), help="What pservers run: builtin (python "
              "-m paddle_cluster.ps) or entry (the entry script, as PADDLE_TRAINING_ROLE=PSERVER). Default: "
              "PSERVER_COMMAND of the config when set, else the entry script when it handles the PSERVER role "
              "(compares it with \"PSERVER\"), else builtin.")
@click.option("-v", "--verbose", is_flag=True, help="Also show the pservers' INFO log lines (always in their log "
              "files; warnings and errors are always shown).")
@_SCRIPT_ARGS
@_handled
def run(ctx: click.Context, dispatch_dir: Optional[str], workspace: Optional[str], job_name: Optional[str],
        resume_from: Optional[str], max_restarts: Optional[int], elastic: bool, backend: Optional[str],
        image: Optional[str], namespace: Optional[str], pservers: Optional[int], trainers: Optional[int],
        nodes: Optional[int], partition: Optional[str], time_limit: Optional[str], account: Optional[str],
        detach: bool, entry_script: Optional[str], pserver: Optional[str], verbose: bool,
        trainer_args: Tuple[str, ...], pod_flags: Dict[str, Any], **resources) -> JobResult:
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
    --num_gradient_servers and --trainer_id are the launcher's and refused (docs/migrating.md).
    """
    cfg = _config(ctx)
    if backend:
        cfg = override(cfg, {"backend": ("--backend", backend)})
    be = None
    if cfg.backend != "k8s" and k8s_pod.given(pod_flags):
        raise click.UsageError(f"{', '.join(k8s_pod.given(pod_flags))}: for --backend k8s only")
    if cfg.backend == "k8s":
        from .launch.backends.k8s import K8sBackend, K8sOptions

        be = K8sBackend(cfg, K8sOptions.from_config(cfg, image, namespace, pservers, trainers, pod_flags))
    elif bool(dispatch_dir) == bool(workspace):
        raise click.UsageError("give exactly one of --job_dispatch_package DIR and --job_workspace PATH")
    settled = settle(cfg, dispatch_dir, workspace, trainer_args, entry_script, pserver)
    for note in settled.notes[:1]:  # the first line: which pserver runs, and how to choose the other
        _say(note)
    if cfg.is_builtin_default and cfg.backend != "k8s":
        _say(origin_line(cfg))
    for note in settled.notes[1:]:
        _say(note)
    spec = JobSpec(settled.cfg, job_name or default_job_name(settled.cfg), dispatch_dir, workspace, tuple(trainer_args),
                   resume_from, cfg.max_restarts if max_restarts is None else max_restarts, elastic,
                   tuple(settled.init.items()), verbose)
    if cfg.backend != "slurm":
        if nodes or partition or time_limit or account or (detach and cfg.backend != "k8s") or any(resources.values()):
            raise click.UsageError("--nodes, --partition, --time, --account, --gres, --cpus-per-task, --mem, "
                                   "--exclusive, --constraint, --qos, --reservation and --sbatch-arg are for --backend "
                                   "slurm, --detach for slurm and k8s")
        if detach:
            from .launch.backends.k8s import submit

            return submit(spec, be, _say)
        return run_job(spec, _out, _say, backend=be)
    from .launch.backends.slurm import SlurmBackend, SlurmOptions

    if not (nodes or cfg.hosts):
        raise click.UsageError("--backend slurm: give --nodes N (how many nodes to allocate)")
    be = SlurmBackend(settled.cfg, SlurmOptions(nodes or len(cfg.hosts), partition, time_limit, account, detach,
                                                **resources))
    return slurm_ops.submit(spec, be, _say) if detach else run_job(spec, _out, _say, backend=be)


def _job_name(cfg: ClusterConfig, name: Optional[str]) -> str:
    return name or journal.latest_job(cfg)


def _on_k8s(cfg: ClusterConfig, name: str):
    """The kubectl commands of job ``name`` when it runs on Kubernetes (as run remembered it, else by the
    config's BACKEND); None for a job of the ssh backend."""
    where = journal.where(cfg, name)
    if (where.get("backend") or cfg.backend) != "k8s":
        return None
    from .launch.backends.k8s import kubectl

    return kubectl.for_job(where.get("namespace") or cfg.k8s_namespace, name, where.get("job_id", ""))


@main.command()
@_earlier_job("Job to stop")
@_handled
def kill(ctx: click.Context, job_name: Optional[str]) -> None:
    """Stop a job on every node (only the processes recorded for that job) and say what was stopped where."""
    cfg = _config(ctx, announce=True)
    name = _job_name(cfg, job_name)
    if slurm_ops.is_slurm_job(cfg, name):
        _out(slurm_ops.kill(cfg, name))
        return
    k = _on_k8s(cfg, name)
    if k is not None:
        from .launch.backends.k8s import kubectl

        for line in kubectl.kill_job(k, cfg.job_dir(name)) or [f"nothing of job {name} in namespace {k.namespace}"]:
            _out(line)
        return
    nodes = ops.kill_job(cfg, name)
    for r in nodes:
        _out(r.line(name))
    _say(ops.kill_summary(cfg, name, nodes))


@main.command()
@click.argument("node")
@click.option("--role", type=click.Choice(["trainer", "pserver", "all"]), default="all", show_default=True,
              help="Whose logs: the trainers', the pservers' or both.")
@click.option("-f", "--follow", is_flag=True, help="Keep printing new lines until the job ends or Ctrl+C.")
@click.option("-n", "lines", type=int, default=50, show_default=True, help="How many last lines to show.")
@_earlier_job("Job whose logs to show")
@_handled
def logs(ctx: click.Context, node: str, role: str, follow: bool, lines: int, job_name: Optional[str]) -> None:
    """Show a node's logs; NODE is node0, 0, or a host from HOSTS (k8s: a pod, fit-trainer-0 or trainer.0)."""
    cfg = _config(ctx, announce=True)
    name = _job_name(cfg, job_name)
    if slurm_ops.is_slurm_job(cfg, name):
        slurm_ops.logs(cfg, name, node, role, lines, follow)
        return
    k = _on_k8s(cfg, name)
    if k is not None:
        from .launch.backends.k8s import kubectl

        kubectl.stream_logs(k, node, lines, follow, _out, cfg.job_dir(name))
        return
    ops.stream_logs(cfg, name, node, role, lines, follow, _out)


@main.command()
@_earlier_job("Job to show")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@_handled
def status(ctx: click.Context, job_name: Optional[str], as_json: bool) -> None:
    """A table of every process of a job: node, host, address, pid, state, training progress, last log line."""
    cfg = _config(ctx, announce=True)
    name = _job_name(cfg, job_name)
    ended = journal.outcome(cfg, name)
    k = _on_k8s(cfg, name)
    if slurm_ops.is_slurm_job(cfg, name):
        head, rows = slurm_ops.status(cfg, name)
        _say(head)
    elif k is not None:
        from .launch.backends.k8s import kubectl

        rows = kubectl.job_status(k, cfg.job_dir(name))
    else:
        rows = ops.job_status(cfg, name, ended)
    if as_json:
        _out(ops.status_json(name, ended, rows))
        return
    how = f"{ended['outcome']} (exit {ended['exit_code']})" if ended else (
        "in progress" if any(r.state == "running" for r in rows) else "ended (no outcome recorded on this machine)")
    _table(["process", "node", "address", "pid", "state", "progress", "last log line"],
           [[r.name, r.node, r.address, r.pid_text, r.state, r.progress, r.last_line] for r in rows],
           title=f"job {name}: {how}", wrap=("address", "pid", "progress"), caption=ended["message"] if ended else None)


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--backend", type=click.Choice(BACKENDS), help="The backend to check for (default: BACKEND of the "
              "config, ssh); slurm checks this machine, whose environment srun gives the nodes.")
@_handled
def check(ctx: click.Context, as_json: bool, backend: Optional[str]) -> None:
    """Preflight every host: SSH without prompts, the interpreter every process will run (PYTHON as the login
    shell finds it, as an absolute path) and its numpy, NIC, ports, ROOT_DIR, disk."""
    cfg = _config(ctx)
    if backend:
        cfg = override(cfg, {"backend": ("--backend", backend)})
    rows = ops.check_cluster(cfg)
    if as_json:
        _out(ops.as_json(rows))
    else:
        _table(["node", "host", "ssh", "python, numpy", "nic", "ports", "ROOT_DIR"],
               [[r.node, r.host, r.ssh, f"{r.interpreter} ({r.python}), numpy {r.numpy}" if r.python != "-" else "-",
                 r.nic, r.ports,
                 f"{r.root_dir}, {r.disk_free} free" if r.disk_free != "-" else r.root_dir] for r in rows],
               wrap=("host", "python, numpy", "nic", "ports"))
    bad = [r for r in rows if not r.ok]
    if bad:
        raise ClusterError(f"{len(bad)} of {len(rows)} host(s) failed the check:"
                           + "".join(f"\n  {r.node} ({r.host}): {r.problem}" for r in bad))


@main.command()
@_earlier_job("Job to plot")
@click.option("-o", "--out", "out_path", metavar="FILE", help="PNG to write (default: <job name>.png here).")
@_handled
def plot(ctx: click.Context, job_name: Optional[str], out_path: Optional[str]) -> None:
    """Draw loss and every reported metric per trainer against step, as a PNG and in the terminal."""
    from .launch import plot as plots

    cfg = _config(ctx, announce=True)
    name = _job_name(cfg, job_name)
    # Kubernetes: the metrics the job's pods left, saved on this machine before they were deleted.
    cs = plots.curves(plots.collect(cfg, name) if _on_k8s(cfg, name) is None else _saved_metrics(cfg, name))
    path = out_path or f"{name}.png"
    plots.draw_png(cs, path, f"{name}: {len({c.trainer for c in cs})} trainer(s)")
    for c in cs:
        _out(f"{c.trainer:>9} {c.metric:<14} {plots.sparkline(c.values)} {c.values[0]:.4g} -> {c.values[-1]:.4g}"
             f" ({len(c.values)} points, steps {c.steps[0]:g}-{c.steps[-1]:g})")
    _say(f"wrote {os.path.abspath(path)}")


def _saved_metrics(cfg: ClusterConfig, name: str) -> dict:
    from .node import jobdir

    found = jobdir.metrics(cfg.job_dir(name))
    if not any(found.values()):
        raise ClusterError(f"job {name} has no metrics saved in {cfg.job_dir(name)}/log (they are saved when run "
                           "or kill deletes the job's pods)")
    return found


@main.group()
def render() -> None:
    """Write what another system needs to run a job (manifests), without running it."""


@render.command("k8s", cls=_ScriptArgsCommand)
@_k8s_pods
@k8s_pod.flags
@click.option("--job_name", metavar="NAME", help="Job name, prefix of every object (default job<yyyymmddHHMMSS>).")
@click.option("--job_workspace", "workspace", default=k8s.DEFAULT_WORKSPACE, show_default=True, metavar="PATH",
              help="Where the workspace is inside the image (the pods' working directory).")
@click.option("--jobset", is_flag=True, help="One JobSet (jobset.x-k8s.io/v1alpha2: its controller must be "
              "installed) instead of a Service and two Jobs: one success and failure policy, one Kueue workload.")
@_SCRIPT_ARGS
@_handled
def render_k8s(ctx: click.Context, image: Optional[str], namespace: Optional[str], pservers: Optional[int],
               trainers: Optional[int], job_name: Optional[str], workspace: str, jobset: bool,
               pod_flags: Dict[str, Any], trainer_args: Tuple[str, ...]) -> None:
    """Kubernetes manifests for a job on stdout: a Secret, a headless Service, pservers and trainers as Indexed
    Jobs. Apply with: paddle-cluster render k8s --image IMAGE | kubectl apply -f -. The entry script's arguments
    go after --."""
    from .launch.backends.k8s import K8sOptions

    cfg = _config(ctx)
    opts = K8sOptions.from_config(cfg, image, namespace, pservers, trainers, pod_flags)
    job = opts.build(cfg, job_name or default_job_name(cfg), workspace, tuple(trainer_args), jobset=jobset)
    if cfg.is_builtin_default and None in (pservers, trainers):
        _say(f"no conf.py or cluster.yaml found: {job.pservers} pserver(s) and {job.trainers} trainer(s), the "
             "built-in default's counts (--pservers/--trainers set them)")
    click.echo(k8s.render(job), nl=False)


def _table(headers, rows, title: Optional[str] = None, wrap: Tuple[str, ...] = (),
           caption: Optional[str] = None) -> None:
    """A table as wide as the terminal, or unwrapped up to 200 columns for a pipe. To fit, the ``wrap`` columns
    and the last one wrap; the others stay whole. ``caption``: a line below it."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title, title_justify="left", caption=caption, caption_justify="left", box=box.SIMPLE_HEAD,
              show_edge=False, pad_edge=False, padding=(0, 1, 0, 0))
    for h in headers:
        t.add_column(h, overflow="fold", no_wrap=h not in wrap and h != headers[-1])
    for r in rows:
        t.add_row(*r)
    Console(width=200 if not sys.stdout.isatty() else None).print(t)


if __name__ == "__main__":
    main()
