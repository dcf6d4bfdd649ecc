"""The node agent: what the launcher runs on every host (``python3 -m paddle_cluster.node.agent CMD``).

Standard library only, so a node needs nothing but Python. Sub-commands print one JSON document, except
``supervise``, which talks JSON lines both ways over its stdin/stdout for the life of a job:

* it starts the job's processes, each in its own process group, and records their pids (with start
  times, so a reused pid is never mistaken for ours) in ``<job dir>/.paddle_cluster/procs.json``;
* it streams every output line to the launcher and appends it to the process's log file;
* it stops everything (SIGTERM to each group, a grace period, SIGKILL) when told to, when signalled, when
  its stdin closes (the SSH session is gone), or when the launcher has been silent for ``orphan_timeout``
  seconds (the network is gone) -- so a dead launcher never leaves processes behind.
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import json
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tarfile
import threading
import time
from typing import Any, Dict, List, Optional

from paddle_cluster import contract

STATE_DIR = ".paddle_cluster"
PROCS_FILE = "procs.json"
HEARTBEAT_S = 2.0


def _emit(obj: Dict[str, Any], _lock=threading.Lock()) -> None:
    data = (json.dumps(obj) + "\n").encode()
    with _lock:
        try:
            os.write(1, data)
        except OSError:
            pass  # the launcher is gone; teardown is driven by stdin EOF / silence


# -- probe --------------------------------------------------------------------------------------------
def interfaces() -> Dict[str, Optional[str]]:
    """Every network interface and its IPv4 address (None when it has none)."""
    out: Dict[str, Optional[str]] = {}
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
                out[name] = socket.inet_ntoa(packed[20:24])
            except OSError:
                out[name] = None
    finally:
        s.close()
    return out


def port_free(addr: str, port: int) -> bool:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((addr, port))
        return True
    except OSError:
        return False
    finally:
        s.close()


def cmd_probe(args: argparse.Namespace) -> int:
    ifaces = interfaces()
    addr = ifaces.get(args.nic)
    try:
        import numpy

        numpy_version: Optional[str] = numpy.__version__
    except Exception:
        numpy_version = None
    root: Dict[str, Any] = {"path": args.root}
    try:
        os.makedirs(args.root, exist_ok=True)
        probe = os.path.join(args.root, f".probe-{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.unlink(probe)
        root["writable"] = True
        root["free_bytes"] = shutil.disk_usage(args.root).free
    except OSError as e:
        root["writable"] = False
        root["error"] = f"{e.strerror or e}"
    ports = [int(p) for p in args.ports.split(",") if p] if args.ports else []
    print(json.dumps({
        "hostname": socket.gethostname(),
        "python": sys.version.split()[0],
        "python_path": sys.executable,
        "numpy": numpy_version,
        "nic": args.nic,
        "address": addr,
        "interfaces": ifaces,
        "ports_taken": [p for p in ports if addr and not port_free(addr, p)],
        "root": root,
    }))
    return 0


# -- unpack -------------------------------------------------------------------------------------------
class UnsafeArchive(Exception):
    pass


def check_member(m: tarfile.TarInfo, dest: str, max_bytes: int) -> None:
    """Refuse anything that could write outside ``dest``: absolute paths, ``..``, links out, devices."""
    name = m.name
    if name.startswith(("/", "\\")) or os.path.isabs(name) or (len(name) > 1 and name[1] == ":"):
        raise UnsafeArchive(f"absolute path {name!r}")
    parts = name.replace("\\", "/").split("/")
    if ".." in parts:
        raise UnsafeArchive(f"path with '..': {name!r}")
    target = os.path.realpath(os.path.join(dest, name))
    if not (target == dest or target.startswith(dest + os.sep)):
        raise UnsafeArchive(f"{name!r} resolves outside the job directory")
    if m.issym() or m.islnk():
        link = m.linkname
        if not link.strip("/.") or link.endswith("/"):
            raise UnsafeArchive(f"link {name!r} -> {link!r} has no real target")
        if os.path.isabs(link) or ".." in link.replace("\\", "/").split("/"):
            raise UnsafeArchive(f"link {name!r} -> {link!r} points outside the job directory")
        base = os.path.dirname(target) if m.issym() else dest
        if not os.path.realpath(os.path.join(base, link)).startswith(dest + os.sep):
            raise UnsafeArchive(f"link {name!r} -> {link!r} points outside the job directory")
    elif not (m.isfile() or m.isdir()):
        raise UnsafeArchive(f"{name!r} is a device, fifo or other special file")
    if m.size > max_bytes:
        raise UnsafeArchive(f"{name!r} is {m.size} bytes, over the {max_bytes}-byte limit")


# Our own checks ran; Python 3.12+ would otherwise warn that no extraction filter was chosen.
_TRUSTED = {"filter": "fully_trusted"} if hasattr(tarfile, "fully_trusted_filter") else {}


def safe_extract(archive: str, dest: str, max_bytes: int = 1 << 36) -> int:
    """Extract into a fresh ``dest`` (via a temporary sibling, renamed at the end); returns member count."""
    dest = os.path.realpath(dest)
    if os.path.exists(dest) and os.listdir(dest):
        raise UnsafeArchive(f"{dest} already exists and is not empty; choose another --job_name")
    tmp = f"{dest}.unpacking-{os.getpid()}"
    n = 0
    try:
        os.makedirs(tmp)
        real_tmp = os.path.realpath(tmp)
        with tarfile.open(archive, "r:*") as tar:
            total = 0
            files = set()
            for m in tar:
                check_member(m, real_tmp, max_bytes)
                if m.islnk() and m.linkname not in files:
                    raise UnsafeArchive(f"hard link {m.name!r} -> {m.linkname!r}: no such file earlier in the archive")
                total += m.size
                if total > max_bytes:
                    raise UnsafeArchive(f"archive expands to more than {max_bytes} bytes")
                # No setuid/setgid; the owner can always read and write (and enter directories).
                m.mode = (m.mode | (0o700 if m.isdir() else 0o600)) & 0o777
                m.uid = m.gid = os.getuid()
                m.uname = m.gname = ""
                tar.extract(m, real_tmp, set_attrs=not m.issym(), **_TRUSTED)  # checked above
                if m.isfile():
                    files.add(m.name)
                n += 1
        if os.path.isdir(dest):
            os.rmdir(dest)
        os.rename(tmp, dest)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return n


def cmd_unpack(args: argparse.Namespace) -> int:
    try:
        n = safe_extract(args.archive, args.dest)
    except (UnsafeArchive, tarfile.TarError, OSError) as e:
        print(json.dumps({"ok": False, "error": str(e)}))
        return 1
    except Exception as e:  # noqa: BLE001 - whatever a hostile archive provokes, answer in JSON, not a traceback
        print(json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}"}))
        return 1
    print(json.dumps({"ok": True, "members": n}))
    return 0


# -- process records ----------------------------------------------------------------------------------
def start_time(pid: int) -> Optional[int]:
    """The kernel's start time of ``pid`` (clock ticks since boot), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def _alive_as_recorded(pid: int, started: Optional[int]) -> bool:
    st = start_time(pid)
    if st is None:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                return False
    except OSError:
        return False
    return started is None or st == started


def group_members(pgid: int) -> List[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[2]) == pgid and fields[0] != "Z":
                    pids.append(int(entry))
            except (OSError, ValueError, IndexError):
                continue
    return pids


def _has_job_tag(pid: int, job_id: str) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"PADDLE_JOB_ID={job_id}".encode() in f.read().split(b"\0")
    except OSError:
        return False


def job_group_alive(rec: Dict[str, Any], job_id: str) -> List[int]:
    """Live members of a recorded process group that provably belong to this job."""
    if _alive_as_recorded(rec["pid"], rec.get("start_time")):
        return group_members(rec["pgid"]) or [rec["pid"]]
    # The leader is gone; members still in its group are ours only if they carry this job's id.
    return [p for p in group_members(rec["pgid"]) if _has_job_tag(p, job_id)]


def signal_groups(records: List[Dict[str, Any]], job_id: str, grace: float) -> List[str]:
    """SIGTERM every live group, wait up to ``grace`` s, SIGKILL what is left. Returns the names hit."""
    hit = []
    for rec in records:
        if job_group_alive(rec, job_id):
            hit.append(rec["name"])
            _killpg(rec["pgid"], signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(job_group_alive(r, job_id) for r in records):
        time.sleep(0.05)
    for rec in records:
        if job_group_alive(rec, job_id):
            _killpg(rec["pgid"], signal.SIGKILL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(job_group_alive(r, job_id) for r in records):
        time.sleep(0.05)
    return hit


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class State:
    """``procs.json``: the agent and every process it started. Rewritten atomically on each change."""

    def __init__(self, job_dir: str, job_id: str) -> None:
        self.dir = os.path.join(job_dir, STATE_DIR)
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        self.path = os.path.join(self.dir, PROCS_FILE)
        self.lock = threading.Lock()
        self.data: Dict[str, Any] = {"job_id": job_id, "agent": {"pid": os.getpid(),
                                     "start_time": start_time(os.getpid())}, "procs": []}
        self.save()

    def save(self) -> None:
        with self.lock:
            tmp = self.path + ".tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(self.data, f, indent=1)
            os.replace(tmp, self.path)


def load_state(job_dir: str) -> Optional[Dict[str, Any]]:
    try:
        with open(os.path.join(job_dir, STATE_DIR, PROCS_FILE)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


# -- supervise ----------------------------------------------------------------------------------------
_libc = None


def _die_with_parent() -> None:
    """Child pre-exec: new process group, and SIGTERM if the agent dies (even by SIGKILL)."""
    global _libc
    os.setpgid(0, 0)
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
        _libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


_SHELL_CHARS = set("|&;<>()$`\\\"'*?[]#~=%{}\n")


def command_argv(cmd: str) -> List[str]:
    """Run a plain command directly, so PDEATHSIG reaches the program itself; anything else via sh."""
    if _SHELL_CHARS.isdisjoint(cmd):
        return cmd.split()
    return ["/bin/sh", "-c", cmd]


class Stop(Exception):
    def __init__(self, reason: str, grace: Optional[float] = None) -> None:
        super().__init__(reason)
        self.reason, self.grace = reason, grace


class Supervisor:
    def __init__(self, args: argparse.Namespace) -> None:
        self.job_dir = os.path.realpath(args.job_dir)
        self.orphan_timeout = args.orphan_timeout
        self.grace = args.grace
        self.env: Dict[str, str] = {}
        self.job_id = ""
        self.state: Optional[State] = None
        self.procs: Dict[str, subprocess.Popen] = {}
        self.threads: List[threading.Thread] = []
        self.lib_dir = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    # messages from the launcher
    def on_prepare(self, msg: Dict[str, Any]) -> None:
        self.env = dict(msg["env"])
        self.job_id = self.env["PADDLE_JOB_ID"]
        os.makedirs(os.path.join(self.job_dir, "log"), exist_ok=True)
        self.state = State(self.job_dir, self.job_id)
        contract.write_env_file(os.path.join(self.state.dir, contract.ENV_FILE), self.env)
        with open(os.path.join(self.job_dir, "nodefile"), "w") as f:
            f.write(f"{msg['node']}\n")
        _emit({"ev": "prepared"})

    def on_start(self, msg: Dict[str, Any]) -> None:
        assert self.state is not None, "start before prepare"
        for p in msg["procs"]:
            env = dict(os.environ)
            env.update(self.env)
            env.update(p["env"])
            env["PYTHONPATH"] = os.pathsep.join(x for x in (self.lib_dir, env.get("PYTHONPATH", "")) if x)
            extra_ld = msg.get("ld_library_path", "")
            if extra_ld:
                env["LD_LIBRARY_PATH"] = os.pathsep.join(x for x in (extra_ld, env.get("LD_LIBRARY_PATH", "")) if x)
            log_path = os.path.join(self.job_dir, "log", p["log"])
            try:
                proc = subprocess.Popen(command_argv(p["cmd"]), cwd=msg["cwd"], env=env,
                                        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        preexec_fn=_die_with_parent, close_fds=True)
            except OSError as e:
                _emit({"ev": "exit", "proc": p["name"], "code": 127, "signal": None,
                       "error": f"cannot start {p['cmd']!r} in {msg['cwd']}: {e.strerror or e}"})
                continue
            self.procs[p["name"]] = proc
            rec = {"name": p["name"], "role": p["role"], "pid": proc.pid, "pgid": proc.pid,
                   "start_time": start_time(proc.pid), "log": log_path, "cmd": p["cmd"], "exit_code": None,
                   "signal": None, "started_at": time.time()}
            with self.state.lock:
                self.state.data["procs"].append(rec)
            self.state.save()
            t = threading.Thread(target=self._pump, args=(p["name"], proc, log_path, rec), daemon=True)
            t.start()
            self.threads.append(t)
            _emit({"ev": "started", "proc": p["name"], "pid": proc.pid})

    def _pump(self, name: str, proc: subprocess.Popen, log_path: str, rec: Dict[str, Any]) -> None:
        assert proc.stdout is not None
        # A full disk must not stop the streaming: the process would block on a full pipe and its exit
        # would never be reported (the job would hang). The log file is given up on, the stream goes on.
        log: Optional[Any] = None
        try:
            log = open(log_path, "ab")
        except OSError as e:
            self._log_lost(name, log_path, e)
        for raw in iter(proc.stdout.readline, b""):
            if log is not None:
                try:
                    log.write(raw)
                    log.flush()
                except OSError as e:
                    self._log_lost(name, log_path, e)
                    log = self._close_quietly(log)
            _emit({"ev": "log", "proc": name, "line": raw.decode(errors="replace").rstrip("\n")})
        self._close_quietly(log)
        code = proc.wait()
        rec["exit_code"], rec["signal"] = (None, -code) if code < 0 else (code, None)
        assert self.state is not None
        try:
            self.state.save()
        except OSError as e:
            _emit({"ev": "agent_output", "line": f"cannot record the exit of {name} in procs.json: {e}"})
        _emit({"ev": "exit", "proc": name, "code": rec["exit_code"], "signal": rec["signal"]})

    @staticmethod
    def _log_lost(name: str, log_path: str, e: OSError) -> None:
        _emit({"ev": "agent_output", "line": f"cannot write {log_path} ({e.strerror or e}); the output of {name} "
                                             "is only streamed to the launcher from here on"})

    @staticmethod
    def _close_quietly(f: Optional[Any]) -> None:
        if f is not None:
            try:
                f.close()
            except OSError:
                pass
        return None

    def on_wait_ports(self, msg: Dict[str, Any]) -> None:
        deadline = time.monotonic() + msg["timeout"]
        pending = list(msg["ports"])
        while pending:
            dead = [n for n in msg["procs"] if n in self.procs and self.procs[n].poll() is not None]
            if dead:
                _emit({"ev": "not_ready", "why": f"{', '.join(dead)} exited before listening", "ports": pending})
                return
            if time.monotonic() > deadline:
                _emit({"ev": "not_ready", "why": f"nothing listening within {msg['timeout']:.0f} s",
                       "ports": pending})
                return
            still = []
            for port in pending:
                try:
                    socket.create_connection((msg["host"], port), timeout=0.5).close()
                except OSError:
                    still.append(port)
            pending = still
            if pending:
                self._drain_stdin(0.1)
        _emit({"ev": "ready"})

    # the main loop
    def _drain_stdin(self, timeout: float) -> Optional[Dict[str, Any]]:
        """Wait up to ``timeout`` s for one message; track silence and EOF (the launcher is gone)."""
        r, _, _ = select.select([0], [], [], timeout)
        if not r:
            if time.monotonic() - self.last_heard > self.orphan_timeout:
                raise Stop(f"launcher silent for {self.orphan_timeout:.0f} s")
            return None
        line = self._stdin.readline()
        if not line:
            raise Stop("launcher connection closed")
        self.last_heard = time.monotonic()
        line = line.strip()
        if not line:
            return None
        msg = json.loads(line)
        if msg.get("op") == "ping":
            return None
        if msg.get("op") == "stop":
            raise Stop("stopped by the launcher", msg.get("grace"))
        return msg

    def run(self) -> int:
        self._stdin = os.fdopen(0, "r", buffering=1)
        self.last_heard = time.monotonic()
        handlers = {"prepare": self.on_prepare, "start": self.on_start, "wait_ports": self.on_wait_ports}
        stop_hb = threading.Event()
        threading.Thread(target=self._heartbeat, args=(stop_hb,), daemon=True).start()
        reason, grace = "", self.grace
        try:
            while True:
                msg = self._drain_stdin(0.5)
                if msg is not None:
                    handlers[msg["op"]](msg)
        except Stop as s:
            reason = s.reason
            grace = self.grace if s.grace is None else s.grace
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            records = self.state.data["procs"] if self.state else []
            hit = signal_groups(records, self.job_id, grace)
            for p in self.procs.values():
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
            for t in self.threads:
                t.join(timeout=2)
            stop_hb.set()
            _emit({"ev": "stopped", "reason": reason, "killed": hit})
        return 0

    def _heartbeat(self, stop: threading.Event) -> None:
        while not stop.wait(HEARTBEAT_S):
            _emit({"ev": "hb"})


def _raise_stop(signum: int, _frame: Any) -> None:
    raise Stop(f"agent received {signal.Signals(signum).name}")


def cmd_supervise(args: argparse.Namespace) -> int:
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, _raise_stop)
    # SIGPIPE stays ignored (Python's default): a write to a vanished launcher must not kill the agent
    # before it has stopped its processes.
    return Supervisor(args).run()


# -- kill, status, logs -------------------------------------------------------------------------------
def cmd_kill(args: argparse.Namespace) -> int:
    state = load_state(args.job_dir)
    if state is None:
        print(json.dumps({"found": False, "stopped": []}))
        return 0
    running = [p["name"] for p in state["procs"] if job_group_alive(p, state["job_id"])]
    agent = state.get("agent", {})
    agent_rec = {"name": "agent", "pid": agent.get("pid", -1), "pgid": agent.get("pid", -1),
                 "start_time": agent.get("start_time")}
    if agent.get("pid") and _alive_as_recorded(agent["pid"], agent.get("start_time")):
        os.kill(agent["pid"], signal.SIGTERM)  # it tears down its own children first
        deadline = time.monotonic() + args.grace + 6
        while time.monotonic() < deadline and _alive_as_recorded(agent["pid"], agent.get("start_time")):
            time.sleep(0.05)
    signal_groups(state["procs"], state["job_id"], args.grace)
    if _alive_as_recorded(agent_rec["pid"], agent_rec["start_time"]):
        os.kill(agent_rec["pid"], signal.SIGKILL)
    left = [p["name"] for p in state["procs"] if job_group_alive(p, state["job_id"])]
    print(json.dumps({"found": True, "stopped": running, "left": left}))
    return 0


def _last_line(path: str) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 4096))
            lines = [x for x in f.read().decode(errors="replace").splitlines() if x.strip()]
        return lines[-1] if lines else ""
    except OSError:
        return ""


def _progress(job_dir: str, name: str) -> str:
    """A trainer's latest metrics record, e.g. ``pass 2 step 340 loss 0.5312``; "" when it has none."""
    role, _, idx = name.partition(".")
    if role != "trainer":
        return ""
    line = _last_line(os.path.join(job_dir, "log", f"metrics.trainer{idx}.jsonl"))
    try:
        rec = json.loads(line)
    except ValueError:
        return ""
    parts = [f"{k} {rec[k]:.4g}" if isinstance(rec.get(k), float) else f"{k} {rec[k]}"
             for k in ("pass", "step", "loss") if k in rec]
    return " ".join(parts)


def cmd_status(args: argparse.Namespace) -> int:
    state = load_state(args.job_dir)
    if state is None:
        print(json.dumps({"found": False, "procs": []}))
        return 0
    out = []
    for p in state["procs"]:
        alive = bool(job_group_alive(p, state["job_id"]))
        if alive:
            st = "running"
        elif p.get("exit_code") is not None:
            st = f"exited {p['exit_code']}"
        elif p.get("signal") is not None:
            st = f"killed by {signal.Signals(p['signal']).name}"
        else:
            st = "gone"
        out.append({"name": p["name"], "role": p["role"], "pid": p["pid"], "state": st,
                    "last_line": _last_line(p["log"]), "progress": _progress(args.job_dir, p["name"])})
    print(json.dumps({"found": True, "procs": out}))
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    log_dir = os.path.join(args.job_dir, "log")
    if not os.path.isdir(log_dir):
        print(f"no log directory {log_dir}", file=sys.stderr)
        return 1
    prefixes = {"trainer": ("train",), "pserver": ("server",), "all": ("train", "server")}[args.role]
    files = sorted(f for f in os.listdir(log_dir) if f.startswith(prefixes) and f.endswith(".log"))
    if not files:
        print(f"no {args.role} logs in {log_dir}", file=sys.stderr)
        return 1
    handles = []
    for name in files:
        f = open(os.path.join(log_dir, name), "rb")
        lines = f.read().decode(errors="replace").splitlines()
        tag = f"[{name}] " if len(files) > 1 else ""
        for line in lines[-args.n:] if args.n > 0 else []:
            print(tag + line)
        handles.append((tag, f))
    sys.stdout.flush()
    if not args.follow:
        return 0
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    partial = {id(f): b"" for _, f in handles}
    while True:
        got = False
        for tag, f in handles:
            chunk = f.read()
            if chunk:
                got = True
                data = partial[id(f)] + chunk
                *done, partial[id(f)] = data.split(b"\n")
                for line in done:
                    print(tag + line.decode(errors="replace"))
        sys.stdout.flush()
        if not got:
            time.sleep(0.2)


def cmd_metrics(args: argparse.Namespace) -> int:
    """Every trainer's metrics records on this node, as one JSON document (torn lines skipped)."""
    log_dir = os.path.join(args.job_dir, "log")
    out: Dict[str, List[Any]] = {}
    names = sorted(os.listdir(log_dir)) if os.path.isdir(log_dir) else []
    for name in names:
        if name.startswith("metrics.trainer") and name.endswith(".jsonl"):
            recs = []
            with open(os.path.join(log_dir, name), errors="replace") as f:
                for line in f:
                    try:
                        rec = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(rec, dict):
                        recs.append(rec)
            out[name[len("metrics."):-len(".jsonl")]] = recs
    print(json.dumps(out))
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="paddle_cluster.node.agent")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("probe")
    p.add_argument("--nic", required=True)
    p.add_argument("--ports", default="")
    p.add_argument("--root", required=True)
    p = sub.add_parser("unpack")
    p.add_argument("--archive", required=True)
    p.add_argument("--dest", required=True)
    p = sub.add_parser("supervise")
    p.add_argument("--job-dir", required=True)
    p.add_argument("--orphan-timeout", type=float, default=20.0)
    p.add_argument("--grace", type=float, default=5.0)
    for name in ("kill", "status", "metrics"):
        p = sub.add_parser(name)
        p.add_argument("--job-dir", required=True)
        p.add_argument("--grace", type=float, default=5.0)
    p = sub.add_parser("logs")
    p.add_argument("--job-dir", required=True)
    p.add_argument("--role", choices=("trainer", "pserver", "all"), default="all")
    p.add_argument("-n", type=int, default=50)
    p.add_argument("-f", "--follow", action="store_true")
    args = ap.parse_args(argv)
    return {"probe": cmd_probe, "unpack": cmd_unpack, "supervise": cmd_supervise, "kill": cmd_kill,
            "status": cmd_status, "logs": cmd_logs, "metrics": cmd_metrics}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
