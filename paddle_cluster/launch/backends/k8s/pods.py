"""What the launcher reads of a job's pods besides their states: each one's log (followed, joined across the
kubelet's rotation, saved with the job's results, streamed by ``logs``), ``status``'s rows, ``top``'s figures; and
``kill``, which marks the pods and deletes the job's objects. Every log is read through one ``kubectl proxy`` per
command (``logfollow.py``), never a ``kubectl logs`` per pod.
"""

from __future__ import annotations

import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional

from paddle_cluster.contract import PSERVER
from paddle_cluster.node import pod as pod_entry
from paddle_cluster.node import top as node_top
from paddle_cluster.node.pod import FIGURES, FIGURES_S, METRICS, QUIET

from ...errors import ClusterError
from ...interrupt import stoppable
from ...top import NodeDoc
from ..base import ProcRow
from .kubectl import (
    KILLED,
    KILLED_ANNOTATION,
    ROLES,
    Kubectl,
    PodState,
    find_pod,
    pod_states,
    pod_summary,
    proc_name,
    states_of,
)
from .logfollow import LogProxy

ALL = "all"  # ``logs all``: every pod of the job (of ``--role``)
FOLLOW_ASK_S = 1.0  # ``logs -f``: how often the job's pods are listed for new ones and for its end


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
    with LogProxy(k.binary) as proxy:
        saved = save_results(k, proxy, pods, job_dir)
    lines = k.run(k.delete(wait=True), timeout=600).splitlines()
    return ([f"logs and metrics of {len(saved)} pod(s) saved in {job_dir}/log"] if saved else []) + lines


def followed_copy(job_dir: str, pod: str) -> str:
    """Where ``run`` keeps what it read following a pod's log: the whole log, which the kubelet's current file
    alone is not once it rotated."""
    return os.path.join(job_dir, "log", f".{pod}.followed")


def whole_log(current: List[str], copy: List[str]) -> List[str]:
    """A pod's whole log as the API server serves it (``current``: the kubelet's current file, which past its size
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


def save_results(k: Kubectl, proxy: LogProxy, pods: List[PodState], job_dir: str) -> List[str]:
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
            return proxy.read(k.namespace, p.name)
        except ClusterError:
            return None
    with ThreadPoolExecutor(max_workers=8) as ex:  # a request each, at once: every run's end and kill wait for them
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
    # A request or two per pod, at once: one pod after another, a user's job of dozens of pods waited seconds.
    lasts: List[str] = []
    if states:
        with LogProxy(k.binary) as proxy, ThreadPoolExecutor(max_workers=8) as ex:
            lasts = list(ex.map(lambda p: last_output(k, proxy, p.name) if p.state else "", states))
    rows = [pod_row(p, last) for p, last in zip(states, lasts)] or saved_rows(job_dir)
    if not rows:
        raise ClusterError(f"no pods with {k.selector} in namespace {k.namespace} and no saved logs in {job_dir}/log "
                           "(another namespace: --namespace / K8S_NAMESPACE?)")
    return rows


def last_output(k: Kubectl, proxy: LogProxy, pod: str) -> str:
    """The last line the pod's process printed: the log's last, or, when that is the entry point's figures line
    (every FIGURES_S), the last other one of a longer tail; "" when there is none or kubectl cannot say."""
    for tail in (1, 1000):
        try:
            lines = [ln for ln in proxy.read(k.namespace, pod, tail, timeout=30).splitlines()
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
            text = proxy.read(k.namespace, p.name, FIGURES_TAIL, timeout=30) if ran else ""
        except ClusterError as e:
            return NodeDoc(p.hostname, p.node_name, {}, str(e))
        for line in reversed(text.splitlines()):
            if line.startswith(FIGURES):
                try:  # the entry point's own line (node/podlog.py): the process cannot write one
                    said = json.loads(line[len(FIGURES):])
                except (ValueError, RecursionError):
                    pass
                break
        said = said if isinstance(said, dict) else {"figures": said}  # not an object: the row says what is missing
        own, at = said.get("figures"), said.get("time")
        row = {"name": proc_name(p), "role": p.role, "state": pod_summary(p), "started_at": said.get("started_at"),
               "figures": own, "metrics": said.get("metrics"), "age": None}
        if p.state == "running" and isinstance(at, (int, float)) and now - at < 3 * FIGURES_S:  # a line of late
            # How old the process's own figures were when the line was written (the line: under FIGURES_S old).
            row.update(cpu=said.get("cpu"), rss=said.get("rss"),
                       age=node_top.age(own if isinstance(own, dict) else {}, at))
        return NodeDoc(p.hostname, p.node_name, {"time": now, "procs": [row]})
    with LogProxy(k.binary) as proxy, ThreadPoolExecutor(max_workers=8) as ex:  # a request each, as ``status``
        return list(ex.map(one, pods))


def stream_logs(k: Kubectl, text: str, role: str, lines: int, follow: bool, out: Callable[[str], None],
                job_dir: str = "") -> None:
    """``logs``: the last ``lines`` lines of one pod's output (``text``: ``find_pod``'s names) or, ``text`` being
    ``all``, of each pod of ``role``, each line headed ``[trainer.0@fit-trainer-0] `` as ``run`` shows it; with
    ``follow``, their new lines until the pod ended (``all``: until the job's Jobs ended, pods that start meanwhile
    included); the saved logs once the job's pods are gone."""
    pods = pod_states(k.run(k.get_pods()))
    if not pods and job_dir:  # the job's objects are deleted: its saved logs
        _saved_logs(job_dir, text, role, lines, out)
        return
    if text == ALL:
        wanted: Callable[[PodState], bool] = lambda p: role == ALL or p.role == ROLES[role]  # noqa: E731
    else:
        name = find_pod(pods, text).name
        wanted = lambda p: p.name == name  # noqa: E731
    head = (lambda p: f"[{proc_name(p)}@{p.hostname}] ") if text == ALL else (lambda p: "")
    lock = threading.Lock()

    def show(p: PodState, raw: str) -> None:
        if not raw.startswith(QUIET):  # a trainer's METRICS records at its end, and top's figures, are not output
            with lock:
                out(head(p) + raw.rstrip("\n"))
    with LogProxy(k.binary) as proxy:
        if not follow:
            for p in sorted(filter(wanted, pods), key=lambda p: (p.role != PSERVER, p.index)):
                if p.state:  # (a pod whose container never ran has no log)
                    shown = [ln for ln in proxy.read(k.namespace, p.name).splitlines() if not ln.startswith(QUIET)]
                    for line in shown[-lines:] if lines > 0 else []:
                        show(p, line)
            return
        with stoppable():
            try:
                _follow_pods(k, proxy, wanted, lines, show, text == ALL)
            except KeyboardInterrupt:
                pass


def _follow_pods(k: Kubectl, proxy: LogProxy, wanted: Callable[[PodState], bool], lines: int,
                 show: Callable[[PodState, str], None], whole_job: bool) -> None:
    """Each wanted pod's log from its last ``lines`` lines on (one that starts later: from its start), a thread each
    through ``proxy``; the job's pods (and, ``whole_job``, its Jobs) listed through it every ``FOLLOW_ASK_S`` for
    pods that start and for the end: the wanted pods ended (``whole_job``: the Jobs finished or deleted) and their
    logs read out."""
    followers: Dict[str, threading.Thread] = {}
    problems: List[str] = []

    def read(p: PodState, tail: Optional[int]) -> None:
        try:
            for raw in proxy.follow(k.namespace, p.name, tail=tail):
                show(p, raw)
        except ClusterError as e:
            problems.append(f"pod/{p.name}: {e}")
    tail: Optional[int] = lines if lines >= 0 else None  # then None: every line of a pod started since
    while True:
        # The Jobs before the pods: a pod the last listing of a finished job lacks was never followed.
        done = not whole_job or all(_finished(j) for j in proxy.items(k.namespace, "apis/batch/v1", "jobs",
                                                                       k.selector))
        mine = [p for p in states_of(proxy.items(k.namespace, "api/v1", "pods", k.selector)) if wanted(p)]
        for p in mine:
            if p.state in ("running", "terminated") and p.name not in followers:
                followers[p.name] = t = threading.Thread(target=read, args=(p, tail), daemon=True,
                                                         name=f"logs-{p.name}")
                t.start()
        tail = None
        if (done if whole_job else all(p.state == "terminated" for p in mine)) and not any(
                t.is_alive() for t in followers.values()):
            break
        time.sleep(FOLLOW_ASK_S)
    if problems:
        raise ClusterError("; ".join(problems))


def _finished(job: Dict[str, Any]) -> bool:
    """Whether a Job's controller says it ended (Complete or Failed): none of its pods starts again."""
    conds = (job.get("status") or {}).get("conditions") or []
    return any(c.get("type") in ("Complete", "Failed") and c.get("status") == "True" for c in conds)


def _saved_logs(job_dir: str, text: str, role: str, lines: int, out: Callable[[str], None]) -> None:
    rows = saved_rows(job_dir)
    if text == ALL:
        chosen = [r for r in rows if role == ALL or r.role == ROLES[role]]
    else:
        chosen = [r for r in rows if text == r.name or text.replace("-", ".").endswith("." + r.name)][:1]
    if not chosen:
        raise ClusterError(f"no pods of this job left and no saved log of {text!r} in {job_dir}/log; saved: "
                           f"{', '.join(r.name for r in rows) or 'none'}")
    for row in chosen:
        with open(os.path.join(job_dir, "log", f"{row.name}.log"), encoding="utf-8", errors="replace") as f:
            for line in f.read().splitlines()[-lines:] if lines > 0 else []:
                out((f"[{row.name}] " if text == ALL else "") + line)

