"""``node session``: everything the launcher needs from a node before a job, in one process on one channel.

The launcher starts it with a ``Request`` (``launch/session.py`` installs the library first, on the same
channel, when its hash is new). It answers with one JSON line: the probe. Only when the launcher says ``go``
(every node's probe agreed) does it touch the workspace and answer with its state -- copied into the job
directory from this node's cache when it holds that archive's tree (nothing is sent), else the path where the
launcher is to upload the archive. After an upload the launcher names the file on stdin and
the session verifies its hash, caches its tree and copies it in. With ``agent`` the process then becomes the
job's ``supervise`` agent on the same stdin/stdout, so a job costs each node one interpreter and one channel.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import secrets
import sys
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from paddle_cluster import contract

from . import probe, supervisor, trees
from .unpack import UnsafeArchive

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


def _command() -> Dict[str, Any]:
    line = _line()
    try:
        doc = json.loads(line) if line else {}
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


def _workspace(req: Request) -> Dict[str, Any]:
    if req.workspace_dir:
        return {"exists": os.path.isdir(req.workspace_dir), "script": not req.workspace_script
                or os.path.isfile(os.path.join(req.workspace_dir, req.workspace_script))}
    if not req.workspace_sha:
        return {}
    try:
        contract.check_job_name(os.path.basename(req.job_dir))
        held = os.path.isdir(trees.tree_dir(req.root, req.workspace_sha))
        if trees.materialize(req.root, req.workspace_sha, req.job_dir):
            return {"ok": True, "sent": False}
    except (contract.ContractError, UnsafeArchive, OSError) as e:
        return {"ok": False, "error": str(e)}
    packages = os.path.join(req.root, ".paddle_cluster", "packages")
    os.makedirs(packages, mode=0o700, exist_ok=True)
    return {"need": os.path.join(packages, f"{req.workspace_sha}.tar.part-{secrets.token_hex(4)}"),
            "damaged": held}  # its cached tree was written into since it was unpacked: dropped


def _receive(req: Request, part: str) -> Dict[str, Any]:
    """The uploaded archive at ``part``: hash checked, its tree cached, copied into the job directory."""
    try:
        h = hashlib.sha256()
        with open(part, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        if h.hexdigest() != req.workspace_sha:
            return {"ok": False, "error": "checksum mismatch after upload"}
        trees.store(req.root, part, req.workspace_sha, max(req.max_members, 1))
        trees.materialize(req.root, req.workspace_sha, req.job_dir)
        return {"ok": True, "sent": True}
    except (UnsafeArchive, OSError) as e:
        return {"ok": False, "error": str(e)}
    finally:
        if os.path.exists(part):
            os.unlink(part)


def main(text: str) -> int:
    req = Request.from_json(text)
    _reply("probe", **probe.probe(req.nic, req.ports, req.root))
    if req.wants_workspace:
        # Nothing is written before the launcher has every node's probe: it may refuse the job (a machine
        # listed twice would race itself into one job directory).
        if _command().get("go") is not True:
            return 1  # the launcher gave up (another node failed): nothing to do
        ws = _workspace(req)
        _reply("workspace", workspace=ws)
        if "need" in ws:
            if _command().get("uploaded") != ws["need"]:
                return 1
            _reply("workspace", workspace=_receive(req, ws["need"]))
    if not req.agent:
        return 0
    sys.stdout.flush()
    return supervisor.supervise(req.orphan_timeout, req.grace)
