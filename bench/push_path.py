"""``python -m bench.push_path``: the path of one dense push through the pserver's code, as calls.

An in-process pserver and two trainers (real clients over loopback TCP); trainer 0 pushes, then trainer 1's
push -- the one that completes the step -- is traced with ``threading.setprofile`` on the pserver's threads
(connection and apply threads; the clients' threads are not counted) from the moment it is sent until the
block has moved to the next step. Counted are calls of Python functions inside ``paddle_cluster`` only:

- stops: distinct functions entered;
- files: distinct files they are in;
- hand-offs: calls from one file into another (every one is a return across files too);
- call-backs: calls into a file that is already on the stack below the caller (A calls B calls A again).

One block under one segment (``stream.SEGMENT``), so no loop is counted twice. Cases: sync SGD (folded by
segment), sync momentum (a whole block's sum, applied on the apply threads), async SGD. ``-v`` lists the calls.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from typing import Dict, List, Tuple

import numpy as np

from .common import REPO

sys.path.insert(0, os.path.join(REPO, "tests"))

from helpers import free_port_range  # noqa: E402

from paddle_cluster.contract import Endpoint, JobEnv  # noqa: E402
from paddle_cluster.ps import OptimizerSpec  # noqa: E402
from paddle_cluster.ps.client import PSClient  # noqa: E402
from paddle_cluster.ps.server import handlers  # noqa: E402
from paddle_cluster.ps.server.pserver import PServer  # noqa: E402
from paddle_cluster.ps.wire import protocol as P  # noqa: E402

PKG = os.path.join(REPO, "paddle_cluster") + os.sep
SECRET = "449f9768f45a2be336f877d3b677c2c83b567a85f79f63669a9075100682e3de"
CASES = (("sync", "sgd"), ("sync", "momentum"), ("async", "sgd"))


WIRE = {"stream.py", "protocol.py", "auth.py", "poly1305.py", "net.py", "channel.py"}  # frames, MACs, sockets


def _file(code) -> str:  # noqa: ANN001
    return os.path.relpath(code.co_filename, PKG)


def wire(path: str) -> bool:
    return os.path.basename(path) in WIRE or "/wire/" in path


class Tracer:
    """Records every call into paddle_cluster made by the PUSH_DENSE handler (``entry``) and below it, and on
    the apply threads, on the pserver's threads: (callee "file:function", caller's file, a call-back?)."""

    def __init__(self, entry) -> None:  # noqa: ANN001
        self.entry = entry
        self.calls: List[Tuple[str, str, bool]] = []
        self.on = False

    def __call__(self, frame, event, arg):  # noqa: ANN001 - the profile hook's signature
        if not self.on or event != "call" or not frame.f_code.co_filename.startswith(PKG):
            return
        name = threading.current_thread().name
        if not name.startswith("pserver"):
            return
        below, f, inside = [], frame.f_back, frame.f_code is self.entry or "-apply" in name
        while f is not None:
            if f.f_code.co_filename.startswith(PKG):
                below.append(_file(f.f_code))
            inside = inside or f.f_code is self.entry
            f = f.f_back
        if not inside:
            return
        here = _file(frame.f_code)
        caller = below[0] if below and frame.f_code is not self.entry else ""
        self.calls.append((f"{here}:{frame.f_code.co_qualname}", caller, here != caller and here in below[1:]))


def summary(calls: List[Tuple[str, str, bool]]) -> Dict[str, int]:
    stops = {c for c, _, _ in calls}
    return {"stops": len(stops), "files": len({s.split(":")[0] for s in stops}),
            "hand-offs": sum(1 for c, caller, _ in calls if caller and c.split(":")[0] != caller),
            "call-backs": sum(1 for _, _, back in calls if back), "calls": len(calls)}


def step_of(block) -> int:  # noqa: ANN001
    """The block's step number (an int before issue 37's ``Step`` object, its ``n`` after)."""
    return block.step if isinstance(block.step, int) else block.step.n


def measure(mode: str, opt: str, verbose: bool) -> Dict[str, int]:
    with tempfile.TemporaryDirectory() as tmp:
        env = JobEnv(job_id="path", pservers=(Endpoint("127.0.0.1", free_port_range(1)),), trainers=2, ports_num=1,
                     ports_num_for_sparse=0, secret=SECRET, job_dir=tmp, barrier_timeout=30)
        tracer = Tracer(handlers.OPS[P.Op.PUSH_DENSE].__code__)
        threading.setprofile(tracer)  # before any pserver thread starts: threads started later inherit it
        server = PServer(env, 0).start()
        spec = OptimizerSpec(opt, lr=0.1)
        w0 = np.zeros((64, 256), np.float32)  # 64 KiB: one segment
        clients: List[PSClient] = [None, None]  # type: ignore[list-item]

        def open_(i: int) -> None:
            clients[i] = PSClient(env, mode=mode, optimizer=spec, trainer_id=i)
            clients[i].register_dense({"w": w0})

        threads = [threading.Thread(target=open_, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        block = next(iter(server.state.blocks.values()))
        g = np.ones_like(w0)
        try:
            for i in range(2):  # a step first, so nothing below is a first-time path (buffers, rows)
                clients[i].wait(clients[i].push({"w": g}))
            for c in clients:
                c.pull()
            clients[0].wait(clients[0].push({"w": g}))
            before = step_of(block)
            tracer.on = True
            clients[1].wait(clients[1].push({"w": g}))
            deadline = time.monotonic() + 10
            while step_of(block) == before and time.monotonic() < deadline:
                time.sleep(0.001)
            time.sleep(0.05)  # the apply thread's last returns
            tracer.on = False
        finally:
            threading.setprofile(None)
            for c in clients:
                c.close()
            server.stop()
        assert step_of(block) == before + 1, "the traced push did not complete the step"
    step = [c for c in tracer.calls if not wire(c[0].split(":")[0])]
    if verbose:
        for callee, caller, back in step:
            print(f"    {caller or '-':<18} -> {callee}{'   (call-back)' if back else ''}")
    return {"step": summary(step), "all": summary(tracer.calls)}


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.push_path", description=__doc__.split("\n")[0])
    ap.add_argument("-v", action="store_true", help="list the calls")
    args = ap.parse_args()
    cols = ("stops", "files", "hand-offs", "call-backs", "calls")
    print(f"{'case':<16} {'counted':<8} " + " ".join(f"{c:>10}" for c in cols))
    for mode, opt in CASES:
        r = measure(mode, opt, args.v)
        for part in ("step", "all"):
            print(f"{mode + ' ' + opt:<16} {part:<8} " + " ".join(f"{r[part][c]:>10}" for c in cols), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
