"""The ``supervise`` agent: one per node and job, the parent of every process of that job on that node.

It talks JSON lines both ways over its stdin/stdout for the life of a job: it starts the job's processes
(``procs``), streams every output line to the launcher and appends it to the process's log file, and stops
everything (SIGTERM to each group, a grace period, SIGKILL) when told to, when signalled, when its stdin
closes (the SSH session is gone), or when the launcher has been silent for ``orphan_timeout`` seconds (the
network is gone) -- so a dead launcher never leaves processes behind.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import threading
import time
from typing import Any, Dict, List, Optional

from paddle_cluster import contract

from . import procs

HEARTBEAT_S = 2.0


def _emit(obj: Dict[str, Any], _lock=threading.Lock()) -> None:
    data = (json.dumps(obj) + "\n").encode()
    with _lock:
        try:
            os.write(1, data)
        except OSError:
            pass  # the launcher is gone; teardown is driven by stdin EOF / silence


class Stop(Exception):
    def __init__(self, reason: str, grace: Optional[float] = None) -> None:
        super().__init__(reason)
        self.reason, self.grace = reason, grace


class Supervisor:
    def __init__(self, job_dir: str, orphan_timeout: float, grace: float) -> None:
        self.job_dir = os.path.realpath(job_dir)
        self.orphan_timeout = orphan_timeout
        self.grace = grace
        self.env: Dict[str, str] = {}
        self.job_id = ""
        self.state: Optional[procs.Records] = None
        self.popens: Dict[str, subprocess.Popen] = {}
        self.threads: List[threading.Thread] = []
        self.lib_dir = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    # messages from the launcher
    def on_prepare(self, msg: Dict[str, Any]) -> None:
        self.env = dict(msg["env"])
        self.job_id = contract.job_id_of(self.env)
        os.makedirs(os.path.join(self.job_dir, "log"), exist_ok=True)
        self.state = procs.Records(self.job_dir, self.job_id)
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
                proc = procs.spawn(p["cmd"], msg["cwd"], env)
            except OSError as e:
                _emit({"ev": "exit", "proc": p["name"], "code": 127, "signal": None,
                       "error": f"cannot start {p['cmd']!r} in {msg['cwd']}: {e.strerror or e}"})
                continue
            self.popens[p["name"]] = proc
            rec = {"name": p["name"], "role": p["role"], "pid": proc.pid, "pgid": proc.pid,
                   "start_time": procs.start_time(proc.pid), "log": log_path, "cmd": p["cmd"], "exit_code": None,
                   "signal": None, "started_at": time.time()}
            self.state.add(rec)
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
            dead = [n for n in msg["procs"] if n in self.popens and self.popens[n].poll() is not None]
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
            records = self.state.procs if self.state else []
            hit = procs.signal_groups(records, self.job_id, grace)
            for p in self.popens.values():
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


def supervise(job_dir: str, orphan_timeout: float, grace: float) -> int:
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, _raise_stop)
    # SIGPIPE stays ignored (Python's default): a write to a vanished launcher must not kill the agent
    # before it has stopped its processes.
    return Supervisor(job_dir, orphan_timeout, grace).run()
