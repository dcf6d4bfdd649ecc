"""Sending a workspace archive to the nodes that lack it, once over the launcher's uplink: the launcher feeds
the first such node over SSH, and each forwards what it receives to the next as it arrives (``node/chain.py``).
A node whose chain link fails is sent the archive by the launcher directly, which is said in one line.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

from paddle_cluster.node import messages as m
from paddle_cluster.node.session import REPLY

from . import delta, dispatch
from .dispatch import Package
from .errors import HostError
from .hosts import Node, fanout
from .session import NodeSession

Progress = Callable[[str, int], Callable[[int, int], None]]


@dataclass(frozen=True)
class Need:
    """A node that lacks the archive: its session, the FIFO the launcher writes into, its listener."""

    node: Node
    session: NodeSession
    fifo: str
    listener: str  # host:port on its PADDLE_NIC address
    base: str = ""  # the hash of its most recent cached tree (what a changed workspace can be sent against)


def send_all(needs: List[Need], pkg: Package, directory: str, job_dir: str, bar: Progress) -> List[str]:
    """Put the workspace ``pkg`` (packed from ``directory``) on every node of ``needs``: one chain per tree they
    hold, each sent only the files changed since that tree when this launcher made it too; the lines to say."""
    told: List[str] = []
    groups: Dict[str, List[Need]] = {}
    for nd in needs:
        groups.setdefault(nd.base, []).append(nd)
    with tempfile.TemporaryDirectory(prefix="paddle-cluster-delta-") as tmp:
        for base, group in groups.items():
            made = delta.make(pkg, directory, dispatch.workspace_cache_dir(), base, tmp) if base else None
            if made is None:
                told += send(group, pkg, job_dir, bar)
                continue
            part, count = made
            told.append(f"{', '.join(nd.node.name for nd in group)}: sent only the {count} changed file(s) "
                        f"({_size(part.size)} of {_size(pkg.size)}) against the workspace held there")
            told += send(group, part, job_dir, bar, base, pkg)
    return told


def send(needs: List[Need], pkg: Package, job_dir: str, bar: Progress, base: str = "",
         whole: Optional[Package] = None) -> List[str]:
    """Put ``pkg`` on every node of ``needs`` (in this order down the chain): the workspace archive, or with
    ``base`` a delta against that tree (a node that cannot use it is sent ``whole``); the lines to tell the user."""
    told: List[str] = []
    at: Dict[int, int] = {nd.node.index: k for k, nd in enumerate(needs)}
    broken: Dict[int, str] = {}  # chain position -> why the link into it failed, as its sender said

    def feed(nd: Need, it: Package, forward: str = "", on: str = "") -> None:
        nd.session.send(m.Fetch("launcher", forward, it.sha256, it.size, on))
        try:
            nd.node.put(it.path, nd.fifo, bar(nd.node.name, it.size))
        except HostError as e:  # the node stops waiting for it, and the nodes after it stop waiting for that one
            nd.session.send(m.Abort(str(e)))
            raise

    def one(n: Node) -> None:
        k = at[n.index]
        nd, nxt = needs[k], needs[k + 1] if k + 1 < len(needs) else None
        it, on, direct = pkg, base, k == 0
        if direct:
            feed(nd, it, nxt.listener if nxt else "", on)
        else:
            nd.session.send(m.Fetch("chain", nxt.listener if nxt else "", it.sha256, it.size, on))
        while True:
            doc = nd.session.reply("receiving the workspace")
            if doc[REPLY] == "progress":  # still receiving (a large archive can take longer than REPLY_TIMEOUT)
                continue
            if doc[REPLY] == "forward":  # its link to the next node failed: that one falls back by itself
                broken[k + 1] = str(doc.get("error"))
                if nxt is not None and not doc.get("linked"):
                    nxt.session.send(m.Abort(broken[k + 1]))
                continue
            ws = doc["workspace"]
            if "retry" in ws and not direct:
                told.append(f"{n.name}: the chain link from {needs[k - 1].node.name} failed "
                            f"({broken.get(k) or ws['retry']}); the launcher sent it the workspace directly")
                direct = True
                feed(nd, it, on=on)
                continue
            if "retry" in ws and on and whole is not None:
                told.append(f"{n.name}: {ws['retry']}; the launcher sent it the whole workspace")
                it, on = whole, ""
                feed(nd, it)
                continue
            if "retry" in ws:
                raise HostError(n.label, f"receiving the workspace: {ws['retry']}")
            if not ws.get("ok"):
                raise HostError(n.label, f"unpacking the workspace into {job_dir} refused: {ws.get('error')}")
            return

    fanout([nd.node for nd in needs], one).ok("sending the workspace")
    return sorted(told)


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 100_000 else f"{n / 1e3:.0f} kB"
