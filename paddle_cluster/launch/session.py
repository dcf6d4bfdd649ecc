"""The launcher's side of a node session (``node/session.py``): one command on the node's one connection that
installs the node library when its hash is new, probes, puts the workspace in place and, for ``run``, becomes
the job's agent -- so a launch costs each node one channel and one interpreter, and no round trip is serial.
"""

from __future__ import annotations

import json
from collections import deque
from typing import Any, Deque, Dict

from paddle_cluster.node import messages as m
from paddle_cluster.node.session import REPLY, SessionRequest

from .errors import HostConfigError, HostError
from .hosts import CommandStream, Node
from .package import Package

# Runs on the node with nothing but Python: the library of this hash is installed (sent on stdin, after a
# 16-digit length, when the node says it lacks it), then the session runs from it.
BOOT = r"""
import os, sys
root, sha = sys.argv[1], sys.argv[2]
lib = os.path.join(root, ".paddle_cluster", "lib", sha)
def read(n):
    b = b""
    while len(b) < n:
        c = os.read(0, n - len(b))
        if not c:
            sys.exit(1)
        b += c
    return b
if not os.path.isdir(lib):
    import hashlib, io, json, shutil, tarfile
    try:
        os.makedirs(os.path.dirname(lib), mode=0o700, exist_ok=True)
    except OSError as e:  # ROOT_DIR is not a directory this user can write here
        print(json.dumps({"session": "error", "key": "root_dir", "error": "cannot create %s there: %s" % (
            os.path.dirname(lib), e.strerror or e)}))
        sys.exit(1)
    os.write(1, b'{"session": "need-lib"}\n')
    data = read(int(read(16)))
    if hashlib.sha256(data).hexdigest() != sha:
        print(json.dumps({"session": "error", "error": "node library: checksum mismatch after upload"}))
        sys.exit(1)
    tmp = lib + ".tmp-%d" % os.getpid()
    with tarfile.open(fileobj=io.BytesIO(data)) as t:
        for m in t:  # our own archive, but stay inside tmp regardless
            if m.name.startswith("/") or ".." in m.name.split("/") or not (m.isfile() or m.isdir()):
                sys.exit("bad member " + m.name)
            t.extract(m, tmp)
    try:
        os.rename(tmp, lib)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # another launcher installed the same library meanwhile
sys.path.insert(0, lib)
from paddle_cluster.node.session import main
sys.exit(main(sys.argv[3]))
"""

PYTHON_FIX = ("set PYTHON to a Python 3 with numpy on that host (an absolute path, or a name its login shell "
              "finds; paddle-cluster check shows each host's)")
REPLY_TIMEOUT = 300.0  # an answer can wait for unpacking a large workspace
# Lines a node prints that are not the session's answers (a login script's, a wrapper's): the last ones are kept,
# each cut short, to be shown with the agent's output and named in an error -- never held whole or without end.
KEPT_LINES, KEPT_CHARS = 50, 4096


class NodeSession:
    """One node's session; after ``open`` (and ``receive``) its ``stream`` carries the agent's messages."""

    def __init__(self, node: Node, lib: Package, lib_data: bytes, req: SessionRequest) -> None:
        self.node, self.lib, self.lib_data, self.req = node, lib, lib_data, req
        try:
            self.stream: CommandStream = node.stream([node.cfg.python, "-c", BOOT, node.cfg.root_dir, lib.sha256,
                                                      req.to_json()])
        except OSError as e:  # a local node: PYTHON names no executable file here
            raise self._config_error("python", f"{e.strerror or e}: {PYTHON_FIX}") from None
        self.other: Deque[str] = deque(maxlen=KEPT_LINES)
        self.answered = False  # the node's interpreter has run the session (else PYTHON is the suspect)

    def open(self) -> Dict[str, Any]:
        """The node's probe, with ``workspace``: its state there; the library is sent first if it is new."""
        doc = self.reply("starting the node session")
        if doc[REPLY] == "need-lib":
            self.stream.write(b"%016d" % len(self.lib_data) + self.lib_data)
            doc = self.reply("installing paddle_cluster")
        return doc

    def go(self, token: str) -> Dict[str, Any]:
        """What the node holds of the workspace (it writes nothing yet). ``token`` authenticates the chain links
        of this dispatch (``node/chain.py``)."""
        self.stream.write_line(m.encode(m.Go(token)))
        return self.reply("preparing the workspace")["workspace"]

    def place(self) -> Dict[str, Any]:
        """Let the node put the workspace in place (every probe agreed, every node has it); its state there."""
        self.stream.write_line(m.encode(m.PlaceWorkspace()))
        return self.reply("putting the workspace in place")["workspace"]

    def send(self, msg: m.SessionCommand) -> None:
        self.stream.write_line(m.encode(msg))

    def reply(self, what: str) -> Dict[str, Any]:
        """The node's next answer (``REPLY`` says which); other lines are kept, an error answer raised."""
        self.stream.settimeout(REPLY_TIMEOUT)
        self.stream.awaiting = what
        try:
            for line in self.stream.lines():
                try:
                    doc = json.loads(line)
                except (ValueError, RecursionError):  # not an answer, however odd: kept, never fatal
                    doc = None
                if isinstance(doc, dict) and REPLY in doc:
                    self.answered = True
                    if doc[REPLY] == "error" and doc.get("key") == "root_dir":
                        raise self._config_error("root_dir", f"{doc.get('error')}; set ROOT_DIR to an absolute "
                                                 "directory the SSH user can write on every host")
                    if doc[REPLY] == "error":
                        raise HostError(self.node.label, f"{what}: {doc.get('error')}")
                    return doc
                self.other.append(line[:KEPT_CHARS])
        finally:
            self.stream.settimeout(None)
            self.stream.awaiting = ""
        last = [x.strip() for x in list(self.other)[-5:] if x.strip()]
        detail = " | ".join(last) or "the session ended without an answer"
        python = self.node.cfg.python
        if not self.answered and (not last or any(python in x or "Error" in x for x in last)):
            # nothing of the session ran, and what was said names the interpreter (not found, not executable) or
            # a Python error (not a Python 3), or nothing was said at all (not a Python): PYTHON is at fault. Other
            # output (a nologin shell, a wrapper's refusal) is shown as it is.
            raise self._config_error("python", f"did not run the node session there ({detail}): {PYTHON_FIX}")
        raise HostError(self.node.label, f"{what} failed: {detail}")

    def _config_error(self, name: str, fix: str) -> HostConfigError:
        """A setting (``name``, a config field) that does not work on this node, named with its source."""
        return HostConfigError(self.node.label, str(self.node.cfg.error(name, fix)))

    def close(self) -> None:
        self.stream.close()

