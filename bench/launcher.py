"""The launcher on real sshd hosts: time to all processes ready, workspace dispatch, unchanged re-dispatch.

Needs root (``tests/sshcluster.py``). ``run`` is driven through the CLI exactly as a user would; every
trainer prints its wall-clock start time, so "ready" is when the last trainer of the job started (the
launcher starts trainers only after every pserver listens). Dispatch is timed as the user waits for it,
through the launcher's own ``deliver`` (the node sessions of ``run``, without the agents): a new workspace every
round (packing included), less a tiny new workspace's ``deliver``, against ``scp`` of the same file. The floor is
what each node costs whatever the launcher does: one SSH command, one interpreter. Every launch, dispatch and
``scp`` also reports its CPU: the launcher's (with its ``ssh`` children) and every host's (its cgroup), so the
goals can show the bound (launcher + hosts) / cores beside the time. The launch, floor and dispatch
rows are measured again on hosts whose login shell reads no rc file (``plain_``), in the same run.
"""

from __future__ import annotations

import hashlib
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from .common import REPO, Row, Stats, sshcluster_module, tests_helpers

TRAIN_PY = ("import time, os\n"
            "print('BENCH_READY %.6f %s' % (time.time(), os.environ['PADDLE_TRAINER_ID']), flush=True)\n")


def write_conf(path: Path, cl, hosts: List[str], python: str = "") -> Path:
    settings = {
        "HOSTS": hosts, "ROOT_DIR": "/home/paddle", "PADDLE_NIC": "eth0", "PADDLE_PORT": 7164,
        "PADDLE_PORTS_NUM": 1, "PADDLE_PORTS_NUM_FOR_SPARSE": 1, "PYTHON": python or cl.python,
        "PSERVER_COMMAND": "{python} ps.py", "SSH_IDENTITY_FILE": str(cl.key_path),
        "SSH_KNOWN_HOSTS": str(cl.known_hosts), "SSH_CONNECT_TIMEOUT": 10.0, "START_TIMEOUT": 60.0,
        "KILL_GRACE": 2.0,
    }
    path.write_text("".join(f"{k} = {v!r}\n" for k, v in settings.items()))
    return path


def _cpu_self() -> float:
    """CPU seconds of this process and its waited-for children (the launcher, and its ``ssh`` clients)."""
    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime


def _cpu_nodes(cl, n: int) -> List[float]:
    return [cl.cpu_seconds(i) or 0.0 for i in range(n)]


def _settle(cl, n: int, sessions: bool) -> None:
    """Wait (a deadline, not a sleep) until what a launch or dispatch started on the first ``n`` nodes has ended,
    so its CPU is all counted; ``sessions``: the SSH sessions too (their connection is closed)."""
    deadline = time.monotonic() + 15
    for i in range(n):
        while cl.pids(i, include_ssh_sessions=sessions) and time.monotonic() < deadline:
            time.sleep(0.05)


def _run_cli(cl, conf: Path, ws: Path, n: int) -> Tuple[float, float, float]:
    """One ``run`` through the CLI: (seconds to the last trainer's start, the launcher's CPU seconds -- the CLI
    and its children --, the nodes' CPU seconds: sshd, shells, session, agent, pservers, trainers)."""
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    c0, n0 = _cpu_self(), _cpu_nodes(cl, n)
    t0 = time.time()
    res = subprocess.run([sys.executable, "-m", "paddle_cluster", "--conf", str(conf), "run",
                          "--job_dispatch_package", str(ws)], capture_output=True, text=True, timeout=300, env=env,
                         stdin=subprocess.DEVNULL, cwd=REPO)
    c1 = _cpu_self()
    if res.returncode != 0:
        raise RuntimeError(f"run failed ({res.returncode}): {res.stderr[-2000:]}")
    stamps = {m.group(2): float(m.group(1)) for m in re.finditer(r"BENCH_READY (\d+\.\d+) (\d+)", res.stdout)}
    if len(stamps) != n:
        raise RuntimeError(f"expected {n} trainers to report, got {sorted(stamps)}: {res.stdout[-1000:]}")
    _settle(cl, n, sessions=True)
    return max(stamps.values()) - t0, c1 - c0, sum(_cpu_nodes(cl, n)) - sum(n0)


def run(counts=(1, 2, 4, 8), reps: int = 3, dispatch_mb: int = 200, dispatch_counts=(1, 3, 8),
        dispatch_reps: int = 3, parts=("launch", "dispatch")) -> Dict[str, Any]:
    """Every row on the machine as it is, and the launch, floor and dispatch rows again with hosts whose login
    shell reads no rc file (``plain_``, ``plainslow_``), and the 3-host dispatch with another job loading the
    machine (``loaded_``), in one run on one cluster. ``parts``: "launch", "dispatch" or both."""
    sc = sshcluster_module()
    out: Dict[str, Any] = {}
    work = Path(tempfile.mkdtemp(prefix="bench-launch-"))
    ws = work / "ws"
    ws.mkdir()
    (ws / "train.py").write_text(TRAIN_PY)
    (ws / "ps.py").write_text(tests_helpers().LISTEN_PS_PY)
    plain = tuple(sorted({min(counts), 8 if 8 in counts else max(counts)}))
    with sc.SSHCluster(max(counts + tuple(dispatch_counts)), work / "cluster") as cl:
        out["cpu_accounting"] = cl.cpu_seconds(0) is not None
        # -- run -> all processes ready ---------------------------------------------------------------
        _run_cli(cl, write_conf(work / "conf-warm.py", cl, cl.hosts[:max(counts)]), ws, max(counts))  # the lib
        if "launch" in parts:
            for key, launch_counts in (("", counts), ("plain_", plain)):
                cl.set_plain_shell(bool(key))
                out.update(_launches(cl, work, ws, launch_counts, reps, key))
                out.update(_floor(cl, work, sorted({*plain, max(launch_counts)}), reps, key))
            out.update(_census(cl, work, ws, plain))
        cl.set_plain_shell(False)
        # -- dispatch of a big workspace, on 1 Gbit/s links (the launcher's own link too) --------------------
        big, blob = _workspace_of(work / "big", dispatch_mb)
        small, small_blob = _workspace_of(work / "small", dispatch_mb // 4)
        top = (max(dispatch_counts),)
        mid = tuple(n for n in dispatch_counts if n == 3) or top
        for rate, key, ws_dir, file, hosts in (("1gbit", "", big, blob, dispatch_counts),
                                               ("1gbit", "loaded_", big, blob, mid),
                                               # where the shared cores are not the limit (see docs)
                                               ("100mbit", "slow_", small, small_blob, top),
                                               ("1gbit", "plain_", big, blob, dispatch_counts),
                                               ("100mbit", "plainslow_", small, small_blob, top)):
            if "dispatch" not in parts:
                break
            cl.set_plain_shell(key.startswith("plain"))
            for i in range(cl.n):
                cl.shape(i, rate)
            cl.shape_uplink(rate)
            out.update(_dispatch(cl, work, ws_dir, file, hosts, dispatch_reps, key, loaded=key == "loaded_"))
    shutil.rmtree(work, ignore_errors=True)
    return out


def _launches(cl, work: Path, ws: Path, counts, reps: int, key: str) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for n in counts:
        conf = write_conf(work / f"conf{n}.py", cl, cl.hosts[:n])
        wall, mine, nodes = zip(*(_run_cli(cl, conf, ws, n) for _ in range(reps)))
        out[f"{key}launch_{n}"], out[f"{key}launch_cpu_{n}"] = Stats(list(wall)), Stats(list(mine))
        out[f"{key}launch_node_cpu_{n}"] = Stats(list(nodes))
    return out


def _census(cl, work: Path, ws: Path, counts) -> Dict[str, Any]:
    """What one launch costs each host in SSH exec channels (sshd's 'Starting session' lines) and Python
    interpreters (PYTHON is a wrapper that notes each start), on the largest of ``counts``."""
    n = max(counts)
    wrapper = work / "python-counted"
    wrapper.write_text(f"#!/bin/sh\necho $$ >> /home/paddle/interpreters\nexec {cl.python} \"$@\"\n")
    wrapper.chmod(0o755)
    conf = write_conf(work / "conf-census.py", cl, cl.hosts[:n], python=str(wrapper))
    before = [_sessions_started(cl, i) for i in range(n)]
    for i in range(n):
        (cl.root_dir(i) / "interpreters").unlink(missing_ok=True)
    _run_cli(cl, conf, ws, n)
    return {"census_hosts": n,
            "census_channels": [_sessions_started(cl, i) - before[i] for i in range(n)],
            "census_interpreters": [len((cl.root_dir(i) / "interpreters").read_text().split()) for i in range(n)]}


def _sessions_started(cl, i: int) -> int:
    return (cl.workdir / f"sshd{i}.log").read_text().count("Starting session:")


def _floor(cl, work: Path, counts: List[int], reps: int, prefix: str = "") -> Dict[str, Any]:
    """What every launch costs each node whatever the launcher does, on open connections: one SSH command
    (sshd's session and the user's login shell, which runs its rc files) and one Python interpreter."""
    sys.path.insert(0, REPO)
    from paddle_cluster.launch.access import make_nodes
    from paddle_cluster.launch.config import load_config
    from paddle_cluster.launch.each_node import each_node

    out: Dict[str, Any] = {}
    for n in counts:
        nodes = make_nodes(load_config(str(write_conf(work / f"conf-floor{n}.py", cl, cl.hosts[:n]))))
        try:
            each_node(nodes, lambda x: x.run(["true"])).ok("warming up")
            for key, argv in (("floor_ssh", ["true"]), ("floor_python", [cl.python, "-c", "pass"])):
                samples = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    each_node(nodes, lambda x: x.run(argv)).ok(key)  # noqa: B023 - called before the loop moves on
                    samples.append(time.perf_counter() - t0)
                out[f"{prefix}{key}_{n}"] = Stats(samples)
        finally:
            each_node(nodes, lambda x: x.close())
    return out


def _workspace_of(ws: Path, mb: int):
    """A workspace of ``mb`` MiB of random bytes (data.bin) and a train.py; (its directory, data.bin)."""
    ws.mkdir()
    blob = ws / "data.bin"
    _renew(blob, mb)
    (ws / "train.py").write_text(TRAIN_PY)
    return ws, blob


def _renew(blob: Path, mb: int) -> str:
    """New random contents for ``blob`` (a new workspace: the launcher has no archive of it); their SHA-256."""
    h = hashlib.sha256()
    with open(blob, "wb") as f:
        for _ in range(mb):
            b = os.urandom(1 << 20)
            h.update(b)
            f.write(b)
    return h.hexdigest()


HOG = "import time\nend = time.time() + 3600\nwhile time.time() < end:\n    sum(range(10000))\n"


def _hog() -> subprocess.Popen:
    """Another job loading the machine: one process keeping one core busy (as the issue's "heavy job")."""
    return subprocess.Popen([sys.executable, "-c", HOG], stdin=subprocess.DEVNULL)


def _dispatch(cl, work: Path, big: Path, blob: Path, counts, reps: int, key: str = "",
              loaded: bool = False) -> Dict[str, Any]:
    """Dispatch as the user waits for it: every round a new workspace (new bytes: packed while it is sent), the
    whole ``deliver`` from the call to every job directory in place, packing included, and the same for a tiny
    new workspace (what every launch costs whatever its size: sessions, probe, placing); the difference is the
    workspace's own time, set against one ``scp``. Also the sending (first byte sent -> every job directory in
    place), the same workspace again unchanged on 3 hosts (and its workspace step), and one ``scp``.
    ``loaded``: another job keeps one core busy meanwhile."""
    sys.path.insert(0, REPO)
    from paddle_cluster.launch.backends.ssh import SSHBackend
    from paddle_cluster.launch.config import load_config
    from paddle_cluster.launch.plan import JobSpec

    quiet = lambda _msg: None  # noqa: E731
    mb = blob.stat().st_size >> 20
    out: Dict[str, Any] = {f"{key}dispatch_ok": True}
    tiny = work / f"tiny-{key}"
    tiny.mkdir(exist_ok=True)
    (tiny / "train.py").write_text(TRAIN_PY)

    def clear(n: int) -> None:
        for i in range(n):
            for cache in ("packages", "trees"):  # archives and unpacked trees: the next delivery sends again
                shutil.rmtree(cl.root_dir(i) / ".paddle_cluster" / cache, ignore_errors=True)
            for d in cl.root_dir(i).glob("BENCHJOB*"):
                shutil.rmtree(d, ignore_errors=True)

    def verify(name: str, n: int, want: str) -> bool:
        return all(hashlib.sha256((cl.root_dir(i) / name / "data.bin").read_bytes()).hexdigest() == want
                   for i in range(n))

    hog = _hog() if loaded else None
    try:
        for n in counts:
            cfg = load_config(str(write_conf(work / f"conf-dispatch{n}.py", cl, cl.hosts[:n])))
            backend = SSHBackend(cfg)
            backend.probe_cluster(quiet, check_ports=False)
            full, small, again, step, moved, mine, nodes = [], [], [], [], [], [], []
            try:
                for r in range(reps + 1):
                    clear(n)
                    (tiny / "train.py").write_text(TRAIN_PY + f"# {key} {n} {r}\n")  # new: packed as sent
                    t0 = time.perf_counter()
                    backend.deliver(JobSpec(cfg, f"BENCHJOB{r}t", dispatch_dir=str(tiny)), quiet)
                    small_s = time.perf_counter() - t0
                    want = _renew(blob, mb)
                    spec = JobSpec(cfg, f"BENCHJOB{r}", dispatch_dir=str(big))
                    c0, n0 = _cpu_self(), _cpu_nodes(cl, n)
                    t0 = time.perf_counter()
                    delivered = backend.deliver(spec, quiet)
                    t1 = time.perf_counter()
                    c1 = _cpu_self()
                    _settle(cl, n, sessions=False)  # the connections stay open: their sshd is idle
                    out[f"{key}dispatch_ok"] = out[f"{key}dispatch_ok"] and verify(spec.name, n, want)
                    if r:  # the first round is the warm-up
                        full.append(t1 - t0)
                        small.append(small_s)
                        moved.append(delivered.sending_seconds)
                        mine.append(c1 - c0)
                        nodes.append(sum(_cpu_nodes(cl, n)) - sum(n0))
                    if n == 3 and not loaded:
                        spec2 = JobSpec(cfg, f"BENCHJOB{r}b", dispatch_dir=str(big))
                        t2 = time.perf_counter()
                        delivered = backend.deliver(spec2, quiet)
                        t3 = time.perf_counter()
                        out[f"{key}dispatch_ok"] = out[f"{key}dispatch_ok"] and verify(spec2.name, n, want)
                        if r:
                            again.append(t3 - t2)
                            step.append(delivered.workspace_seconds)
            finally:
                backend.close()
            out[f"{key}dispatch_full_{n}"], out[f"{key}dispatch_moved_{n}"] = Stats(full), Stats(moved)
            out[f"{key}dispatch_tiny_{n}"] = Stats(small)
            out[f"{key}dispatch_user_{n}"] = Stats([b - a for a, b in zip(small, full)])
            out[f"{key}dispatch_cpu_{n}"], out[f"{key}dispatch_node_cpu_{n}"] = Stats(mine), Stats(nodes)
            if again:
                out[f"{key}dispatch_again"], out[f"{key}dispatch_again_step"] = Stats(again), Stats(step)
        scp, mine, nodes = [], [], []
        want = hashlib.sha256(blob.read_bytes()).hexdigest()
        for r in range(reps + 1):
            c0, n0 = _cpu_self(), _cpu_nodes(cl, 1)
            t0 = time.perf_counter()
            subprocess.run(["scp", "-q", "-i", cl.key_path, "-o", f"UserKnownHostsFile={cl.known_hosts}",
                            "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes", str(blob),
                            f"root@{cl.ips[0]}:/home/paddle/scp-data.bin"], check=True, stdin=subprocess.DEVNULL)
            t1, c1 = time.perf_counter(), _cpu_self()
            _settle(cl, 1, sessions=True)
            if r:
                scp.append(t1 - t0)
                mine.append(c1 - c0)
                nodes.append(_cpu_nodes(cl, 1)[0] - n0[0])
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    out[f"{key}scp"], out[f"{key}scp_cpu_1"], out[f"{key}scp_node_cpu_1"] = Stats(scp), Stats(mine), Stats(nodes)
    out[f"{key}scp_ok"] = hashlib.sha256((cl.root_dir(0) / "scp-data.bin").read_bytes()).hexdigest() == want
    clear(max(counts))
    return out


PLAIN = ", plain login shell"  # rows measured on hosts whose login shell reads no rc file (SSHCluster.set_plain_shell)


def _cpu_note(out: Dict[str, Any], cpu: str, n: int) -> str:
    """'CPU: launcher a s, nodes b s (c per host)' for the results ``cpu`` (a key without its ``_cpu_{n}``)."""
    mine, nodes = out.get(f"{cpu}_cpu_{n}"), out.get(f"{cpu}_node_cpu_{n}")
    if mine is None or not out.get("cpu_accounting"):
        return ""
    return f"CPU: launcher {mine.median:.2f} s, nodes {nodes.median:.2f} s ({nodes.median / n:.3f} per host)"


def bound(m: Dict[str, Any], cpu: str, n: int) -> Optional[float]:
    """Seconds the CPU of a launch or dispatch needs on this machine's cores at best: (launcher + nodes) / cores;
    None without CPU accounting."""
    mine, nodes = m.get(f"{cpu}_cpu_{n}"), m.get(f"{cpu}_node_cpu_{n}")
    return None if mine is None or nodes is None or not m.get("cpu_accounting") else (mine + nodes) / m["cores"]


def launch_detail(m: Dict[str, Any], key: str, n: int) -> str:
    """The launch target's CPU accounting: what grows on the launcher with the hosts (ours), the nodes' share
    (each machine's own on a real cluster), and the bound on these cores against the 1-host launch."""
    b, one = bound(m, f"{key}launch", n), m.get(f"{key}launch_1")
    if b is None or one is None:
        return ""
    l1, ln, nodes = m[f"{key}launch_cpu_1"], m[f"{key}launch_cpu_{n}"], m[f"{key}launch_node_cpu_{n}"]
    return (f"launcher CPU {l1:.2f} s at 1 host, {ln:.2f} s at {n} ({1e3 * (ln - l1) / (n - 1):+.0f} ms per added "
            f"host); nodes {nodes / n:.2f} s per host; bound (launcher + nodes) / {m['cores']} cores {b:.2f} s "
            f"= {b / one:.2f}x 1 host")


def dispatch_detail(m: Dict[str, Any], key: str, n: int) -> str:
    b, scp = bound(m, f"{key}dispatch", n), m.get(f"{key}scp")
    if b is None or scp is None:
        return ""
    return (f"launcher CPU {m[f'{key}dispatch_cpu_{n}']:.2f} s, nodes {m[f'{key}dispatch_node_cpu_{n}'] / n:.2f} s "
            f"per host; bound {b:.2f} s = {b / scp:.2f}x scp")


def report(out: Dict[str, Any], c: Dict[str, Any], add, m: Dict[str, Any]) -> None:
    """The launcher section's rows (``add``) and the headline numbers the targets use (``m``), from ``run``."""
    m["cores"], m["cpu_accounting"] = os.cpu_count() or 1, out.get("cpu_accounting", False)
    for k, st in out.items():
        if isinstance(st, Stats):
            m[k] = st.median
    for key, suffix in (("", ""), ("plain_", PLAIN)):
        for n in sorted(int(k.rsplit("_", 1)[1]) for k in out if re.fullmatch(f"{key}launch_\\d+", k)):
            st = out[f"{key}launch_{n}"]
            add(Row("launcher", f"run -> all processes ready, {n} host(s){suffix}", st.median, "s", st.spread(),
                    check="ok", note=_cpu_note(out, f"{key}launch", n), extra=st.to_dict()))
        for k in sorted(k for k in out if re.fullmatch(f"{key}floor_(ssh|python)_\\d+", k)):
            what, n = k[len(key):].rsplit("_", 1)
            label = {"floor_ssh": "floor: one SSH command on every host", "floor_python": "floor: one "
                     "interpreter over SSH on every host"}[what]
            add(Row("launcher", f"{label}, {n} host(s){suffix}", out[k].median, "s", out[k].spread(), check="ok",
                    extra=out[k].to_dict()))
    if "census_channels" in out:
        ch, py = out["census_channels"], out["census_interpreters"]
        m["census"] = (max(ch), max(py))
        add(Row("launcher", f"one launch on {out['census_hosts']} hosts: SSH exec channels per host", max(ch), "",
                note=f"Python interpreters per host: {max(py)} (session -> agent, pserver, trainer)"
                + (f"; per host: channels {ch}, interpreters {py}" if len(set(ch)) + len(set(py)) > 2 else "")))
    mb = c["dispatch_mb"]
    rows = []
    new = "new workspace, as the user waits (packing included)"
    for key, suffix in (("", ""), ("loaded_", ", another job loading the machine"), ("plain_", PLAIN)):
        for n in c["dispatch_counts"]:
            rows += [(f"{key}dispatch_full_{n}", f"dispatch {mb} MB to {n} host(s), 1 Gbit/s links{suffix}: {new}",
                      f"{key}dispatch", n),
                     (f"{key}dispatch_user_{n}", "  less a tiny new workspace's dispatch (the workspace's own time)",
                      "", n),
                     (f"{key}dispatch_moved_{n}", "  of which the sending (first byte -> trees in place)", "", n)]
        rows += [(f"{key}dispatch_again", f"dispatch again, unchanged, 3 hosts: whole deliver{suffix}", "", 3),
                 (f"{key}dispatch_again_step", "  of which the workspace step (last node up -> job dirs)", "", 3),
                 (f"{key}scp", f"scp of the same {mb} MB file to 1 host, 1 Gbit/s{suffix}", f"{key}scp", 1)]
    top = max(c["dispatch_counts"])
    for key, suffix in (("slow_", ""), ("plainslow_", PLAIN)):
        rows += [(f"{key}dispatch_full_{top}", f"dispatch {mb // 4} MB to {top} hosts, 100 Mbit/s links{suffix}: "
                  f"{new}", f"{key}dispatch", top),
                 (f"{key}dispatch_user_{top}", "  less a tiny new workspace's dispatch (the workspace's own time)",
                  "", top),
                 (f"{key}dispatch_moved_{top}", "  of which the sending (first byte -> trees in place)", "", top),
                 (f"{key}scp", f"scp of the same {mb // 4} MB file to 1 host, 100 Mbit/s{suffix}", f"{key}scp", 1)]
    for key, label, cpu, n in rows:
        if key not in out:
            continue
        st = out[key]
        prefix = next((p for p in ("plainslow_", "slow_", "plain_", "loaded_") if key.startswith(p)), "")
        good = out[prefix + ("scp_ok" if key.endswith("scp") else "dispatch_ok")]
        add(Row("launcher", label, st.median, "s", st.spread(), check="ok" if good else "FAILED",
                note=_cpu_note(out, cpu, n) if cpu else "", extra=st.to_dict()))
