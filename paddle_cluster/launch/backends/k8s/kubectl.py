"""The ``kubectl`` command lines a Kubernetes job needs, as data, and what they print, as typed values (pod
states, and the events they mean: ``PodWatch``).

Every command names the job's namespace and label selector, so it only ever touches that job's objects.
``Kubectl.run`` is the one place a command is executed; a failure becomes a ``ClusterError`` carrying
kubectl's own last words.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple

from paddle_cluster.contract import PSERVER, TRAINER
from paddle_cluster.node import messages as m
from paddle_cluster.node import pod as pod_entry

from ...errors import ClusterError, UsageError
from ..base import Event, NodeLost
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
ROLES = {"pserver": PSERVER, "trainer": TRAINER}
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
    role = ROLES.get((meta.get("labels") or {}).get(LABEL_ROLE, ""))
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


def pod_summary(p: PodState) -> str:
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
        self.waiting: Dict[int, Tuple[str, str]] = {}  # node -> (pod, why) while its container waits to start
        self.said: set = set()  # the waiting reasons said (each once for the whole job)
        self.seen: set = set()  # the names of the pods seen
        self.gone: set = set()  # pods forgotten: stopped when the cluster took the job back (``forget``)

    def forget(self) -> None:
        """The cluster took the job back (Kueue evicted it): the pods seen so far are stopped, their ends are not
        the job's; follow the pods that come next as if nothing had started."""
        self.gone |= self.seen
        for d in (self.last, self.started, self.exited, self.waiting):
            d.clear()

    def why_waiting(self) -> str:
        """Why the pods not started yet wait, one clause per distinct reason naming its pods ("" if none)."""
        pods: Dict[str, List[str]] = {}
        for name, why in self.waiting.values():
            pods.setdefault(why, []).append(name)
        return "; ".join(f"{why} (pod{'s' if len(names) > 1 else ''} {', '.join(sorted(names))})"
                         for why, names in pods.items())

    def update(self, pods: List[PodState]) -> List[Event]:
        out: List[Event] = []
        seen = set()
        for p in pods:
            node = self.nodes.get((p.role, p.index))
            if node is None or p.name in self.gone:
                continue
            seen.add(node)
            self.seen.add(p.name)
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
                if p.reason.startswith("ImagePullBackOff") and self.waiting.get(node, ("", ""))[1].startswith(
                        "ErrImagePull"):
                    continue  # the kubelet waits before pulling again: the pull's own error says why
                self.waiting[node] = (p.name, p.reason)
                why = f"pod {p.name}: {p.reason}"
                if p.reason.split(":")[0] in FATAL_WAITING:
                    out.append(m.NotReady(node, why))
                elif p.reason not in self.said:  # one line per distinct reason, not per pod nor per back-off
                    self.said.add(p.reason)
                    out.append(m.Note(node, why))
            if p.state in ("running", "terminated"):
                self.waiting.pop(node, None)
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
