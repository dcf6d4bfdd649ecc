"""``python -m paddle_cluster.node CMD``: what the launcher runs on a node (standard library only).

Every sub-command prints one JSON document, except ``supervise``, which talks JSON lines both ways for the
life of a job, ``bootstrap``, its twin for agents an engine starts (``bootstrap.py``), ``logs``, which prints
log lines, ``send``, which prints a file's bytes, and ``pod``, the entry point of a Kubernetes pod, which
becomes the job's process (``pod.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List, Optional

from paddle_cluster import contract

from . import bootstrap, files, jobdir, private, supervisor, top, unpack


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m paddle_cluster.node")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("unpack", help="extract a workspace archive into a fresh job directory, safely")
    p.add_argument("--archive", required=True)
    p.add_argument("--dest", required=True)
    p.add_argument("--max-members", type=int, default=unpack.MAX_MEMBERS)
    p = sub.add_parser("supervise", help="run this node's share of a job (messages as JSON lines on stdin/stdout)")
    p.add_argument("--orphan-timeout", type=float, default=20.0)
    p.add_argument("--grace", type=float, default=5.0)
    p = sub.add_parser("bootstrap", help="run this node's share of a job started by an engine (mpirun, srun): "
                       "the node index from its variables, the plan from a file")
    p.add_argument("--plan", metavar="FILE", required=True, help="the Start message of every node, one per line")
    p.add_argument("--ranks", metavar="ENGINE:NODE,NODES,LOCAL,HOST", required=True, help="the engine that "
                   "started this process and the variables it sets (A|B: the first set), e.g. "
                   "srun:SLURM_NODEID,SLURM_JOB_NUM_NODES|SLURM_NNODES,SLURM_LOCALID,SLURMD_NODENAME")
    p.add_argument("--grace", type=float, default=5.0)
    p.add_argument("--events", metavar="FILE", default="", help="append events to FILE ({node}: the node index) "
                   "instead of stdout")
    p.add_argument("--rendezvous", metavar="DIR", default="", help="shared directory where the nodes publish "
                   "their addresses to complete the plan (Slurm)")
    p.add_argument("--nic", default="", help="with --rendezvous: the interface whose address the node publishes")
    p.add_argument("--timeout", type=float, default=60.0, help="with --rendezvous: seconds to wait for every node")
    p.add_argument("--keep-going", action="store_true", help="a failed process does not stop the node (a "
                   "launcher that follows the job decides, or --elastic)")
    p.add_argument("--keep-going-while", metavar="FILE", default="", help="keep going only while FILE keeps "
                   "changing (the following launcher's lease); fail fast once it has not for --lease-timeout s")
    p.add_argument("--lease-timeout", type=float, default=20.0, help="with --keep-going-while: seconds")
    p.add_argument("--own-session", action="store_true", help="run the agent in a POSIX session of its own that gets "
                   "SIGTERM when this process dies: for engines that SIGKILL their ranks (MPICH's Hydra)")
    p.add_argument("--remove-plan", action="store_true", help="remove the plan file once read (it holds the job "
                   "secret; each node has its own: {node} in --plan, or a file per host)")
    for name in ("kill", "status", "metrics", "top"):
        p = sub.add_parser(name)
        p.add_argument("--job-dir", required=True)
        if name == "kill":
            p.add_argument("--grace", type=float, default=5.0)
    p = sub.add_parser("files", help="the regular files under PATHs of the job directory, with sizes and SHA-256")
    p.add_argument("--job-dir", required=True)
    p.add_argument("paths", nargs="+", metavar="PATH")
    p = sub.add_parser("send", help="the bytes of one regular file of the job directory, from --offset, on stdout")
    p.add_argument("--job-dir", required=True)
    p.add_argument("--path", required=True)
    p.add_argument("--offset", type=int, default=0)
    p = sub.add_parser("private", help="a file only this user can read (an engine's plan, which holds the job "
                       "secret): --write PATH takes stdin, in a directory checked and made private; --remove PATH")
    act = p.add_mutually_exclusive_group(required=True)
    act.add_argument("--write", metavar="PATH")
    act.add_argument("--remove", metavar="PATH")
    p = sub.add_parser("checkpoints", help="the steps under ROOT whose shards of every given pserver are complete")
    p.add_argument("--root", required=True)
    p.add_argument("--pservers", required=True, help="pserver ids, comma-separated")
    p = sub.add_parser("logs")
    p.add_argument("--job-dir", required=True)
    p.add_argument("--role", choices=("trainer", "pserver", "all"), default="all")
    p.add_argument("-n", type=int, default=50)
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new lines until the job ends or "
                   "stdin closes (the launcher is gone)")
    return ap


def _bad_job_dir(path: str) -> Optional[str]:
    """Why ``path`` is not ROOT_DIR/<a plain job name> (None: it is); checked again here, not only by the CLI."""
    try:
        contract.check_job_name(os.path.basename(path))
    except contract.ContractError as e:
        return f"refusing job directory {path!r}: {e}"
    return None


def main(argv: Optional[List[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["pod"]:  # its own parser: everything after -- is the command to become
        from . import pod

        return pod.main(args[1:])
    a = _parser().parse_args(args)
    target = a.dest if a.cmd == "unpack" else getattr(a, "job_dir", None)
    bad = _bad_job_dir(target) if target else None  # supervise checks the job dir its plan names
    if bad:
        print(json.dumps({"ok": False, "error": bad}))
        return 2
    if a.cmd == "supervise":
        return supervisor.supervise(a.orphan_timeout, a.grace)
    if a.cmd == "bootstrap" and a.own_session:
        return bootstrap.shielded([x for x in args if x != "--own-session"])
    if a.cmd == "bootstrap":
        return bootstrap.main(a.ranks, a.plan, a.grace, a.events, a.rendezvous, a.nic, a.timeout, not a.keep_going,
                              lease=a.keep_going_while, lease_timeout=a.lease_timeout, remove_plan=a.remove_plan)
    if a.cmd == "logs":
        return jobdir.print_logs(a.job_dir, a.role, a.n, a.follow)
    if a.cmd == "send":
        return files.send(a.job_dir, a.path, a.offset)
    if a.cmd == "unpack":
        doc = unpack.unpack_report(a.archive, a.dest, a.max_members)
    elif a.cmd == "kill":
        doc = jobdir.kill(a.job_dir, a.grace)
    elif a.cmd == "status":
        doc = jobdir.status(a.job_dir)
    elif a.cmd == "top":
        doc = top.snapshot(a.job_dir)
    elif a.cmd == "files":
        doc = files.listing(a.job_dir, a.paths)
    elif a.cmd == "private":
        try:
            if a.write:
                private.write_private(a.write, sys.stdin.buffer.read())
            doc = {"ok": True, "removed": private.remove(a.remove)} if a.remove else {"ok": True}
        except (private.PrivateError, OSError) as e:
            doc = {"ok": False, "error": str(e) if isinstance(e, private.PrivateError) else
                   f"{a.write or a.remove}: {e.strerror or e}"}
    elif a.cmd == "checkpoints":
        from paddle_cluster.ps.checkpoint import complete_steps  # numpy: only this one needs it
        from paddle_cluster.ps.errors import CheckpointError

        try:
            doc = {"ok": True, "steps": complete_steps(a.root, [int(k) for k in a.pservers.split(",") if k])}
        except CheckpointError as e:  # e.g. a step directory that cannot be read: say so, not a traceback
            doc = {"ok": False, "error": str(e)}
    else:
        doc = jobdir.metrics(a.job_dir)
    print(json.dumps(doc))
    return 0 if doc.get("ok", True) else 1


if __name__ == "__main__":
    sys.exit(main())
