"""Kubernetes manifests for a job: ``paddle-cluster render k8s`` and ``run --backend k8s``.

Pure: ``topology`` places the job's pods, ``job_of`` takes what the manifests say from the plan ``build_plan``
made of it, and ``manifests`` turns that ``K8sJob`` into four documents -- a Secret (the job secret, and nothing
else holds it), a headless Service (stable DNS names), and the pservers and trainers as ``batch/v1`` Indexed Jobs
whose completion index is the pserver/trainer id.

Pod ``<job>-pserver-<i>`` gets the hostname ``<job>-pserver-<i>`` (an Indexed Job's pods are named
``<Job name>-<index>``) and, through ``subdomain``, the DNS name ``<job>-pserver-<i>.<job>.<namespace>.svc``:
the pserver endpoints are known before any pod exists, so no pod ever asks the API server for addresses.
Every pod runs ``python -m paddle_cluster.node pod`` (``node/pod.py``), which takes its id from the index.
The workspace is in the image (see docs/backends.md for why).
"""

from __future__ import annotations

import base64
import dataclasses
import math
import re
import shlex
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import yaml

from paddle_cluster.contract import PSERVER, SECRET_VAR, TRAINER, JobEnv

from ...config import ClusterConfig
from ...errors import ConfigError
from ...plan import JobPlan, Place, Topology
from .pod_options import PodOptions

LABEL_JOB = "paddle-cluster/job"
LABEL_ROLE = "paddle-cluster/role"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
JOBSET_API = "jobset.x-k8s.io/v1alpha2"
JOBSET_RESOURCE = "jobsets.jobset.x-k8s.io"
LABEL_ID = "paddle-cluster/job-id"  # unique per run: what cleanup selects, so it never touches another job
SECRET_KEY = "job-secret"
SECRET_DIR = "/var/run/paddle-cluster/secret"  # the Secret, mounted: node/pod.py reads it once
DEFAULT_NAMESPACE = "default"
DEFAULT_WORKSPACE = "/workspace"
PACK_DIR = "/var/run/paddle-cluster/workspace"  # where a pod sees the ConfigMap holding a dispatched workspace
PACK_KEY = "workspace.tar.gz"
CHECKPOINTS = "/checkpoints"  # where the pserver pods mount --checkpoint-pvc; a job's are under <job name>/
PACK_LIMIT = 1 << 20  # what a ConfigMap holds in all
POD_PYTHON = "python3"  # the image's interpreter; the local PYTHON of a config means nothing in a pod

_DNS_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")  # RFC 1035: what a Service name must be
_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")  # RFC 1123 label
_ROLE_WORD = {PSERVER: "pserver", TRAINER: "trainer"}


@dataclass(frozen=True)
class K8sJob:
    """Everything the manifests say about a job, decided once."""

    name: str  # the Kubernetes name of the job: Service, prefix of every object, label value
    namespace: str
    image: str
    env: JobEnv  # the job-wide contract; its pservers are the pods' stable DNS names
    pserver_cmd: Tuple[str, ...]
    trainer_cmd: Tuple[str, ...]
    pods: PodOptions = PodOptions()
    start_timeout: float = 60.0
    kill_grace: float = 5.0
    workspace_pack: bytes = b""  # --job_dispatch_package: the workspace as a gzipped tar, in a ConfigMap
    jobset: bool = False  # one JobSet (jobset.x-k8s.io) instead of a Service and two Jobs

    @property
    def pservers(self) -> int:
        return len(self.env.pservers)

    @property
    def trainers(self) -> int:
        return self.env.trainers

    @property
    def selector(self) -> str:
        """The label selector of every object of this run of the job (``kubectl delete -l``): its unique id,
        so objects of another job that happens to share the name are never selected."""
        return f"{LABEL_ID}={self.env.job_id}"

    def object_names(self) -> List[str]:
        """``kind/name`` of every object the manifests create (``kubectl get`` arguments)."""
        return [f"secret/{self.name}-secret"] + ([] if self.jobset else [f"service/{self.name}"]) + (
            [f"configmap/{self.name}-workspace"] if self.workspace_pack else []) + self.owner_names()

    @property
    def roles(self) -> Tuple[str, ...]:
        """The roles that have pods: both, or the trainers alone (a collective job)."""
        return (PSERVER, TRAINER) if self.pservers else (TRAINER,)

    def owner_names(self) -> List[str]:
        """``kind/name`` of the objects owning the rest: the Jobs (two, or the trainers' alone), or the JobSet."""
        if self.jobset:
            return [f"jobset.jobset.x-k8s.io/{self.name}"]
        return [f"job.batch/{self.job_name(role)}" for role in self.roles]

    def job_name(self, role: str) -> str:
        return job_name(self.name, role, self.jobset)

    def labels(self, role: Optional[str] = None) -> Dict[str, str]:
        out = {"app.kubernetes.io/name": "paddle-cluster", "app.kubernetes.io/managed-by": "paddle-cluster",
               LABEL_JOB: self.name, LABEL_ID: self.env.job_id}
        if role is not None:
            out[LABEL_ROLE] = _ROLE_WORD[role]
        return out


def job_name(name: str, role: str, jobset: bool = False) -> str:
    """The name of the Job running the pods of ``role`` (a JobSet names its Jobs ``<JobSet>-<role>-0``)."""
    return f"{name}-{_ROLE_WORD[role]}" + ("-0" if jobset else "")


def selector(name: str) -> str:
    return f"{LABEL_JOB}={name}"


def pod_host(name: str, namespace: str, role: str, index: int, jobset: bool = False) -> str:
    """The stable DNS name of pod ``index`` of a role: hostname ``<Job name>-<index>``, subdomain the job's
    headless Service. Relative to the cluster domain, which the pods' resolver search path supplies."""
    # A JobSet's pods: <JobSet>-<replicated Job>-<Job index>-<pod index>, one Job per replicated Job here.
    return f"{name}-{_ROLE_WORD[role]}-{'0-' if jobset else ''}{index}.{name}.{namespace}.svc"


def object_name(job_name: str) -> str:
    """``job_name`` as Kubernetes names it: lower case, ``_`` and ``.`` become ``-``."""
    return re.sub(r"[_.]", "-", job_name.lower())


def k8s_name(job_name: str, trainers: int, pservers: int, jobset: bool = False) -> str:
    """``object_name(job_name)``, checked to be usable for every object and pod hostname of the job."""
    name = object_name(job_name)
    # The longest pod hostname, <name>-trainer-<index>, must be a DNS label (63 characters).
    longest = max(len(f"-trainer-{trainers - 1}"), len(f"-pserver-{pservers - 1}")) + (2 if jobset else 0)
    limit = 63 - longest
    if not _DNS_LABEL.fullmatch(name) or len(name) > limit:
        raise ConfigError("--job_name", job_name, "is not usable as a Kubernetes name: use lower-case letters, "
                          f"digits and '-', starting with a letter and ending with a letter or digit, at most "
                          f"{limit} characters")
    return name


NAMESPACE_FIX = "must be a Kubernetes namespace name (lower-case letters, digits and '-', at most 63 characters)"


def namespace_ok(namespace: str) -> bool:
    return bool(_NAMESPACE.fullmatch(namespace)) and len(namespace) <= 63


def topology(cfg: ClusterConfig, *, job_name: str, namespace: str = DEFAULT_NAMESPACE,
             pservers: Optional[int] = None, trainers: Optional[int] = None, workspace: str = DEFAULT_WORKSPACE,
             pods: PodOptions = PodOptions(), packed: bool = False, jobset: bool = False,
             resume_from: str = "") -> Tuple[str, Topology]:
    """The job's Kubernetes name and its topology: one process per pod (pserver *i* is node *i*, trainer *j* node
    *pservers + j*), each pod at its stable DNS name; counts default to the config's (hosts, or one without
    HOSTS, x per-node)."""
    if cfg.collective and pservers:
        raise ConfigError("--pservers", pservers, "this job has no pservers (PSERVERS_PER_NODE = 0, run --collective): "
                          "drop --pservers, or give the job pservers")
    hosts = Topology.hosts(cfg, [""] * max(1, len(cfg.hosts)))  # what the config places on its hosts
    n_ps = hosts.pservers if pservers is None else pservers
    n_tr = hosts.trainers if trainers is None else trainers
    if (n_ps < 1 and not cfg.collective) or n_tr < 1:
        raise ConfigError("--pservers/--trainers", f"{n_ps}/{n_tr}", "a job needs at least one of each")
    if not namespace_ok(namespace):
        raise ConfigError("--namespace", namespace, NAMESPACE_FIX)
    if not workspace.startswith("/"):
        raise ConfigError("--job_workspace", workspace, "must be an absolute path inside the image")
    jobset = jobset or bool(pods.queue)  # Kueue admits a JobSet as one workload, two Jobs as two
    name = k8s_name(job_name, n_tr, n_ps, jobset)
    # A config's ROOT_DIR names a directory of its hosts; the built-in local default's is this machine's.
    root = ClusterConfig(hosts=()).root_dir if cfg.is_builtin_default else cfg.root_dir
    if packed:  # unpacked by each pod into its job-dir volume
        workspace = f"{root}/{name}/workspace"
    if resume_from and not pods.checkpoint_pvc:
        raise ConfigError("--resume_from", resume_from, "a pod's checkpoints go with it: give --checkpoint-pvc CLAIM "
                          "(a PersistentVolumeClaim the pserver pods share) to the job you resume from and to this one")
    if resume_from.startswith("/"):
        raise ConfigError("--resume_from", resume_from, "on Kubernetes give the name of the earlier job whose "
                          f"checkpoints are on --checkpoint-pvc (under {CHECKPOINTS}/<job>)")
    # As on every backend, a resumed job goes on writing where it resumed from.
    ckpt = f"{CHECKPOINTS}/{object_name(resume_from) if resume_from else name}" if pods.checkpoint_pvc else ""
    # Every pod has its own address (the pod resolves the names to the pods' addresses before its process starts:
    # node/pod.py), so each process is the first of its node and takes that one's ports.
    places = [Place(pod_host(name, namespace, PSERVER, i, jobset), 1, 0, POD_PYTHON) for i in range(n_ps)]
    places += [Place(pod_host(name, namespace, TRAINER, j, jobset), 0, 1, POD_PYTHON) for j in range(n_tr)]
    # The config's PADDLE_NIC is an interface of its HOSTS (the built-in local cluster's is lo): a pod binds its own
    # address unless --pod-nic names one of the pods' interfaces (ENV may still set the variables).
    return name, Topology(tuple(places), f"{root}/{name}", workspace, ckpt, nic=pods.nic)


def job_of(plan: JobPlan, *, name: str, namespace: str, image: str, pods: PodOptions = PodOptions(),
           workspace_pack: bytes = b"", jobset: bool = False) -> K8sJob:
    """What the manifests say of ``plan`` (``topology``'s, named ``name``)."""
    if not image or any(c.isspace() for c in image):
        raise ConfigError("--image", image, "give the image holding the workspace, e.g. registry.example/ml/job:1")
    cmds = {p.role: tuple(shlex.split(p.cmd)) for n in plan.nodes for p in n.procs}
    cfg = plan.spec.cfg
    return K8sJob(name, namespace, image, plan.env, cmds.get(PSERVER, ()), cmds[TRAINER], pods, cfg.start_timeout,
                  cfg.kill_grace, workspace_pack, jobset or bool(pods.queue))


def manifests(job: K8sJob) -> List[Dict[str, Any]]:
    """The Secret, the headless Service and the two Indexed Jobs, in the order to apply them."""
    pack = [_workspace(job)] if job.workspace_pack else []
    if job.jobset:
        return [_secret(job), *pack, _jobset(job)]
    return [_secret(job), _service(job), *pack, *(_indexed_job(job, role) for role in job.roles)]


def _jobset(job: K8sJob) -> Dict[str, Any]:
    """The two Jobs as one JobSet: its controller makes the headless Service (``network``), the job succeeds
    when the trainers have (the pservers are then stopped) and fails, stopping everything, when any Job fails;
    Kueue admits it as one workload."""
    replicated = []
    for role in job.roles:
        j = _indexed_job(job, role)
        spec = j["spec"]
        spec.pop("ttlSecondsAfterFinished", None)  # the JobSet's, below
        spec["template"]["spec"].pop("subdomain")  # set by the JobSet controller: the JobSet's name
        replicated.append({"name": _ROLE_WORD[role], "replicas": 1,
                           "template": {"metadata": {"labels": job.labels(role)}, "spec": spec}})
    meta = _meta(job, job.name)
    if job.pods.queue:
        meta["labels"][QUEUE_LABEL] = job.pods.queue
    spec: Dict[str, Any] = {
        "replicatedJobs": replicated,
        "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
        "successPolicy": {"operator": "All", "targetReplicatedJobs": [_ROLE_WORD[TRAINER]]},
        "failurePolicy": {"maxRestarts": 0},
    }
    if job.pods.ttl is not None:
        spec["ttlSecondsAfterFinished"] = job.pods.ttl
    return {"apiVersion": JOBSET_API, "kind": "JobSet", "metadata": meta, "spec": spec}


def _workspace(job: K8sJob) -> Dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(job, f"{job.name}-workspace"),
            "binaryData": {PACK_KEY: base64.b64encode(job.workspace_pack).decode()}}


def to_yaml(docs: List[Dict[str, Any]]) -> str:
    return yaml.safe_dump_all(docs, sort_keys=False, default_flow_style=False)


def render(job: K8sJob) -> str:
    """The manifests as one YAML stream for ``kubectl apply -f -``, with a header saying what it holds."""
    head = (f"# paddle-cluster job {job.name} (id {job.env.job_id}): {job.pservers} pserver(s), {job.trainers} "
            f"trainer(s) in namespace {job.namespace}\n# This stream holds the job secret (in the Secret): pipe it "
            f"into 'kubectl create -f -' rather than keeping it (create, not apply: it refuses to replace objects "
            f"of another job of this name).\n# Delete everything with: kubectl delete -n {job.namespace} "
            f"{JOBSET_RESOURCE if job.jobset else 'jobs.batch,services'},secrets,configmaps -l "
            f"{job.selector}\n")
    return head + to_yaml(manifests(job))


def _meta(job: K8sJob, name: str, role: Optional[str] = None) -> Dict[str, Any]:
    return {"name": name, "namespace": job.namespace, "labels": job.labels(role)}


def _secret(job: K8sJob) -> Dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Secret", "metadata": _meta(job, f"{job.name}-secret"), "type": "Opaque",
            "stringData": {SECRET_KEY: job.env.secret}}


def _ports(job: K8sJob) -> List[Tuple[str, int]]:
    """A pserver pod's ports, named (every pserver pod has its own address, so all use the same ports); without
    pservers, a trainer pod's (MASTER_PORT, which trainer 0 listens on, and its PADDLE_TRAINER_ENDPOINTS port)."""
    env = job.env
    if not env.pservers:
        return [("master", env.master_port), ("trainer", env.trainer_endpoints[0].port)]
    return [(f"dense-{i}" if i < env.ports_num else f"sparse-{i - env.ports_num}", port)
            for i, port in enumerate(env.all_ports(0))]


def _service(job: K8sJob) -> Dict[str, Any]:
    # Headless: no virtual IP, DNS answers with the pods' own addresses; and published before the pods are
    # ready, so a pserver can resolve its own name while it starts.
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(job, job.name),
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                     "selector": {LABEL_JOB: job.name, LABEL_ID: job.env.job_id},
                     "ports": [{"name": n, "port": p, "targetPort": p, "protocol": "TCP"} for n, p in _ports(job)]}}


def _env(job: K8sJob, role: str) -> List[Dict[str, Any]]:
    """The container's environment: the job-wide contract and the role, never the secret. It comes from the
    Secret mounted as a file (``_secret_volume``), which the entry point reads once: in the environment it would
    stay readable in PID 1's ``/proc/1/environ`` by every process of the pod's user, a trainer's too."""
    contract = dataclasses.replace(job.env, role=role).to_environ()
    return [{"name": k, "value": v} for k, v in sorted(contract.items()) if k != SECRET_VAR]


def _secret_volume(job: K8sJob) -> Dict[str, Any]:
    """The Secret as a read-only file of the pod's group (fsGroup), 0440."""
    return {"name": "job-secret", "secret": {"secretName": f"{job.name}-secret", "defaultMode": 0o440,
                                             "items": [{"key": SECRET_KEY, "path": SECRET_KEY}]}}


def _indexed_job(job: K8sJob, role: str) -> Dict[str, Any]:
    n = job.pservers if role == PSERVER else job.trainers
    word = _ROLE_WORD[role]
    keeps_checkpoints = role == PSERVER and bool(job.pods.checkpoint_pvc)
    container: Dict[str, Any] = {
        "name": word,
        "image": job.image,
        "workingDir": job.env.workspace,
        "command": [POD_PYTHON, "-m", "paddle_cluster.node", "pod", "--start-timeout", f"{job.start_timeout:g}",
                    # A pserver ends once every trainer pod has ended, launcher or not (node/pod.py).
                    *(["--trainer-names", trainer_names(job)] if role == PSERVER else []),
                    *(["--unpack", f"{PACK_DIR}/{PACK_KEY}"] if job.workspace_pack else []),
                    "--secret-file", f"{SECRET_DIR}/{SECRET_KEY}", "--"],
        "args": list(job.pserver_cmd if role == PSERVER else job.trainer_cmd),
        "env": _env(job, role),
        "resources": (job.pods.pserver if role == PSERVER else job.pods.trainer).spec(),
        "securityContext": job.pods.container_security(),
        "volumeMounts": [{"name": "job-dir", "mountPath": job.env.job_dir}] + (
            [{"name": "workspace", "mountPath": PACK_DIR, "readOnly": True}] if job.workspace_pack else []) + (
            [{"name": "checkpoints", "mountPath": CHECKPOINTS}] if keeps_checkpoints else []) + [
            {"name": "job-secret", "mountPath": SECRET_DIR, "readOnly": True}],
    }
    if role == PSERVER:
        container["ports"] = [{"name": name, "containerPort": p, "protocol": "TCP"} for name, p in _ports(job)]
    pod = {
        "restartPolicy": "Never",  # a failed process fails the job (fail-fast), as on every backend
        "subdomain": job.name,  # with the Indexed Job's hostname: the stable DNS name
        "enableServiceLinks": False,  # no SERVICE_* variables from every Service of the namespace
        "automountServiceAccountToken": False,  # the pods never talk to the API server
        "terminationGracePeriodSeconds": math.ceil(job.kill_grace),
        "containers": [container],
        # Logs, metrics and checkpoints of this pod; they go with it (docs/backends.md: what persists).
        "volumes": [{"name": "job-dir", "emptyDir": {}}] + (
            [{"name": "workspace", "configMap": {"name": f"{job.name}-workspace"}}] if job.workspace_pack else []) + (
            [{"name": "checkpoints", "persistentVolumeClaim": {"claimName": job.pods.checkpoint_pvc}}]
            if keeps_checkpoints else []) + [_secret_volume(job)],
        **job.pods.pod_spec(),
    }
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": _meta(job, job.job_name(role), role),
            "spec": {"completionMode": "Indexed", "completions": n, "parallelism": n, "backoffLimit": 0,
                     **job.pods.job_spec(),
                     "template": {"metadata": {"labels": job.labels(role)}, "spec": pod}}}


def trainer_names(job: K8sJob) -> str:
    """The trainer pods' stable DNS names, ``{}`` for the index."""
    return pod_host(job.name, job.namespace, TRAINER, 0, job.jobset).replace("-0.", "-{}.", 1)
