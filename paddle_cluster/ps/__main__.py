"""Run one pserver of a job: ``python -m paddle_cluster.ps``.

Configured by the environment contract (``contract.JobEnv``: endpoints, ports, trainer count, secret, job
dir, barrier timeout, ``PADDLE_PSERVER_ID``; ``contract.ProcessEnv``) plus these optional variables / flags:

=========================  ======================  ===========================================================
variable                   flag                    meaning
=========================  ======================  ===========================================================
``PADDLE_RESUME``          ``--resume``            ``latest`` (newest complete checkpoint; none: exit 3), a step
                                                   number, or a step directory; empty = fresh start
``PADDLE_CHECKPOINT_DIR``  ``--checkpoint-dir``    checkpoint root (default ``<job_dir>/checkpoints``, or
                                                   ``./checkpoints`` without a job dir)
``PADDLE_MAX_FRAME_BYTES`` ``--max-frame-bytes``   largest frame accepted (default 1 GiB)
``PADDLE_LOG_LEVEL``       ``--log-level``         ``DEBUG``, ``INFO`` (default), ``WARNING`` or ``ERROR``
``PADDLE_MAX_CONNECTIONS`` ``--max-connections``   connections served at once (default 256, at most 64 of them
                                                   authenticating); more are refused with a message
``PADDLE_PSERVER_MEMORY``                          bytes it may hold (``8G``, ``512M``; default half of the
                                                   node's memory over the job's pservers on it)
``PADDLE_ALLOW_NONFINITE``                         ``1``: accept NaN/Inf gradients (refused by default)
=========================  ======================  ===========================================================

It prints ``PSERVER_READY <id> <host> <ports>`` on stdout once every port listens, serves until all trainers
have closed (exit 0), and exits 0 on SIGTERM/SIGINT too. Exit 2: bad contract; 3: the requested checkpoint is
unusable, or asked to resume there is none (never a fresh start); 4: cannot listen.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import List, Optional

from ..contract import ContractError, JobEnv, ProcessEnv
from .server.pserver import serve


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m paddle_cluster.ps", description=__doc__.split("\n")[0])
    ap.add_argument("--resume", default=None, help="default: PADDLE_RESUME")
    ap.add_argument("--checkpoint-dir", default=None, help="default: PADDLE_CHECKPOINT_DIR")
    ap.add_argument("--max-frame-bytes", type=int, default=None, help="default: PADDLE_MAX_FRAME_BYTES or 1 GiB")
    ap.add_argument("--log-level", default=None, help="default: PADDLE_LOG_LEVEL or INFO")
    ap.add_argument("--max-connections", type=int, default=None, help="default: PADDLE_MAX_CONNECTIONS or 256")
    args = ap.parse_args(argv)
    try:
        env = JobEnv.from_environ()
        if env is None:
            raise ContractError("no pserver endpoints in the environment (PADDLE_PSERVER_ENDPOINTS)")
        if env.pserver_id is None:
            raise ContractError("PADDLE_PSERVER_ID is not set (or PADDLE_CURRENT_IP does not name one pserver)")
        proc = ProcessEnv.from_environ()
        # Flags win over the variables.
        env = dataclasses.replace(env, resume=env.resume if args.resume is None else args.resume,
                                  checkpoint_dir=env.checkpoint_dir if args.checkpoint_dir is None
                                  else args.checkpoint_dir)
        proc = dataclasses.replace(
            proc, max_frame_bytes=proc.max_frame_bytes if args.max_frame_bytes is None else args.max_frame_bytes,
            log_level=proc.log_level if args.log_level is None else args.log_level,
            max_connections=proc.max_connections if args.max_connections is None else args.max_connections)
    except ContractError as e:
        print(f"pserver: {e}", file=sys.stderr)
        return 2
    return serve(env, proc)


if __name__ == "__main__":
    sys.exit(main())
