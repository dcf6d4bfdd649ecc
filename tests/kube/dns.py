"""The stand-in cluster's DNS (what CoreDNS answers for a headless Service): a UDP server on the cluster
bridge's gateway address that every pod's /etc/resolv.conf names. A name it holds gets its A record; any other
name of the cluster domain NXDOMAIN, as CoreDNS answers once a pod has ended. ``fault`` makes it fail on purpose
for a while, as a CoreDNS restart does: SERVFAIL (the pods' resolver: EAI_AGAIN) or no answer at all (a
timeout)."""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Dict, Optional

A, AAAA = 1, 28
NOERROR, SERVFAIL, NXDOMAIN = 0, 2, 3
TTL = 5  # CoreDNS's default for a Service's records


def fault(root: Path, mode: str, seconds: float) -> None:
    """From now on for ``seconds``: ``servfail`` or ``drop`` every query (the controller's DNS reads it)."""
    (root / "dns_fault.json").write_text(json.dumps({"mode": mode, "until": time.time() + seconds}))


class ClusterDNS:
    def __init__(self, address: str, root: Path) -> None:
        self.records: Dict[str, str] = {}  # name (lower case, no trailing dot) -> IPv4; replaced whole
        self.fault_file = root / "dns_fault.json"
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((address, 53))
        self.sock.settimeout(0.2)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True, name="dns")
        self.thread.start()

    def _fault(self) -> str:
        try:
            f = json.loads(self.fault_file.read_text())
        except (OSError, ValueError):
            return ""
        return f["mode"] if time.time() < f["until"] else ""

    def _serve(self) -> None:
        while not self.stopped.is_set():
            try:
                query, peer = self.sock.recvfrom(512)
            except socket.timeout:
                continue
            except OSError:
                return
            mode = self._fault()
            if mode == "drop":
                continue
            reply = self.answer(query, SERVFAIL if mode == "servfail" else None)
            if reply is not None:
                self.sock.sendto(reply, peer)

    def answer(self, query: bytes, rcode: Optional[int] = None) -> Optional[bytes]:
        try:
            tid, _flags, qdcount = struct.unpack("!HHH", query[:6])
            i, labels = 12, []
            while query[i]:
                n = query[i]
                labels.append(query[i + 1:i + 1 + n].decode("ascii").lower())
                i += 1 + n
            qtype, _qclass = struct.unpack("!HH", query[i + 1:i + 5])
        except (struct.error, IndexError, UnicodeDecodeError):
            return None
        question = query[12:i + 5]
        ip = self.records.get(".".join(labels))
        answers = b""
        if rcode is None:
            rcode = NOERROR if ip is not None else NXDOMAIN
            if ip is not None and qtype == A:
                answers = b"\xc0\x0c" + struct.pack("!HHIH", A, 1, TTL, 4) + socket.inet_aton(ip)
        flags = 0x8580 | rcode  # a response, authoritative, recursion desired and available
        return struct.pack("!HHHHHH", tid, flags, 1 if qdcount else 0, 1 if answers else 0, 0, 0) + question + answers

    def close(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=2)
        self.sock.close()
