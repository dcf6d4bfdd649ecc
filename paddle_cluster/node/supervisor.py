"""The ``supervise`` agent: one per node and job, the parent of every process of that job on that node.

It receives its node's share of the job (a ``NodePlan``) and runs it alone: starts the pservers, waits until
every pserver port of the whole job accepts a connection, starts the trainers, and reports everything as
events (``messages``). It streams every output line and appends it to the process's log file, and stops
everything (SIGTERM to every process of the job, a grace period, SIGKILL) when told to, when signalled, or when its
channel to the launcher is gone (closed, or silent for ``orphan_timeout`` seconds) -- so a dead launcher
never leaves processes behind.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import threading
import time
import traceback
from typing import IO, Any, Callable, Dict, List, Optional, Tuple, Union

from paddle_cluster import contract

from . import layout, lines, procs, top
from . import messages as m

HEARTBEAT_S = 2.0
TRACK_S = 0.5  # how often the agent records the job's descendants (kill after the agent died needs them)
COMMAND_MAX = 16 << 20  # the longest line the launcher may send (a Start with a large plan is ~100 kB)


class Stop(Exception):
    def __init__(self, reason: str, grace: Optional[float] = None) -> None:
        super().__init__(reason)
        self.reason, self.grace = reason, grace


class Emitter:
    """Events to the launcher, one JSON line each on fd 1; stamped with this node's index."""

    def __init__(self) -> None:
        self.node = -1  # until the plan names this node
        self._lock = threading.Lock()

    def __call__(self, make: Callable[..., m.Event], **fields: Any) -> None:
        data = (m.encode(make(node=self.node, **fields)) + "\n").encode()
        with self._lock:
            try:
                os.write(1, data)
            except OSError:
                pass  # the launcher is gone; teardown is driven by the channel's end or silence


class StdinChannel:
    """Commands from the launcher on stdin; its end (EOF) or ``orphan_timeout`` s of silence stop the job."""

    def __init__(self, orphan_timeout: float, fd: int = 0) -> None:
        self.orphan_timeout, self.fd = orphan_timeout, fd
        self.last_heard = time.monotonic()
        self._buf = b""

    def get(self, timeout: float) -> Optional[m.Command]:
        """The next command other than ``Ping`` within ``timeout`` s, or None; raises ``Stop``."""
        line = self._line(timeout)
        if line is None or not line.strip():
            return None
        try:
            msg = m.decode(line.decode(errors="replace"))
        except m.MessageError as e:
            raise Stop(f"unreadable message from the launcher: {e}") from None
        if isinstance(msg, m.Stop):
            raise Stop("stopped by the launcher", msg.grace)
        return None if isinstance(msg, m.Ping) else msg

    def _line(self, timeout: float) -> Optional[bytes]:
        # Raw reads, not a buffered file: select() cannot see lines a file object has already buffered.
        if b"\n" not in self._buf:
            r, _, _ = select.select([self.fd], [], [], timeout)
            if not r:
                if time.monotonic() - self.last_heard > self.orphan_timeout:
                    raise Stop(f"launcher silent for {self.orphan_timeout:.0f} s")
                return None
            chunk = os.read(self.fd, 1 << 16)
            if not chunk:
                raise Stop("launcher connection closed")
            self.last_heard = time.monotonic()
            self._buf += chunk
            if b"\n" not in self._buf:
                if len(self._buf) > COMMAND_MAX:
                    raise Stop(f"a message from the launcher longer than {COMMAND_MAX} bytes")
                return None
        line, _, self._buf = self._buf.partition(b"\n")
        return line


class NoChannel:
    """No launcher to hear from: the plan came from a file (an engine started the agent). A signal stops the
    job, and the agent ends by itself once its processes have finished or (``fail_fast``) one has failed.

    ``lease``: a file a launcher that follows the job rewrites every second or so (Slurm: on the shared
    filesystem). While its content keeps changing the agent keeps going after a failure (the launcher decides);
    once it has not changed for ``lease_timeout`` s (the launcher died, or never came) the agent fails fast.
    Changes are timed on this node's clock, so clocks of the launcher and the nodes need not agree."""

    def __init__(self, fail_fast: bool = True, lease: str = "", lease_timeout: float = 0.0) -> None:
        self.fail_fast = fail_fast
        self.lease, self.lease_timeout = lease, lease_timeout
        self._seen: Optional[bytes] = None
        self._heard = time.monotonic()
        self.orphaned = False  # set once the lease went stale: said once, then fail-fast

    def get(self, timeout: float) -> None:
        time.sleep(timeout)
        if self.lease and not self.fail_fast:
            try:
                with open(self.lease, "rb") as f:
                    content = f.read()
            except OSError:
                content = None
            if content is not None and content != self._seen:
                self._seen, self._heard = content, time.monotonic()
            elif time.monotonic() - self._heard > self.lease_timeout:
                self.fail_fast = self.orphaned = True


class Supervisor:
    def __init__(self, channel: Union[StdinChannel, NoChannel], grace: float,
                 plan: Optional[m.NodePlan] = None) -> None:
        self.channel, self.grace = channel, grace
        self.emit = Emitter()
        self.plan = plan
        self.records: Optional[procs.Records] = None
        self.popens: Dict[str, subprocess.Popen] = {}
        self.pumps: Dict[str, threading.Thread] = {}
        self.lib_dir = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        self.failed = False  # the agent ends because a process failed (its exit status says so)
        self.spawn_lock = threading.Lock()  # a child that dies at once is subprocess's to reap, not _track's
        self.started = time.time()  # a ``kill`` from before this agent (same job name) does not count

    def run(self) -> int:
        procs.become_subreaper()
        stop_hb, stop_track = threading.Event(), threading.Event()
        threading.Thread(target=self._heartbeat, args=(stop_hb,), daemon=True).start()
        threading.Thread(target=self._track, args=(stop_track,), daemon=True).start()
        reason, grace = "", self.grace
        try:
            while self.plan is None:
                msg = self.channel.get(0.5)
                if isinstance(msg, m.Start):
                    self.plan = msg.plan
            self.emit.node = self.plan.node
            self._prepare(self.plan)
            self._start(self.plan.pservers)
            if self._wait_for_pservers(self.plan):
                self.emit(m.Ready)
                self._start(self.plan.trainers)
            elif isinstance(self.channel, NoChannel):
                self.failed = True
                raise Stop("pservers not ready")
            while True:
                self.channel.get(0.5)
                if isinstance(self.channel, NoChannel):
                    self._check_done(self.channel)
        except Stop as s:
            reason = s.reason
            grace = self.grace if s.grace is None else s.grace
        except Exception as e:  # noqa: BLE001 - reported, and the job's processes are still stopped below
            for line in traceback.format_exc().splitlines():
                self.emit(m.Note, line=line)
            reason = f"agent failed: {type(e).__name__}: {e}"
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            stop_track.set()
            reason = self._stopping(reason)
            hit = procs.stop_job(self.records.data, grace, self._no_grace) if self.records else []
            for p in self.popens.values():
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
            for t in self.pumps.values():
                t.join(timeout=2)
            procs.reap_orphans(procs.process_table(), {p.pid for p in self.popens.values()})
            stop_hb.set()
            self.emit(m.Stopped, reason=reason, killed=tuple(hit))
        return 1 if self.failed else 0

    def _no_grace(self) -> bool:
        """Whether the launcher, while this agent waits out the grace period, says to stop without it (a second
        Ctrl+C): ``Stop`` with grace 0 on the channel, or ``node kill --grace 0`` (agents an engine started have
        no channel)."""
        if self.plan is not None and procs.no_grace_requested(self.plan.job_dir, self.started):
            return True
        try:
            self.channel.get(0)
        except Stop as s:
            return s.grace == 0
        return False

    def _stopping(self, reason: str) -> str:
        """Record every process still running as stopped (``status`` shows that, not its exit status, which
        races with the signal) and tell the launcher why, before the exits arrive."""
        by_kill = self.plan is not None and procs.kill_requested(self.plan.job_dir, self.started)
        reason = "stopped by paddle-cluster kill" if by_kill else reason
        if self.records is not None:
            why = "kill" if by_kill else "launcher" if reason == "stopped by the launcher" else reason
            with self.records.lock:  # save() may be dumping these records from the tracking thread
                for rec in self.records.procs:
                    p = self.popens.get(rec["name"])
                    if p is not None and p.poll() is None:
                        rec["stopped"] = why
            try:
                self.records.save()
            except OSError:
                pass
        self.emit(m.Stopping, reason=reason, by_kill=by_kill)
        return reason

    def _check_done(self, channel: NoChannel) -> None:
        """Without a launcher: stop when a process failed (fail-fast) or when every process has finished."""
        codes = {name: p.poll() for name, p in self.popens.items()}
        failed = [name for name, c in codes.items() if c not in (None, 0)]
        if channel.orphaned:
            channel.orphaned = False
            self.emit(m.Note, line=f"no word from the launcher for {channel.lease_timeout:.0f} s ({channel.lease}): "
                      "this node now stops the job when one of its processes fails")
        if failed and channel.fail_fast:
            self.failed = True
            raise Stop(f"{failed[0]} failed (exit status {codes[failed[0]]})")
        if self.plan is not None and len(codes) == len(self.plan.procs) and None not in codes.values():
            self.failed = bool(failed)
            raise Stop("every process of this node finished")

    def _prepare(self, plan: m.NodePlan) -> None:
        if plan.pending:  # run as it is, a placeholder would be dialled as an address
            self.failed = True
            raise Stop(f"the plan still holds {', '.join(plan.pending)}: values only the nodes learn, which its "
                       "engine's bootstrap fills in (node bootstrap --rendezvous)")
        # The launcher checked the name; a plan from a file or another launcher is checked again here.
        try:
            contract.check_job_name(os.path.basename(plan.job_dir))
        except contract.ContractError as e:
            self.failed = True
            raise Stop(f"refusing job directory {plan.job_dir!r}: {e}") from None
        # Owner-only: the job directory holds logs, checkpoints and the process records.
        os.makedirs(plan.job_dir, mode=0o700, exist_ok=True)
        os.chmod(plan.job_dir, 0o700)
        try:
            layout.prepare(plan.job_dir, plan.node, plan.workspace)
        except layout.LayoutError as e:
            raise Stop(str(e)) from None
        self.sampler = top.Sampler(plan.job_dir)  # before the records: ``_track`` samples once they are there
        self.records = procs.Records(plan.job_dir, contract.job_id_of(plan.environ))

    def _environ(self, p: m.ProcPlan) -> Dict[str, str]:
        assert self.plan is not None
        env = dict(os.environ)
        env.update(self.plan.environ)
        env.update(p.env)
        env.update(contract.node_defaults(env))
        env["PWD"] = self.plan.cwd  # the agent's own PWD is the login directory; the process starts in cwd
        env["PYTHONPATH"] = os.pathsep.join(x for x in (self.lib_dir, env.get("PYTHONPATH", "")) if x)
        if self.plan.ld_library_path:
            env["LD_LIBRARY_PATH"] = os.pathsep.join(
                x for x in (self.plan.ld_library_path, env.get("LD_LIBRARY_PATH", "")) if x)
        return env

    def _start(self, plans: Tuple[m.ProcPlan, ...]) -> None:
        assert self.plan is not None and self.records is not None
        for p in plans:
            log_path = os.path.join(self.plan.job_dir, "log", p.log)
            layout.info_link(os.path.dirname(log_path), p.log)
            with self.spawn_lock:
                env = self._environ(p)
                try:
                    proc = procs.spawn(p.cmd, self.plan.cwd, env)
                except OSError as e:
                    self.emit(m.Exited, proc=p.name, code=127, signal=None,
                              error=f"cannot start {p.cmd!r} in {self.plan.cwd}: {e.strerror or e}")
                    continue
                self.popens[p.name] = proc
                rec = {"name": p.name, "role": p.role, "pid": proc.pid, "pgid": proc.pid,
                       "start_time": procs.start_time(proc.pid), "log": log_path, "cmd": p.cmd, "exit_code": None,
                       "signal": None, "started_at": time.time(),
                       # where it is reached: a pserver's own address (each local one has its own loopback)
                       "address": contract.current_ip_of(env) or self.plan.address}
                self.records.add(rec)
            t = threading.Thread(target=self._pump, args=(p.name, proc, log_path, rec), daemon=True)
            t.start()
            self.pumps[p.name] = t
            self.emit(m.Started, proc=p.name, pid=proc.pid)

    def _pump(self, name: str, proc: subprocess.Popen, log_path: str, rec: Dict[str, Any]) -> None:
        assert self.records is not None
        records = self.records
        # A full disk must not stop the streaming: the process would block on a full pipe and its exit
        # would never be reported (the job would hang). The log file is given up on, the stream goes on.
        log: List[Optional[IO[bytes]]] = [None]
        try:
            log[0] = open(log_path, "ab")
        except OSError as e:
            self._log_lost(name, log_path, e)

        def write(data: bytes) -> None:
            if log[0] is not None:
                try:
                    log[0].write(data)
                    log[0].flush()
                except OSError as e:
                    self._log_lost(name, log_path, e)
                    log[0] = _close_quietly(log[0])

        def exited(code: int) -> None:
            rec["exit_code"], rec["signal"] = (None, -code) if code < 0 else (code, None)
            if code < 0 and not rec.get("stopped") and procs.kill_requested(self.plan.job_dir, self.started):
                # A kill that signals the whole job at once (Slurm's scancel) reaches this process before the
                # agent's own handler runs: say it is a kill before its exit reads as a failure. (One the agent
                # stopped itself was recorded and said by ``_stopping`` already.)
                rec["stopped"] = "kill"
                self.emit(m.Stopping, reason="stopped by paddle-cluster kill", by_kill=True)
            try:
                records.save()
            except OSError as e:
                self.emit(m.Note, line=f"cannot record the exit of {name} in procs.json: {e}")
            self.emit(m.Exited, proc=name, code=rec["exit_code"], signal=rec["signal"])

        lines.follow(proc, write, lambda line: self.emit(m.Log, proc=name, line=line), exited)
        _close_quietly(log[0])

    def _log_lost(self, name: str, log_path: str, e: OSError) -> None:
        self.emit(m.Note, line=f"cannot write {log_path} ({e.strerror or e}); the output of {name} is only "
                               "streamed to the launcher from here on")

    def _wait_for_pservers(self, plan: m.NodePlan) -> bool:
        """Until every pserver port of the job accepts a connection: True; False (reported) when one of this
        node's pservers dies first or ``start_timeout`` passes."""
        deadline = time.monotonic() + plan.start_timeout
        pending = list(plan.endpoints)
        pause = 0.01  # a pserver usually listens within a few tens of ms: look again soon, then less often
        while pending:
            dead = [p.name for p in plan.pservers
                    if p.name not in self.popens or self.popens[p.name].poll() is not None]
            if dead:
                for name in dead:  # its last words and its exit reach the launcher before the verdict
                    if name in self.pumps:
                        self.pumps[name].join(timeout=2)
                ports = [e.port for e in pending if e.host == plan.address]
                self.emit(m.NotReady, why=f"{', '.join(dead)} exited before listening (ports {ports})")
                return False
            if time.monotonic() > deadline:
                self.emit(m.NotReady, why=f"nothing listening on {', '.join(map(str, pending))} within "
                                          f"{plan.start_timeout:.0f} s")
                return False
            # In order, up to the first that does not accept yet: probing every pending port each round made N
            # agents send up to N * ports connection attempts per round (~20k SYNs/s at 32 nodes on 2 cores),
            # CPU the pservers being waited for needed to start.
            while pending and _accepts(pending[0]):
                pending.pop(0)
            if pending:
                self.channel.get(pause)
                pause = min(0.1, 2 * pause)
        return True

    def _heartbeat(self, stop: threading.Event) -> None:
        while not stop.wait(HEARTBEAT_S):
            self.emit(m.Heartbeat)

    def _track(self, stop: threading.Event) -> None:
        """Keep procs.json's list of descendants current and reap the orphans the agent adopted."""
        while not stop.wait(TRACK_S):
            with self.spawn_lock:
                table, zombies = procs.subtree(os.getpid()) or (procs.process_table(), None)
                if self.records is not None:
                    try:
                        self.records.track(table)
                    except OSError:
                        pass  # a full disk: the record stays as it was; teardown scans /proc anyway
                    self.sampler.sample(list(self.records.procs), table)  # ``top``'s CPU % and RSS
                procs.reap_orphans(table, {p.pid for p in self.popens.values()}, zombies)


def _accepts(e: Any) -> bool:
    try:
        socket.create_connection((e.host, e.port), timeout=0.5).close()
        return True
    except OSError:
        return False


def _close_quietly(f: Optional[IO[bytes]]) -> None:
    if f is not None:
        try:
            f.close()
        except OSError:
            pass
    return None


def _raise_stop(signum: int, _frame: Any) -> None:
    raise Stop(f"agent received {signal.Signals(signum).name}")


def supervise(orphan_timeout: float, grace: float, plan: Optional[m.NodePlan] = None, fail_fast: bool = True,
              lease: str = "") -> int:
    """Run one node's share of a job, as the launcher sends it on stdin (or ``plan``, without a launcher
    channel: then the agent ends with its processes, exit 1 if one failed); events go to stdout."""
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, _raise_stop)
    # SIGPIPE stays ignored (Python's default): a write to a vanished launcher must not kill the agent
    # before it has stopped its processes.
    channel = NoChannel(fail_fast, lease, orphan_timeout) if plan is not None else StdinChannel(orphan_timeout)
    return Supervisor(channel, grace, plan).run()
