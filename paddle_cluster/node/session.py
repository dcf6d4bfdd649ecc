"""``node session``: everything the launcher needs from a node before a job, in one process on one channel.

The launcher starts it with a ``Request`` (``launch/session.py`` installs the library first, on the same
channel, when its hash is new). It answers with one JSON line: the probe. Only when the launcher says ``Go``
(every node's probe agreed) does it touch the workspace and answer with its state -- hard-linked into the job
directory from this node's cache when it holds that archive's tree (nothing is sent), else where the archive
can come in (``node/chain.py``: a FIFO the launcher writes into, a port the node before connects to). The
launcher's ``Fetch`` says which; the session checks the hash, caches the tree and links it in. With ``agent``
the process then becomes the job's ``supervise`` agent on the same stdin/stdout, so a job costs each node one
interpreter and one channel.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import sys
import threading
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from paddle_cluster import contract

from . import chain, probe, supervisor, trees
from . import messages as m
from .unpack import UnsafeArchive

F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)  # linux/fcntl.h; in fcntl from Python 3.10
REPLY = "session"  # the key every answer of a session carries, so other output (a warning) is told apart


@dataclass(frozen=True)
class Request:
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

    @property
    def wants_workspace(self) -> bool:
        return bool(self.workspace_sha or self.workspace_dir)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Request:
        doc = json.loads(text)
        doc["ports"] = tuple(doc.get("ports", ()))
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


def _command() -> Optional[m.SessionCommand]:
    """The launcher's next session command (a stray ``Abort`` skipped); None when it gave up or sent garbage."""
    while True:
        line = _line()
        try:
            msg = m.decode(line) if line else None
        except m.MessageError:
            return None
        if not isinstance(msg, m.Abort):
            return msg if isinstance(msg, m.SESSION) else None


def _workspace(req: Request, address: str) -> Tuple[Dict[str, Any], Optional[chain.Receiver]]:
    """The workspace's state on this node, and the receiver to fill when the archive must be sent."""
    if req.workspace_dir:
        return {"exists": os.path.isdir(req.workspace_dir), "script": not req.workspace_script
                or os.path.isfile(os.path.join(req.workspace_dir, req.workspace_script))}, None
    if not req.workspace_sha:
        return {}, None
    try:
        contract.check_job_name(os.path.basename(req.job_dir))
        held = os.path.isdir(trees.tree_dir(req.root, req.workspace_sha))
        if trees.materialize(req.root, req.workspace_sha, req.job_dir):
            return {"ok": True, "sent": False}, None
        packages = os.path.join(req.root, ".paddle_cluster", "packages")
        os.makedirs(packages, mode=0o700, exist_ok=True)
        rx = chain.Receiver(address, os.path.join(packages, f"{req.workspace_sha}.fifo-{os.getpid()}"))
    except (contract.ContractError, UnsafeArchive, OSError) as e:
        return {"ok": False, "error": str(e)}, None
    # damaged: its cached tree was written into since it was unpacked, and dropped
    return {"need": rx.fifo, "port": rx.port, "damaged": held, "base": trees.newest(req.root)}, rx


def _fetch(req: Request, rx: chain.Receiver, token: bytes) -> Optional[Dict[str, Any]]:
    """Receive the archive as the launcher says (``Fetch``; after a failed chain link, again from the
    launcher), unpacking it into the cache as it arrives, then link it into the job directory; None when the
    launcher gave up."""
    while True:
        cmd = _command()
        if not isinstance(cmd, m.Fetch):
            return None
        why, error = _receive(req, rx, cmd, token)
        if not why and error is not None and cmd.base:
            why = f"the changed files could not be put on the tree held here: {error}"
        if not why:
            break
        _reply("workspace", workspace={"retry": why})
    if error is not None:
        return {"ok": False, "error": str(error)}
    try:
        trees.materialize(req.root, req.workspace_sha, req.job_dir)
        return {"ok": True, "sent": True}
    except (UnsafeArchive, OSError) as e:
        return {"ok": False, "error": str(e)}


def _receive(req: Request, rx: chain.Receiver, cmd: m.Fetch, token: bytes) -> Tuple[str, Optional[Exception]]:
    """One try: the archive streamed through a pipe into the cache's unpacker while it arrives (the tree is put
    in place only once its hash is right); why the transfer failed ("" if not), and the unpacker's error."""
    sha, size = (cmd.sha, cmd.size) if cmd.sha else (req.workspace_sha, req.workspace_size)
    r, w = os.pipe()
    try:
        fcntl.fcntl(w, F_SETPIPE_SZ, chain.CHUNK)
    except OSError:
        pass  # a smaller pipe only means more wake-ups
    done, verdict = threading.Event(), {"ok": False}
    failed: List[Exception] = []

    def unpack() -> None:
        with os.fdopen(r, "rb") as f:
            def verified() -> bool:
                while f.read(chain.CHUNK):  # the tar's padding: let the transfer finish before asking
                    pass
                done.wait()
                return verdict["ok"]
            try:
                trees.store(req.root, f, req.workspace_sha, max(req.max_members, 1) + 1, size, verified, cmd.base)
            except Exception as e:  # noqa: BLE001 - whatever a bad archive provokes is answered, never a traceback
                failed.append(e)
            finally:
                while f.read(chain.CHUNK):  # refused or failed: still drain it, the nodes after this one need it
                    pass

    t = threading.Thread(target=unpack, name="unpack")
    t.start()
    try:
        with os.fdopen(w, "wb", buffering=0) as out:
            why = rx.receive(cmd.source, cmd.forward, token, sha, size, out, 0, _reply)
            verdict["ok"] = not why
    finally:
        done.set()
        t.join()
    return why, (failed[0] if failed and not why else None)


def main(text: str) -> int:
    req = Request.from_json(text)
    found = probe.probe(req.nic, req.ports, req.root)
    _reply("probe", **found)
    if req.wants_workspace:
        # Nothing is written before the launcher has every node's probe: it may refuse the job (a machine
        # listed twice would race itself into one job directory).
        go = _command()
        if not isinstance(go, m.Go):
            return 1  # the launcher gave up (another node failed): nothing to do
        ws, rx = _workspace(req, found.get("address") or "")
        _reply("workspace", workspace=ws)
        if rx is not None:
            try:
                done = _fetch(req, rx, bytes.fromhex(go.token))
            finally:
                rx.close()
            if done is None:
                return 1
            _reply("workspace", workspace=done)
    if not req.agent:
        return 0
    sys.stdout.flush()
    return supervisor.supervise(req.orphan_timeout, req.grace)
