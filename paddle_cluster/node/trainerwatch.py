"""Whether a pserver pod's trainers are gone, learnt without a launcher: from the trainers' own connections to
the pserver's ports (the pod's ``/proc/net/tcp``, no network traffic), and from the cluster DNS only while none is
connected.

- A trainer connected, or whose name resolved, has been *seen*; trainers never seen are never counted as gone:
  they may not be scheduled yet (a node being added, a quota without room, an image being pulled), and no pod
  can tell that from a trainer that never existed -- the launcher, which reads the Jobs, ends such a job, and
  ``--deadline`` bounds one without it.
- While a trainer is connected nothing is asked of the DNS. With none connected, every trainer name answering
  NXDOMAIN for ``GONE_GRACE_S`` without a break means every trainer pod has ended (the headless Service
  publishes a pod's name only until it ends; no pod comes back: restartPolicy Never, backoffLimit 0).
- A resolver that fails or does not answer (a CoreDNS restart: EAI_AGAIN, a timeout) says nothing about the
  names; but once a trainer has connected, no connection for ``UNANSWERED_GONE_S`` while the resolver has not
  answered for as long means the trainers are gone too: a resolver that fails for ever (air-gapped upstream)
  does not hide a failed job.

Names are asked as absolute names once the cluster domain is known (one query each instead of one per search
domain under ``ndots:5``). Standard library only.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from typing import Callable, Iterable, List, Optional, Set, Tuple

# NXDOMAIN for every trainer name this long: gone. The only NXDOMAIN while a trainer pod runs is a stale negative
# answer, cached at most 5 s (CoreDNS's kubernetes TTL) by each of at most two caches (NodeLocal DNSCache in
# front of CoreDNS).
GONE_GRACE_S = 10.0
# No trainer connected (after one was) and the resolver not answering this long: gone. A trainer's client
# reconnects within seconds after a broken connection; a finished trainer's close ends the built-in pserver.
UNANSWERED_GONE_S = 60.0
CHECK_S = 1.0  # connections: read from /proc every this often (local, cheap)
ASK_S = 2.0  # the DNS, while no trainer is connected and one was seen: every this often
IDLE_ASK_S = 5.0  # the DNS, before any trainer is seen (they may wait for a node for minutes)
NXDOMAIN = "NXDOMAIN"  # the resolver's authoritative "no such name" (EAI_NONAME, EAI_NODATA)
_NO_SUCH_NAME = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}
_ESTABLISHED = "01"
_LOOPBACK6 = ("00000000000000000000000001000000", "0000000000000000FFFF0000")  # ::1, and ::ffff:0:0/96 + 127/8


def lookup(host: str) -> Tuple[List[str], str]:
    """(``host``'s addresses, "") or ([], why not): ``NXDOMAIN`` when the resolver answered that no such name
    exists, else its error (a temporary failure, a timeout), which says nothing about the name."""
    try:
        return sorted({ai[4][0] for ai in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}), ""
    except socket.gaierror as e:
        return [], NXDOMAIN if e.errno in _NO_SUCH_NAME else (e.strerror or str(e))
    except (OSError, UnicodeError) as e:
        return [], str(e)


def cluster_domain(host: str) -> str:
    """The suffix the resolver's search path gave ``host`` (``.cluster.local``), "" when it resolved as given or
    not at all: the canonical name of its answer."""
    try:
        canon = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM, flags=socket.AI_CANONNAME)[0][3]
    except (OSError, UnicodeError, IndexError):
        return ""
    canon = canon.rstrip(".").lower()
    return canon[len(host):] if canon.startswith(host.lower() + ".") else ""


def peers(ports: Iterable[int], tables: Tuple[str, ...] = ("/proc/net/tcp", "/proc/net/tcp6")) -> Set[str]:
    """The remote addresses (as the kernel writes them) with an established connection to one of ``ports`` in
    this pod's network namespace, other than the pod itself."""
    wanted = {f"{p:04X}" for p in ports}
    out: Set[str] = set()
    for table in tables:
        try:
            with open(table, encoding="ascii") as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 4 or fields[3] != _ESTABLISHED:
                continue
            (local, lport), (remote, _) = fields[1].split(":"), fields[2].split(":")
            if lport in wanted and remote != local and not _loopback(remote):
                out.add(remote)
    return out


def _loopback(addr: str) -> bool:
    """127.0.0.0/8 or ::1, as /proc/net/tcp{,6} write them (each 32-bit word in host byte order)."""
    if len(addr) == 8:
        return addr.endswith("7F")
    return addr == _LOOPBACK6[0] or (addr.startswith(_LOOPBACK6[1]) and addr.endswith("7F"))


@dataclass
class TrainersGone:
    """One pserver pod's view of its trainers; ``check`` every ``CHECK_S`` says, once, why they are gone."""

    names: List[str]
    ports: List[int]
    say: Callable[[str], None]
    connected: Callable[[], Set[str]] = set  # replaced in __post_init__: the pod's connections
    seen: bool = False
    was_connected: bool = False  # a trainer connected once (resolving alone: it may wait for another pserver)
    domain: str = ""
    nx_since: Optional[float] = None  # when every name first answered NXDOMAIN, none resolving since
    failing: Optional[Tuple[float, str]] = None  # since when, and why, the resolver has not answered
    alone_since: Optional[float] = None  # since when no trainer is connected
    asked: float = float("-inf")

    def __post_init__(self) -> None:
        if self.connected is set:
            ports = list(self.ports)
            self.connected = lambda: peers(ports)

    def check(self, now: Optional[float] = None) -> str:
        now = time.monotonic() if now is None else now
        if self.connected():
            self.seen = self.was_connected = True
            self.nx_since = self.alone_since = None
            return ""
        self.alone_since = now if self.alone_since is None else self.alone_since
        if now - self.asked < (ASK_S if self.seen else IDLE_ASK_S):
            return ""
        self.asked = now
        answers = [lookup(n + self.domain + ("." if self.domain else "")) for n in self.names]
        errors = sorted({why for addrs, why in answers if not addrs and why != NXDOMAIN})
        if errors and self.failing is None:
            self.failing = (now, errors[0])
            self.say(f"cannot resolve the trainers' names ({errors[0]}): asking again; a resolver failure does not "
                     "count as the trainers being gone")
        elif not errors and self.failing is not None:
            self.say(f"the resolver answers again after {now - self.failing[0]:.0f} s")
            self.failing = None
        resolved = [n for n, (addrs, _) in zip(self.names, answers) if addrs]
        if resolved:
            self.seen, self.nx_since = True, None
            if not self.domain:
                self.domain = cluster_domain(resolved[0])
            return ""
        if not self.seen:
            return ""
        if all(why == NXDOMAIN for _, why in answers):
            self.nx_since = now if self.nx_since is None else self.nx_since
            if now - self.nx_since >= GONE_GRACE_S:
                return (f"the cluster DNS has answered NXDOMAIN for every trainer's name for {GONE_GRACE_S:g} s, none "
                        "connected")
            return ""
        self.nx_since = None  # an unanswered name breaks the NXDOMAIN run
        if (self.was_connected and self.failing is not None and now - self.failing[0] >= UNANSWERED_GONE_S
                and now - self.alone_since >= UNANSWERED_GONE_S):
            return (f"no trainer has been connected for {UNANSWERED_GONE_S:g} s and the cluster DNS has not answered "
                    f"for {now - self.failing[0]:.0f} s ({self.failing[1]})")
        return ""
