"""``SSHNode``: a remote host over SSH (Fabric, paramiko), and ``connect_error``, the one place SSH and socket
failures become a one-line ``ConnectError``. Apart from ``hosts`` so that only a config with a remote host
imports paramiko (``access.make_nodes``): ~0.2 s of CPU that every other command would pay."""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import subprocess
import threading
import time
from functools import cache
from typing import BinaryIO, Callable, Iterator, List, Optional, Sequence, Tuple

import paramiko

from paddle_cluster.node.lines import bounded_lines

from .config import ClusterConfig, HostSpec
from .errors import ConnectError, HostError
from .hosts import Cancel, CommandResult, CommandStream, Local, Node, _cancel_when, opened, send_into

# The first line of every stream: the POSIX session (process group) its command runs in, for ``abort``. sshd makes
# one per command (setsid) whose leader execs the login shell, which execs sh, whose $$ it is.
SESSION_MARK = "paddle-cluster-session "


def _marked(argv: Sequence[str]) -> str:
    return "exec sh -c " + shlex.quote(f'echo "{SESSION_MARK}$$"; exec "$@"') + " sh " + shlex.join(argv)


class _ChannelStream(CommandStream):
    def __init__(self, channel: paramiko.Channel, kill: Callable[[int], None]) -> None:
        self.channel, self._kill = channel, kill
        self._session: List[int] = []  # the command's POSIX session on the node, once its first line is read
        self._lock = threading.Lock()
        # Not a generator method: one holding ``self`` would make a cycle that only the garbage collector frees,
        # maybe at exit, when paramiko's file object complains ("I/O operation on closed file") as it goes.
        self._lines = _channel_lines(channel, self._session)

    def write(self, data: bytes) -> None:
        with self._lock:
            self.channel.sendall(data)

    def lines(self) -> Iterator[str]:
        return self._lines

    def settimeout(self, seconds: Optional[float]) -> None:
        self.channel.settimeout(seconds)

    def ended(self) -> bool:
        return self.channel.exit_status_ready()

    def close(self) -> None:
        try:
            self.channel.shutdown_write()
        except (OSError, EOFError, paramiko.SSHException):
            pass

    def abort(self) -> None:
        # Closing stdin reaches only a command that reads it, not one waiting for something else (a PYTHON wrapper,
        # a stalled disk); sshd kills nothing when a channel closes, and its "signal" request is refused for root
        # logins (no privilege separation then). So: kill the command's POSIX session over another channel.
        if self._session and not self.ended():
            try:
                self._kill(self._session[0])
            except Exception:  # noqa: BLE001 - the node may be unreachable: its agent then stops on its own
                pass
        self.channel.close()  # our reads end now


def _channel_lines(channel: paramiko.Channel, session: List[int]) -> Iterator[str]:
    """The channel's lines, but for the first that says its POSIX session (into ``session``)."""
    f = channel.makefile("rb")
    try:
        for line in bounded_lines(f.readline):
            if not session and line.startswith(SESSION_MARK) and line[len(SESSION_MARK):].isdigit():
                session.append(int(line[len(SESSION_MARK):]))
                continue
            yield line
    except (OSError, EOFError, paramiko.SSHException):
        return


class _AcceptNew(paramiko.MissingHostKeyPolicy):
    """Trust an unknown host key and append it to ``path``; a lock keeps parallel connections from
    clobbering each other's entries (paramiko's AutoAddPolicy rewrites the whole file per client)."""

    _lock = threading.Lock()

    def __init__(self, path: str) -> None:
        self.path = path

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        client.get_host_keys().add(hostname, key.get_name(), key)
        with self._lock, open(self.path, "a") as f:
            f.write(paramiko.hostkeys.HostKeyEntry([hostname], key).to_line())


class SSHNode(Node):
    """A remote host over SSH (Fabric). Unknown host keys are refused unless the config says otherwise."""

    def __init__(self, index: int, spec: HostSpec, cfg: ClusterConfig) -> None:
        super().__init__(index, spec, cfg)
        self._conn = None
        self._opening = None  # the connection being made, for ``abort``
        self._lock = threading.Lock()

    def _connection(self):
        with self._lock:
            if self._conn is None:
                self._conn = self._open()
            return self._conn

    def _open(self):
        import fabric  # imported here so the local-only path never pays for it

        cfg = self.cfg
        fconf = fabric.Config(runtime_ssh_path=cfg.ssh_config_file) if cfg.ssh_config_file else fabric.Config()
        kwargs = {"allow_agent": True, "look_for_keys": cfg.ssh_identity_file is None,
                  "banner_timeout": cfg.ssh_connect_timeout, "auth_timeout": cfg.ssh_connect_timeout}
        if cfg.ssh_identity_file:
            kwargs["key_filename"] = cfg.ssh_identity_file
        conn = fabric.Connection(self.spec.host, user=self.spec.user, port=self.spec.port, config=fconf,
                                 connect_timeout=int(max(1, cfg.ssh_connect_timeout)), connect_kwargs=kwargs)
        hop = conn
        while isinstance(hop, fabric.Connection):  # the gateways of a ProxyJump chain need the same policy
            self._harden(hop.client)
            hop = hop.gateway
        self._opening = conn
        try:
            conn.open()
        except Exception as e:  # noqa: BLE001 - every way a connection fails becomes one line naming the fix
            raise connect_error(self.label, conn.host, conn.port, conn.user, e, cfg) from e
        finally:
            self._opening = None
        return conn

    def _harden(self, client: paramiko.SSHClient) -> None:
        path = self.cfg.known_hosts
        if os.path.exists(path):
            client.load_host_keys(path)
        if self.cfg.ssh_accept_new_host_keys:
            os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
            client.set_missing_host_key_policy(_AcceptNew(path))
        else:
            client.set_missing_host_key_policy(paramiko.RejectPolicy())

    def run(self, argv: Sequence[str], timeout: Optional[float] = None, stdin: str = "") -> CommandResult:
        conn = self._connection()
        try:
            chan = conn.client.get_transport().open_session(timeout=self.cfg.ssh_connect_timeout)
            if timeout:
                chan.settimeout(timeout)
            chan.exec_command(shlex.join(argv))
            if stdin:
                chan.sendall(stdin.encode())
            chan.shutdown_write()
            out, err = chan.makefile("rb").read(), chan.makefile_stderr("rb").read()
            code = chan.recv_exit_status()
        except (socket.timeout, TimeoutError):
            raise HostError(self.label, f"{shlex.join(argv)[:120]} did not finish within {timeout:.0f} s") from None
        except (paramiko.SSHException, EOFError, OSError) as e:
            raise HostError(self.label, f"SSH connection lost: {e}") from None
        return CommandResult(out.decode(errors="replace"), err.decode(errors="replace"), code)

    def run_into(self, argv: Sequence[str], sink: BinaryIO, timeout: Optional[float] = None) -> CommandResult:
        conn = self._connection()
        try:
            chan = conn.client.get_transport().open_session(timeout=self.cfg.ssh_connect_timeout)
            cancel = Cancel(chan.close, "a file being copied")
            self._streams.add(cancel)  # Ctrl+C (each_node's abort) closes the channel: the copy ends at once
            try:
                chan.settimeout(timeout)
                chan.exec_command(shlex.join(argv))
                chan.shutdown_write()
                for b in iter(lambda: chan.recv(1 << 20), b""):
                    sink.write(b)
                err = chan.makefile_stderr("rb").read()
                code = chan.recv_exit_status()  # -1 when the channel was closed first (aborted)
            finally:
                self._streams.discard(cancel)
        except (socket.timeout, TimeoutError):
            raise HostError(self.label, f"{shlex.join(argv)[:120]}: no data for {timeout:.0f} s") from None
        except (paramiko.SSHException, EOFError, OSError) as e:
            raise HostError(self.label, f"SSH connection lost: {e}") from None
        return CommandResult("", err.decode(errors="replace"), code)

    def put(self, local: Local, remote: str, progress: Optional[Callable[[int, int], None]] = None,
            until: Optional[Callable[[], bool]] = None) -> None:
        if self._put_openssh(local, remote, progress, until):
            return
        conn = self._connection()
        fi, size, name = opened(local)
        try:
            sftp = conn.client.open_sftp()
            try:
                # No size check afterwards: remote may be a FIFO, and the node checks the SHA-256 anyway.
                with _cancel_when(until, sftp.close), fi:
                    sftp.putfo(fi, remote, size, callback=progress, confirm=False)
            finally:
                sftp.close()
        except (paramiko.SSHException, EOFError, OSError) as e:
            why = "stopped: nothing reads it any more" if until is not None and until() else f"failed: {e}"
            raise HostError(self.label, f"upload of {name} to {remote} {why}") from None

    def _openssh_argv(self, command: str) -> Optional[List[str]]:
        """``ssh`` running ``command`` on this host with the same key, config and known_hosts as our own
        connection, strict host-key checking and no prompts; None without an OpenSSH client."""
        ssh = shutil.which("ssh")
        if ssh is None:
            return None
        cfg = self.cfg
        argv = [ssh, "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes", "-o",
                f"UserKnownHostsFile={cfg.known_hosts}", "-o", f"ConnectTimeout={int(max(1, cfg.ssh_connect_timeout))}"]
        if cfg.ssh_config_file:
            argv += ["-F", cfg.ssh_config_file]
        if cfg.ssh_identity_file:
            argv += ["-i", cfg.ssh_identity_file, "-o", "IdentitiesOnly=yes"]
        if self.spec.port:
            argv += ["-p", str(self.spec.port)]
        if self.spec.user:
            argv += ["-l", self.spec.user]
        argv += ["--", self.spec.host]
        return [*argv[:-2], *_gcm_first(tuple(argv)), *argv[-2:], command]

    def _put_openssh(self, local: Local, remote: str, progress: Optional[Callable[[int, int], None]],
                     until: Optional[Callable[[], bool]] = None) -> bool:
        """Upload through the OpenSSH client: paramiko's SFTP runs in this process under one GIL (~55 MB/s,
        and parallel uploads to several hosts share it), OpenSSH runs one process per host at line speed.
        False (nothing done) when OpenSSH is missing or cannot log in; the caller then uses SFTP."""
        argv = self._openssh_argv(f"cat > {shlex.quote(remote)}")
        if argv is None:
            return False
        f, total, name = opened(local)
        p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        done = 0
        # The wait for ssh's end is cancellable too: ssh takes a whole small file into its window at once, and
        # then waits for a remote `cat` that waits for a FIFO reader, which may never come.
        with _cancel_when(until, p.kill):
            try:
                with f:
                    for k in iter(lambda: send_into(f, p.stdin.fileno(), 1 << 20), 0):
                        done += k
                        if progress:
                            progress(done, total)
                p.stdin.close()
            except BrokenPipeError:
                pass
            except BaseException:  # the archive being made failed (the workspace changed): nothing may arrive whole
                p.kill()
                p.wait()
                raise
            err = p.stderr.read().decode(errors="replace").strip()
            rc = p.wait()
        if rc == 255 and until is not None:
            # A node gone mid-upload ends ssh with 255 too, and its session's end shows a moment later: falling back
            # to SFTP then would leave an SFTP server on the node blocked opening a FIFO nobody reads.
            deadline = time.monotonic() + 2.0
            while not until() and time.monotonic() < deadline:
                time.sleep(0.05)
        if until is not None and rc != 0 and until():
            raise HostError(self.label, f"upload of {name} to {remote} stopped: nothing reads it any more")
        if rc == 255:  # ssh itself failed (login, host key, network): let paramiko try and report
            return False
        if rc != 0 or done != total:
            raise HostError(self.label, f"upload of {name} to {remote} failed: {err or rc}")
        return True

    def abort(self) -> List[str]:
        awaited = super().abort()
        opening = self._opening
        if opening is not None:  # an sshd that accepted and says nothing: its handshake ends now, not at a timeout
            awaited.append("the SSH connection")
            try:
                opening.client.close()
            except Exception:  # noqa: BLE001 - it is being given up either way
                pass
        return awaited

    def _stream(self, argv: Sequence[str]) -> CommandStream:
        conn = self._connection()
        chan = conn.client.get_transport().open_session(timeout=self.cfg.ssh_connect_timeout)
        chan.set_combine_stderr(True)
        chan.exec_command(_marked(argv))
        return _ChannelStream(chan, lambda sid: self.run(["kill", "-s", "KILL", "--", f"-{sid}"], timeout=5))

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None


GCM = ("aes128-gcm@openssh.com", "aes256-gcm@openssh.com")


@cache
def _gcm_first(argv: Tuple[str, ...]) -> Tuple[str, ...]:
    """``-o Ciphers=`` with AES-GCM first when nothing chose the ciphers (neither the user's nor the system's
    ssh config: ``ssh -G`` resolves them to OpenSSH's default) and this CPU has AES instructions: an upload
    then costs ``ssh`` and the node's ``sshd`` about half the CPU of the default chacha20-poly1305. Empty
    otherwise: an explicit choice is never overridden. ``argv`` is ``ssh [options] -- host``."""
    if not _has_aes():
        return ()
    *opts, dashes, host = argv
    plain = [a for i, a in enumerate(opts) if a != "-F" and (i == 0 or opts[i - 1] != "-F")]
    try:
        chosen, default = (_ciphers([*o, "-G", dashes, host]) for o in (opts, [*plain, "-F", "/dev/null"]))
    except (OSError, subprocess.SubprocessError):
        return ()
    if not default or chosen != default or not set(GCM) <= set(default):
        return ()
    return ("-o", "Ciphers=" + ",".join([*GCM, *(c for c in default if c not in GCM)]))


def _ciphers(argv: List[str]) -> List[str]:
    out = subprocess.run(argv, capture_output=True, text=True, timeout=10, stdin=subprocess.DEVNULL).stdout
    return next((line.split()[1].split(",") for line in out.splitlines() if line.startswith("ciphers ")), [])


def _has_aes() -> bool:
    """Whether this CPU has AES instructions (x86's ``aes`` flag, arm64's ``aes`` feature)."""
    try:
        with open("/proc/cpuinfo") as f:
            rows = (line.partition(":") for line in f)
            return any(key.strip() in ("flags", "Features") and "aes" in value.split() for key, _, value in rows)
    except OSError:
        return False


def _ssh_command(user: str, address: str, port: int, cfg: ClusterConfig, *extra: str) -> str:
    key = f" -i {shlex.quote(cfg.ssh_identity_file)}" if cfg.ssh_identity_file else ""
    return f"ssh{' '.join(('',) + extra)} -o BatchMode=yes -p {port}{key} {user}@{address} true"


def _key_files(cfg: ClusterConfig) -> List[str]:
    """The key files a login offers: SSH_IDENTITY_FILE, else the usual ~/.ssh/id_* that exist."""
    if cfg.ssh_identity_file:
        return [cfg.ssh_identity_file]
    home = os.path.expanduser("~/.ssh")
    return [p for p in (os.path.join(home, f"id_{t}") for t in ("rsa", "ecdsa", "ed25519", "dsa")) if os.path.isfile(p)]


def _needs_passphrase(path: str) -> bool:
    try:
        paramiko.PKey.from_path(path)
    except paramiko.PasswordRequiredException:
        return True
    except TypeError as e:  # cryptography's word for an encrypted PEM key
        return "password" in str(e).lower()
    except Exception:  # noqa: BLE001 - unreadable or not a key: another message says so
        return False
    return False


def _agent_has_keys() -> bool:
    agent = paramiko.Agent()
    try:
        return bool(agent.get_keys())
    finally:
        agent.close()


def connect_error(label: str, host: str, port: int, user: str, e: BaseException, cfg: ClusterConfig) -> ConnectError:
    """What went wrong opening an SSH session, as a ``ConnectError``: the only place paramiko's and the socket
    layer's exceptions are read."""
    address = host
    if isinstance(e, paramiko.ssh_exception.NoValidConnectionsError) and e.errors:
        peer, e = next(iter(e.errors.items()))  # "[Errno None] Unable to connect": the cause is inside
        address, port = peer[0], peer[1]
    check = _ssh_command(user, address, port, cfg)
    known = cfg.known_hosts
    refused = paramiko.AuthenticationException
    if isinstance(e, paramiko.BadHostKeyException):
        return ConnectError(label, address, port, f"host key CHANGED (differs from {known})",
                            f"if the host was reinstalled: ssh-keygen -R {address} -f {known}; otherwise do not "
                            "connect")
    if isinstance(e, refused) and not _agent_has_keys():
        locked = [k for k in _key_files(cfg) if _needs_passphrase(k)]
        if locked:  # paramiko skips a key it cannot open: the key may well be installed (ssh-copy-id is no fix)
            return ConnectError(label, address, port, f"login as {user} refused: {locked[0]} has a passphrase "
                                "and no ssh-agent holds it (passphrases and passwords are never prompted for)",
                                f"add it to an agent: eval \"$(ssh-agent)\" && ssh-add {locked[0]}")
    if isinstance(e, refused):
        keys = cfg.ssh_identity_file or "ssh-agent and ~/.ssh/id_*"
        return ConnectError(label, address, port, f"login as {user} refused (tried {keys}; passwords are never "
                            "prompted for)", f"install the key: ssh-copy-id -p {port}"
                            f"{' -i ' + cfg.ssh_identity_file if cfg.ssh_identity_file else ''} {user}@{address}")
    text = str(e)
    if isinstance(e, paramiko.SSHException) and "No authentication methods available" in text:
        # no agent, no ~/.ssh/id_*, no SSH_IDENTITY_FILE: the quick start's ssh-keygen step not done yet
        return ConnectError(label, address, port, f"no SSH key to log in as {user} with (no ssh-agent, no "
                            "~/.ssh/id_*, no SSH_IDENTITY_FILE; passwords are never prompted for)", "make one and "
                            f"install it: ssh-keygen -t ed25519 && ssh-copy-id -p {port} {user}@{address}")
    if isinstance(e, paramiko.SSHException) and cfg.ssh_identity_file and "not a valid" in text:
        return ConnectError(label, address, port, f"SSH_IDENTITY_FILE {cfg.ssh_identity_file} is not a private key "
                            f"({text})", "give the private key's file, not its .pub, e.g. ~/.ssh/id_ed25519")
    if isinstance(e, paramiko.SSHException) and "not found in known_hosts" in text:
        return ConnectError(label, address, port, f"host key of {address} is unknown (not in {known})",
                            f"check it and add it: ssh-keyscan -p {port} {address} >> {known} (or run once with "
                            "--accept-new-host-keys)")
    if isinstance(e, paramiko.SSHException) and "banner" in text:
        return ConnectError(label, address, port, "connected, but no SSH greeting came (not an SSH server, or "
                            "overloaded)", f"diagnose: {_ssh_command(user, address, port, cfg, '-v')}")
    if isinstance(e, (socket.timeout, TimeoutError)):
        return ConnectError(label, address, port, f"no answer within {cfg.ssh_connect_timeout:.0f} s "
                            "(SSH_CONNECT_TIMEOUT; host down, wrong address or a firewall)", f"diagnose: ping -c 1 "
                            f"{address}; {check}")
    if isinstance(e, socket.gaierror):
        return ConnectError(label, address, port, f"cannot resolve {host} ({e.strerror})", "fix the name in "
                            "HOSTS or ~/.ssh/config; diagnose: getent hosts " + host)
    errno_ = getattr(e, "errno", None)
    if errno_ == 111:  # ECONNREFUSED
        return ConnectError(label, address, port, "connection refused (no SSH server listening on that port)",
                            f"start sshd there or fix the port in HOSTS; diagnose: {check}")
    if errno_ in (101, 113):  # ENETUNREACH, EHOSTUNREACH
        return ConnectError(label, address, port, "no route to host (down or on another network)",
                            f"diagnose: ip route get {address}; ping -c 1 {address}")
    what = f"SSH failed: {type(e).__name__}: {text}" if text else f"SSH failed: {type(e).__name__}"
    return ConnectError(label, address, port, what, f"diagnose: {_ssh_command(user, address, port, cfg, '-v')}")
