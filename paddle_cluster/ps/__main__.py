"""Run one pserver of a job: ``python -m paddle_cluster.ps``.

Configured by the environment contract (``JobEnv.from_environ()``: endpoints, ports, trainer count,
secret, job dir, barrier timeout, ``PADDLE_PSERVER_ID``) plus these optional variables / flags:

=========================  ======================  ===========================================================
variable                   flag                    meaning
=========================  ======================  ===========================================================
``PADDLE_RESUME``          ``--resume``            ``latest`` (newest complete checkpoint), a step number, or a
                                                   step directory; empty = fresh start
``PADDLE_CHECKPOINT_DIR``  ``--checkpoint-dir``    checkpoint root (default ``<job_dir>/checkpoints``, or
                                                   ``./checkpoints`` without a job dir)
``PADDLE_MAX_FRAME_BYTES`` ``--max-frame-bytes``   largest frame accepted (default 1 GiB)
=========================  ======================  ===========================================================

It prints ``PSERVER_READY <id> <host> <ports>`` on stdout once every port listens, serves until all trainers
have closed (exit 0), and exits 0 on SIGTERM/SIGINT too. Exit 2: bad contract; 3: the requested checkpoint is
unusable; 4: cannot listen.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import List, Optional

from ..contract import ContractError, JobEnv

log = logging.getLogger("paddle_cluster.ps")


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m paddle_cluster.ps", description=__doc__.split("\n")[0])
    ap.add_argument("--resume", default=None, help="default: PADDLE_RESUME")
    ap.add_argument("--checkpoint-dir", default=None, help="default: PADDLE_CHECKPOINT_DIR")
    ap.add_argument("--max-frame-bytes", type=int, default=int(os.environ.get("PADDLE_MAX_FRAME_BYTES") or (1 << 30)))
    ap.add_argument("--log-level", default=os.environ.get("PADDLE_LOG_LEVEL", "INFO"))
    args = ap.parse_args(argv)
    try:
        env = JobEnv.from_environ()
        if env is None:
            raise ContractError("no pserver endpoints in the environment (PADDLE_PSERVER_ENDPOINTS)")
        if env.pserver_id is None:
            raise ContractError("PADDLE_PSERVER_ID is not set (or PADDLE_CURRENT_IP does not name one pserver)")
    except ContractError as e:
        print(f"pserver: {e}", file=sys.stderr)
        return 2
    k = env.pserver_id
    logging.basicConfig(stream=sys.stderr, level=getattr(logging, args.log_level.upper(), logging.INFO),
                        format=f"%(asctime)s pserver[{k}] %(levelname)s %(message)s")

    # Imported here so a bad contract is reported without paying for numpy.
    from . import checkpoint as ckpt
    from .errors import CheckpointError
    from .server import PServer

    resume = env.resume if args.resume is None else args.resume
    root = env.checkpoint_dir if args.checkpoint_dir is None else args.checkpoint_dir
    root = root or ckpt.default_root(env.job_dir)
    try:
        shard = ckpt.resolve_resume(resume, root, k, len(env.pservers))
    except (CheckpointError, ValueError) as e:
        log.error("cannot resume (%s): %s", resume, e)
        return 3
    if resume and shard is None:
        log.info("no checkpoint under %s; starting fresh", root)
    server = PServer(env, k, resume=shard, checkpoint_root=root, max_frame=args.max_frame_bytes)
    try:
        server.start()
    except OSError as e:
        log.error("%s", e)
        return 4

    def on_signal(signum: int, _frame: object) -> None:
        log.info("signal %d: shutting down", signum)
        server.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print(f"PSERVER_READY {k} {server.host} {','.join(map(str, server.ports))}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
