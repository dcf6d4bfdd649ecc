"""The Kubernetes backend: ``run --backend k8s`` applies the manifests of ``render k8s`` with kubectl, turns
what kubectl shows into the events every backend yields, and deletes the job's objects by label at the end.

Each pod is a node of the plan with one process (pserver *i* is node *i*, trainer *j* node *pservers + j*).
Events come from kubectl: ``get pods --watch -o json`` (a container started, waits for a reason, or ended
with an exit code), of the Jobs and Events, and the pods' logs followed through one ``kubectl proxy``
(``logfollow.py``: their output lines, and the entry point's "ready"/"error" lines: ``Ready``/``NotReady``).
Nothing here runs inside the cluster; the pods need no launcher (they finish the job on their own) and ``kill``
deletes them by label.
"""

from __future__ import annotations

import gzip
import json
import os
import queue
import re
import shlex
import subprocess
import tempfile
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, cast

from paddle_cluster.contract import PSERVER, TRAINER
from paddle_cluster.node import messages as m

from ... import dispatch
from ...config import ClusterConfig, override
from ...errors import ClusterError, ConfigError
from ...plan import JobPlan, JobSpec, Topology
from ...top import CallSource
from ..base import (
    EVENTS_MAX,
    Backend,
    BackendHelp,
    BackendOption,
    Description,
    Event,
    JobRef,
    LiveJob,
    NodeLost,
    Prepared,
    Request,
    Requeued,
)
from . import kubectl as kc
from . import manifests as k8s
from . import pod_options, pods, rights, settings
from .jobwatch import JobWatch
from .kubectl import Kubectl, PodWatch, log_events, owners, pod_states, states_of, watch_events
from .logfollow import LogProxy
from .pod_options import PodOptions
from .pods import save_results
from .settings import K8sSettings

RETRY_S = 2.0  # between a watch that ended and the next
QUEUE_ASK_S = 2.0  # between two questions for the job's place in its Kueue queue


@dataclass(frozen=True)
class K8sOptions:
    """What ``run --backend k8s`` adds to a job: where and from which image (flags, else the config)."""

    image: str
    namespace: str = k8s.DEFAULT_NAMESPACE
    pservers: Optional[int] = None
    trainers: Optional[int] = None
    pods: PodOptions = PodOptions()

    @classmethod
    def from_config(cls, cfg: ClusterConfig, image: Optional[str] = None, namespace: Optional[str] = None,
                    pservers: Optional[int] = None, trainers: Optional[int] = None,
                    pod: Optional[Dict[str, Any]] = None) -> K8sOptions:
        """The options given (``pod``: the pod options, ``pod_options.pod_flags``), else the config's K8S_* keys; a
        wrong value is named as the flag, or as the key in its file, or as the default."""
        pod = dict(pod or {})
        given = {name: (flag, v) for name, flag, v in (
            ("k8s_image", "--image", image), ("k8s_namespace", "--namespace", namespace),
            ("k8s_pserver_requests", "--pserver-requests", pod.get("pserver_requests")),
            ("k8s_trainer_requests", "--trainer-requests", pod.get("trainer_requests"))) if v}
        cfg = override(cfg, given, settings.KEYS) if given else cfg
        mine = K8sSettings.of(cfg)
        if not mine.image:
            raise ConfigError("--image", None, "give the image holding the workspace (--image IMAGE or K8S_IMAGE "
                              "in the config; docs/backends.md says how to build it)")
        if any(c.isspace() for c in mine.image):
            raise settings.IMAGE.error(cfg, "give the image holding the workspace, e.g. registry.example/ml/job:1")
        if not k8s.namespace_ok(mine.namespace):
            raise settings.NAMESPACE.error(cfg, k8s.NAMESPACE_FIX)
        keys = ("--pserver-requests" if pod.get("pserver_requests") else "K8S_PSERVER_REQUESTS",
                "--trainer-requests" if pod.get("trainer_requests") else "K8S_TRAINER_REQUESTS")
        pod["pserver_requests"] = mine.pserver_requests or ""
        pod["trainer_requests"] = mine.trainer_requests or ""
        try:
            pods = PodOptions.parse(**pod, keys=keys)
        except ConfigError as e:
            if e.key in keys[:2] and not e.key.startswith("-"):  # a K8S_* key: name its file too
                raise cfg.error(e.key.lower(), e.fix) from None
            raise
        return cls(mine.image, mine.namespace, pservers, trainers, pods)

    def topology(self, spec: JobSpec, packed: bool, jobset: bool) -> Tuple[str, Topology]:
        """``spec``'s Kubernetes name and topology with these options (``k8s.topology``)."""
        return k8s.topology(spec.cfg, job_name=spec.name, namespace=self.namespace, pservers=self.pservers,
                            trainers=self.trainers, workspace=spec.workspace or k8s.DEFAULT_WORKSPACE, pods=self.pods,
                            packed=packed, jobset=jobset, resume_from=spec.resume_from or "")

    def job(self, plan: JobPlan, name: str, workspace_pack: bytes, jobset: bool) -> k8s.K8sJob:
        return k8s.job_of(plan, name=name, namespace=self.namespace, image=self.image, pods=self.pods,
                          workspace_pack=workspace_pack, jobset=jobset)


def packed_workspace(directory: str) -> bytes:
    """``--job_dispatch_package``: the workspace as a gzipped tar small enough for a ConfigMap, packed in a
    temporary directory (``render`` writes nothing; and a ConfigMap's workspace is small: no cache to keep)."""
    with tempfile.TemporaryDirectory(prefix="paddle-cluster-pack-") as tmp:
        pkg = dispatch.pack_workspace(directory, tmp)
        with open(pkg.path, "rb") as f:
            data = gzip.compress(f.read(), mtime=0)
    if len(data) > k8s.PACK_LIMIT - 4096:  # room for the ConfigMap's own fields
        raise ConfigError("--job_dispatch_package", directory, f"packs to {len(data) / 1024:.0f} KiB, over the "
                          f"{k8s.PACK_LIMIT // 1024} KiB a ConfigMap holds: build the workspace into the image and "
                          "give --job_workspace PATH inside it (docs/backends.md), or leave large data out of it")
    return data


def pod_of_role(node: str, role: str) -> None:
    """``logs NODE --role ROLE``: a pod runs one process, so a ROLE other than the pod's is an error, not ignored."""
    m_ = re.search(r"(pserver|trainer)[.-]\d+(-[a-z0-9]{5})?$", node)
    if role != "all" and m_ and m_.group(1) != role:
        raise ClusterError(f"logs {node} --role {role}: {node} is a {m_.group(1)}'s pod, and a pod runs one process: "
                           f"leave --role out, or name a {role} (logs {role}.0)")


@dataclass(frozen=True)
class K8sPrepared(Prepared):
    """What ``prepare`` named: the job's Kubernetes name (``preview`` too), each pod's node (``(role, index) ->
    node``) and each role's Kubernetes Job."""

    name: str = ""
    nodes: Dict[Tuple[str, int], int] = field(default_factory=dict)
    job_names: Dict[str, str] = field(default_factory=dict)  # role -> its Job's name


@dataclass(frozen=True)
class K8sRequest(Request):
    """The job's objects: ``manifests``, the YAML stream of ``job`` that ``kubectl create -f -`` is given."""

    job: k8s.K8sJob
    manifests: str


class K8sBackend(Backend):
    name = "k8s"
    help = BackendHelp("Kubernetes Jobs", "the Kubernetes manifests",
                       "whether kubectl may do in the namespace all that run, status, logs and kill do (kubectl auth "
                       "can-i)", render_hint="Apply with: paddle-cluster render k8s --image IMAGE | kubectl apply -f -",
                       node_hint="a pod: fit-trainer-0 or trainer.0, or all: every pod of --role")
    needs_workspace = False  # it is in the image
    needs_hosts = False  # one pod per process: HOSTS only multiplies the per-node counts
    detach = ""
    conf_keys = settings.KEYS
    options = (
        BackendOption("--image", "image", "The image holding Python 3, numpy, paddle-cluster and the workspace "
                      "(docs/backends.md; default: K8S_IMAGE).", metavar="IMAGE"),
        BackendOption("--namespace", "namespace", "The namespace (default: K8S_NAMESPACE, default).", metavar="NS",
                      check=True),
        BackendOption("--pservers", "pservers", "Pserver pods (default: HOSTS x PSERVERS_PER_NODE; no HOSTS: "
                      "PSERVERS_PER_NODE).", int, "N", 1),
        BackendOption("--trainers", "trainers", "Trainer pods (default: HOSTS x TRAINERS_PER_NODE; no HOSTS: "
                      "TRAINERS_PER_NODE).", int, "M", 1),
        *pod_options.OPTIONS,
        BackendOption("--jobset", "jobset", "One JobSet (jobset.x-k8s.io/v1alpha2: its controller must be "
                      "installed) instead of a Service and two Jobs: one success and failure policy, one Kueue "
                      "workload (--queue implies it; check: its rights).", bool, check=True),
        BackendOption("--pending-timeout", "pending_timeout", "run: fail the job once the cluster has held it this "
                      "long for a known reason (a pod it cannot schedule yet, no room in the quota, a Kueue queue, "
                      "an image being pulled), naming that reason (default: wait as long as the cluster says it "
                      "makes progress).", int, "S", 1),
    )

    @classmethod
    def create(cls, cfg: ClusterConfig, opts: Mapping[str, Any], detach: bool = False) -> K8sBackend:
        be = cls(cfg, K8sOptions.from_config(cfg, opts.get("image"), opts.get("namespace"), opts.get("pservers"),
                                             opts.get("trainers"), pod_options.pod_flags(opts)))
        be.detached, be.jobset = detach, bool(opts.get("jobset"))
        be.pending_timeout = opts.get("pending_timeout")
        return be

    def preview(self, spec: JobSpec, say: Callable[[str], None]) -> K8sPrepared:
        name, topology = self.opts.topology(spec, bool(spec.dispatch_dir), self.jobset)
        if self.cfg.is_builtin_default and None in (self.opts.pservers, self.opts.trainers):
            say(f"no conf.py or cluster.yaml found: {topology.pservers} pserver(s) and {topology.trainers} trainer(s), "
                "the built-in default's counts (--pservers/--trainers set them)")
        return K8sPrepared(topology, (), (), name)

    def render(self, plan: JobPlan, prepared: Prepared) -> K8sRequest:
        spec = plan.spec
        pack = packed_workspace(spec.dispatch_dir) if spec.dispatch_dir else b""
        job = self.opts.job(plan, cast(K8sPrepared, prepared).name, pack, self.jobset)  # prepared by this backend
        text = k8s.render(job)
        return K8sRequest(plan, (("", text),),  # its own comments say what it is
                          {"backend": self.name, "namespace": job.namespace, "job_id": job.env.job_id,
                           **({"jobset": "1"} if job.jobset else {})}, prepared, job, text)

    @classmethod
    def _kubectl(cls, job: JobRef) -> Kubectl:
        namespace = job.handle.get("namespace") or K8sSettings.of(job.cfg).namespace
        return kc.for_job(namespace, job.name, job.handle.get("job_id", ""), bool(job.handle.get("jobset")))

    @classmethod
    def describe(cls, job: JobRef) -> Description:
        return Description("", pods.job_status(cls._kubectl(job), job.cfg.job_dir(job.name)))

    @classmethod
    def logs(cls, job: JobRef, node: str, role: str, lines: int, follow: bool, out: Callable[[str], None]) -> None:
        pod_of_role(node, role)
        pods.stream_logs(cls._kubectl(job), node, role, lines, follow, out, job.cfg.job_dir(job.name))

    @classmethod
    def cancel(cls, job: JobRef, say: Callable[[str], None]) -> List[str]:
        k = cls._kubectl(job)
        return pods.kill_job(k, job.cfg.job_dir(job.name)) or [f"nothing of job {job.name} in namespace {k.namespace}"]

    @classmethod
    def check(cls, cfg: ClusterConfig, opts: Mapping[str, Any]) -> List[rights.PermissionRow]:
        return rights.check(override(cfg, {"k8s_namespace": ("--namespace", opts["namespace"])}, settings.KEYS)
                            if opts.get("namespace") else cfg, jobset=bool(opts.get("jobset")),
                            queue=bool(opts.get("queue")))

    @classmethod
    def figures(cls, job: JobRef) -> CallSource:
        """``top``: the pods, each with the figures its entry point last wrote into its log (no agent, no exec)."""
        k = cls._kubectl(job)
        return CallSource(lambda: pods.figures(k))

    @classmethod
    def outputs(cls, job: JobRef) -> Any:
        raise ClusterError(cls.outputs_at(job.cfg, job.name))

    @classmethod
    def outputs_at(cls, cfg: ClusterConfig, name: str) -> str:
        return ("on Kubernetes a pod's output/ is in its workspace, which goes with the pod (fetch cannot reach "
                "it): have trainer 0 write its results to a volume it mounts, or copy them with `kubectl cp "
                "<namespace>/<pod>:<workspace>/output DIR` while the pod runs (docs/backends.md, Kubernetes: Outputs)")

    @classmethod
    def metrics(cls, job: JobRef) -> Dict[str, Any]:
        """The metrics the job's pods left, saved on this machine before they were deleted."""
        from paddle_cluster.node import jobdir

        found = jobdir.metrics(job.cfg.job_dir(job.name))
        if not any(found.values()):
            raise ClusterError(f"job {job.name} has no metrics saved in {job.cfg.job_dir(job.name)}/log (they are "
                               "saved when run or kill deletes the job's pods)")
        return found

    def __init__(self, cfg: ClusterConfig, opts: K8sOptions, binary: str = "kubectl") -> None:
        self.cfg, self.opts = cfg, opts
        self.binary = binary
        self.detached = False  # run --detach: create the objects, follow nothing
        self.jobset = False  # render k8s --jobset
        self.pending_timeout: Optional[int] = None  # run --pending-timeout

    # -- preparing ------------------------------------------------------------------------------------
    def prepare(self, spec: JobSpec, say: Callable[[str], None]) -> K8sPrepared:
        for flag, given, why in (
                ("--max_restarts", spec.max_restarts, "a failed pod fails its Job; restarts from checkpoints need "
                 "the ssh backend"),
                ("--elastic", spec.elastic, "a failed trainer pod fails the trainer Job, which stops the others")):
            if given:
                raise ConfigError(flag, given, f"not available with BACKEND k8s: {why}")
        opts = self.opts  # spec.cfg below: the settled config (launch/entry.py chose the pserver, --entry, ports)
        if spec.dispatch_dir and spec.workspace:
            raise ConfigError("--job_dispatch_package", spec.dispatch_dir, "give it or --job_workspace, not both")
        k8s_name, topology = opts.topology(spec, bool(spec.dispatch_dir), self.jobset)
        jobset = self.jobset or bool(opts.pods.queue)
        kubectl = Kubectl(opts.namespace, "", self.binary, kc.kinds(jobset))
        if not rights.first_answer(kubectl, "--backend k8s"):  # the first question: a context that does not answer
            raise ClusterError(f"kubectl says you {rights.refusal(kubectl, rights.NEEDS[0])}")
        if jobset:
            self._need_jobsets(kubectl)
        for need in rights.NEEDS[1:]:  # the others run needs at once (check asks for them all)
            if need.at_run and not kubectl.may(need.verb, need.resource):
                raise ClusterError(f"kubectl says you {rights.refusal(kubectl, need)}")
        # Each pod's node, as the plan numbers them (a pod per node: one process each).
        nodes = {(role, k): node for role, numbering in ((PSERVER, topology.pserver_ids()),
                                                         (TRAINER, topology.trainer_ids()))
                 for node, ids in enumerate(numbering) for k in ids}
        job_names = {r: k8s.job_name(k8s_name, r, jobset) for r in (PSERVER, TRAINER)}
        names = tuple(f"{job_names[r]}-{i}" for r, i in sorted(nodes, key=nodes.__getitem__))
        say(f"job {k8s_name}: {topology.pservers} pserver pod(s), {topology.trainers} trainer pod(s) of "
            f"{opts.image} in namespace {opts.namespace}")
        return K8sPrepared(topology, names, tuple(f"pod {n}" for n in names), k8s_name, nodes, job_names)

    def _need_jobsets(self, kubectl: Kubectl) -> None:
        """The JobSet form needs JobSet's API (its controller) in the cluster, and the right to create JobSets."""
        listed = kubectl.run(kubectl.api_resources(k8s.JOBSET_API.split("/")[0])).split()
        if k8s.JOBSET_RESOURCE not in listed:
            why = "--queue NAME" if self.opts.pods.queue else "--jobset"
            raise ConfigError(why.split()[0], self.opts.pods.queue or True, "needs JobSet (jobset.x-k8s.io), which "
                              "this cluster does not offer ('kubectl api-resources --api-group=jobset.x-k8s.io' lists "
                              "nothing): Kueue admits a job's pservers and trainers as one workload only as a "
                              "JobSet; install JobSet (github.com/kubernetes-sigs/jobset) or leave the option out")
        need = rights.JOBSET_NEEDS[0]
        if not kubectl.may(need.verb, need.resource):
            raise ClusterError(f"kubectl says you {rights.refusal(kubectl, need)}")

    # -- running --------------------------------------------------------------------------------------
    def submit(self, request: Request, say: Callable[[str], None]) -> K8sLiveJob:
        """Create the request's objects (``kubectl create`` of its manifests) and follow them; detached, return
        once created: the pods end the job on their own (fail-fast, the pservers once the trainers are gone), and
        ``status``/``logs``/``kill`` find it by its id."""
        job = K8sLiveJob(cast(K8sRequest, request), self.cfg, self.binary, say,  # rendered by this backend
                         self.pending_timeout)
        try:
            job.start(self.detached)
        except BaseException:
            job.stop(self.cfg.kill_grace)  # what it created, by the run's unique id
            job.close()
            raise
        return job


class K8sLiveJob(LiveJob):
    """One job's objects, created and followed: a watch of its pods, Jobs and events, and the log of each pod that
    ran (through one ``kubectl proxy``), turned into the events every backend yields."""

    def __init__(self, request: K8sRequest, cfg: ClusterConfig, binary: str, say: Callable[[str], None],
                 pending_timeout: Optional[float] = None) -> None:
        super().__init__(request)
        prepared = cast(K8sPrepared, request.prepared)
        self.k8s_request, self.cfg, self.say = request, cfg, say
        self.job = job = request.job
        self.job_dir = request.plan.spec.job_dir
        self.kubectl = Kubectl(job.namespace, job.selector, binary, kc.kinds(job.jobset))
        # Bounded: a pod printing faster than the launcher shows it waits (its log stream is not read on).
        self.events: queue.Queue[Event] = queue.Queue(maxsize=EVENTS_MAX)
        self._closing = False  # stopping: an event that does not fit is dropped, never waited for
        nodes = prepared.nodes
        self.watch = PodWatch(nodes)
        self.jobwatch = JobWatch({name: [n for (r, _), n in nodes.items() if r == role]
                                  for role, name in prepared.job_names.items()},
                                 lambda p: nodes.get((p.role, p.index)), job.pods.queue, pending_timeout)
        self.followers: Dict[int, threading.Thread] = {}  # node -> the thread reading its pod's log
        self.stale_followers: List[threading.Thread] = []  # of pods Kueue's eviction stopped
        self.proxy: Optional[LogProxy] = None
        self._lock = threading.Lock()
        self._state = threading.Lock()
        self._polling: Optional[threading.Event] = None
        self._watchers: List[subprocess.Popen] = []
        self.readied: set = set()  # nodes whose entry point said ready or not

    def start(self, detached: bool) -> None:
        request, job = self.k8s_request, self.job
        taken = owners(self.kubectl.run(self.kubectl.get_named(job.object_names())))
        if taken:
            whose = {f"job {o.job} (id {o.job_id})" if o.job else "not created by paddle-cluster" for o in taken}
            raise ClusterError(f"namespace {job.namespace} already has {', '.join(o.what for o in taken)} "
                               f"({'; '.join(sorted(whose))}): nothing was changed; choose another --job_name, or "
                               f"stop that job first (paddle-cluster kill --job_name {job.name})")
        # Marked started before creating: a half-created job is deleted too -- by its unique id, so only what
        # this run created. `create`, not `apply`: an object of that name made meanwhile is an error, not replaced.
        self._polling = done = threading.Event()
        self.kubectl.run(self.kubectl.create(), stdin=request.manifests)
        kc.own_by_owners(self.kubectl, job)
        if detached:
            self._polling = None  # created: from now on the cluster runs and ends the job on its own
            ttl = job.pods.ttl
            self.say(f"job {request.plan.name} created in namespace {job.namespace} (id {job.env.job_id})"
                     + (f"; Kubernetes deletes it {ttl} s after it ends" if ttl is not None else ""))
            return
        self.proxy = LogProxy(self.kubectl.binary)  # the pods' logs: one process for the whole job
        for kind, selected, update in (("pods", True, self._pods), ("jobs.batch", True, self.jobwatch.jobs),
                                       ("events", False, self.jobwatch.events)):
            threading.Thread(target=self._watch, args=(done, kind, selected, update), daemon=True,
                             name=f"k8s-{kind}").start()
        if job.pods.queue:
            threading.Thread(target=self._watch_queue, args=(done,), daemon=True, name="k8s-queue").start()

    def log_of(self, node: int, proc: m.ProcPlan) -> str:
        return f"{self.job_dir}/log/{proc.name}.log"  # saved there before the pods are deleted

    def unstopped(self, nodes: List[int]) -> str:
        return (f"pods left after deleting the job's objects: {', '.join(self.names[i] for i in nodes)}; see "
                f"'{shlex.join(self.kubectl.get())}'")

    def _pods(self, docs: List[Dict[str, Any]]) -> List[Event]:
        states = states_of(docs)
        events = self.watch.update(states)
        if any(isinstance(e, NodeLost) or (isinstance(e, m.Exited) and e.code and any(p.deleting for p in states))
               for e in events):
            # Pods deleted by their Job's controller (past --deadline, its Job failed, Kueue evicted it): the Job's
            # or Kueue's reason, not the exit code of a pod it stopped, is why the job ended -- whichever watch
            # speaks first. Kueue's eviction does not end it: those pods are forgotten, the next ones followed.
            why = self._why_stopped_now()
            if self._requeued(why):
                events = self.watch.update(states)
            events = why + events
        return events + self.jobwatch.pods(docs)

    def _requeued(self, events: List[Event]) -> bool:
        """(Holding ``_state``.) Whether ``events`` say the cluster took the job back (``Requeued``): then the pods
        seen so far, and their log followers, are forgotten."""
        if not any(isinstance(e, Requeued) for e in events):
            return False
        self.watch.forget()
        self.readied.clear()
        with self._lock:
            self.stale_followers += self.followers.values()
            self.followers.clear()
        return True

    def _why_stopped_now(self) -> List[Event]:
        out: List[Event] = []
        kinds = [("jobs.batch", True)] + ([(rights.WORKLOADS, False)] if self.job.pods.queue else [])
        for kind, selected in kinds:
            try:
                docs = kc.items_of(json.loads(self.kubectl.run(self.kubectl.list_of(kind, selected), timeout=30)
                                              or "{}"))
            except (ClusterError, ValueError):
                continue
            out += (self.jobwatch.jobs(docs) if kind == "jobs.batch" else
                    self.jobwatch.workloads(docs, [self.job.name, *self.jobwatch.job_nodes]))
        return out

    def _watch(self, done: threading.Event, kind: str, selected: bool,
               update: Callable[[List[Dict[str, Any]]], List[Event]]) -> None:
        """The job's objects of ``kind`` as they change (``update`` gets them all, and says what that means): a
        listing, then ``kubectl get --watch``; again after a problem (a watch the API server ended, a lost
        connection), the listing catching up on what the watch missed."""
        problem = ""
        while not done.is_set():
            try:
                objs = {o["metadata"]["name"]: o for o in kc.items_of(json.loads(self.kubectl.run(
                    self.kubectl.list_of(kind, selected), timeout=60) or "{}"))}
                self._update(update, objs)
                w = subprocess.Popen(self.kubectl.watch(kind, selected), stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                self._watchers.append(w)
                assert w.stdout is not None and w.stderr is not None
                expired = ""
                for ev in watch_events(w.stdout):
                    if ev.get("type") == "ERROR":  # the API server ended the watch (410: its history moved on)
                        expired = ev["object"].get("message", "") or "ended"
                        w.terminate()  # (kubectl would wait for more)
                        break
                    name = ev["object"].get("metadata", {}).get("name", "")
                    if ev.get("type") == "DELETED":
                        objs.pop(name, None)
                    else:
                        objs[name] = ev["object"]
                    self._update(update, objs)
                err = w.stderr.read().strip()
                code = w.wait()
                if "too old resource version" in expired:
                    problem = ""
                    continue  # as any watcher does after a 410: list again at once, then watch from there
                if expired:
                    raise ClusterError(f"kubectl get {kind} --watch: {expired}")
                if code not in (0, -15) and not done.is_set():
                    raise ClusterError(f"kubectl get {kind} --watch: {(err.splitlines() or ['ended'])[-1]}")
                problem = ""
            except (ClusterError, ValueError) as e:
                if str(e) != problem and not done.is_set():  # once per distinct problem, not every retry
                    problem = str(e)
                    self._put(m.Note(0, f"cannot follow the job's {kind}: {e}"))
            done.wait(RETRY_S)

    def _watch_queue(self, done: threading.Event) -> None:
        """Kueue's verdict on the job (its Workload's conditions) and, while Kueue holds it, its place in line from
        Kueue's visibility API, every ``QUEUE_ASK_S``; a cluster without that API (before Kueue 0.9, or not
        installed) is said once, then not asked again."""
        owners = [self.job.name, *self.jobwatch.job_nodes]  # the JobSet, or a Job
        visible, readable = True, True
        while not done.wait(QUEUE_ASK_S):
            if readable:
                try:
                    docs = kc.items_of(json.loads(self.kubectl.run(self.kubectl.list_of(rights.WORKLOADS, False),
                                                                   timeout=30) or "{}"))
                    with self._state:
                        events = self.jobwatch.workloads(docs, owners)
                        self._requeued(events)
                    self._handle(events)
                except (ClusterError, ValueError) as e:
                    readable = False
                    self._put(m.Note(0, f"cannot read Kueue's Workloads ({e}): a queue that cannot admit the job "
                                        "is not said; waiting without it"))
            with self._state:
                queue = self.jobwatch.queued_for()
            if not queue or not visible:
                continue
            try:
                summary = json.loads(self.kubectl.run(self.kubectl.pending_workloads(queue), timeout=30) or "{}")
            except (ClusterError, ValueError) as e:
                visible = False
                self._put(m.Note(0, f"Kueue's visibility API does not say the job's place in queue {queue} ({e}); "
                                    "waiting without it"))
                continue
            with self._state:
                events = self.jobwatch.in_line(summary, owners)
            self._handle(events)

    def _update(self, update: Callable[[List[Dict[str, Any]]], List[Event]], objs: Dict[str, Any]) -> None:
        with self._state:  # three watches feed the same state
            events = update(list(objs.values()))
        self._handle(events)

    def _handle(self, events: List[Event]) -> None:
        for ev in events:
            if isinstance(ev, m.Started):
                self._follow(ev.node, self.watch.started[ev.node], ev.proc)
            if isinstance(ev, m.Exited):
                # Its last lines first: the failure report quotes them.
                self._follow(ev.node, self.watch.started[ev.node], ev.proc)
                self.followers[ev.node].join(timeout=10)
                if ev.node not in self.readied:  # ended before the entry point said ready or not
                    self._put(m.NotReady(ev.node, f"pod {self.watch.started[ev.node]} exited {ev.code} "
                                                        "before its process started"
                                                        + (f" ({ev.error})" if ev.error else "")))
            self._put(ev)

    def _follow(self, node: int, pod: str, proc: str) -> None:
        with self._lock:
            if node in self.followers:
                return
            t = threading.Thread(target=self._read_logs, args=(node, proc, pod), daemon=True, name=f"logs-{pod}")
            self.followers[node] = t
            t.start()

    def _read_logs(self, node: int, proc: str, pod: str) -> None:
        assert self.proxy is not None
        os.makedirs(os.path.join(self.job_dir, "log"), exist_ok=True)
        with open(pods.followed_copy(self.job_dir, pod), "a", encoding="utf-8") as copy:  # saved with the results
            try:
                self._copy_log(node, proc, pod, copy)
            except ClusterError as e:
                self._put(m.Note(node, f"the log of pod/{pod}: {e}"))

    def _copy_log(self, node: int, proc: str, pod: str, copy: Any) -> None:
        assert self.proxy is not None
        for n, raw in enumerate(self.proxy.follow(self.kubectl.namespace, pod)):
            copy.write(raw if raw.endswith("\n") else raw + "\n")
            copy.flush()
            if n == 0 and pods.began_rotated([raw]):  # followed late: its process ran, the kubelet rotated
                self.readied.add(node)
                self._put(m.Note(node, f"pod/{pod}: the beginning of its log was rotated away on its node before it "
                                       "was followed"))
            for ev in log_events(node, proc, raw.rstrip("\n")):
                if isinstance(ev, (m.Ready, m.NotReady)):
                    if self.followers.get(node) is not threading.current_thread():
                        continue  # a pod Kueue's eviction stopped: the node's next pod says its own
                    self.readied.add(node)
                self._put(ev)

    def _put(self, ev: Event) -> None:
        while True:
            try:
                self.events.put(ev, timeout=0.2)
                return
            except queue.Full:
                if self._closing:
                    return

    def next_event(self, timeout: float) -> Optional[Event]:
        with self._state:
            due = self.jobwatch.due()
        for ev in due:
            self._put(ev)
        try:
            return self.events.get(timeout=timeout)
        except queue.Empty:
            return None

    def holding(self) -> bool:
        with self._state:
            return self.jobwatch.holding()

    def why_waiting(self) -> str:
        with self._state:
            return self.watch.why_waiting()

    def request_stop(self, grace: float) -> None:
        if self._polling is None:
            return
        argvs = [self.kubectl.delete(wait=False)] + ([self.kubectl.kill_pods()] if grace == 0 else [])
        for argv in argvs:  # in the background: this may run in a signal handler
            subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def stop(self, grace: float) -> List[int]:
        """Delete the job's objects and wait until they and their pods are gone; the nodes whose pods remain."""
        if self._polling is None:
            return []
        self._polling.set()
        self._closing = True
        for w in self._watchers:
            if w.poll() is None:
                w.terminate()
        if grace == 0:
            self.request_stop(0)
        try:
            if grace:  # the logs and metrics first: they go with the pods
                states = pod_states(self.kubectl.run(self.kubectl.get_pods()))
                if self.proxy is not None:  # the one following the pods
                    saved = save_results(self.kubectl, self.proxy, states, self.job_dir)
                else:
                    with LogProxy(self.kubectl.binary) as proxy:
                        saved = save_results(self.kubectl, proxy, states, self.job_dir)
                if saved:
                    self.say(f"logs and metrics of {len(saved)} pod(s) saved in {self.job_dir}/log")
            self.kubectl.run(self.kubectl.delete(wait=True), timeout=self.cfg.kill_grace + 120)
            left = pod_states(self.kubectl.run(self.kubectl.get_pods()))
        except ClusterError as e:
            self._put(m.Note(0, f"deleting the job's objects: {e}"))
            return list(range(len(self.names)))
        self._polling = None
        return sorted({self.watch.nodes[(p.role, p.index)] for p in left if (p.role, p.index) in self.watch.nodes})

    def complete_steps(self, root: str, pservers: Dict[int, List[int]]) -> List[List[int]]:
        raise ClusterError("restarts from checkpoints are not available with BACKEND k8s")

    def close(self) -> None:
        self._closing = True
        for w in self._watchers:
            if w.poll() is None:
                w.terminate()
                w.wait(timeout=5)
        if self.proxy is not None:
            self.proxy.close()  # which ends every log stream
        with self._lock:
            for t in [*self.followers.values(), *self.stale_followers]:
                t.join(timeout=2)
