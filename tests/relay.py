"""An on-path attacker between trainers and pservers, as its own process: ``python tests/relay.py MODE T0 [T1 ...]``.

It listens on one port per target ``HOST:PORT`` (printing ``RELAY_READY port0,port1,...``), forwards every
connection to its target, and follows the framing (handshake frames, then header + tag + payload with a tag
after every segment) so it can attack whole frames. It knows no key. MODE:

- ``pass``: forward unchanged;
- ``flip``: flip one byte of the first PUSH_DENSE gradient;
- ``hyper``: inject a SET_HYPER lr=1000 frame before the first PUSH_DENSE;
- ``save``: inject a SAVE frame naming an absolute path (argv: ``save:/the/path``);
- ``replay``: send the first PUSH_DENSE again right after it;
- ``reorder``: hold the first PUSH_DENSE back until the frame after it has gone;
- ``reflect``: send the pserver's first reply back to it as if from the trainer;
- ``splice``: replace the first PUSH_DENSE to pserver 1 by the one sent to pserver 0.

Each attack prints ``RELAY_DID <what>`` once done, so a test knows it happened.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from paddle_cluster.ps.wire import protocol as P  # noqa: E402
from paddle_cluster.ps.wire.auth import MAC_SIZE, NONCE_SIZE, TAG_SIZE  # noqa: E402
from paddle_cluster.ps.wire.stream import SEGMENT  # noqa: E402

HS_C2S = [P.HEADER_SIZE + MAC_SIZE + NONCE_SIZE]  # AUTH_RESPONSE
HS_S2C = [P.HEADER_SIZE + NONCE_SIZE, P.HEADER_SIZE + MAC_SIZE]  # AUTH_CHALLENGE, AUTH_OK
_lock = threading.Lock()
_done = set()
_captured = {}
_have_capture = threading.Event()


def did(what: str) -> None:
    with _lock:
        if what in _done:
            return
        _done.add(what)
    print(f"RELAY_DID {what}", flush=True)


def once(what: str) -> bool:
    with _lock:
        if what in _done or what + "?" in _done:
            return False
        _done.add(what + "?")
        return True


def recv_exact(s: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        b = s.recv(n - len(buf))
        if not b:
            raise EOFError
        buf += b
    return bytes(buf)


def read_frame(s: socket.socket) -> bytes:
    head = recv_exact(s, P.HEADER_SIZE + TAG_SIZE)
    length = P.HEADER.unpack(head[:P.HEADER_SIZE])[8]
    tags = -(-length // SEGMENT)
    return head + recv_exact(s, length + tags * TAG_SIZE)


def op_of(frame: bytes) -> int:
    return P.HEADER.unpack(frame[:P.HEADER_SIZE])[2]


def forged(op: int, body: dict) -> bytes:
    """A well-formed frame with made-up tags: the best anyone without the key can do."""
    data = json.dumps(body).encode()
    return (P.pack_header(op, P.DTYPE_JSON, length=len(data)) + os.urandom(TAG_SIZE) + data
            + os.urandom(TAG_SIZE))


class Conn:
    def __init__(self, index: int, down: socket.socket, up: socket.socket, mode: str) -> None:
        self.index, self.down, self.up, self.mode = index, down, up, mode
        self.up_lock = threading.Lock()

    def send_up(self, data: bytes) -> None:
        with self.up_lock:
            self.up.sendall(data)

    def c2s(self) -> None:
        for n in HS_C2S:
            self.send_up(recv_exact(self.down, n))
        held = None
        while True:
            f = read_frame(self.down)
            push = op_of(f) == P.Op.PUSH_DENSE
            mode = self.mode
            # Each attack is reported before its frames go up: once they do, the trainer may fail and the test
            # kill this relay at once.
            if held is not None:
                did("reorder")
                self.send_up(f)
                self.send_up(held)
                held = None
                continue
            if push and mode == "flip" and once("flip"):
                f = f[:P.HEADER_SIZE + TAG_SIZE + 10] + bytes([f[P.HEADER_SIZE + TAG_SIZE + 10] ^ 0x40]) \
                    + f[P.HEADER_SIZE + TAG_SIZE + 11:]
                did("flip")
                self.send_up(f)
                continue
            if push and mode == "hyper" and once("hyper"):
                did("hyper")
                self.send_up(forged(P.Op.SET_HYPER, {"from_step": 0, "values": {"lr": 1000.0}}))
            if push and mode.startswith("save:") and once("save"):
                did("save")
                self.send_up(forged(P.Op.SAVE, {"step": 0, "path": mode[5:]}))
            if push and mode == "replay" and once("replay"):
                did("replay")
                self.send_up(f)
                self.send_up(f)
                continue
            if push and mode == "reorder" and once("reorder"):
                held = f
                continue
            if push and mode == "splice":
                if self.index == 0 and once("capture"):
                    _captured["frame"] = f
                    _have_capture.set()
                elif self.index == 1 and once("splice"):
                    _have_capture.wait(10)
                    did("splice")
                    self.send_up(_captured.get("frame", f))
                    continue
            self.send_up(f)

    def s2c(self) -> None:
        for n in HS_S2C:
            self.down.sendall(recv_exact(self.up, n))
        while True:
            f = read_frame(self.up)
            self.down.sendall(f)
            if self.mode == "reflect" and once("reflect"):
                did("reflect")
                self.send_up(f)


def pump(c: Conn, fn) -> None:
    try:
        fn()
    except (EOFError, OSError):
        pass
    # Like any proxy: the trainer's side ending half-closes the pserver's; the pserver's side ending (after
    # its last words are forwarded) ends both.
    for s, how in ([(c.up, socket.SHUT_WR)] if fn == c.c2s else [(c.down, socket.SHUT_RDWR), (c.up, socket.SHUT_RDWR)]):
        try:
            s.shutdown(how)
        except OSError:
            pass


def serve(index: int, lsock: socket.socket, target, mode: str) -> None:
    while True:
        down, _ = lsock.accept()
        try:
            up = socket.create_connection(target)
        except OSError:
            down.close()
            continue
        c = Conn(index, down, up, mode)
        for fn in (c.c2s, c.s2c):
            threading.Thread(target=pump, args=(c, fn), daemon=True).start()


def main() -> None:
    mode, targets = sys.argv[1], [t.rpartition(":") for t in sys.argv[2:]]
    ports = []
    for i, (host, _, port) in enumerate(targets):
        ls = socket.socket()
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind(("127.0.0.1", 0))
        ls.listen(64)
        ports.append(ls.getsockname()[1])
        threading.Thread(target=serve, args=(i, ls, (host, int(port)), mode), daemon=True).start()
    print("RELAY_READY " + ",".join(map(str, ports)), flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
