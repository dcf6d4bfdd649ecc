"""What an ``SSHCluster`` (``sshcluster.py``) created, recorded in a state file under ``STATE_DIR``, and its
teardown: everything in its namespaces killed, then namespaces, cgroups, veths and bridge removed -- also for a cluster
whose owning process died without cleaning up (:func:`reap_stale_clusters`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Sequence

STATE_DIR = Path("/run/paddle-sshcluster")
NETNS_DIR = "/var/run/netns"  # where `ip netns add` puts a namespace's file (iproute2's NETNS_RUN_DIR)


def _run(argv: Sequence[str], check: bool = True, **kw) -> subprocess.CompletedProcess:
    kw.setdefault("capture_output", True)
    kw.setdefault("text", True)
    res = subprocess.run(list(argv), **kw)
    if check and res.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({res.returncode}): {(res.stderr or '').strip()}")
    return res


def _starttime(pid: int) -> str | None:
    """The kernel start time of pid (so a reused pid is not mistaken for the owner), or None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _cgroup2_root() -> Path | None:
    """Where cgroup v2 is mounted (``/sys/fs/cgroup``, or ``.../unified`` on hybrid hosts), or None."""
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return None
    for line in mounts:
        fields = line.split()
        if len(fields) > 2 and fields[2] == "cgroup2" and os.access(fields[1], os.W_OK):
            return Path(fields[1])
    return None


def _batch(lines: Sequence[str], netns: str = "", force: bool = False) -> None:
    """``ip`` commands, one a line, in one ``ip -batch`` process (in namespace ``netns`` when given); ``force``
    goes on past a failing line (teardown: what is already gone)."""
    argv = ["ip", *(["-n", netns] if netns else []), *(["-force"] if force else []), "-batch", "-"]
    _run(argv, check=not force, input="".join(f"{line}\n" for line in lines))


def _netns_pids(name: str) -> list[int]:
    """The pids in network namespace ``name``, as ``ip netns pids`` lists them (those whose /proc/PID/ns/net is
    the namespace's file), read here: the tests poll this, and an ``ip`` process per poll cost more than it."""
    try:
        ns = os.stat(f"{NETNS_DIR}/{name}")
    except OSError:
        return []
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            st = os.stat(f"/proc/{pid}/ns/net")
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == (ns.st_dev, ns.st_ino):
            found.append(int(pid))
    return sorted(found)


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split("(", 1)[1].rsplit(")", 1)[0]
    except (OSError, IndexError):
        return ""


def _ppid(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def _teardown(state: dict) -> None:
    """Remove everything a state record names; every step tolerates 'already gone'."""
    for ns in state["netns"]:
        # Kill everything in the namespace until nothing is left (a dying parent may spawn once more).
        deadline = time.monotonic() + 5
        while True:
            pids = _netns_pids(ns)
            if not pids or time.monotonic() > deadline:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.02)
    _batch([f"netns del {ns}" for ns in state["netns"]], force=True)
    for cg in state.get("cgroups", []):
        deadline = time.monotonic() + 5
        while Path(cg).exists():  # a killed process leaves its cgroup once it is reaped
            try:
                os.rmdir(cg)
            except OSError:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.02)
    for link in [*state["veths"], state["bridge"]]:
        if _run(["ip", "link", "show", link], check=False).returncode == 0:
            _run(["ip", "link", "del", link], check=False)
    with contextlib.suppress(FileNotFoundError):
        Path(state["state_file"]).unlink()


def reap_stale_clusters() -> list[str]:
    """Tear down clusters whose owning process is gone; returns their tokens."""
    reaped = []
    if not STATE_DIR.is_dir():
        return reaped
    for f in sorted(STATE_DIR.glob("*.json")):
        try:
            state = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if _starttime(state["owner_pid"]) == state["owner_start"]:
            continue  # still alive: not ours to touch
        _teardown(state)
        reaped.append(state["token"])
    return reaped
