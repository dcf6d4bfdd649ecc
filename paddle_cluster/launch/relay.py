"""Sending a workspace archive to the nodes that lack it, once over the launcher's uplink: the launcher feeds
the first such node over SSH, and each forwards what it receives to the next as it arrives (``node/chain.py``).
A node whose chain link fails is sent the archive by the launcher directly, which is said in one line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List

from paddle_cluster.node import messages as m
from paddle_cluster.node.session import REPLY

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


def send(needs: List[Need], pkg: Package, bar: Progress) -> List[str]:
    """Put ``pkg`` on every node of ``needs`` (in this order down the chain); the lines to tell the user."""
    told: List[str] = []
    at: Dict[int, int] = {nd.node.index: k for k, nd in enumerate(needs)}
    broken: Dict[int, str] = {}  # chain position -> why the link into it failed, as its sender said

    def feed(nd: Need) -> None:
        nd.session.send(m.Fetch("launcher"))
        nd.node.put(pkg.path, nd.fifo, bar(nd.node.name, pkg.size))

    def one(n: Node) -> None:
        k = at[n.index]
        nd, nxt = needs[k], needs[k + 1] if k + 1 < len(needs) else None
        direct = k == 0
        if direct:
            nd.session.send(m.Fetch("launcher", nxt.listener if nxt else ""))
            nd.node.put(pkg.path, nd.fifo, bar(n.name, pkg.size))
        else:
            nd.session.send(m.Fetch("chain", nxt.listener if nxt else ""))
        while True:
            doc = nd.session.reply("receiving the workspace")
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
                feed(nd)
                continue
            if "retry" in ws:
                raise HostError(n.label, f"receiving the workspace: {ws['retry']}")
            if not ws.get("ok"):
                raise HostError(n.label, f"unpacking the workspace refused: {ws.get('error')}")
            return

    fanout([nd.node for nd in needs], one).ok("sending the workspace")
    return sorted(told)
