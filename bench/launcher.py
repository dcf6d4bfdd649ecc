"""The launcher on real sshd hosts: time to all processes ready, workspace dispatch, unchanged re-dispatch.

Needs root (``tests/sshcluster.py``). ``run`` is driven through the CLI exactly as a user would; every
trainer prints its wall-clock start time, so "ready" is when the last trainer of the job started (the
launcher starts trainers only after every pserver listens). Dispatch is timed through the launcher's own
``deliver`` (the node sessions of ``run``, without the agents), against ``scp`` of the same file. The floor is
what each node costs whatever the launcher does: one SSH command, one interpreter.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

from .common import REPO, Stats, sshcluster_module, tests_helpers

TRAIN_PY = ("import time, os\n"
            "print('BENCH_READY %.6f %s' % (time.time(), os.environ['PADDLE_TRAINER_ID']), flush=True)\n")


def write_conf(path: Path, cl, hosts: List[str]) -> Path:
    settings = {
        "HOSTS": hosts, "ROOT_DIR": "/home/paddle", "PADDLE_NIC": "eth0", "PADDLE_PORT": 7164,
        "PADDLE_PORTS_NUM": 1, "PADDLE_PORTS_NUM_FOR_SPARSE": 1, "PYTHON": cl.python,
        "PSERVER_COMMAND": "{python} ps.py", "SSH_IDENTITY_FILE": str(cl.key_path),
        "SSH_KNOWN_HOSTS": str(cl.known_hosts), "SSH_CONNECT_TIMEOUT": 10.0, "START_TIMEOUT": 60.0,
        "KILL_GRACE": 2.0,
    }
    path.write_text("".join(f"{k} = {v!r}\n" for k, v in settings.items()))
    return path


def _run_cli(conf: Path, ws: Path, n: int) -> float:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.time()
    res = subprocess.run([sys.executable, "-m", "paddle_cluster", "--conf", str(conf), "run",
                          "--job_dispatch_package", str(ws)], capture_output=True, text=True, timeout=300, env=env,
                         stdin=subprocess.DEVNULL, cwd=REPO)
    if res.returncode != 0:
        raise RuntimeError(f"run failed ({res.returncode}): {res.stderr[-2000:]}")
    stamps = {m.group(2): float(m.group(1)) for m in re.finditer(r"BENCH_READY (\d+\.\d+) (\d+)", res.stdout)}
    if len(stamps) != n:
        raise RuntimeError(f"expected {n} trainers to report, got {sorted(stamps)}: {res.stdout[-1000:]}")
    return max(stamps.values()) - t0


def run(counts=(1, 2, 4, 8), reps: int = 3, dispatch_mb: int = 200, dispatch_counts=(1, 3, 8),
        dispatch_reps: int = 3) -> Dict[str, Any]:
    sc = sshcluster_module()
    out: Dict[str, Any] = {}
    work = Path(tempfile.mkdtemp(prefix="bench-launch-"))
    ws = work / "ws"
    ws.mkdir()
    (ws / "train.py").write_text(TRAIN_PY)
    (ws / "ps.py").write_text(tests_helpers().LISTEN_PS_PY)
    with sc.SSHCluster(max(counts + tuple(dispatch_counts)), work / "cluster") as cl:
        # -- run -> all processes ready ---------------------------------------------------------------
        _run_cli(write_conf(work / "conf-warm.py", cl, cl.hosts[:max(counts)]), ws, max(counts))  # installs lib
        for n in counts:
            conf = write_conf(work / f"conf{n}.py", cl, cl.hosts[:n])
            out[f"launch_{n}"] = Stats([_run_cli(conf, ws, n) for _ in range(reps)])
        out.update(_floor(cl, work, sorted({min(counts), 8 if 8 in counts else max(counts), max(counts)}), reps))
        # -- dispatch of a big workspace, on 1 Gbit/s links (the launcher's own link too) --------------------
        big, blob = _workspace_of(work / "big", dispatch_mb)
        for rate, key, ws_dir, file, hosts in (("1gbit", "", big, blob, dispatch_counts),
                                               # where the shared cores are not the limit (see docs)
                                               ("100mbit", "slow_", *_workspace_of(work / "small", dispatch_mb // 4),
                                                (max(dispatch_counts),))):
            for i in range(cl.n):
                cl.shape(i, rate)
            cl.shape_uplink(rate)
            out.update(_dispatch(cl, work, ws_dir, file, hosts, dispatch_reps, key))
    shutil.rmtree(work, ignore_errors=True)
    return out


def _floor(cl, work: Path, counts: List[int], reps: int) -> Dict[str, Any]:
    """What every launch costs each node whatever the launcher does, on open connections: one SSH command
    (sshd's session and the user's login shell, which runs its rc files) and one Python interpreter."""
    sys.path.insert(0, REPO)
    from paddle_cluster.launch.config import load_config
    from paddle_cluster.launch.hosts import fanout, make_nodes

    out: Dict[str, Any] = {}
    for n in counts:
        nodes = make_nodes(load_config(str(write_conf(work / f"conf-floor{n}.py", cl, cl.hosts[:n]))))
        try:
            fanout(nodes, lambda x: x.run(["true"])).ok("warming up")
            for key, argv in (("floor_ssh", ["true"]), ("floor_python", [cl.python, "-c", "pass"])):
                samples = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    fanout(nodes, lambda x: x.run(argv)).ok(key)  # noqa: B023 - called before the loop moves on
                    samples.append(time.perf_counter() - t0)
                out[f"{key}_{n}"] = Stats(samples)
        finally:
            fanout(nodes, lambda x: x.close())
    return out


def _workspace_of(ws: Path, mb: int):
    """A workspace of ``mb`` MiB of random bytes (data.bin) and a train.py; (its directory, data.bin)."""
    ws.mkdir()
    blob = ws / "data.bin"
    with open(blob, "wb") as f:
        for _ in range(mb):
            f.write(os.urandom(1 << 20))
    (ws / "train.py").write_text(TRAIN_PY)
    return ws, blob


def _dispatch(cl, work: Path, big: Path, blob: Path, counts, reps: int, key: str = "") -> Dict[str, Any]:
    """Full dispatch to each count of hosts (nothing cached; the whole ``deliver``, and its workspace step: from
    'go' to every job directory in place, i.e. the sending without the sessions), the same again unchanged on
    3 hosts, and one ``scp``."""
    sys.path.insert(0, REPO)
    from paddle_cluster.launch.backends.ssh import SSHBackend
    from paddle_cluster.launch.config import load_config
    from paddle_cluster.launch.plan import JobSpec

    quiet = lambda _msg: None  # noqa: E731
    want = hashlib.sha256(blob.read_bytes()).hexdigest()
    out: Dict[str, Any] = {f"{key}dispatch_ok": True}

    def clear(n: int) -> None:
        for i in range(n):
            for cache in ("packages", "trees"):  # archives and unpacked trees: the next delivery sends again
                shutil.rmtree(cl.root_dir(i) / ".paddle_cluster" / cache, ignore_errors=True)
            for d in cl.root_dir(i).glob("BENCHJOB*"):
                shutil.rmtree(d, ignore_errors=True)

    def verify(name: str, n: int) -> bool:
        return all(hashlib.sha256((cl.root_dir(i) / name / "data.bin").read_bytes()).hexdigest() == want
                   for i in range(n))

    for n in counts:
        cfg = load_config(str(write_conf(work / f"conf-dispatch{n}.py", cl, cl.hosts[:n])))
        backend = SSHBackend(cfg)
        backend.probe_cluster(quiet, check_ports=False)
        full, again, step, moved = [], [], [], []
        try:
            for r in range(reps + 1):
                clear(n)
                spec = JobSpec(cfg, f"BENCHJOB{r}", dispatch_dir=str(big))
                t0 = time.perf_counter()
                backend.deliver(spec, quiet)
                t1 = time.perf_counter()
                out[f"{key}dispatch_ok"] = out[f"{key}dispatch_ok"] and verify(spec.name, n)
                if r:  # the first round is the warm-up
                    full.append(t1 - t0)
                    moved.append(backend.workspace_seconds)
                if n == 3:
                    spec2 = JobSpec(cfg, f"BENCHJOB{r}b", dispatch_dir=str(big))
                    t2 = time.perf_counter()
                    backend.deliver(spec2, quiet)
                    t3 = time.perf_counter()
                    out[f"{key}dispatch_ok"] = out[f"{key}dispatch_ok"] and verify(spec2.name, n)
                    if r:
                        again.append(t3 - t2)
                        step.append(backend.workspace_seconds)
        finally:
            backend.close()
        out[f"{key}dispatch_full_{n}"], out[f"{key}dispatch_moved_{n}"] = Stats(full), Stats(moved)
        if again:
            out[f"{key}dispatch_again"], out[f"{key}dispatch_again_step"] = Stats(again), Stats(step)
    scp = []
    for r in range(reps + 1):
        t0 = time.perf_counter()
        subprocess.run(["scp", "-q", "-i", cl.key_path, "-o", f"UserKnownHostsFile={cl.known_hosts}",
                        "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes", str(blob),
                        f"root@{cl.ips[0]}:/home/paddle/scp-data.bin"], check=True, stdin=subprocess.DEVNULL)
        if r:
            scp.append(time.perf_counter() - t0)
    out[f"{key}scp"] = Stats(scp)
    out[f"{key}scp_ok"] = hashlib.sha256((cl.root_dir(0) / "scp-data.bin").read_bytes()).hexdigest() == want
    clear(max(counts))
    return out
