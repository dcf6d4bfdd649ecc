"""The ``kubectl`` command lines a Kubernetes job needs, as data, and what they print, as typed values (pod
states, and the events they mean: ``PodWatch``).

Every command names the job's namespace and label selector, so it only ever touches that job's objects.
``Kubectl.run`` is the one place a command is executed; a failure becomes a ``ClusterError`` carrying
kubectl's own last words.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

from paddle_cluster.contract import PSERVER, TRAINER
from paddle_cluster.node import messages as m
from paddle_cluster.node import pod as pod_entry
from paddle_cluster.node import top as node_top
from paddle_cluster.node.pod import FIGURES, FIGURES_S, METRICS, QUIET

from ...errors import ClusterError, UsageError
from ...interrupt import stoppable
from ...top import NodeDoc
from ..base import Event, NodeLost, ProcRow
from .manifests import JOBSET_RESOURCE, LABEL_ID, LABEL_JOB, LABEL_ROLE, K8sJob, object_name, selector

INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"  # set by the Job controller on Indexed pods
# Set on a job's pods by ``kill`` before it deletes them: a run following the job reads it when they go, and ends
# "stopped by paddle-cluster kill" (exit 3) as on every backend, not "lost contact" (from any machine: it is on
# the pods, not in this machine's journal).
KILLED_ANNOTATION = "paddle-cluster/stopped-by"
KILLED = "paddle-cluster kill"
OBJECTS = "jobs.batch,services,secrets,configmaps"  # everything render k8s creates (pods go with their Jobs)


def kinds(jobset: bool) -> str:
    """What a job's objects are: those of ``OBJECTS``, and its JobSet (whose Jobs and Service go with it)."""
    return f"{OBJECTS},{JOBSET_RESOURCE}" if jobset else OBJECTS
_ROLES = {"pserver": PSERVER, "trainer": TRAINER}
VISIBILITY = "visibility.kueue.x-k8s.io/v1beta1"  # Kueue 0.9 and later (v1alpha1 before)


class KubectlMissing(ClusterError):
    """No kubectl on PATH."""


@dataclass(frozen=True)
class Kubectl:
    """The commands for one job: ``namespace`` and ``selector`` (``paddle-cluster/job=<name>``)."""

    namespace: str
    selector: str
    binary: str = "kubectl"
    kinds: str = OBJECTS  # what delete deletes

    def _ns(self, *args: str) -> List[str]:
        return [self.binary, "--namespace", self.namespace, *args]

    def can_i(self, verb: str, resource: str) -> List[str]:
        kind, _, sub = resource.partition("/")  # pods/log: the subresource (kubectl reads pods/NAME as a pod)
        return self._ns("auth", "can-i", verb, kind, *([f"--subresource={sub}"] if sub else []))

    def create(self) -> List[str]:
        """Create the objects of the YAML stream on stdin; one that exists already is an error, left as it is."""
        return self._ns("create", "--filename", "-")

    def get_named(self, names: List[str]) -> List[str]:
        """Those of the objects ``kind/name`` that exist, as JSON."""
        return self._ns("get", *names, "--ignore-not-found", "--output", "json")

    def patch(self, names: List[str], change: Dict[str, Any]) -> List[str]:
        """Merge ``change`` into the objects ``kind/name``."""
        return self._ns("patch", *names, "--type", "merge", "--patch", json.dumps(change))

    def get_pods(self) -> List[str]:
        return self.list_of("pods")

    def list_of(self, kind: str, selected: bool = True) -> List[str]:
        """The job's objects of ``kind`` (``selected``: by the job's selector; else all of the namespace's, as
        Events, which carry no labels), as JSON."""
        return self._ns("get", kind, *(["--selector", self.selector] if selected else []), "--output", "json")

    def watch(self, kind: str, selected: bool = True) -> List[str]:
        """Those objects as they change: one JSON document per event, ``{"type": ..., "object": ...}``."""
        return self._ns("get", kind, *(["--selector", self.selector] if selected else []), "--watch",
                        "--output-watch-events", "--output", "json")

    def watch_pods(self) -> List[str]:
        return self.watch("pods")

    def get(self) -> List[str]:
        """The job's Jobs and pods, as a table for people."""
        return self._ns("get", "jobs.batch,pods", "--selector", self.selector, "--output", "wide")

    def logs(self, pod: str, follow: bool = True, tail: Optional[int] = None) -> List[str]:
        return self._ns("logs", f"pod/{pod}", *(["--follow"] if follow else []),
                        *([f"--tail={tail}"] if tail is not None else []))

    def delete(self, wait: bool) -> List[str]:
        """Delete the job's objects; foreground: a Job is gone only once its pods are (with their grace)."""
        return self._ns("delete", self.kinds, "--selector", self.selector, "--ignore-not-found", "--cascade=foreground",
                        f"--wait={'true' if wait else 'false'}")

    def api_resources(self, group: str) -> List[str]:
        """The resources the API server offers in ``group``, one name a line."""
        return [self.binary, "api-resources", f"--api-group={group}", "--output", "name"]

    def pending_workloads(self, queue: str) -> List[str]:
        """Kueue's visibility API: the LocalQueue's workloads not admitted yet, each with its place in line."""
        return [self.binary, "get", "--raw", f"/apis/{VISIBILITY}/namespaces/{self.namespace}/localqueues/{queue}/"
                "pendingworkloads"]

    def kill_pods(self) -> List[str]:
        """The second Ctrl+C: no grace period."""
        return self._ns("delete", "pods", "--selector", self.selector, "--ignore-not-found", "--grace-period=0",
                        "--force", "--wait=false")

    def run(self, argv: List[str], stdin: str = "", timeout: float = 120.0) -> str:
        """Run ``argv`` (one of the above); its stdout, or a ``ClusterError`` with kubectl's error."""
        res = self._exec(argv, stdin, timeout)
        if res.returncode != 0:
            raise self._failed(argv, res)
        return res.stdout

    def may(self, verb: str, resource: str) -> bool:
        """Whether the API server lets us ``verb`` ``resource`` here; ``ClusterError`` when it cannot say."""
        argv = self.can_i(verb, resource)
        res = self._exec(argv, "", 60.0)
        answer = (res.stdout.split() or [""])[0]  # "no" may be followed by " - <the authorizer's reason>"
        if answer in ("yes", "no"):
            return answer == "yes"
        raise self._failed(argv, res)

    @staticmethod
    def _exec(argv: List[str], stdin: str, timeout: float) -> subprocess.CompletedProcess:
        if shutil.which(argv[0]) is None:
            raise KubectlMissing(f"{argv[0]} not found on PATH: install kubectl (https://kubernetes.io/docs/tasks/"
                                 "tools/) and point it at your cluster (KUBECONFIG or ~/.kube/config)")
        try:
            return subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise ClusterError(f"{' '.join(argv[:5])} ...: no answer within {timeout:.0f} s") from None

    @staticmethod
    def _failed(argv: List[str], res: subprocess.CompletedProcess) -> ClusterError:
        last = (res.stderr.strip().splitlines() or res.stdout.strip().splitlines() or ["no output"])[-1]
        return ClusterError(f"{' '.join(argv[:5])} ... failed: {last}")


@dataclass(frozen=True)
class PodState:
    """One pod of the job as ``kubectl get pods -o json`` shows it."""

    name: str
    hostname: str  # <Job name>-<index>: the node name paddle-cluster shows
    role: str
    index: int
    phase: str  # Pending, Running, Succeeded, Failed, Unknown
    state: str  # the container's: "waiting", "running", "terminated", or "" before it has one
    reason: str = ""  # why it waits or ended (ImagePullBackOff, OOMKilled, Unschedulable: ...)
    exit_code: Optional[int] = None
    node_name: str = ""
    pod_ip: str = ""
    deleting: bool = False
    killed: bool = False  # ``kill`` marked it (KILLED_ANNOTATION) before deleting it


def pod_states(text: str) -> List[PodState]:
    """The job's pods from the JSON of ``Kubectl.get_pods()``; pods of no known role are left out."""
    try:
        doc = json.loads(text)
    except ValueError:
        raise ClusterError(f"kubectl get pods printed no JSON: {text[:200]!r}") from None
    return states_of(doc.get("items", []))


def states_of(items: Iterable[Dict[str, Any]]) -> List[PodState]:
    """The pods of these pod documents; pods of no known role are left out."""
    return [p for p in (_pod(item) for item in items) if p is not None]


def items_of(doc: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The objects ``kubectl get -o json`` printed: a List, or the object itself when one was named."""
    if "items" in doc:
        return list(doc["items"] or [])
    return [doc] if doc.get("kind") else []


def watch_events(lines: Iterable[str]) -> Iterator[Dict[str, Any]]:
    """The documents of ``Kubectl.watch``'s output, one after another: one a line (kubectl 1.32) or each
    indented over many lines (older kubectl), so a document ends on a line ending with its closing brace."""
    buf: List[str] = []
    for line in lines:
        buf.append(line)
        if not line.rstrip().endswith("}"):
            continue
        try:
            doc = json.loads("".join(buf))
        except ValueError:
            continue  # a brace inside an indented document
        buf = []
        if isinstance(doc, dict) and isinstance(doc.get("object"), dict):
            yield doc


def _pod(item: Dict[str, Any]) -> Optional[PodState]:
    meta, spec, status = item.get("metadata", {}), item.get("spec", {}), item.get("status", {})
    role = _ROLES.get((meta.get("labels") or {}).get(LABEL_ROLE, ""))
    index = (meta.get("annotations") or {}).get(INDEX_ANNOTATION) or (meta.get("labels") or {}).get(INDEX_ANNOTATION)
    if role is None or index is None or not str(index).isdigit():
        return None
    state, reason, code = "", "", None
    for cs in status.get("containerStatuses") or []:
        st = cs.get("state") or {}
        if "terminated" in st:
            t = st["terminated"]
            state, reason, code = "terminated", t.get("reason", ""), t.get("exitCode")
            if t.get("message"):
                reason += f": {t['message'].strip()}"
        elif "running" in st:
            state = "running"
        elif "waiting" in st:
            w = st["waiting"]
            state, reason = "waiting", w.get("reason", "") + (f": {w['message']}" if w.get("message") else "")
    if not state:  # no container yet: unschedulable, or not looked at yet
        for c in status.get("conditions") or []:
            if c.get("type") == "PodScheduled" and c.get("status") == "False":
                reason = f"{c.get('reason', 'Unschedulable')}: {c.get('message', '')}".rstrip(": ")
        if status.get("phase") == "Failed":  # evicted, or past a deadline, before its container ran
            state, reason = "terminated", f"{status.get('reason', 'Failed')}: {status.get('message', '')}".rstrip(": ")
    return PodState(meta.get("name", ""), spec.get("hostname") or meta.get("name", ""), role, int(index),
                    status.get("phase", ""), state, reason, code, spec.get("nodeName", ""), status.get("podIP", ""),
                    bool(meta.get("deletionTimestamp")),
                    (meta.get("annotations") or {}).get(KILLED_ANNOTATION) == KILLED)


def describe(p: PodState) -> str:
    """A pod's state in a few words, for ``status``."""
    if p.state == "terminated":
        return f"exited {p.exit_code if p.exit_code is not None else '?'}" + (
            f" ({p.reason})" if p.reason not in ("", "Completed", "Error") else "")
    if p.state == "running":
        return "running" + (" (deleting)" if p.deleting else "")
    return f"{p.phase.lower() or 'pending'}" + (f": {p.reason}" if p.reason else "")


def proc_name(p: PodState) -> str:
    return f"{'pserver' if p.role == PSERVER else 'trainer'}.{p.index}"


def find_pod(pods: List[PodState], text: str) -> PodState:
    """A pod by its hostname (``fit-trainer-0``), pod name, or process name (``trainer.0``)."""
    for p in pods:
        if text in (p.hostname, p.name, proc_name(p)):
            return p
    names = ", ".join(f"{p.hostname} ({proc_name(p)})" for p in pods) or "none"
    raise UsageError(f"no pod {text!r} in this job; its pods: {names}")


# -- kill, status, logs of a job on Kubernetes ------------------------------------------------------------------

def for_job(namespace: str, job_name: str, job_id: str = "", jobset: bool = False) -> Kubectl:
    """The commands for job ``job_name``: by its unique id when the run that started it remembered one."""
    return Kubectl(namespace, f"{LABEL_ID}={job_id}" if job_id else selector(object_name(job_name)),
                   kinds=kinds(jobset))


@dataclass(frozen=True)
class Owner:
    """An object already in the namespace under one of a job's names, and the job it belongs to."""

    what: str  # kind/name
    job: str  # the paddle-cluster job name and id on it, or "" when paddle-cluster did not create it
    job_id: str


def owners(text: str) -> List[Owner]:
    """The objects of ``Kubectl.get_named``'s JSON."""
    try:
        items = items_of(json.loads(text or "{}"))
    except ValueError:
        raise ClusterError(f"kubectl get printed no JSON: {text[:200]!r}") from None
    out = []
    for i in items:
        labels = (i.get("metadata") or {}).get("labels") or {}
        kind = {"Job": "job.batch", "JobSet": "jobset.jobset.x-k8s.io"}.get(i.get("kind", ""),
                                                                          str(i.get("kind", "")).lower())
        out.append(Owner(f"{kind}/{i['metadata']['name']}", labels.get(LABEL_JOB, ""), labels.get(LABEL_ID, "")))
    return out


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
    for p in pods:
        if not p.state:  # never ran: no log
            continue
        try:
            text = k.run(k.logs(p.name, follow=False), timeout=120)
        except ClusterError:
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
                   if n.endswith(".log") and n.split(".")[0] in _ROLES)
    rows = []
    for n in names:
        with open(os.path.join(log_dir, n), encoding="utf-8", errors="replace") as f:
            last = ([ln.rstrip("\n") for ln in f if ln.strip()] or [""])[-1]
        role = _ROLES[n.split(".")[0]]
        rows.append(ProcRow("-", "-", "-", n[:-len(".log")], role, None, "ended (pod deleted)", "", last,
                            f"log in {log_dir}/{n}"))
    return sorted(rows, key=lambda r: (r.role != PSERVER, r.name))


def pod_row(p: PodState, last_line: str) -> ProcRow:
    """A pod as a row of ``status``: its process runs in a container on another machine, so no pid; the pod."""
    return ProcRow(p.hostname, p.node_name, p.pod_ip, proc_name(p), p.role, None, describe(p), "", last_line,
                   f"pod/{p.name}")


def job_status(k: Kubectl, job_dir: str) -> List[ProcRow]:
    """One row per pod, with the last line of its log; once the pods are gone, one per log saved."""
    rows = []
    for p in sorted(pod_states(k.run(k.get_pods())), key=lambda p: (p.role != PSERVER, p.index)):
        last = last_output(k, p.name) if p.state else ""
        rows.append(pod_row(p, last))
    rows = rows or saved_rows(job_dir)
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
        row = {"name": proc_name(p), "role": p.role, "state": describe(p), "started_at": said.get("started_at"),
               "figures": own, "metrics": said.get("metrics"), "age": None}
        if p.state == "running" and isinstance(at, (int, float)) and now - at < 3 * FIGURES_S:  # a line of late
            # How old the process's own figures were when the line was written (the line: under FIGURES_S old).
            row.update(cpu=said.get("cpu"), rss=said.get("rss"), age=node_top.age(own, at))
        return NodeDoc(p.hostname, p.node_name, {"time": now, "procs": [row]})
    with ThreadPoolExecutor(max_workers=8) as ex:  # a kubectl each, as ``status`` runs them (one after another)
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


# Waiting reasons that do not go away by waiting: the job fails at once instead of at START_TIMEOUT.
FATAL_WAITING = ("InvalidImageName", "CreateContainerConfigError", "CreateContainerError", "ErrImageNeverPull")


def log_events(node: int, proc: str, line: str) -> List[Event]:
    """A line of a pod's log: output, and the entry point's word that the process starts or cannot. A trainer's
    metrics records (printed once it ended) are kept when the job's results are copied, not shown; the figures
    lines for ``top`` neither."""
    if line.startswith(pod_entry.QUIET):
        return []
    out: List[Event] = [m.Log(node, proc, line)]
    if line.startswith(pod_entry.READY):
        out.append(m.Ready(node))
    elif line.startswith(pod_entry.ERROR):
        out.append(m.NotReady(node, line[len(pod_entry.ERROR):]))
    elif "No module named paddle_cluster" in line or "No module named 'paddle_cluster" in line:
        out.append(m.NotReady(node, f"the image cannot run the pod entry point ({line.strip()}): it needs Python 3 "
                               "with numpy and paddle-cluster installed (docs/backends.md: the image)"))
    return out


class PodWatch:
    """Successive ``PodState`` lists -> the events they mean, each once; pure (the backend runs the commands)."""

    def __init__(self, nodes: Dict[Tuple[str, int], int]) -> None:
        self.nodes = nodes  # (role, index) -> node
        self.last: Dict[int, Tuple[str, str]] = {}  # node -> (state, reason) last reported
        self.started: Dict[int, str] = {}  # node -> pod name, once its container ran
        self.exited: Dict[int, int] = {}
        self.killed = False  # a pod was marked by ``kill``: reported once

    def update(self, pods: List[PodState]) -> List[Event]:
        out: List[Event] = []
        seen = set()
        for p in pods:
            node = self.nodes.get((p.role, p.index))
            if node is None:
                continue
            seen.add(node)
            proc = f"{'pserver' if p.role == PSERVER else 'trainer'}.{p.index}"
            if p.killed and not self.killed:  # before its exit: the outcome is the kill, whatever the exit code
                self.killed = True
                out.append(m.Stopping(node, "stopped by paddle-cluster kill", by_kill=True))
            if p.state in ("running", "terminated") and node not in self.started:
                self.started[node] = p.name
                out.append(m.Started(node, proc, 0))
            if p.state == "terminated" and node not in self.exited:
                self.exited[node] = p.exit_code if p.exit_code is not None else 1
                error = "" if p.reason in ("Completed", "Error") else p.reason
                out.append(m.Exited(node, proc, self.exited[node], None, error))
            elif p.state in ("waiting", "") and p.reason and self.last.get(node) != (p.state, p.reason):
                self.last[node] = (p.state, p.reason)
                why = f"pod {p.name}: {p.reason}"
                fatal = p.reason.split(":")[0] in FATAL_WAITING
                out.append(m.NotReady(node, why) if fatal else m.Note(node, why))
        for node, name in self.started.items():
            if node not in seen and node not in self.exited:
                self.exited[node] = -1
                out.append(NodeLost(node, f"pod {name} was deleted while its process ran"))
        return out


def own_by_owners(kubectl: Kubectl, job: K8sJob) -> None:
    """The Secret, the Service and the ConfigMap belong to the Jobs (two, or the trainers' alone) or the JobSet, so
    Kubernetes deletes them with those (ttlSecondsAfterFinished, or anyone deleting them) -- launcher or not. Their
    uids exist only now."""
    owning = job.owner_names()
    items = items_of(json.loads(kubectl.run(kubectl.get_named(owning)) or "{}"))
    refs = [{"apiVersion": i["apiVersion"], "kind": i["kind"], "name": i["metadata"]["name"],
             "uid": i["metadata"]["uid"]} for i in items]
    if len(refs) != len(owning):
        raise ClusterError(f"the {'JobSet' if job.jobset else 'Jobs'} of job {job.name} vanished right after they "
                           f"were created; see '{shlex.join(kubectl.get())}'")
    rest = [n for n in job.object_names() if n not in owning]
    kubectl.run(kubectl.patch(rest, {"metadata": {"ownerReferences": refs}}))
