"""``node session``: everything the launcher needs from a node before a job, in one process on one channel.

The launcher starts it with a ``SessionRequest`` (``launch/session.py`` installs the library first, on the same
channel, when its hash is new). It answers with one JSON line: the probe. On ``Go`` it answers what it holds
of the workspace: that archive's tree in its cache (nothing is sent), or where the archive can come in
(``node/chain.py``: a FIFO the launcher writes into, a port the node before connects to). The launcher's
``Fetch`` says which, and ``Forward`` where it goes on to; the session unpacks it as it arrives and checks the
hash. Only on ``PlaceWorkspace`` (every node's probe agreed and every node has the workspace) does it write: the tree
into its cache and the job directory, hard links into that tree. With ``agent``
the process then becomes the job's ``supervise`` agent on the same stdin/stdout, so a job costs each node one
interpreter and one channel.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import re
import sys
import threading
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from paddle_cluster import contract

from . import chain, probe, supervisor, trees
from . import messages as m
from .unpack import UnsafeArchive, sweep_stale

F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)  # linux/fcntl.h; in fcntl from Python 3.10
REPLY = "session"  # the key every answer of a session carries, so other output (a warning) is told apart
SHA = re.compile("[0-9a-f]{64}")  # a sealed hash names a directory: nothing else is taken


@dataclass(frozen=True)
class SessionRequest:
    """What the launcher asks of a node: probe (``nic``, ``ports``, ``root``), then the workspace -- the
    archive ``workspace_sha`` copied into ``job_dir``, or (``workspace_dir``) a directory that must exist, with
    ``workspace_script`` in it -- and, with ``agent``, run the job's agent afterwards."""

    nic: str
    root: str
    ports: Tuple[int, ...] = ()
    workspace_sha: str = ""
    job_dir: str = ""
    max_members: int = 0
    workspace_size: int = 0
    workspace_dir: str = ""
    workspace_script: str = ""  # the trainer command's script, relative to workspace_dir (is it there?)
    agent: bool = False
    orphan_timeout: float = 20.0
    grace: float = 5.0
    checkpoints: str = ""  # with --resume_from: the checkpoint root whose shards of ``pservers`` the probe surveys
    pservers: Tuple[int, ...] = ()
    workspace_new: bool = False  # the archive is sent while the launcher packs it: its hash comes last (``Seal``)

    @property
    def wants_workspace(self) -> bool:
        return bool(self.workspace_sha or self.workspace_new or self.workspace_dir)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> SessionRequest:
        doc = json.loads(text)
        doc["ports"] = tuple(doc.get("ports", ()))
        doc["pservers"] = tuple(doc.get("pservers", ()))
        return cls(**doc)


def _reply(kind: str, **doc: Any) -> None:
    os.write(1, (json.dumps({REPLY: kind, **doc}) + "\n").encode())


def _line(fd: int = 0) -> Optional[str]:
    """One line from the launcher, read a byte at a time so nothing meant for the agent is read here."""
    buf = bytearray()
    while True:
        b = os.read(fd, 1)
        if not b:
            return None
        if b == b"\n":
            return buf.decode(errors="replace")
        buf += b
        if len(buf) > 1 << 16:
            return None


class _Orders(chain.Orders):
    """The launcher's orders, read off stdin one line at a time (``take``): besides the chain's, ``place`` (every
    node has the workspace: put it in place), the next ``Go`` or ``Fetch``, and whether the launcher is gone."""

    def __init__(self) -> None:
        super().__init__(0)
        self.place = False
        self.next: Optional[m.SessionCommand] = None
        self.ended = False

    def take(self) -> None:
        line = _line()
        try:
            msg = m.decode(line) if line else None
        except m.MessageError:
            msg = None
        if isinstance(msg, m.Forward):
            self.forward = msg.to
        elif isinstance(msg, m.PlaceWorkspace):
            self.place = True
        elif isinstance(msg, m.Abort):
            self.stop = msg.why
        elif isinstance(msg, m.Seal) and SHA.fullmatch(msg.sha):
            self.sealed = msg.sha
        elif isinstance(msg, (m.Go, m.Fetch)):
            self.next = msg
        else:  # the launcher gave up, or sent garbage
            self.stop, self.ended = "the launcher ended the session", True

    def command(self) -> Optional[m.SessionCommand]:
        """The next ``Go`` or ``Fetch`` (other orders noted meanwhile); None when the launcher is gone."""
        while self.next is None and not self.ended:
            self.take()
        cmd, self.next = self.next, None
        return cmd

    def placed(self) -> bool:
        """Wait for ``PlaceWorkspace``; False when the launcher stopped the dispatch or is gone."""
        while not self.place and not self.stop:
            self.take()
        return self.place and not self.stop


def _workspace(req: SessionRequest, address: str) -> Tuple[Dict[str, Any], Optional[chain.Receiver]]:
    """The workspace's state on this node, and the receiver to fill when the archive must be sent. Nothing is
    written into the job directory yet (``PlaceWorkspace``, once every node has the workspace)."""
    if req.workspace_dir:
        return {"exists": os.path.isdir(req.workspace_dir), "script": not req.workspace_script
                or os.path.isfile(os.path.join(req.workspace_dir, req.workspace_script))}, None
    if not req.workspace_sha and not req.workspace_new:
        return {}, None
    held = False
    try:
        contract.check_job_name(os.path.basename(req.job_dir))
        dest = os.path.realpath(req.job_dir)
        _sweep(req.root, os.path.dirname(dest))
        if os.path.exists(dest) and os.listdir(dest):
            raise UnsafeArchive(f"{dest} already exists and is not empty; choose another --job_name")
        if req.workspace_sha:  # (a new workspace, sent while it is packed, has no hash yet: it is always sent)
            trees.pin(req.root, req.workspace_sha)  # a concurrent launch's session prunes others, never this one
            held = os.path.isdir(trees.tree_dir(req.root, req.workspace_sha))
            if trees.holds(req.root, req.workspace_sha):
                return {"held": True}, None
        packages = os.path.join(req.root, ".paddle_cluster", "packages")
        os.makedirs(packages, mode=0o700, exist_ok=True)
        rx = chain.Receiver(address, os.path.join(packages, f"{req.workspace_sha or 'new'}.rx-{os.getpid()}"))
    except (contract.ContractError, UnsafeArchive, OSError) as e:
        return {"ok": False, "error": str(e)}, None
    # damaged: its cached tree was written into since it was unpacked, and dropped
    base = trees.newest(req.root) if req.workspace_sha else ""  # a new workspace goes whole
    if base:
        trees.pin(req.root, base)  # what the changed files will be linked with (pruned before: sent whole)
    return {"need": rx.fifo, "port": rx.port, "damaged": held, "base": base}, rx


def _sweep(root: str, jobs: str) -> None:
    """Remove what a session killed mid-dispatch left here: its FIFO directory, a half-unpacked or half-dropped
    tree, a half-linked job directory (each named after its pid, which no longer runs)."""
    sweep_stale(os.path.join(root, ".paddle_cluster", "packages"), ("rx",))
    sweep_stale(os.path.dirname(trees.tree_dir(root, "x")), ("unpacking", "drop"))
    sweep_stale(jobs, ("linking", "unpacking"), _job_name)


def _checkpoints(req: SessionRequest) -> Dict[str, Any]:
    """What the checkpoint root holds of this node's pservers' shards (``ps.checkpoint.survey``), or why that
    cannot be told."""
    try:
        from paddle_cluster.ps import checkpoint  # numpy: only this needs it (the probe reports it missing)
        from paddle_cluster.ps.errors import CheckpointError

        return checkpoint.survey(req.checkpoints, req.pservers)
    except ImportError as e:
        return {"error": f"cannot look at checkpoints: {e}"}
    except CheckpointError as e:  # there but unreadable: never taken for "no checkpoint"
        return {"error": str(e)}


def _job_name(name: str) -> bool:
    try:
        contract.check_job_name(name)
    except contract.ContractError:
        return False
    return True


def _place(req: SessionRequest, orders: _Orders, unpacking: Optional[_Unpacking] = None) -> Optional[Dict[str, Any]]:
    """On ``PlaceWorkspace``: the received tree into the cache (``unpacking``), then the job directory made of it; None
    when the launcher stopped the dispatch instead (nothing is kept)."""
    if not orders.placed():
        if unpacking is not None:
            unpacking.finish("")
        return None
    error = unpacking.finish(req.workspace_sha) if unpacking is not None else None
    try:
        if error is None and not trees.materialize(req.root, req.workspace_sha, req.job_dir):
            error = UnsafeArchive(f"the cached tree {req.workspace_sha[:12]} is gone or was written into")
    except (UnsafeArchive, OSError) as e:
        error = e
    return {"ok": False, "error": str(error)} if error is not None else {"ok": True, "sent": unpacking is not None}


def _fetch(req: SessionRequest, rx: chain.Receiver, token: bytes, orders: _Orders) -> Optional[Dict[str, Any]]:
    """Receive the archive as the launcher says (``Fetch``; after a failed chain link, again from the
    launcher), unpacking it into a temporary tree as it arrives; say so, and on ``PlaceWorkspace`` put it in place;
    None when the launcher gave up."""
    while True:
        cmd = orders.command()
        if not isinstance(cmd, m.Fetch):
            return None
        orders.stop = ""  # an Abort meant for an earlier try
        sha, size = (cmd.sha, cmd.size) if cmd.sha else (req.workspace_sha, req.workspace_size)
        unpacking = _Unpacking(req, size, cmd.base)
        try:
            why = rx.receive(cmd.source, token, sha, size, unpacking.out, orders, _reply)
            error = None if why else unpacking.unpacked()
        except BaseException:
            unpacking.finish("")
            raise
        if why or error is not None:
            unpacking.finish("")
        if not why and error is not None and cmd.base:
            why = f"the changed files could not be put on the tree held here: {error}"
            orders.forward = ""  # the next node has the changed files; this one is sent the whole archive alone
        if why:
            _reply("workspace", workspace={"retry": why})
            continue
        if error is not None:
            return {"ok": False, "error": str(error)}
        if not req.workspace_sha:  # sent while it was packed: named by the hash it was checked against
            req = dataclasses.replace(req, workspace_sha=orders.sealed)
            trees.pin(req.root, req.workspace_sha)
        _reply("workspace", workspace={"received": True})
        return _place(req, orders, unpacking)


class _Unpacking:
    """An archive streamed through a pipe (``out``) into the cache's unpacker while it arrives; the tree is put
    in the cache only by ``finish(sha)`` (its hash was right, and every node has it), named ``sha``."""

    def __init__(self, req: SessionRequest, size: int, base: str) -> None:
        r, w = os.pipe()
        try:
            fcntl.fcntl(w, F_SETPIPE_SZ, chain.CHUNK)
        except OSError:
            pass  # a smaller pipe only means more wake-ups
        self.out = os.fdopen(w, "wb", buffering=0)
        self.ready, self.decided, self.sha = threading.Event(), threading.Event(), ""
        self.failed: List[Exception] = []
        self.thread = threading.Thread(target=self._run, args=(r, req, size, base), name="unpack")
        self.thread.start()

    def _run(self, r: int, req: SessionRequest, size: int, base: str) -> None:
        with os.fdopen(r, "rb") as f:
            def verified() -> bool:
                while f.read(chain.CHUNK):  # the tar's padding: let the transfer finish before asking
                    pass
                self.ready.set()
                self.decided.wait()
                return bool(self.sha)
            try:
                trees.store(req.root, f, lambda: self.sha, max(req.max_members, 1) + 1, size, verified, base)
            except Exception as e:  # noqa: BLE001 - whatever a bad archive provokes is answered, never a traceback
                self.failed.append(e)
            finally:
                self.ready.set()
                while f.read(chain.CHUNK):  # refused or failed: still drain it, the nodes after this one need it
                    pass

    def unpacked(self) -> Optional[Exception]:
        """Once the whole archive went in: the unpacker's error, or None when the tree waits for ``finish``."""
        self.out.close()
        self.ready.wait()
        return self.failed[0] if self.failed else None

    def finish(self, sha: str) -> Optional[Exception]:
        """Put the tree in the cache under ``sha``, or ("") drop it; the unpacker's error."""
        self.out.close()
        self.sha = sha
        self.decided.set()
        self.thread.join()
        return self.failed[0] if self.failed and sha else None


def main(text: str) -> int:
    req = SessionRequest.from_json(text)
    found = probe.probe(req.nic, req.ports, req.root)
    if req.checkpoints:
        found["checkpoints"] = _checkpoints(req)
    _reply("probe", **found)
    if req.wants_workspace:
        # Nothing is written before the launcher has every node's probe and every node has the workspace: it
        # may refuse the job (a machine listed twice would race itself into one job directory).
        orders = _Orders()
        go = orders.command()
        if not isinstance(go, m.Go):
            return 1  # the launcher gave up (another node failed): nothing to do
        ws, rx = _workspace(req, found.get("address") or "")
        _reply("workspace", workspace=ws)
        if rx is not None or ws.get("held"):
            try:
                done = _fetch(req, rx, bytes.fromhex(go.token), orders) if rx else _place(req, orders)
            finally:
                if rx is not None:
                    rx.close()
            if done is None:
                return 1
            _reply("workspace", workspace=done)
        trees.unpin()  # the job directory is made: its hard links need the trees no more
    if not req.agent:
        return 0
    sys.stdout.flush()
    return supervisor.supervise(req.orphan_timeout, req.grace)
