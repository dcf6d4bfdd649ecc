"""What the launcher reads of a job's pods besides their states: each one's log (followed, joined across the
kubelet's rotation, saved with the job's results, streamed by ``logs``), ``status``'s rows, ``top``'s figures; and
``kill``, which marks the pods and deletes the job's objects.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, List, Optional

from paddle_cluster.contract import PSERVER
from paddle_cluster.node import pod as pod_entry
from paddle_cluster.node import top as node_top
from paddle_cluster.node.pod import FIGURES, FIGURES_S, METRICS, QUIET

from ...errors import ClusterError
from ...interrupt import stoppable
from ...top import NodeDoc
from ..base import ProcRow
from .kubectl import KILLED, KILLED_ANNOTATION, ROLES, Kubectl, PodState, find_pod, pod_states, pod_summary, proc_name


def kill_job(k: Kubectl, job_dir: str) -> List[str]:
    """Mark the job's pods as killed (a run following them says so), save their logs and metrics into
    ``job_dir``, then delete the job's objects, waiting until its pods are gone; what was saved and kubectl's
    lines ("job.batch ... deleted")."""
    pods = pod_states(k.run(k.get_pods()))
    try:
        if pods:
            k.run(k.patch([f"pod/{p.name}" for p in pods], {"metadata": {"annotations": {KILLED_ANNOTATION: KILLED}}}))
    except ClusterError:  # a pod gone meanwhile, or no right to patch pods: the objects are deleted all the same
        pass
    saved = save_results(k, pods, job_dir)
    lines = k.run(k.delete(wait=True), timeout=600).splitlines()
    return ([f"logs and metrics of {len(saved)} pod(s) saved in {job_dir}/log"] if saved else []) + lines


def followed_copy(job_dir: str, pod: str) -> str:
    """Where ``run`` keeps what it read following a pod's log: the whole log, which the kubelet's current file
    alone is not once it rotated."""
    return os.path.join(job_dir, "log", f".{pod}.followed")


def whole_log(current: List[str], copy: List[str]) -> List[str]:
    """A pod's whole log from ``kubectl logs`` (``current``: the kubelet's current file, which past its size
    limit, 10 MiB by default, it rotates away) and the ``copy`` a follower kept, joined where they overlap; a log
    that still lacks its beginning says so in its first line."""
    if not began_rotated(current):
        return current if len(current) >= len(copy) else copy
    joined = current
    if copy:
        for i in range(max(0, len(copy) - len(current)), len(copy) + 1):  # the longest overlap first
            if copy[i:] == current[:len(copy) - i]:
                joined = copy[:i] + current
                break
    return [ROTATED] + joined if began_rotated(joined) else joined


def began_rotated(lines: List[str]) -> bool:
    """Whether a pod's log lost its beginning: every log of a pod starts with the entry point's first line (or
    Python's word that it cannot run it)."""
    return bool(lines) and not lines[0].startswith(pod_entry.PREFIX) and "No module named" not in lines[0]


ROTATED = ("[paddle-cluster: the beginning of this log was rotated away on its node (the kubelet keeps the current "
           "10 MiB by default: containerLogMaxSize); a run that follows the job keeps every line]")


def save_results(k: Kubectl, pods: List[PodState], job_dir: str) -> List[str]:
    """Each pod's whole log into ``job_dir/log/<process>.log`` (with the copy a follower kept: ``whole_log``)
    and a trainer's metrics records (its log's ``METRICS`` lines) into ``log/metrics.trainer<N>.jsonl``, as the
    other backends leave them, so ``logs`` and ``plot`` work once the pods are gone. Each file is written whole,
    then renamed. The processes saved."""
    log_dir = os.path.join(job_dir, "log")
    saved = []

    def log_of(p: PodState) -> Optional[str]:
        if not p.state:  # never ran: no log
            return None
        try:
            return k.run(k.logs(p.name, follow=False), timeout=120)
        except ClusterError:
            return None
    with ThreadPoolExecutor(max_workers=8) as ex:  # a kubectl each, at once: every run's end and kill wait for them
        texts = list(ex.map(log_of, pods))
    for p, text in zip(pods, texts):
        if text is None:
            continue
        os.makedirs(log_dir, exist_ok=True)
        lines, metrics = [], []
        copy = followed_copy(job_dir, p.name)
        kept = _lines(copy)
        for line in whole_log(text.splitlines(), kept):
            if line.startswith(METRICS):
                metrics.append(line[len(METRICS):].partition(" ")[2])
            elif not line.startswith(FIGURES):
                lines.append(line)
        _write(os.path.join(log_dir, f"{proc_name(p)}.log"), lines)
        if metrics:
            _write(os.path.join(log_dir, f"metrics.trainer{p.index}.jsonl"), metrics)
        if os.path.exists(copy):
            os.unlink(copy)
        saved.append(proc_name(p))
    return saved


def _lines(path: str) -> List[str]:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read().splitlines()
    except FileNotFoundError:
        return []


def _write(path: str, lines: List[str]) -> None:
    with open(path + ".part", "w", encoding="utf-8") as f:
        f.write("".join(f"{ln}\n" for ln in lines))
    os.replace(path + ".part", path)


def saved_rows(job_dir: str) -> List[ProcRow]:
    """``status`` of a job whose pods are gone: one row per saved log."""
    log_dir = os.path.join(job_dir, "log")
    names = sorted(n for n in (os.listdir(log_dir) if os.path.isdir(log_dir) else [])
                   if n.endswith(".log") and n.split(".")[0] in ROLES)
    rows = []
    for n in names:
        with open(os.path.join(log_dir, n), encoding="utf-8", errors="replace") as f:
            last = ([ln.rstrip("\n") for ln in f if ln.strip()] or [""])[-1]
        role = ROLES[n.split(".")[0]]
        rows.append(ProcRow("-", "-", "-", n[:-len(".log")], role, None, "ended (pod deleted)", "", last,
                            f"log in {log_dir}/{n}"))
    return sorted(rows, key=lambda r: (r.role != PSERVER, r.name))


def pod_row(p: PodState, last_line: str) -> ProcRow:
    """A pod as a row of ``status``: its process runs in a container on another machine, so no pid; the pod."""
    return ProcRow(p.hostname, p.node_name, p.pod_ip, proc_name(p), p.role, None, pod_summary(p), "", last_line,
                   f"pod/{p.name}")


def job_status(k: Kubectl, job_dir: str) -> List[ProcRow]:
    """One row per pod, with the last line of its log; once the pods are gone, one per log saved."""
    states = sorted(pod_states(k.run(k.get_pods())), key=lambda p: (p.role != PSERVER, p.index))
    # A kubectl or two per pod, at once: one pod after another, ``status`` of 5 pods took 1.3-1.6 s here, 0.5-0.7 s
    # so, and a user's job of dozens of pods waited seconds more.
    with ThreadPoolExecutor(max_workers=8) as ex:
        lasts = list(ex.map(lambda p: last_output(k, p.name) if p.state else "", states))
    rows = [pod_row(p, last) for p, last in zip(states, lasts)] or saved_rows(job_dir)
    if not rows:
        raise ClusterError(f"no pods with {k.selector} in namespace {k.namespace} and no saved logs in {job_dir}/log "
                           "(another namespace: --namespace / K8S_NAMESPACE?)")
    return rows


def last_output(k: Kubectl, pod: str) -> str:
    """The last line the pod's process printed: the log's last, or, when that is the entry point's figures line
    (every FIGURES_S), the last other one of a longer tail; "" when there is none or kubectl cannot say."""
    for tail in (1, 1000):
        try:
            lines = [ln for ln in k.run(k.logs(pod, follow=False, tail=tail), timeout=30).splitlines()
                     if ln.strip() and not ln.startswith(QUIET)]
        except ClusterError:
            return ""
        if lines:
            return lines[-1].strip()
    return ""


FIGURES_TAIL = 200  # the log lines ``top`` looks at for a pod's latest figures: 400 s of a quiet process


def figures(k: Kubectl) -> List[NodeDoc]:
    """``top``: each pod of the job with its process's latest ``FIGURES`` line (node/pod.py) among the last lines
    of its log (a process printing more than FIGURES_TAIL lines in FIGURES_S seconds shows none)."""
    pods = sorted(pod_states(k.run(k.get_pods())), key=lambda p: (p.role != PSERVER, p.index))
    if not pods:
        raise ClusterError(f"no pods with {k.selector} in namespace {k.namespace}: the job ended (status says how) "
                           "or runs in another namespace (--namespace / K8S_NAMESPACE?)")

    def one(p: PodState) -> NodeDoc:
        now, said = time.time(), {}
        try:
            ran = p.state in ("running", "terminated")  # a waiting container has no log yet
            text = k.run(k.logs(p.name, follow=False, tail=FIGURES_TAIL), timeout=30) if ran else ""
        except ClusterError as e:
            return NodeDoc(p.hostname, p.node_name, {}, str(e))
        for line in reversed(text.splitlines()):
            if line.startswith(FIGURES):
                try:
                    said = json.loads(line[len(FIGURES):])
                except ValueError:
                    pass
                break
        own, at = said.get("figures") or {}, said.get("time")
        row = {"name": proc_name(p), "role": p.role, "state": pod_summary(p), "started_at": said.get("started_at"),
               "figures": own, "metrics": said.get("metrics"), "age": None}
        if p.state == "running" and isinstance(at, (int, float)) and now - at < 3 * FIGURES_S:  # a line of late
            # How old the process's own figures were when the line was written (the line: under FIGURES_S old).
            row.update(cpu=said.get("cpu"), rss=said.get("rss"), age=node_top.age(own, at))
        return NodeDoc(p.hostname, p.node_name, {"time": now, "procs": [row]})
    with ThreadPoolExecutor(max_workers=8) as ex:  # a kubectl each, as ``status`` runs them
        return list(ex.map(one, pods))


def stream_logs(k: Kubectl, text: str, lines: int, follow: bool, out: Callable[[str], None],
                job_dir: str = "") -> None:
    pods = pod_states(k.run(k.get_pods()))
    if not pods and job_dir:  # the job's objects are deleted: its saved logs
        rows = saved_rows(job_dir)
        row = next((r for r in rows if text == r.name or text.replace("-", ".").endswith("." + r.name)), None)
        if row is None:
            raise ClusterError(f"no pods of this job left and no saved log of {text!r} in {job_dir}/log; saved: "
                               f"{', '.join(r.name for r in rows) or 'none'}")
        with open(os.path.join(job_dir, "log", f"{row.name}.log"), encoding="utf-8", errors="replace") as f:
            for line in f.read().splitlines()[-lines:] if lines > 0 else []:
                out(line)
        return
    pod = find_pod(pods, text)
    if not follow:  # the last lines of output: a trainer's METRICS records at its end are not output
        shown = [ln for ln in k.run(k.logs(pod.name, follow=False)).splitlines() if not ln.startswith(QUIET)]
        for line in shown[-lines:] if lines > 0 else []:
            out(line)
        return
    argv = k.logs(pod.name, follow=follow, tail=lines)
    with stoppable(), subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True, errors="replace") as p:
        assert p.stdout is not None and p.stderr is not None
        try:
            for line in p.stdout:
                if not line.startswith(QUIET):
                    out(line.rstrip("\n"))
        except KeyboardInterrupt:
            p.terminate()
        err = p.stderr.read().strip()
    if p.returncode not in (0, -15) and err:
        raise ClusterError(f"kubectl logs pod/{pod.name}: {err.splitlines()[-1]}")
