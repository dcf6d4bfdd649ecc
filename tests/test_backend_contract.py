"""The backend contract through the CLI: ``run --dry-run`` and ``render`` print each backend's native request and
start nothing; a backend's option given to another backend is a clear error; ``run --help`` groups the options
by backend; ``status``, ``logs`` and ``kill`` find a job on the backend the journal recorded, whatever the config
says now."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from engines import DRY_RUN, DRY_RUN_OPTIONS, NATIVE, NO_HOSTS_NATIVE, NO_HOSTS_OPTIONS, PRINTS_SECRETS
from helpers import HOLD_PY, checkout_env, cli, local_conf, start_cli, wait_for, write_settings

from paddle_cluster.cli import main
from paddle_cluster.launch import journal
from paddle_cluster.launch.backends import REGISTRY, backend_class, declared_options, foreign_options, run_options
from paddle_cluster.launch.backends.base import BackendOption
from paddle_cluster.launch.config import load_config
from paddle_cluster.launch.registry import DEFAULT


def _user_conf(tmp: Path) -> Path:
    """The README's conf.py: two hosts that are never contacted (a dry run talks to no host)."""
    return write_settings(tmp / "conf.py", {"HOSTS": ["root@10.9.0.2", "root@10.9.0.3"],
                                            "ROOT_DIR": str(tmp / "root"), "PADDLE_NIC": "eth0", "PADDLE_PORT": 7164})


def _isolated(tmp: Path) -> dict:
    return dict(os.environ, HOME=str(tmp / "home"), XDG_STATE_HOME=str(tmp / "state"),
                XDG_CACHE_HOME=str(tmp / "cache"), TMPDIR=str(tmp / "scratch"))


@pytest.mark.parametrize("backend", list(REGISTRY))
@pytest.mark.parametrize("how", ["run --dry-run", "render"])
@pytest.mark.parametrize("name", [["--job_name", "dry"], []], ids=["named", "default-name"])
def test_dry_run_prints_the_native_request_and_starts_nothing(tmp_path, backend, how, name):
    conf, env = _user_conf(tmp_path), _isolated(tmp_path)
    (tmp_path / "scratch").mkdir()
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "train.py").write_text("print('hi')\n")
    args = ["run", "--backend", backend, "--dry-run"] if how == "run --dry-run" else ["render", backend]
    args += ["--job_dispatch_package", str(ws)]  # (k8s: packed into a ConfigMap)
    res = cli(conf, *args, *DRY_RUN_OPTIONS[backend], *name, "--", "--num_passes", "2", env=env)
    assert res.returncode == 0, res.stderr
    for marker in NATIVE[backend]:
        assert marker.replace("job dry", "job dry" if name else "job JOB") in res.stdout, (marker, res.stdout)
    assert "Traceback" not in res.stderr
    # Nothing started, nothing written: no job directory, no journal entry (a default name is not reserved), no
    # cached archive, no temporary file.
    assert not (tmp_path / "root").exists()
    assert not (tmp_path / "state").exists() and not (tmp_path / "cache").exists()
    assert list((tmp_path / "scratch").iterdir()) == []
    if backend not in PRINTS_SECRETS:  # a dry run prints no credential
        assert "PADDLE_JOB_SECRET=<set>" in res.stdout and "PADDLE_TRAINER_KEY=<set>" in res.stdout


@pytest.mark.parametrize("backend", list(REGISTRY))
def test_hosts_is_required_by_the_backends_whose_nodes_it_lists_only(tmp_path, backend):
    """A conf.py without HOSTS (and without BACKEND: ``--backend`` chooses): Slurm and Kubernetes give the nodes,
    so their request is made; ssh and mpi run on the machines of HOSTS, so run, render, check and status refuse
    it naming the backend, where it came from and the fix, and write nothing."""
    conf, env = _user_conf(tmp_path), _isolated(tmp_path)
    conf.write_text("".join(ln + "\n" for ln in conf.read_text().splitlines() if not ln.startswith("HOSTS")))
    (tmp_path / "scratch").mkdir()
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "train.py").write_text("print('hi')\n")
    res = cli(conf, "run", "--backend", backend, "--dry-run", "--job_dispatch_package", str(ws),
              *NO_HOSTS_OPTIONS[backend],
              "--job_name", "dry", env=env)
    assert "Traceback" not in res.stderr
    if backend_class(backend).needs_hosts:
        assert res.returncode == 2 and res.stdout == "", res.stdout
        assert f"HOSTS is not set in {conf}: backend {backend} (--backend {backend}) runs the job on the " \
               'machines HOSTS lists: list them, e.g. HOSTS = ["root@192.168.1.10"], or run on an engine that ' \
               "gives the nodes: --backend slurm or --backend k8s" in res.stderr, res.stderr
        for args, chosen in ((["render", backend, "--job_dispatch_package", str(ws)], f"render {backend}"),
                             (["check", "--backend", backend], f"--backend {backend}")):
            other = cli(conf, *args, env=env)
            assert other.returncode == 2, other.stderr
            assert f"is not set in {conf}: backend {backend} ({chosen})" in other.stderr, other.stderr
        if backend == DEFAULT:  # a job of this config is looked for on it
            st = cli(conf, "status", "--job_name", "dry", env=env)
            assert st.returncode == 2 and f"backend {backend} (the default; {conf} sets no BACKEND)" in st.stderr, \
                st.stderr
    else:
        assert res.returncode == 0, res.stderr
        for marker in NO_HOSTS_NATIVE[backend]:
            assert marker in res.stdout, (marker, res.stdout)
    assert not (tmp_path / "root").exists() and list((tmp_path / "scratch").iterdir()) == []


@pytest.mark.parametrize("option,value,owner", [("--partition", "gpu", "slurm"), ("--nodes", "3", "slurm"),
                                                ("--sbatch-arg", "--mail-type=END", "slurm"),
                                                ("--image", "img:1", "k8s"), ("--namespace", "ml", "k8s")])
def test_an_option_of_another_backend_is_a_clear_error(tmp_path, option, value, owner):
    conf = _user_conf(tmp_path)
    res = cli(conf, "run", "--backend", "ssh", option, value, "--job_dispatch_package", str(tmp_path),
              env=_isolated(tmp_path))
    assert res.returncode == 2, res.stderr
    assert f"{option}: for --backend {owner} only (this job runs on backend ssh, from --backend)" in res.stderr
    assert "Traceback" not in res.stderr and not (tmp_path / "root").exists()


def test_detach_where_the_engine_cannot_is_a_clear_error(tmp_path):
    res = cli(_user_conf(tmp_path), "run", "--backend", "mpi", "--detach", "--job_dispatch_package", str(tmp_path),
              env=_isolated(tmp_path))
    assert res.returncode == 2
    assert "--detach is not offered by backend mpi" in res.stderr


def test_run_help_groups_the_options_by_backend():
    out = CliRunner().invoke(main, ["run", "--help"], terminal_width=200).output
    sections = re.findall(r"^(Options[^:\n]*):", out, re.M)
    assert sections == ["Options", *[f"Options of --backend {b}" for b in REGISTRY if backend_class(b).options]]
    slurm = out.split("Options of --backend slurm:")[1].split("Options of --backend k8s:")[0]
    assert "--partition" in slurm and "--image" not in slurm
    common = out.split("Options of --backend")[0]
    assert "--dry-run" in common and "--partition" not in common


def test_the_journal_keeps_each_jobs_backend_and_handle(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    cfg = load_config(str(_user_conf(tmp_path)))
    journal.remember(cfg, "a", None, {"backend": "slurm", "slurm_job": "17"})
    journal.remember(cfg, "b", None, {"backend": "ssh"})
    assert journal.where(cfg, "a") == {"backend": "slurm", "slurm_job": "17"}  # not only the latest job's
    assert journal.where(cfg, "b") == {"backend": "ssh"} and journal.where(cfg, "c") == {}


def test_status_logs_and_kill_find_an_ssh_job_through_the_journal(tmp_path):
    """The config now says BACKEND slurm; the job ran on ssh (localhost): the journal says so, and status, logs
    and kill reach it there. (local_conf pins PYTHON to this interpreter, which has numpy.)"""
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "train.py").write_text(HOLD_PY)
    conf = local_conf(tmp_path, KILL_GRACE=2.0)
    env = _isolated(tmp_path)
    (tmp_path / "scratch").mkdir()
    run = start_cli(conf, "run", "--backend", "ssh", "--job_dispatch_package", str(ws), "--job_name", "viaj",
                    env=env)
    try:
        log = tmp_path / "root" / "viaj" / "log" / "train.log"
        wait_for(lambda: log.exists() and "holding 0" in log.read_text(), 60, "the trainer holding")
        text = conf.read_text() + "BACKEND = 'slurm'\n"
        conf.write_text(text)
        st = cli(conf, "status", "--json", env=env)
        assert st.returncode == 0, st.stderr
        states = {r["name"]: r["state"] for r in json.loads(st.stdout)["processes"]}
        assert states == {"pserver.0": "running", "trainer.0": "running"}, st.stdout
        lg = cli(conf, "logs", "node0", "--role", "trainer", env=env)
        assert lg.returncode == 0 and "holding 0" in lg.stdout, lg.stderr
        k = cli(conf, "kill", env=env)
        assert k.returncode == 0, k.stderr
        assert re.search(r"node0 \(localhost\): .*trainer\.0", k.stdout), k.stdout
        assert run.wait(timeout=60) == 3  # stopped by paddle-cluster kill
    finally:
        if run.poll() is None:
            run.send_signal(signal.SIGINT)
            run.wait(timeout=60)


def test_no_code_outside_the_backends_packages_switches_on_a_backend():
    """``if cfg.backend == "slurm"`` or ``isinstance(be, SlurmBackend)`` outside ``launch/backends/<name>/``: what
    one backend does is its package's (the contract's methods), so a new backend touches its package and the
    registry line only."""
    import ast

    root = Path(__file__).resolve().parent.parent / "paddle_cluster"
    classes = {REGISTRY[b].split(":")[1] for b in REGISTRY}
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("launch/backends/") and rel.count("/") > 2 or rel == "launch/registry.py" or \
                not rel.startswith(("launch/", "cli.py")):  # the node runtime knows engines by their variables
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and any(isinstance(c, ast.Constant) and c.value in REGISTRY
                                                     for c in [node.left, *node.comparators]):
                found.append(f"{rel}:{node.lineno}: compares with a backend's name")
            if isinstance(node, (ast.Name, ast.Attribute)) and getattr(node, "id", getattr(node, "attr", "")) in \
                    classes:
                found.append(f"{rel}:{node.lineno}: names a backend's class")
    assert not found, found


def test_cli_names_no_backend():
    """Not in code, help texts nor comments: what ``--help`` says of a backend comes from its class (``summary``,
    ``renders``, ``node_hint``, ``checks``, its options), so a new backend's help needs no edit of cli.py."""
    import re

    text = (Path(__file__).resolve().parent.parent / "paddle_cluster" / "cli.py").read_text()
    engines = [*REGISTRY, "Kubernetes", "kubectl", "Slurm", "sbatch", "mpirun", "mpiexec", "Open MPI", "MPICH"]
    found = [f"cli.py:{n}: {line.strip()}" for n, line in enumerate(text.splitlines(), 1)
             if re.search(r"\b(" + "|".join(map(re.escape, engines)) + r")\b", line)]
    assert not found, found


class _QueueBackend(backend_class("k8s")):  # a throwaway engine declaring an option k8s has too
    name = "pbs"
    options = (BackendOption("--queue", "queue", "The PBS queue (qsub -q).", metavar="Q"),)


def test_an_option_two_backends_declare_is_one_option_of_each(monkeypatch):
    """A new engine may declare a flag another has (--queue: Kueue's on k8s, qsub's on PBS): ``run`` takes it
    once, with each one's help; it is foreign only to backends declaring neither; declared otherwise, refused."""
    monkeypatch.setitem(REGISTRY, "pbs", f"{__name__}:_QueueBackend")
    (queue,) = [o for o in run_options() if o.flag == "--queue"]
    assert queue.help.startswith("k8s: The Kueue LocalQueue") and queue.help.endswith("pbs: The PBS queue (qsub -q).")
    assert [o.help for o in run_options("pbs")] == ["The PBS queue (qsub -q)."]
    assert foreign_options("pbs", {"queue": "q"}) == [] and foreign_options("k8s", {"queue": "q"}) == []
    assert foreign_options("ssh", {"queue": "q"}) == [("--queue", "k8s or --backend pbs")]
    monkeypatch.setattr(_QueueBackend, "options", (BackendOption("--queue", "queue", "A count.", int),))
    with pytest.raises(TypeError, match="backends k8s and pbs declare --queue \\(queue\\) differently"):
        declared_options()


def test_the_dry_run_on_the_built_in_local_cluster_shows_the_endpoints_the_run_binds(tmp_path, monkeypatch):
    """No conf.py: the dry run's pserver and trainer endpoints are those of the plan made from the probed host
    (each pserver its own loopback address, as the real run binds them), not consecutive ports of a placeholder."""
    from paddle_cluster.launch.backends.ssh import SSHBackend
    from paddle_cluster.launch.config import builtin_default
    from paddle_cluster.launch.plan import JobSpec, Topology, build_plan

    env = _isolated(tmp_path)
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "train.py").write_text("print('hi')\n")
    res = subprocess.run([sys.executable, "-m", "paddle_cluster", "run", "--job_dispatch_package", str(ws),
                          "--dry-run"], capture_output=True, text=True, timeout=120, cwd=ws, env=checkout_env(env),
                         stdin=subprocess.DEVNULL)
    assert res.returncode == 0 and "built-in local cluster" in res.stderr, res.stderr
    shown = dict(kv.split("=", 1) for kv in res.stdout.split("job-wide environment: ", 1)[1].split("\n", 1)[0].split())
    monkeypatch.setenv("HOME", env["HOME"])  # the built-in cluster's ROOT_DIR is under it
    cfg = builtin_default()
    be = SSHBackend(cfg)
    try:
        addresses = be.probe_cluster(lambda _s: None, check_ports=False)  # what prepare finds (ports aside)
    finally:
        be.close()
    real = build_plan(JobSpec(cfg, "x"), Topology.hosts(cfg, addresses)).env.to_environ()
    for key in ("PADDLE_PSERVER_ENDPOINTS", "PADDLE_TRAINER_ENDPOINTS", "MASTER_ADDR", "MASTER_PORT"):
        assert shown[key] == real[key], (key, shown[key], real[key])


@pytest.mark.parametrize("backend", list(REGISTRY))
def test_render_leaves_its_backend_as_it_was(tmp_path, backend):
    """A dry run renders on a backend no job ran on: rendering changes nothing of it (a later submit would
    otherwise start from what the dry run left)."""
    from paddle_cluster.launch.backends import backend_for
    from paddle_cluster.launch.plan import JobSpec, build_plan

    cfg = load_config(str(_user_conf(tmp_path)))
    cfg = cfg.__class__(**{**cfg.__dict__, "backend": backend})
    be = backend_for(cfg, DRY_RUN[backend])
    spec = JobSpec(cfg, "dry", workspace="/ws")
    before = {k: repr(v) for k, v in vars(be).items()}
    preview = be.preview(spec, lambda _s: None)
    request = be.render(build_plan(spec, preview.topology), preview)
    assert {k: repr(v) for k, v in vars(be).items()} == before
    assert request.plan.spec is spec and request.handle["backend"] == backend


def test_run_submits_the_request_it_rendered_and_the_dry_run_prints_it(tmp_path, monkeypatch):
    """``run`` submits the very ``Request`` it rendered (a restart renders the resumed plan), and ``run
    --dry-run`` prints that request's text: the same lines but for the job's id and the probed interpreter. The
    backend holds nothing of the job afterwards."""
    from paddle_cluster.launch.backends import backend_for
    from paddle_cluster.launch.plan import JobSpec
    from paddle_cluster.launch.run import run_job

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    conf = local_conf(tmp_path)
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "train.py").write_text("print('trained')\n")
    dry = cli(conf, "run", "--job_dispatch_package", str(ws), "--job_name", "sub", "--pserver", "builtin",
              "--dry-run", env=_isolated(tmp_path))
    assert dry.returncode == 0, dry.stderr
    be = backend_for(load_config(str(conf)))
    rendered, submitted = [], []
    render, submit = be.render, be.submit
    be.render = lambda plan, prepared: rendered.append(render(plan, prepared)) or rendered[-1]
    be.submit = lambda request, say: submitted.append(request) or submit(request, say)
    said: list = []
    before = {k: repr(v) for k, v in vars(be).items()}
    result = run_job(JobSpec(be.cfg, "sub", dispatch_dir=str(ws)), said.append, said.append, backend=be)
    assert result.exit_code == 0, (result.message, said)
    assert len(submitted) == 1 and submitted[0] is rendered[0]
    # The job's state was its Prepared's and its LiveJob's: the backend, a scheduler, is as it was.
    assert {k: repr(v) for k, v in vars(be).items()} == before
    (python,) = {n.python for n in submitted[0].plan.topology.nodes}

    def same(text: str) -> str:
        return re.sub(r"PADDLE_JOB_ID=\S+", "PADDLE_JOB_ID=<id>", text).replace(python, "<python>")

    assert same(submitted[0].text()) == same(dry.stdout.replace(be.cfg.python, python))


QSUB = '''"""A throwaway PBS backend, written as docs/backends.md "Adding a backend" says, to show what a new engine
touches: this package, one registry line and one test module."""

from paddle_cluster.launch.backends.base import (Backend, BackendHelp, BackendOption, Description, Prepared, Request,
                                                 plan_text)
from paddle_cluster.launch.config import ConfKey
from paddle_cluster.launch.errors import ClusterError
from paddle_cluster.launch.plan import Topology
from paddle_cluster.node.bootstrap import RankVars

RANKS = RankVars("pbsdsh", "PBS_NODENUM", "PBS_NUM_NODES", "PBS_VNODENUM")
QUEUE = ConfKey("QSUB_QUEUE", "batch", check=lambda q: "" if q.isidentifier() else "a queue's name")


class QsubBackend(Backend):
    name = "qsub"
    help = BackendHelp("PBS jobs", "the qsub script")
    needs_hosts = False
    options = (BackendOption("--queue", "queue", "The PBS queue (qsub -q).", metavar="Q"),)
    conf_keys = (QUEUE,)

    @classmethod
    def create(cls, cfg, opts, detach=False):
        be = cls()
        be.cfg, be.queue = cfg, opts.get("queue") or QUEUE.of(cfg)
        return be

    def preview(self, spec, say):
        return Prepared(Topology.hosts(spec.cfg, ["<node0>", "<node1>"]), ("node0", "node1"), ("node0", "node1"))

    def prepare(self, spec, say):
        raise ClusterError("qsub: no PBS server here")

    def render(self, plan, prepared):
        argv = ["pbsdsh", "python3", "-m", "paddle_cluster.node", "bootstrap", "--ranks", RANKS.text()]
        script = f"#PBS -q {self.queue}\\n#PBS -l nodes={len(plan.nodes)}\\n" + " ".join(argv)
        return Request(plan, ((f"qsub script of job {plan.name}, job id {plan.env.job_id}", script),
                              ("each node runs its share of the plan:", plan_text(plan, prepared.labels))),
                       {"backend": self.name}, prepared)

    def submit(self, request, say):
        raise ClusterError("qsub: no PBS server here")

    @classmethod
    def describe(cls, job):
        return Description("", [])

    @classmethod
    def logs(cls, job, node, role, lines, follow, out):
        raise ClusterError("qsub: no PBS server here")

    @classmethod
    def cancel(cls, job, say):
        return []
'''

# Its line in launch/registry.py, made in every interpreter of the test (the CLI's, the suite's) before anything
# reads the registry, as the edit of that file would be.
REGISTRY_LINE = '''from paddle_cluster.launch.registry import REGISTRY
REGISTRY["qsub"] = "qsubbackend:QsubBackend"
'''

# Its module under tests/engines/: what its dry run prints, and the option it is given.
QSUB_ENGINE = '''"""The throwaway PBS backend: its dry run's markers; no engine of the conformance suite."""

NATIVE = ["#PBS -l nodes=2", "--ranks pbsdsh:PBS_NODENUM", "#PBS -q long"]
DRY_RUN = {"queue": "long"}
ENGINES = ()
'''


def test_a_new_backend_is_its_package_one_registry_line_and_one_test_module(tmp_path):
    """docs/backends.md's "Adding a backend", done: a throwaway PBS backend's package and its line in REGISTRY give
    ``run --help`` its options, a conf.py its key (a misspelt one refused with the fix), ``run --dry-run`` and
    ``render qsub`` its request of the plan every backend gets, and ``run`` its error; and with its one module
    under tests/engines/ the suite's backend tests run on it too (on a copy of tests/ holding that module): nothing
    else was edited."""
    (tmp_path / "pkgs" / "qsubbackend").mkdir(parents=True)
    (tmp_path / "pkgs" / "qsubbackend" / "__init__.py").write_text(QSUB)
    (tmp_path / "pkgs" / "sitecustomize.py").write_text(REGISTRY_LINE)
    conf = write_settings(tmp_path / "conf.py", {"ROOT_DIR": str(tmp_path / "root"), "QSUB_QUEUE": "long",
                                                 "PADDLE_PORT": 7164})
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "train.py").write_text("print('hi')\n")
    env = _isolated(tmp_path)
    env["PYTHONPATH"] = str(tmp_path / "pkgs")

    def cli_with_qsub(*args: str) -> subprocess.CompletedProcess:
        return cli(conf, *args, env=env)

    helped = cli_with_qsub("run", "--help")
    assert helped.returncode == 0 and "Options of --backend qsub" in helped.stdout and "qsub -q" in helped.stdout
    for args in (["run", "--backend", "qsub", "--dry-run"], ["render", "qsub"]):
        res = cli_with_qsub(*args, "--job_dispatch_package", str(ws), "--job_name", "pbs1")
        assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
        assert "#PBS -q long\n#PBS -l nodes=2\n" in res.stdout and "--ranks pbsdsh:PBS_NODENUM" in res.stdout
        assert re.search(r"qsub script of job pbs1, job id pbs1-[0-9a-f]{8}", res.stdout), res.stdout
    queued = cli_with_qsub("run", "--backend", "qsub", "--dry-run", "--queue", "short", "--job_workspace", "/w")
    assert "#PBS -q short" in queued.stdout, queued.stderr
    ran = cli_with_qsub("run", "--backend", "qsub", "--job_workspace", "/w")
    assert ran.returncode != 0 and "qsub: no PBS server here" in ran.stderr and "Traceback" not in ran.stderr
    conf.write_text(conf.read_text().replace("QSUB_QUEUE", "QSUB_QUEU"))
    bad = cli_with_qsub("run", "--backend", "qsub", "--dry-run", "--job_workspace", "/w")
    assert bad.returncode == 2 and "did you mean QSUB_QUEUE?" in bad.stderr, bad.stderr

    # The suite: this checkout with a copy of tests/ that holds tests/engines/qsub.py, and the backend tests of this
    # file that take their backends from REGISTRY, run on qsub (the in-process one and two through the CLI).
    here = Path(__file__).resolve().parent
    repo = tmp_path / "repo"
    repo.mkdir()
    for entry in here.parent.iterdir():
        if entry.name != "tests":
            (repo / entry.name).symlink_to(entry)
    shutil.copytree(here, repo / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    (repo / "tests" / "engines" / "qsub.py").write_text(QSUB_ENGINE)
    items = ["test_render_leaves_its_backend_as_it_was[qsub]", "test_hosts_is_required_by_the_backends_whose_nodes_"
             "it_lists_only[qsub]", "test_dry_run_prints_the_native_request_and_starts_nothing[named-render-qsub]"]
    suite = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            *(f"tests/{Path(__file__).name}::{i}" for i in items)], cwd=repo, capture_output=True,
                           text=True, timeout=300, env=checkout_env(env), stdin=subprocess.DEVNULL)
    assert suite.returncode == 0 and f"{len(items)} passed" in suite.stdout, suite.stdout[-3000:] + suite.stderr
