"""Nodes of the cluster (``each_node`` runs a function on every one at once).

A ``Node`` runs commands, copies files and opens a long-lived command stream on one host. ``localhost``
is a ``LocalNode`` (subprocess, no SSH); every other host is an ``SSHNode`` (Fabric ``Connection``, in
``sshnode``: a config of local hosts only never imports paramiko). Both
speak the same interface, so everything above this module is one code path.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable, Dict, Iterator, List, Optional, Protocol, Sequence, Tuple, Union

from paddle_cluster.node.lines import bounded_lines

from .config import ClusterConfig, HostSpec
from .errors import HostError

# paramiko logs a failed handshake (no SSH banner, a reset) as an ERROR with a traceback; with no handler of
# its own that reaches the terminal above our one-line message. ``--debug`` turns the logging back on
# (set here, before cli reads --debug, although paramiko itself is only imported by sshnode).
logging.getLogger("paramiko").addHandler(logging.NullHandler())
logging.getLogger("paramiko").propagate = False


@dataclass(frozen=True)
class CommandResult:
    stdout: str
    stderr: str
    exit_code: int


class CommandStream:
    """A long-running remote command: write lines to its stdin, read lines from its stdout+stderr.
    ``lines()`` is one iterator for the stream's life: a reader may take over where another stopped.
    ``awaiting`` is what its caller says while it waits for the command's answer (what ``Node.abort`` reports)."""

    awaiting = ""

    def write_line(self, text: str) -> None:
        self.write(text.encode() + b"\n")

    def write(self, data: bytes) -> None:
        raise NotImplementedError

    def lines(self) -> Iterator[str]:
        raise NotImplementedError

    def settimeout(self, seconds: Optional[float]) -> None:
        """Reading ``lines()`` ends (as at EOF) after ``seconds`` of silence; None: never."""

    def ended(self) -> bool:
        """The remote command has exited (its output may still be unread)."""
        return False

    def close(self) -> None:
        raise NotImplementedError

    def abort(self) -> None:
        """End the command now, whatever it waits for: its POSIX session killed (where the node allows it), the
        stream closed, so that reading ``lines()`` ends."""
        self.close()


class Cancel(CommandStream):
    """A command that is no stream (``run_into``'s copy) made abortable: ``Node.abort`` calls ``stop``."""

    def __init__(self, stop: Callable[[], None], awaiting: str) -> None:
        self._stop, self.awaiting = stop, awaiting

    def close(self) -> None:
        pass

    def abort(self) -> None:
        self._stop()


class Node:
    """One host of the cluster; ``index`` is its node id (its position in ``HOSTS``)."""

    def __init__(self, index: int, spec: HostSpec, cfg: ClusterConfig) -> None:
        self.index, self.spec, self.cfg = index, spec, cfg
        self._streams: weakref.WeakSet[CommandStream] = weakref.WeakSet()  # for ``abort``

    @property
    def name(self) -> str:
        return f"node{self.index}"

    @property
    def label(self) -> str:
        return f"node{self.index} ({self.spec.text})"

    def run(self, argv: Sequence[str], timeout: Optional[float] = None, stdin: str = "") -> CommandResult:
        raise NotImplementedError

    def run_into(self, argv: Sequence[str], sink: BinaryIO, timeout: Optional[float] = None) -> CommandResult:
        """Run ``argv`` with its standard output written to ``sink`` as it comes (a file's bytes, any size);
        its stderr and exit status in the result. A silence of ``timeout`` s is a ``HostError``."""
        raise NotImplementedError

    def put(self, local: Local, remote: str, progress: Optional[Callable[[int, int], None]] = None,
            until: Optional[Callable[[], bool]] = None) -> None:
        """Copy ``local`` (a path, or an archive still being made) to ``remote`` (a file or a FIFO); ``until()``,
        polled meanwhile, stops the copy once true (a HostError): a FIFO whose reader died would otherwise hold
        the upload forever."""
        raise NotImplementedError

    def stream(self, argv: Sequence[str]) -> CommandStream:
        """A long-running command on the node; ``abort`` ends it."""
        s = self._stream(argv)
        self._streams.add(s)
        return s

    def _stream(self, argv: Sequence[str]) -> CommandStream:
        raise NotImplementedError

    def abort(self) -> List[str]:
        """Ctrl+C: end at once every command stream this node has open (the calls waiting on them then fail), from
        another thread than the one waiting; a connection still being made is given up. What was awaited of the
        node then (an answer, the connection): the node's part in a stop that did not finish."""
        awaited = []
        for s in list(self._streams):
            if s.awaiting:
                awaited.append(s.awaiting)
            try:
                s.abort()
            except Exception:  # noqa: BLE001 - the others still have to end
                pass
        return awaited

    def close(self) -> None:
        pass

    def run_json(self, argv: Sequence[str], what: str, timeout: Optional[float] = None,
                 stdin: str = "") -> Dict[str, Any]:
        """Run ``argv`` (given ``stdin``) and return its answer: a JSON object on the last line of its output,
        whatever the exit status (the answer says what went wrong). Without one, a ``HostError`` quoting the
        output."""
        res = self.run(argv, timeout=timeout, stdin=stdin)
        try:
            doc = json.loads(res.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            doc = None
        if not isinstance(doc, dict):
            detail = (res.stderr.strip() or res.stdout.strip()).splitlines()[-5:]
            raise HostError(self.label, f"{what} failed (exit {res.exit_code}): " + " | ".join(detail))
        return doc


class Growing(Protocol):
    """An archive sent while it is made (``launch/dispatch.Packing``): its final ``size``, and a ``reader()`` from
    its start whose ``read`` waits for more (and raises the packer's error)."""

    size: int
    directory: str

    def reader(self) -> BinaryIO: ...


Local = Union[str, Growing]


def send_into(f: BinaryIO, fd: int, n: int) -> int:
    """Up to ``n`` more bytes of ``f`` (``opened``) into ``fd`` by ``os.sendfile``: the kernel moves them from the
    file (or the archive being made, whose reader waits for more) without a copy through Python; 0 at its end."""
    sendinto = getattr(f, "sendinto", None)
    return sendinto(fd, n) if sendinto is not None else os.sendfile(fd, f.fileno(), None, n)


def opened(local: Local) -> Tuple[BinaryIO, int, str]:
    """What ``put`` sends, read from its start: (a file object, its size, its name for messages)."""
    if isinstance(local, str):
        return open(local, "rb"), os.path.getsize(local), os.path.basename(local)
    return local.reader(), local.size, f"the archive of {os.path.basename(local.directory.rstrip('/'))}"


class _PopenStream(CommandStream):
    def __init__(self, argv: Sequence[str]) -> None:
        self.proc = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, bufsize=0, start_new_session=True)
        self._lock = threading.Lock()
        assert self.proc.stdout is not None
        self._lines = bounded_lines(self.proc.stdout.readline)

    def write(self, data: bytes) -> None:
        with self._lock:
            assert self.proc.stdin is not None
            self.proc.stdin.write(data)

    def lines(self) -> Iterator[str]:
        return self._lines

    def ended(self) -> bool:
        return self.proc.poll() is not None

    def abort(self) -> None:
        try:  # its own POSIX session (start_new_session): the command and all it started
            os.killpg(self.proc.pid, signal.SIGKILL)
        except OSError:
            pass
        self.close()

    def close(self) -> None:
        if self.proc.stdin:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        try:  # the command ends when its stdin does; one that does not is killed with its session
            self.proc.wait(timeout=1)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except OSError:
                pass
            self.proc.wait()


class LocalNode(Node):
    """``localhost``: commands run as subprocesses, files are copied, no SSH."""

    def run(self, argv: Sequence[str], timeout: Optional[float] = None, stdin: str = "") -> CommandResult:
        try:
            p = subprocess.run(list(argv), input=stdin, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise HostError(self.label, f"{shlex.join(argv)} did not finish within {timeout:.0f} s") from None
        except FileNotFoundError as e:
            raise HostError(self.label, f"cannot run {argv[0]}: {e.strerror}") from None
        return CommandResult(p.stdout, p.stderr, p.returncode)

    def run_into(self, argv: Sequence[str], sink: BinaryIO, timeout: Optional[float] = None) -> CommandResult:
        try:
            p = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        except OSError as e:
            raise HostError(self.label, f"cannot run {argv[0]}: {e.strerror}") from None
        assert p.stdout is not None and p.stderr is not None
        cancel = Cancel(p.kill, "a file being copied")
        self._streams.add(cancel)  # Ctrl+C (each_node's abort) ends the copy
        try:
            for b in iter(lambda: p.stdout.read1(1 << 20), b""):  # type: ignore[union-attr]
                sink.write(b)
        except BaseException:
            p.kill()
            raise
        finally:
            err = p.stderr.read().decode(errors="replace")
            p.wait()
            self._streams.discard(cancel)
        return CommandResult("", err, p.returncode)

    def put(self, local: Local, remote: str, progress: Optional[Callable[[int, int], None]] = None,
            until: Optional[Callable[[], bool]] = None) -> None:
        fi, size, name = opened(local)
        try:
            with _cancel_when(until, lambda: _unblock_fifo(remote)), fi, \
                    open(remote, "wb") as fo:  # remote may be a FIFO (node/chain.py)
                shutil.copyfileobj(fi, fo, 1 << 20)
        except BrokenPipeError:
            raise HostError(self.label, f"upload of {name} to {remote} stopped: nothing reads it any more") from None
        if progress:
            progress(size, size)

    def _stream(self, argv: Sequence[str]) -> CommandStream:
        return _PopenStream(argv)


@contextmanager
def _cancel_when(until: Optional[Callable[[], bool]], cancel: Callable[[], None]) -> Iterator[None]:
    """While the block runs, call ``cancel()`` once ``until()`` is true (and again at every look after, for a
    cancel that can come too early: a FIFO's writer not blocked yet)."""
    if until is None:
        yield
        return
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.2):
            if until():
                cancel()

    t = threading.Thread(target=watch, daemon=True, name="upload-watch")
    t.start()
    try:
        yield
    finally:
        done.set()
        t.join()


def _unblock_fifo(path: str) -> None:
    """A writer blocked opening the FIFO ``path`` opens it (as a reader came) and then finds no reader (EPIPE)."""
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK))
    except OSError:
        pass
