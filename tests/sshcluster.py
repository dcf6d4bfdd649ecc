"""A real N-host SSH cluster on one machine, for tests (see shared REFERENCE.md §5).

Each host is a network namespace with a veth named ``eth0`` on a private bridge, its own IPv4, its own
hostname ``node{i}`` (UTS namespace), its own ``/home/paddle`` (a private mount namespace bind-mounting
``workdir/root{i}``) and its own ``sshd`` on port 22.  All hosts share the test machine's filesystem and PID
space, so a remote command can use this test's own interpreter (:attr:`SSHCluster.python`).  Each host's
processes are also in a cgroup of their own where cgroup v2 is mounted, so :meth:`SSHCluster.cpu_seconds`
tells the CPU a host used, exited processes included.  ``plain_shell=True`` gives root a login shell that
reads no rc file on every host (an empty file over ``~/.bashrc`` in the host's mount namespace): on this
machine root's rc costs ~0.12 s of CPU per SSH command, which separate machines would each pay on their own.

Needs root, ``iproute2`` (``ip``, ``tc``), ``openssh-server`` and ``openssh-client``: ``scripts/test``
installs them.  Everything a cluster creates is recorded in a state file under ``/run/paddle-sshcluster``;
a cluster whose owning process died without cleaning up (``kill -9``, a crashed pytest) is torn down by the
next :class:`SSHCluster` that starts, so nothing accumulates.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import ipaddress
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from sshstate import (
    STATE_DIR,
    _batch,
    _cgroup2_root,
    _comm,
    _netns_pids,
    _ppid,
    _run,
    _starttime,
    _teardown,
    reap_stale_clusters,
)

SSHD = "/usr/sbin/sshd"
SKIP_REASON = "needs root and openssh-server/iproute2: run scripts/test, which installs them"
SUBNET_FIRST_OCTETS = "10.77"
_counter = 0


def unavailable_reason() -> str | None:
    """Why a cluster cannot be built here (a skip reason), or None if it can."""
    missing = []
    if os.geteuid() != 0:
        missing.append("not root")
    for tool in ("ip", "tc", "nsenter", "unshare", "ssh-keygen"):
        if shutil.which(tool) is None:
            missing.append(f"no {tool}")
    if not os.access(SSHD, os.X_OK):
        missing.append(f"no {SSHD}")
    if missing:
        return f"{SKIP_REASON} ({', '.join(missing)})"
    return None


def _b36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        n, r = divmod(n, 36)
        out = digits[r] + out
        if n == 0:
            return out


_ARP = Path("/proc/sys/net/ipv4/neigh/default")
_arp_saved: dict = {}  # the machine's own limits before the first raise
_arp_owners: dict = {}  # the open clusters (by id) -> their host count


def _arp_want(n: int) -> dict:
    return {"gc_thresh3": max(1024, 8 * n * n), "gc_thresh2": max(512, 4 * n * n)}


def _neighbour_room(n: int, owner: int) -> None:
    """Make the kernel's ARP table hold what ``n`` hosts talking to each other need (raise only), until the
    cluster closes (``_neighbour_room_done``).

    The table and its limits are one for the whole machine, every network namespace's entries in it: each host
    holds an entry per peer, ~n*n in all.  At the default hard limit (gc_thresh3 = 1024) 32 hosts overflow it,
    new entries are refused, and the SYNs that needed one are dropped -- connects between some hosts then wait
    ~20 s for TCP's retries (measured: /proc/net/stat/arp_cache table_fulls rising, every other counter quiet).
    """
    _arp_owners[owner] = n
    for name, value in _arp_want(n).items():
        with contextlib.suppress(OSError, ValueError):
            now = int((_ARP / name).read_text())
            if now < value:
                _arp_saved.setdefault(name, now)
                (_ARP / name).write_text(str(value))


def _neighbour_room_done(owner: int) -> None:
    """Lower the limits to what the clusters still open need, and to the machine's own once none is."""
    _arp_owners.pop(owner, None)
    for name in list(_arp_saved):
        need = max([_arp_want(n)[name] for n in _arp_owners.values()], default=0)
        with contextlib.suppress(OSError, ValueError):
            (_ARP / name).write_text(str(max(_arp_saved[name], need)))
        if not _arp_owners:
            del _arp_saved[name]


class SSHCluster:
    """``n`` SSH hosts ``node0..node{n-1}`` in network namespaces; build on construction, ``close()`` to end.

    Use as a context manager.  Files in ``workdir``: ``id_ed25519`` (client key, :attr:`key_path`),
    ``host_ed25519`` (the one host key of every sshd), ``known_hosts``, ``ssh_config`` (aliases ``node{i}``),
    ``sshd{i}.conf``/``.log``/``.pid`` and ``root{i}/`` (node i's ``/home/paddle``).
    """

    def __init__(self, n: int, workdir: str | os.PathLike, *, start_timeout: float = 15.0,
                 plain_shell: bool = False):
        global _counter
        reason = unavailable_reason()
        if reason:
            raise RuntimeError(reason)
        if not 1 <= n <= 200:
            raise ValueError(f"n must be 1..200, got {n}")
        self.n = n
        self.workdir = Path(workdir).resolve()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.python = sys.executable
        # Names unique per process and per cluster: 'pc' + base36(pid) padded to 5 (pid_max is 2**22) +
        # base36(counter), ~9 chars, so the longest interface name, '<token>v<i>', stays within Linux's 15.
        _counter += 1
        self.token = f"pc{_b36(os.getpid()).rjust(5, '0')}{_b36(_counter)}"
        self.bridge = f"{self.token}br"
        self._veths = [f"{self.token}v{i}" for i in range(n)]
        self._netns = [f"{self.token}-node{i}" for i in range(n)]
        cg_root = _cgroup2_root()
        self._cgroups = [cg_root / f"{self.token}-node{i}" for i in range(n)] if cg_root else []
        self._procs: list[subprocess.Popen] = []
        self._bare: list[tuple[str, str]] = []  # add_bare_hosts: (netns, ip)
        self._closed = False
        self.key_path = str(self.workdir / "id_ed25519")
        self.known_hosts = str(self.workdir / "known_hosts")
        self.ssh_config = str(self.workdir / "ssh_config")
        self._state = {
            "token": self.token,
            "owner_pid": os.getpid(),
            "owner_start": _starttime(os.getpid()),
            "netns": self._netns,
            "veths": self._veths,
            "bridge": self.bridge,
            "cgroups": [str(c) for c in self._cgroups],
            "state_file": str(STATE_DIR / f"{self.token}.json"),
        }
        atexit.register(self.close)
        try:
            self._build(start_timeout)
            if plain_shell:
                self.set_plain_shell(True)
        except BaseException:
            self.close()
            raise

    # -- building -------------------------------------------------------------------------------------

    def _build(self, start_timeout: float) -> None:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege-separation directory
        # Subnet choice and bridge creation under one lock, so concurrent clusters never pick the same one.
        with open(STATE_DIR / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            reap_stale_clusters()
            # Record before creating anything, so a crash at any point is still reaped later.
            Path(self._state["state_file"]).write_text(json.dumps(self._state))
            self.subnet = self._free_subnet()
            net = ipaddress.ip_network(self.subnet)
            self.gateway = str(net[1])
            self.ips = [str(net[10 + i]) for i in range(self.n)]
            _neighbour_room(self.n, id(self))
            _run(["ip", "link", "add", self.bridge, "type", "bridge"])
            _run(["ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge])
            # Bridged frames skip the host's iptables (br_netfilter + a FORWARD DROP policy, as Docker
            # sets, would silently cut the hosts off from each other); best effort on older kernels.
            _run(["ip", "link", "set", self.bridge, "type", "bridge", "nf_call_iptables", "0",
                  "nf_call_ip6tables", "0", "nf_call_arptables", "0"], check=False)
            _run(["ip", "link", "set", self.bridge, "up"])
        self.hosts = [f"root@{ip}" for ip in self.ips]

        for f in ("id_ed25519", "host_ed25519"):
            for p in (self.workdir / f, self.workdir / f"{f}.pub"):
                p.unlink(missing_ok=True)
            _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"sshcluster-{f}",
                  "-f", str(self.workdir / f)])
        host_pub = (self.workdir / "host_ed25519.pub").read_text().split()
        Path(self.known_hosts).write_text(
            "".join(f"{ip},node{i} {host_pub[0]} {host_pub[1]}\n" for i, ip in enumerate(self.ips)))
        Path(self.ssh_config).write_text("".join(
            f"Host node{i}\n    HostName {ip}\n    User root\n    IdentityFile {self.key_path}\n"
            f"    IdentitiesOnly yes\n    UserKnownHostsFile {self.known_hosts}\n"
            f"    StrictHostKeyChecking yes\n    BatchMode yes\n\n"
            for i, ip in enumerate(self.ips)))

        self._plug([(self._netns[i], self._veths[i], self.ips[i]) for i in range(self.n)])
        for i in range(self.n):
            self._add_node(i)
        self._wait_listening(start_timeout)

    def _free_subnet(self) -> str:
        used = _run(["ip", "-o", "-4", "addr", "show"]).stdout + _run(["ip", "-4", "route", "show"]).stdout
        # Start from a pid-derived third octet so separate runs rarely even probe the same subnets.
        start = os.getpid() % 250
        for k in range(250):
            x = (start + k) % 250 + 1
            prefix = f"{SUBNET_FIRST_OCTETS}.{x}."
            if prefix not in used:
                return f"{prefix}0/24"
        raise RuntimeError(f"no free {SUBNET_FIRST_OCTETS}.x.0/24 subnet")

    def _add_node(self, i: int) -> None:
        ns, ip = self._netns[i], self.ips[i]
        root = self.root_dir(i)
        root.mkdir(parents=True, exist_ok=True)
        conf = self.workdir / f"sshd{i}.conf"
        conf.write_text(
            f"ListenAddress {ip}:22\n"
            f"HostKey {self.workdir / 'host_ed25519'}\n"
            f"AuthorizedKeysFile {self.key_path}.pub\n"
            f"PidFile {self.workdir / f'sshd{i}.pid'}\n"
            "UsePAM no\nStrictModes no\nPermitRootLogin prohibit-password\n"
            "PasswordAuthentication no\nKbdInteractiveAuthentication no\n"
            "Subsystem sftp internal-sftp\nLogLevel VERBOSE\nUseDNS no\nPrintMotd no\nPrintLastLog no\n"
            # Tests fan out many connections/channels at once; the defaults (10 unauthenticated, 10
            # sessions per connection) would drop some at random.
            "MaxStartups 200\nMaxSessions 200\n")
        log = self.workdir / f"sshd{i}.log"
        log.write_text("")
        # ip netns exec -> unshare -> sh -> exec sshd -D: every step execs, so the Popen pid is sshd's.
        setup = (f"hostname node{i} && mkdir -p /home/paddle && mount --bind {root} /home/paddle && "
                 f"exec {SSHD} -D -e -f {conf}")
        with open(log, "ab") as errf:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", ns, "unshare", "--mount", "--uts", "--propagation", "private",
                 "sh", "-c", setup],
                stdin=subprocess.DEVNULL, stdout=errf, stderr=errf, start_new_session=True)
        self._procs.append(proc)
        if self._cgroups:  # before sshd's first fork (nothing connects before _wait_listening), so it counts all
            try:
                self._cgroups[i].mkdir()
                (self._cgroups[i] / "cgroup.procs").write_text(str(proc.pid))
            except OSError:  # a cgroup tree we may not use after all: no accounting (teardown removes what was made)
                self._cgroups = []

    def add_bare_hosts(self, k: int) -> list[tuple[str, str]]:
        """``k`` more namespaces on the bridge with an address, ``eth0`` and ``lo`` but no sshd (the pods of
        tests/kube/standin.py): ``[(netns, ip)]``, torn down with the hosts; not in :meth:`pids`."""
        first = 10 + self.n + len(self._bare)
        if first + k > 255:
            raise ValueError(f"no room in {self.subnet} for {k} more addresses")
        made = [(f"{self.token}-b{j}", str(ipaddress.ip_network(self.subnet)[j])) for j in range(first, first + k)]
        self._state["netns"] = [*self._state["netns"], *(ns for ns, _ in made)]
        Path(self._state["state_file"]).write_text(json.dumps(self._state))
        self._plug([(ns, f"{self.token}b{j}", ip) for j, (ns, ip) in enumerate(made, start=first)])
        self._bare += made
        return made

    def _plug(self, plugs: Sequence[tuple[str, str, str]]) -> None:
        """For each ``(ns, veth, ip)``: a new namespace ``ns`` whose ``eth0`` (``ip``) is the far end of ``veth`` on
        the bridge. One ``ip -batch`` here and one in each namespace (a stand-in's 20 pod sandboxes took 120
        ``ip`` processes, ~1 s of a loaded machine, per test)."""
        _batch([line for ns, veth, _ in plugs for line in (
            f"netns add {ns}", f"link add {veth} type veth peer name eth0 netns {ns}",
            f"link set {veth} master {self.bridge} up")])
        for ns, _, ip in plugs:
            _batch([f"addr add {ip}/24 dev eth0", "link set eth0 up", "link set lo up"], ns)

    def _wait_listening(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        pending = set(range(self.n))
        while pending:
            for i in sorted(pending):
                proc = self._procs[i]
                if proc.poll() is not None:
                    raise RuntimeError(f"sshd of node{i} ({self.ips[i]}) exited with {proc.returncode}: "
                                       f"{self._sshd_log(i)}")
                with contextlib.suppress(OSError), socket.create_connection((self.ips[i], 22), timeout=0.5):
                    pending.discard(i)
            if pending and time.monotonic() > deadline:
                raise RuntimeError(
                    f"sshd not accepting on port 22 after {timeout:.0f}s: "
                    + "; ".join(f"node{i} ({self.ips[i]}): {self._sshd_log(i) or 'no output'}"
                                for i in sorted(pending)))
            if pending:
                time.sleep(0.02)

    def _sshd_log(self, i: int) -> str:
        try:
            return (self.workdir / f"sshd{i}.log").read_text().strip()
        except OSError:
            return ""

    # -- inspection and control -----------------------------------------------------------------------

    def root_dir(self, i: int) -> Path:
        """The host path mounted as /home/paddle inside node i."""
        return self.workdir / f"root{i}"

    def netns(self, i: int) -> str:
        """Node i's network namespace name (for ``ip netns exec``/``ip -n``)."""
        return self._netns[i]

    def veth(self, i: int) -> str:
        """Host-side (bridge) end of node i's link; the namespace end is ``eth0``."""
        return self._veths[i]

    def sshd_pid(self, i: int) -> int:
        """Pid of node i's listening sshd."""
        return self._procs[i].pid

    def pids(self, i: int, *, include_ssh_sessions: bool = False) -> list[int]:
        """Pids of processes in node i (``ip netns pids``), sorted.

        Always excluded: node i's listening sshd.  Also excluded unless ``include_ssh_sessions``: the
        per-connection sshd processes it forks (descendants of the listener whose executable is sshd
        itself, by command name ``sshd``: ``sshd: root@notty`` and its privilege-separated parent), which
        come and go with client connections and linger some ms after a client disconnects.  Processes that
        exit while being listed are dropped.  Everything else is counted,
        including the shells and commands those sessions run, so ``pids(i) == []`` means "nothing of
        the job is left on node i".
        """
        listener = self.sshd_pid(i)
        out = []
        for pid in _netns_pids(self._netns[i]):
            if pid == listener or not Path(f"/proc/{pid}").exists():
                continue
            if not include_ssh_sessions and self._is_ssh_session(pid, listener):
                continue
            out.append(pid)
        return out

    @staticmethod
    def _is_ssh_session(pid: int, listener: int) -> bool:
        # The command name, not /proc/pid/exe: an exiting process has no exe link but keeps its name.
        if _comm(pid) not in ("sshd", "sshd-session"):
            return False
        p = pid
        for _ in range(10):  # session processes are a level or two below the listener
            p = _ppid(p)
            if p == listener:
                return True
            if p <= 1:
                return False
        return False

    def cpu_seconds(self, i: int) -> float | None:
        """CPU seconds (user + system) every process of node i has used since it was built, those that exited
        included (its cgroup); None without cgroup v2.  Processes entered with :meth:`exec` are not counted."""
        if not self._cgroups:
            return None
        for line in (self._cgroups[i] / "cpu.stat").read_text().splitlines():
            key, value = line.split()
            if key == "usage_usec":
                return int(value) / 1e6
        return None

    def set_plain_shell(self, on: bool) -> None:
        """Whether root's login shell on every node reads an empty ``~/.bashrc`` (for sessions started from now
        on): an empty file bind-mounted over it in each node's own mount namespace, or removed again."""
        empty = self.workdir / "empty_rc"
        empty.write_text("")
        rc = Path(os.path.expanduser("~root")) / ".bashrc"
        for i in range(self.n):
            mounted = self.exec(i, ["mountpoint", "-q", str(rc)], check=False).returncode == 0
            if on and not mounted and rc.exists():
                self.exec(i, ["mount", "--bind", str(empty), str(rc)])
            elif not on and mounted:
                self.exec(i, ["umount", str(rc)])

    def kill_all(self, i: int) -> list[int]:
        """SIGKILL everything :meth:`pids` reports for node i (test hygiene); returns the pids killed."""
        victims = self.pids(i)
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return victims

    def _enter(self, i: int) -> list[str]:
        # Net namespace by name; mount + UTS namespaces taken from node i's sshd, which owns them.
        return ["nsenter", f"--net=/run/netns/{self._netns[i]}", "--target", str(self.sshd_pid(i)),
                "--mount", "--uts", "--"]

    def exec(self, i: int, argv: Sequence[str], **kw) -> subprocess.CompletedProcess:
        """Run argv inside node i (its network, hostname and /home/paddle); ``subprocess.run`` kwargs.

        Defaults: ``capture_output=True, text=True, check=True``.
        """
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        kw.setdefault("check", True)
        return subprocess.run([*self._enter(i), *argv], **kw)

    def popen(self, i: int, argv: Sequence[str], **kw) -> subprocess.Popen:
        """Start argv inside node i in the background; ``subprocess.Popen`` kwargs.  close() kills it."""
        return subprocess.Popen([*self._enter(i), *argv], **kw)

    def connection(self, i: int, **kw):
        """A ``fabric.Connection`` to node i as root with the cluster key and strict host-key checking.

        Unknown or mismatched host keys are rejected (``paramiko.RejectPolicy``) against :attr:`known_hosts`.
        Unless a ``config`` is given, ``run()`` does not read local stdin (pytest captures it; CI has none).
        """
        import fabric
        import paramiko

        kw.setdefault("connect_timeout", 10)
        kw.setdefault("config", fabric.Config(overrides={"run": {"in_stream": False}}))
        ckw = {"key_filename": self.key_path, "look_for_keys": False, "allow_agent": False,
               **kw.pop("connect_kwargs", {})}
        conn = fabric.Connection(self.ips[i], user="root", port=22, connect_kwargs=ckw, **kw)
        conn.client.load_host_keys(self.known_hosts)
        conn.client.set_missing_host_key_policy(paramiko.RejectPolicy())
        return conn

    def link_down(self, i: int) -> None:
        """Cut node i off the bridge (host-side veth down): packets to it are dropped."""
        _run(["ip", "link", "set", self._veths[i], "down"])

    def link_up(self, i: int) -> None:
        _run(["ip", "link", "set", self._veths[i], "up"])

    def shape(self, i: int, rate: str = "1gbit") -> None:
        """Limit node i's link to ``rate`` in both directions (tbf on the host veth and on its eth0)."""
        tbf = ["root", "tbf", "rate", rate, "burst", "256kb", "latency", "50ms"]
        _run(["tc", "qdisc", "replace", "dev", self._veths[i], *tbf])
        _run(["ip", "netns", "exec", self._netns[i], "tc", "qdisc", "replace", "dev", "eth0", *tbf])

    def shape_uplink(self, rate: str = "1gbit") -> None:
        """Limit what this machine (the launcher) sends into the cluster network to ``rate``: tbf on the bridge
        device, which carries only this machine's own packets (node-to-node traffic passes between ports)."""
        _run(["tc", "qdisc", "replace", "dev", self.bridge, "root", "tbf", "rate", rate, "burst", "256kb",
              "latency", "50ms"])

    def unshape(self, i: int) -> None:
        _run(["tc", "qdisc", "del", "dev", self._veths[i], "root"], check=False)
        _run(["ip", "netns", "exec", self._netns[i], "tc", "qdisc", "del", "dev", "eth0", "root"],
             check=False)

    # -- teardown -------------------------------------------------------------------------------------

    def close(self) -> None:
        """Kill every process in every node, delete namespaces, veths and bridge.  Idempotent."""
        if self._closed:
            return
        self._closed = True
        _teardown(self._state)
        _neighbour_room_done(id(self))
        for proc in self._procs:
            with contextlib.suppress(Exception):
                proc.wait(timeout=5)  # reap our own children so no zombie is left
        atexit.unregister(self.close)

    def __enter__(self) -> SSHCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SSHCluster(n={self.n}, token={self.token!r}, ips={getattr(self, 'ips', None)})"
