"""Sending a workspace archive to the nodes that lack it, once over the launcher's uplink: the launcher feeds the
first such node over SSH as soon as its session says it lacks it, and each node that says so later joins the end
of the chain while it runs; every node forwards what it receives to the next (``node/chain.py``). A node whose
chain link fails is sent the archive by the launcher directly, which is said in one line.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple, Union

from paddle_cluster.node import messages as m
from paddle_cluster.node.session import REPLY

from . import delta, dispatch
from .dispatch import Package, Packing
from .errors import HostError
from .session import NodeSession

Progress = Callable[[str, int], Callable[[int, int], None]]


@dataclass(frozen=True)
class Recipient:
    """A node that lacks the archive: its session, the FIFO the launcher writes into, its listener."""

    session: NodeSession
    fifo: str
    listener: str  # host:port on its PADDLE_NIC address
    base: str = ""  # the hash of its most recent cached tree (what a changed workspace can be sent against)

    @property
    def name(self) -> str:
        return self.session.node.name


class Aborted(Exception):
    """This node's part ended because the dispatch failed on another node (that one's error is the one to say)."""


class Dispatch:
    """One workspace dispatch (``pkg``, packed from ``directory``) to ``nodes`` sessions. Each says whether it
    lacks the archive (``join``) or holds it (``settled``) as soon as it is up; a node that lacks it is put at
    the end of the chain of what it is to be sent (the whole archive, or the changed files against the tree it
    holds, when this launcher made that tree too), the first of a chain fed by the launcher. Once every node
    has said, the last of each chain is told no one follows it. ``abort`` stops every node of the dispatch.

    A new workspace (``pkg`` a ``Packing``) goes down one chain while it is packed: every node is sent it without
    its hash (``Fetch`` without ``sha``), then ``Seal`` with it once the launcher read the last byte and found the
    workspace unchanged throughout; if it changed, the dispatch is aborted (nothing is placed anywhere)."""

    def __init__(self, pkg: Union[Package, Packing], directory: str, job_dir: str, nodes: int, bar: Progress,
                 tmp: str) -> None:
        self.live = pkg if isinstance(pkg, Packing) else None
        self.pkg, self.directory, self.job_dir, self.bar, self.tmp = pkg, directory, job_dir, bar, tmp
        self.started: Optional[float] = None  # when the launcher began to send (time.perf_counter)
        self.failed = False
        self._lock = threading.Lock()
        self._pending = nodes
        self._tails: Dict[str, Recipient] = {}  # archive sha -> the last node of its chain, told of no successor yet
        self._after: Dict[str, Recipient] = {}  # node name -> the node after it
        self._before: Dict[str, Recipient] = {}
        self._members: List[Recipient] = []
        self._deltas: Dict[str, Optional[Tuple[Package, int]]] = {}  # base -> the delta against it, and its files
        self._by_delta: Dict[str, List[str]] = {}  # base -> the nodes sent that delta
        self._told: List[str] = []
        self._broken: Dict[str, str] = {}  # node name -> why the link into it failed, as its sender said
        self._sealed = ""
        if self.live is not None:
            threading.Thread(target=self._seal, daemon=True, name="seal").start()

    # -- who goes where ----------------------------------------------------------------------------------------
    def settled(self) -> None:
        """A node holds the archive."""
        with self._lock:
            self._settle()

    def join(self, nd: Recipient) -> None:
        """Put ``nd`` at the end of its chain, and receive the archive there (or from the launcher, at the head
        of a chain, or when its link fails); returns once the node has it whole and unpacked."""
        with self._lock:
            if self.failed:
                raise Aborted()
            it, on = self.pkg, ""
            made = self._delta(nd.base) if nd.base and self.live is None else None
            if made is not None:
                it, on = made[0], nd.base
                self._by_delta[on].append(nd.name)
            tail = self._tails.get(self._sha(it))
            self._tails[self._sha(it)] = nd
            self._members.append(nd)
            if tail is not None:
                self._before[nd.name], self._after[tail.name] = tail, nd
                nd.session.send(m.Fetch("chain", self._sha(it), it.size, on))
                tail.session.send(m.Forward(nd.listener))
                if self._sealed:
                    nd.session.send(m.Seal(self._sealed))
            self._settle()
        try:
            self._receive(nd, it, on, direct=tail is None)
        except Exception:
            if self.failed:
                raise Aborted() from None
            raise

    def abort(self, why: str) -> bool:
        """Stop every node of the dispatch; False when it had been stopped already (by another node's failure)."""
        with self._lock:
            if self.failed:
                return False
            self.failed = True
            members = list(self._members)
        for nd in members:
            try:
                nd.session.send(m.Abort(why))
            except Exception:  # noqa: BLE001 - its session may be gone: it stops by itself then
                pass
        return True

    def lines(self) -> List[str]:
        """What to tell the user: what went as deltas, and the nodes the launcher had to feed directly."""
        out = []
        for base, names in self._by_delta.items():
            made = self._deltas[base]
            if names and made is not None:
                out.append(f"{', '.join(sorted(names))}: sent only the {made[1]} changed file(s) "
                           f"({_size(made[0].size)} of {_size(self.pkg.size)}) against the workspace held there")
        return out + sorted(self._told)

    def _sha(self, it: Union[Package, Packing]) -> str:
        """The hash a node is told with ``Fetch``: none for the archive still being made (``Seal`` says it)."""
        return "" if it is self.live else it.sha256

    def _seal(self) -> None:
        """Once the archive being sent is whole: its hash to every node sent it (those joining later are told
        as they join); if the workspace changed while it was read, the dispatch stops."""
        assert self.live is not None
        try:
            sha = self.live.wait().sha256
        except Exception as e:  # noqa: BLE001 - a ClusterError naming the file; wait() raises it again for the caller
            self.abort(str(e))
            return
        with self._lock:
            self._sealed = sha
            members = list(self._members)
        for nd in members:
            try:
                nd.session.send(m.Seal(sha))
            except Exception:  # noqa: BLE001 - its session is gone: that node's own error is said
                pass

    def _settle(self) -> None:
        self._pending -= 1
        if self._pending == 0:  # every node has said: no one else joins
            for tail in self._tails.values():
                tail.session.send(m.Forward(""))
            self._tails.clear()

    def _delta(self, base: str) -> Optional[Tuple[Package, int]]:
        if base not in self._deltas:
            self._deltas[base] = delta.make(self.pkg, self.directory, dispatch.workspace_cache_dir(), base, self.tmp)
            self._by_delta[base] = []
        return self._deltas[base]

    def _leave(self, nd: Recipient, sha: str) -> None:  # never the archive being made: it has no delta
        """``nd`` is sent another archive than its chain's: it forwards nothing (a later node joins elsewhere)."""
        with self._lock:
            if self._tails.get(sha) is nd:
                del self._tails[sha]
                nd.session.send(m.Forward(""))

    # -- one node ----------------------------------------------------------------------------------------------
    def _feed(self, nd: Recipient, it: Union[Package, Packing], on: str) -> None:
        nd.session.send(m.Fetch("launcher", self._sha(it), it.size, on))
        with self._lock:
            if self._sealed and it is self.live:
                nd.session.send(m.Seal(self._sealed))
        if self.started is None:
            self.started = time.perf_counter()
        node = nd.session.node
        try:
            node.put(self.live if it is self.live else it.path, nd.fifo, self.bar(node.name, it.size),
                     until=nd.session.stream.ended)
        except HostError as e:  # the node stops waiting for it, and the nodes after it stop waiting for that one
            if nd.session.stream.ended():  # killed, or it crashed: nothing there reads the upload any more
                raise HostError(node.label, "its session ended while it received the workspace (the upload was "
                                "stopped); nothing of it runs there now") from None
            nd.session.send(m.Abort(str(e)))
            raise

    def _receive(self, nd: Recipient, it: Union[Package, Packing], on: str, direct: bool) -> None:
        node = nd.session.node
        if direct:
            self._feed(nd, it, on)
        while True:
            doc = nd.session.reply("receiving the workspace")
            if self.failed:
                raise Aborted()
            if doc[REPLY] == "progress":  # still receiving (a large archive can take longer than REPLY_TIMEOUT)
                continue
            if doc[REPLY] == "forward":  # its link to the next node failed: that one falls back by itself
                nxt = self._after.get(nd.name)
                if nxt is not None:
                    self._broken_into(nxt, str(doc.get("error")), bool(doc.get("linked")))
                continue
            ws = doc["workspace"]
            if ws.get("received"):
                return
            if "retry" in ws and not direct:
                before = self._before[nd.name].name
                broken = self._broken.pop(nd.name, "") or ws["retry"]
                self._told.append(f"{node.name}: the chain link from {before} failed ({broken}); the launcher sent "
                                  "it the workspace directly")
                direct = True
                self._feed(nd, it, on)
                continue
            if "retry" in ws and on:
                self._told.append(f"{node.name}: {ws['retry']}; the launcher sent it the whole workspace")
                self._leave(nd, it.sha256)
                it, on = self.pkg, ""
                self._feed(nd, it, on)
                continue
            if "retry" in ws:
                raise HostError(node.label, f"receiving the workspace: {ws['retry']}")
            raise HostError(node.label, f"unpacking the workspace into {self.job_dir} refused: {ws.get('error')}")

    def _broken_into(self, nxt: Recipient, why: str, linked: bool) -> None:
        with self._lock:
            self._broken[nxt.name] = why
        if not linked:  # never made: that node still waits for it
            nxt.session.send(m.Abort(why))


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 100_000 else f"{n / 1e3:.0f} kB"
