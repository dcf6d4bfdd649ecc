"""Helpers shared by the test modules (their fixtures are in conftest.py): free ports, waiting on a condition
with a deadline, the process sweep of the SSH cluster and of local process groups, config files, the CLI, the
stand-in processes (also the benchmarks': bench/common.py), and a checkpointing job.

Test modules import from here, from rt_helpers.py (pserver/trainer processes) and from sshcluster.py, never
from each other.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Iterator, List, Tuple

REPO = Path(__file__).resolve().parent.parent
ROOT = "/home/paddle"  # ROOT_DIR on the SSH cluster's nodes (each has its own, see sshcluster.py)


def dataset_dir(*parts: str, var: str = "") -> Path:
    """A directory of the shared test datasets: ``$var`` when that names one, else under ``$PADDLE_CLUSTER_DATASETS``,
    else under the checkout's sibling ``shared/datasets`` (``<repo>/../shared/datasets``: where the development
    machine and CI put them). Never one machine's absolute path."""
    if var and os.environ.get(var):
        return Path(os.environ[var])
    root = os.environ.get("PADDLE_CLUSTER_DATASETS") or REPO.parent / "shared" / "datasets"
    return Path(root, *parts)


# -- ports ------------------------------------------------------------------------------------------------


# Seed scripts (tests/seeds/) as a PaddlePaddle user ports them: the two import lines, and what they print.
SEEDS = Path(__file__).resolve().parent / "seeds"
HOUSING = REPO / "examples" / "fit_a_line" / "housing.data"
IMPORTS = {"import paddle\n": "import paddle_cluster.compat.paddle as paddle\n",
           "import paddle.fluid as fluid\n": "import paddle_cluster.compat.paddle.fluid as fluid\n"}
LOSS = re.compile(r"^Epoch: (\d+), Batch: (\d+), loss: (\S+)$", re.M)


def ported(src: Path, dest: Path) -> Path:
    """``src`` with its two ``import paddle`` lines replaced -- and a check that nothing else changed."""
    lines = src.read_text().splitlines(keepends=True)
    out = [IMPORTS.get(line, line) for line in lines]
    assert sum(a != b for a, b in zip(lines, out)) == 2
    dest.write_text("".join(out))
    return dest


def losses(out: str):
    return [(int(e), int(b), float(v)) for e, b, v in LOSS.findall(out)]


def ports_free(ports: Iterable[int], host: str = "127.0.0.1") -> bool:
    """True if every port binds on ``host`` right now (SO_REUSEADDR, as the pserver and the preflight bind)."""
    for port in ports:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError:
                return False
    return True


def free_port_range(n: int) -> int:
    """First of ``n`` consecutive ports free on 127.0.0.1, below Linux's ephemeral range (32768 up), picked at
    random so concurrent test runs rarely try the same ones."""
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    lo, hi = 20000, 32000
    for _ in range(200):
        base = rng.randrange(lo, hi - n)
        if ports_free(range(base, base + n)):
            return base
    raise RuntimeError(f"no {n} consecutive free ports in [{lo}, {hi})")


# -- waiting ----------------------------------------------------------------------------------------------


def wait_for(pred, timeout: float, what: str, interval: float = 0.2):
    """``pred()``'s first true value, polled until ``timeout`` seconds have passed; else fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def stop_groups(procs: Iterable[subprocess.Popen]) -> None:
    """SIGKILL the process group of each of ``procs`` (each started with ``start_new_session``), reap it and
    close its stdout: what a test's or a benchmark's ``finally`` does with the processes it started."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            pass
        if p.stdout:
            p.stdout.close()


def assert_nothing_left(cluster, within: float = 15.0) -> None:
    """Every node of ``cluster`` runs no process (sshd aside) within ``within`` seconds."""
    left = {}

    def empty() -> bool:
        left.update({i: cluster.pids(i) for i in range(len(cluster.hosts))})
        return not any(left.values())

    try:
        wait_for(empty, within, "the nodes to be empty")
    except AssertionError:
        raise AssertionError(f"processes left on the nodes: {left}") from None


# -- subprocesses ------------------------------------------------------------------------------


def checkout_env(base=None, **over: str) -> dict:
    """``base`` (default: this process's environment) with this checkout first on PYTHONPATH, so a subprocess
    runs this paddle_cluster and not an installed one, whatever its working directory; ``over`` sets more."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.update(over)
    return env


OMIT = object()  # a write_conf / local_conf value: leave the key out (the README's conf.py has no such key)


def write_settings(path: Path, settings: dict) -> Path:
    path.write_text("".join(f"{k} = {v!r}\n" for k, v in settings.items() if v is not OMIT))
    return path


def write_conf(tmp: Path, cluster, name: str = "conf.py", hosts=None, **over) -> Path:
    """A conf.py for ``cluster`` (an SSHCluster): its hosts, key and known_hosts; ``over`` sets more keys."""
    settings = {
        "HOSTS": hosts if hosts is not None else cluster.hosts,
        "ROOT_DIR": ROOT,
        "PADDLE_NIC": "eth0",
        "PADDLE_PORT": 7164,  # each node has its own network namespace: no other job listens there
        "PADDLE_PORTS_NUM": 2,
        "PADDLE_PORTS_NUM_FOR_SPARSE": 1,
        "LD_LIBRARY_PATH": "/extra/lib",
        "PYTHON": cluster.python,
        "PSERVER_COMMAND": "{python} ps.py",
        "ENV": {"MY_SETTING": "42"},
        "SSH_IDENTITY_FILE": str(cluster.key_path),
        "SSH_KNOWN_HOSTS": str(cluster.known_hosts),
        "SSH_CONNECT_TIMEOUT": 4.0,
        "START_TIMEOUT": 30.0,
        "ORPHAN_TIMEOUT": 6.0,
        "KILL_GRACE": 2.0,
    }
    return write_settings(tmp / name, {**settings, **over})


def local_conf(tmp: Path, name: str = "conf.py", **over) -> Path:
    """A conf.py for this machine alone (ROOT_DIR ``tmp/root``), listening on free ports; ``over`` sets more."""
    from paddle_cluster.launch.config import ClusterConfig  # not at the top: trainers import this module too

    settings = {"HOSTS": ["localhost"], "ROOT_DIR": str(tmp / "root"), "PADDLE_NIC": "lo",
                "PYTHON": sys.executable, **over}
    if "PADDLE_PORT" not in settings:
        per = settings.get("PADDLE_PORTS_NUM", ClusterConfig.paddle_ports_num) + \
            settings.get("PADDLE_PORTS_NUM_FOR_SPARSE", ClusterConfig.paddle_ports_num_for_sparse)
        # The pservers' ports, then MASTER_PORT and the trainers' (a collective job's only ones).
        settings["PADDLE_PORT"] = free_port_range(
            per * settings.get("PSERVERS_PER_NODE", ClusterConfig.pservers_per_node) + 1
            + settings.get("TRAINERS_PER_NODE", ClusterConfig.trainers_per_node))
    return write_settings(tmp / name, settings)


def cli(conf: Path, *args: str, timeout: float = 120, env=None) -> subprocess.CompletedProcess:
    """``paddle-cluster --conf CONF ARGS...`` to its end (at most ``timeout`` seconds)."""
    return subprocess.run([sys.executable, "-m", "paddle_cluster", "--conf", str(conf), *args],
                          capture_output=True, text=True, timeout=timeout, env=checkout_env(env),
                          stdin=subprocess.DEVNULL)


def start_cli(conf: Path, *args: str, env=None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "paddle_cluster", "--conf", str(conf), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=checkout_env(env),
                            stdin=subprocess.DEVNULL)


def no_traceback(res: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in res.stderr and "Traceback" not in res.stdout, res.stderr


class Launch:
    """``paddle-cluster run`` in the background; every output line kept with the time it arrived."""

    def __init__(self, conf_path: Path, *args: str) -> None:
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-m", "paddle_cluster", "--conf", str(conf_path), "run",
                                      *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=checkout_env(), stdin=subprocess.DEVNULL)
        self.lines: list = []  # (time, stream, line)
        self._lock = threading.Lock()
        self._readers = [threading.Thread(target=self._read, args=(f, k), daemon=True)
                         for f, k in ((self.proc.stdout, "out"), (self.proc.stderr, "err"))]
        for t in self._readers:
            t.start()

    def _read(self, f, kind: str) -> None:
        for line in iter(f.readline, ""):
            with self._lock:
                self.lines.append((time.monotonic(), kind, line.rstrip("\n")))

    def find(self, pattern: str, after: float = 0.0):
        """(time, line) of the first line at or after ``after`` matching the regex, or None."""
        with self._lock:
            for t, _, line in self.lines:
                if t >= after and re.search(pattern, line):
                    return t, line
        return None

    def wait_line(self, pattern: str, timeout: float = 60.0, after: float = 0.0):
        return wait_for(lambda: self.find(pattern, after), timeout, f"a line matching {pattern!r}; got:\n"
                        + self.text()[-3000:])

    def finish(self, timeout: float = 120.0) -> int:
        """The launcher's exit code; it is killed (and the test fails) if it has not exited within ``timeout``."""
        try:
            self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        for t in self._readers:  # a killed launcher's children may hold its pipes a little longer
            t.join(timeout=5)
        return self.proc.returncode

    @property
    def stdout(self) -> str:
        return "\n".join(line for _, k, line in self.lines if k == "out")

    @property
    def stderr(self) -> str:
        return "\n".join(line for _, k, line in self.lines if k == "err")

    def assert_no_launcher_traceback(self) -> None:
        """The launcher's own output has no traceback (the processes' lines are prefixed, report tails indented)."""
        assert not [line for _, _, line in self.lines if line.startswith("Traceback")], self.text()[-3000:]

    def text(self) -> str:
        return "\n".join(f"{k}: {line}" for _, k, line in self.lines)


# -- a workspace that checks the contract (launcher and node tests) ------------------------------------------

# A workspace whose trainer checks the whole environment contract and whose pserver stand-in just listens
# (the runtime's own pserver is exercised by the runtime and example tests).
CONTRACT_TRAIN_PY = r'''
import os, sys, time
e = os.environ
n = int(e["PADDLE_TRAINERS"])
tid = int(e["PADDLE_TRAINER_ID"])
assert e["PADDLE_TRAINING_ROLE"] == "TRAINER"
assert e["PADDLE_INIT_TRAINER_ID"] == str(tid) and 0 <= tid < n
assert e["PADDLE_INIT_NUM_GRADIENT_SERVERS"] == str(n)
ips = e["PADDLE_PSERVER_IPS"].split(",")
assert e["PADDLE_INIT_PSERVERS"] == e["PADDLE_PSERVER_IPS"]
assert e["PADDLE_CURRENT_IP"] in ips, (e["PADDLE_CURRENT_IP"], ips)
assert e["PADDLE_INIT_PORT"] == e["PADDLE_PSERVER_PORT"]
assert e["PADDLE_INIT_PORTS_NUM"] and e["PADDLE_INIT_PORTS_NUM_FOR_SPARSE"]
assert len(e["PADDLE_TRAINER_KEY"]) == 64 and "PADDLE_JOB_SECRET" not in e and e["PADDLE_JOB_ID"]
assert e["PADDLE_PSERVER_ENDPOINTS"].count(":") == len(ips)
assert "/extra/lib" in e["LD_LIBRARY_PATH"].split(":")[0], e["LD_LIBRARY_PATH"]
assert e["MY_SETTING"] == "42"
node = int(open(os.path.join(e["PADDLE_JOB_DIR"], "nodefile")).read())
assert e["PADDLE_CURRENT_IP"] == ips[node]
print(f"ENV OK trainer {tid} of {n} on node {node} args {sys.argv[1:]}")
if e.get("SLEEP_FOREVER"):
    print("sleeping", flush=True)
    time.sleep(3600)
if os.path.exists("crash-" + str(tid)):
    print("about to crash", flush=True)
    sys.exit(3)
'''

LISTEN_PS_PY = r'''
import os, socket, time
from paddle_cluster.contract import JobEnv
env = JobEnv.from_environ()
socks = []
for port in env.all_ports(env.pserver_id):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((env.current_ip, port))
    s.listen()
    socks.append(s)
print(f"pserver {env.pserver_id} listening on {env.current_ip}:{env.all_ports(env.pserver_id)}", flush=True)
time.sleep(3600)
'''


def make_workspace(path: Path) -> Path:
    """The launcher tests' workspace (with write_conf's ENV and PSERVER_COMMAND): a log/ that must not ship."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "train.py").write_text(CONTRACT_TRAIN_PY)
    (path / "ps.py").write_text(LISTEN_PS_PY)
    (path / "data").mkdir(exist_ok=True)
    (path / "data" / "part-0").write_text("1 2 3\n")
    (path / "log").mkdir(exist_ok=True)
    (path / "log" / "old.log").write_text("must not be shipped\n")
    return path



# -- the engine backends' jobs (test_backend_mpi.py, test_backend_slurm.py) ---------------------------------

FIT_A_LINE = REPO / "examples" / "fit_a_line"
FINAL_MSE = re.compile(r"^\[trainer\.0@node0\] final test_mse=(\S+)$", re.M)

# A trainer that prints every PADDLE_* variable it got (one JSON line), then holds until stopped, with a setsid
# grandchild (which escapes every process group); trainer <t> exits 3 instead when a file crash-<t> is there.
HOLD_PY = r"""
import json, os, subprocess, sys, time
tid = os.environ["PADDLE_TRAINER_ID"]
if os.path.exists("crash-" + tid):
    print("about to crash", flush=True)
    sys.exit(3)
print("env " + json.dumps({k: v for k, v in os.environ.items() if k.startswith("PADDLE_")}), flush=True)
subprocess.Popen(["sleep", "300"], start_new_session=True)
print("holding", tid, flush=True)
time.sleep(300)
"""


def small_workspace(tmp: Path, train: str = HOLD_PY, ps: str = LISTEN_PS_PY) -> Path:
    """``tmp/ws`` with ``train.py`` and a ``ps.py`` pserver stand-in (PSERVER_COMMAND = "{python} ps.py")."""
    ws = tmp / "ws"
    ws.mkdir()
    (ws / "train.py").write_text(train)
    (ws / "ps.py").write_text(ps)
    return ws

# What every trainer must see, whichever backend started it: the Fluid names, the v2 PADDLE_INIT_* names the
# seeds' scripts read, and the job's own.
TRAINER_VARS = ("PADDLE_TRAINING_ROLE", "PADDLE_PSERVER_IPS", "PADDLE_PSERVER_PORT", "PADDLE_TRAINERS",
                "PADDLE_TRAINER_ID", "PADDLE_CURRENT_IP",
                "PADDLE_INIT_PSERVERS", "PADDLE_INIT_PORT", "PADDLE_INIT_PORTS_NUM",
                "PADDLE_INIT_PORTS_NUM_FOR_SPARSE", "PADDLE_INIT_NUM_GRADIENT_SERVERS", "PADDLE_INIT_TRAINER_ID",
                "PADDLE_INIT_TRAINER_COUNT", "PADDLE_INIT_USE_GPU",
                "PADDLE_JOB_ID", "PADDLE_PSERVER_ENDPOINTS", "PADDLE_JOB_DIR", "PADDLE_WORKSPACE",
                "PADDLE_BARRIER_TIMEOUT", "PADDLE_TRAINER_KEY")


def check_trainer_env(lines: Iterable[str], ips, port: int, ports_num: int, sparse: int, job_dirs) -> None:
    """The ``env`` lines of HOLD_PY's trainers, one per node (trainer t on node t, whose address is ips[t] and
    whose job directory is job_dirs[t]), hold the whole contract with the values of that placement."""
    envs = {}
    for line in lines:
        got = re.match(r"^\[trainer\.(\d+)@node(\d+)\] env (\{.*\})$", line.strip())
        if got:
            assert got.group(1) == got.group(2), line  # one trainer per node, in node order
            envs[int(got.group(1))] = json.loads(got.group(3))
    assert sorted(envs) == list(range(len(ips))), f"env lines of trainers {sorted(envs)} of {len(ips)}"
    for t, e in envs.items():
        missing = [k for k in TRAINER_VARS if k not in e]
        assert not missing, f"trainer {t} lacks {missing}"
        assert e["PADDLE_TRAINING_ROLE"] == "TRAINER"
        assert e["PADDLE_TRAINER_ID"] == e["PADDLE_INIT_TRAINER_ID"] == str(t)
        assert e["PADDLE_TRAINERS"] == e["PADDLE_INIT_NUM_GRADIENT_SERVERS"] == str(len(ips))
        assert e["PADDLE_PSERVER_IPS"] == e["PADDLE_INIT_PSERVERS"] == ",".join(ips)
        assert e["PADDLE_PSERVER_PORT"] == e["PADDLE_INIT_PORT"] == str(port)
        assert e["PADDLE_PSERVER_ENDPOINTS"] == ",".join(f"{ip}:{port}" for ip in ips)
        assert (e["PADDLE_INIT_PORTS_NUM"], e["PADDLE_INIT_PORTS_NUM_FOR_SPARSE"]) == (str(ports_num), str(sparse))
        assert e["PADDLE_CURRENT_IP"] == ips[t] and e["PADDLE_JOB_DIR"] == str(job_dirs[t])
        assert len(e["PADDLE_TRAINER_KEY"]) == 64 and "PADDLE_JOB_SECRET" not in e
    assert len({e["PADDLE_JOB_ID"] for e in envs.values()}) == 1
    assert len({e["PADDLE_TRAINER_KEY"] for e in envs.values()}) == len(envs)  # a key per trainer


# -- a checkpointing job on the SSH cluster (fault and security tests) ---------------------------------------

# train.py pushes a gradient of ones with SGD lr=0.5 every step, so in sync mode the final parameters are
# exactly ``-0.5 * total`` whatever was rolled back and replayed; trainer 0 checkpoints every ``every`` steps.
TRAIN_PY = r'''
import os, sys, time
import numpy as np
from paddle_cluster.ps import OptimizerSpec, connect
total, every, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
delay = float(os.environ.get("STEP_DELAY", "0.05"))
n = int(os.environ.get("PARAM_SIZE", "40000"))
hold = os.environ.get("HOLD_FILE")  # every trainer waits at step ``every`` while this file exists
# Small blocks, so every pserver holds a part of w (and of every checkpoint).
ps = connect(mode=mode, optimizer=OptimizerSpec("sgd", lr=0.5), max_block_bytes=max(1 << 15, n * 4 // 8))
w = ps.register_dense({"w": np.zeros(n, np.float32)})["w"]
print(f"start step={ps.step} w0={w[0]:g}", flush=True)   # a resumed job starts at the checkpoint's step
g = np.ones(n, np.float32)
while ps.step < total:
    while hold and ps.step == every and os.path.exists(hold):
        time.sleep(0.05)
    ps.pull()
    ps.push({"w": g})
    if ps.trainer_id == 0 and ps.step % every == 0:
        info = ps.save_checkpoint()
        print(f"checkpoint step={info.step}", flush=True)
    time.sleep(delay)
w = ps.pull()["w"]
print(f"end step={ps.step} w0={w[0]:g} all_equal={bool((w == w[0]).all())}", flush=True)
ps.close()
'''

TOTAL, EVERY = 60, 10
FAST = {"BARRIER_TIMEOUT": 5.0, "ORPHAN_TIMEOUT": 5.0, "KILL_GRACE": 1.0, "START_TIMEOUT": 20.0,
        "SSH_CONNECT_TIMEOUT": 4.0, "PSERVER_COMMAND": "{python} -m paddle_cluster.ps",
        "PADDLE_PORTS_NUM": 1, "PADDLE_PORTS_NUM_FOR_SPARSE": 0, "ENV": {}}


def workspace(tmp: Path) -> Path:
    ws = tmp / "ws"
    ws.mkdir(exist_ok=True)
    (ws / "train.py").write_text(TRAIN_PY)
    return ws


def conf(tmp: Path, cluster, name: str = "conf.py", **over) -> Path:
    return write_conf(tmp, cluster, name, **{**FAST, **over})


def proc_pid(cluster, node: int, job: str, name: str) -> int:
    """The pid the agent recorded for process ``name`` of ``job`` on ``node`` (latest record wins)."""
    path = cluster.root_dir(node) / job / ".paddle_cluster" / "procs.json"

    def get():
        try:
            recs = [p for p in json.loads(path.read_text())["procs"] if p["name"] == name]
        except (OSError, ValueError, KeyError):
            return None
        return recs[-1]["pid"] if recs else None
    return wait_for(get, 30, f"{name} of {job} on node{node}")


def final_w(run: Launch, trainers: int = 3) -> float:
    """The one final value of w every trainer printed (all of w equal)."""
    ends = [run.find(rf"\[trainer\.{t}@node\d\] end step=") for t in range(trainers)]
    assert all(ends), run.text()[-3000:]
    values = {float(re.search(r"w0=(\S+)", e[1]).group(1)) for e in ends}
    assert all("all_equal=True" in e[1] for e in ends)
    assert len(values) == 1, values
    return values.pop()


# -- the hosts' interpreter from their login shell's rc file (test_interpreter.py, test_conformance.py) ----------


@contextlib.contextmanager
def rc_python(cluster, tmp: Path):
    """Root's ``~/.bashrc`` on every host (each in its own mount namespace; the file itself is shared) puts a
    directory first on PATH whose ``python3`` is an interpreter with numpy; yields that ``python3``'s path."""
    # This interpreter's own directory, not a link to the file behind it: a link elsewhere to a venv's python
    # runs the base interpreter, without the venv's packages (numpy among them).
    bindir = Path(sys.executable).parent
    python = bindir / "python3"
    assert python.exists(), f"{bindir} has no python3 for the hosts' rc file to put first on PATH"
    (tmp / "rc-python").mkdir(parents=True)
    rc = tmp / "rc-python" / "bashrc"
    rc.write_text(f'export PATH="{bindir}:$PATH"\n')
    bashrc = str(Path(os.path.expanduser("~root")) / ".bashrc")
    if not os.path.exists(bashrc):
        import pytest  # not at the top: trainers import this module too

        pytest.skip(f"{bashrc} does not exist to bind an rc file over")
    mounted = []
    try:
        for i in range(cluster.n):
            cluster.exec(i, ["mount", "--bind", str(rc), bashrc])  # stacks over an empty one (plain_shell)
            mounted.append(i)
        yield str(python)
    finally:
        for i in mounted:
            cluster.exec(i, ["umount", bashrc], check=False)


def secret_holders(tops: Iterable[Path], needles: Iterable[str], skip: Iterable[Path] = ()) -> Tuple[List[str],
                                                                                                   List[str]]:
    """Where the job secret (any of ``needles``) is on disk under the directories ``tops`` (but in ``skip``):
    (every regular file holding it, read as root whatever its mode; those of them user ``nobody`` can read).
    nobody walks from each top as a user there does (each top opened as root: the tests' own parents are
    private), in a forked child with its ids."""
    import pwd

    needles = [n.encode() for n in needles if n]
    skipped = {str(p) for p in skip}
    held = [str(p) for top in tops for p in Path(top).rglob("*") if str(p) not in skipped
            and p.is_file() and not p.is_symlink() and any(n in p.read_bytes() for n in needles)]
    pw = pwd.getpwnam("nobody")
    readable: List[str] = []
    for top in tops:
        top_fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: nobody's ids, no capabilities; every file it can open and read
            try:
                os.close(r)
                os.setgroups([])
                os.setgid(pw.pw_gid)
                os.setuid(pw.pw_uid)
                found = []
                for dirpath, _dirs, files, dfd in os.fwalk(".", dir_fd=top_fd):
                    for name in files:
                        try:
                            fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW, dir_fd=dfd)
                        except OSError:
                            continue
                        try:
                            data = os.read(fd, 1 << 24) if os.path.isfile(f"/proc/self/fd/{fd}") else b""
                        except OSError:
                            data = b""
                        os.close(fd)
                        path = os.path.normpath(os.path.join(top, dirpath, name))
                        if path not in skipped and any(n in data for n in needles):
                            found.append(path)
                os.write(w, "\n".join(found).encode())
            finally:
                os._exit(0)
        os.close(w)
        with os.fdopen(r, "rb") as f:
            readable += [x for x in f.read().decode().split("\n") if x]
        os.waitpid(pid, 0)
        os.close(top_fd)
    return held, readable


def run_alone(monkeypatch, tmp_path: Path, frontend: str = "") -> Iterator[Any]:
    """The body of a test file's ``alone`` fixture: this process as a trainer run alone (no launcher's PADDLE_
    variables, so a frontend starts its in-process pserver), in ``tmp_path``; with ``frontend`` ("torch",
    "paddle") it yields ``paddle_cluster.<frontend>`` and shuts it down after the test."""
    for k in [k for k in os.environ if k.startswith("PADDLE_")]:
        monkeypatch.delenv(k)
    monkeypatch.chdir(tmp_path)
    mod = importlib.import_module(f"paddle_cluster.{frontend}") if frontend else None
    yield mod
    if mod is not None:
        mod.shutdown()
