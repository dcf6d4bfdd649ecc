"""A job directory laid out as the seeds' (``paddle.py``'s) was, on every node: ``nodefile`` (this node's index),
``log/`` (``train.log``, ``server.log`` and the runtime's ``paddle_trainer.INFO`` / ``paddle_pserver2.INFO``
names for them) and ``output/``, all beside the workspace's files, where the processes run.

With ``--job_workspace`` the workspace is already on the node, maybe on a filesystem every node shares: it is
only read. Its top-level entries are linked into the job directory (``ROOT_DIR/<job>``, on the node's own disk),
so the scripts find their files where they were, while ``nodefile``, ``log/`` and ``output/`` are the node's
own. A job directory that another node already claimed (ROOT_DIR itself shared) is refused.
"""

from __future__ import annotations

import os

OWN = ("nodefile", "log", "output", ".paddle_cluster")  # never linked from the workspace: each node's own
INFO_NAMES = {"train": "paddle_trainer", "server": "paddle_pserver2"}


class LayoutError(Exception):
    """The job directory cannot be laid out; the message names it and the fix."""


def prepare(job_dir: str, node: int, workspace: str = "") -> None:
    """``nodefile``, ``log/``, ``output/`` in ``job_dir`` (already created), and the workspace's entries."""
    # The node's claim on the directory, apart from nodefile (a dispatched workspace may carry a stale one).
    claim = os.path.join(job_dir, ".paddle_cluster", "node")
    os.makedirs(os.path.dirname(claim), mode=0o700, exist_ok=True)
    try:
        with open(claim) as f:
            claimed = f.read().strip()
    except OSError:
        claimed = ""
    if claimed and claimed != str(node):
        raise LayoutError(f"{job_dir} is already node {claimed}'s job directory: ROOT_DIR is on a filesystem the "
                          "nodes share; give each node a ROOT_DIR of its own (its local disk)")
    for path in (claim, os.path.join(job_dir, "nodefile")):
        # Replaced, never written in place: a workspace's own nodefile is a link into the node's cache.
        tmp = f"{path}.tmp-{os.getpid()}"  # never another process's temporary
        with open(tmp, "w") as f:
            f.write(f"{node}\n")
        os.replace(tmp, path)
    for name in ("log", "output"):
        os.makedirs(os.path.join(job_dir, name), exist_ok=True)
    try:
        names = sorted(os.listdir(workspace)) if workspace else []
        for name in names:
            dest = os.path.join(job_dir, name)
            if name not in OWN and not os.path.lexists(dest):
                os.symlink(os.path.join(workspace, name), dest)
    except OSError as e:
        raise LayoutError(f"cannot link the workspace {workspace} into {job_dir}: {e.strerror or e}") from None


def info_link(log_dir: str, log_name: str) -> None:
    """``paddle_trainer.INFO`` -> ``train.log`` (``paddle_trainer.3.INFO`` -> ``train.3.log``), likewise
    ``paddle_pserver2.INFO`` -> ``server.log``: the names the seeds' users look for."""
    kind, _, rest = log_name.partition(".")
    if kind not in INFO_NAMES or not rest.endswith("log"):
        return
    link = os.path.join(log_dir, f"{INFO_NAMES[kind]}.{rest[:-3]}INFO")
    try:
        if not os.path.lexists(link):
            os.symlink(log_name, link)
    except OSError:
        pass  # a convenience name: a full disk or an odd filesystem must not stop the job
