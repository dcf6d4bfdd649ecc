"""What a Kubernetes job's pods ask of the cluster: resources per role, where they may run, who they run as, and
how long the job's objects live -- the options ``run --backend k8s`` and ``render k8s`` share (``PodOptions``),
each parsed from its flag with an error naming that flag.

By default every pod satisfies the restricted Pod Security Standard: not root (``runAsNonRoot``, a numeric
user), no privilege escalation, every capability dropped, the runtime's default seccomp profile.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Tuple

from ...errors import ConfigError
from ..base import BackendOption

DEFAULT_REQUESTS = (("cpu", "1"), ("memory", "1Gi"))
DEFAULT_TTL = 86400  # finished Jobs (and their pods' logs) stay a day for `status`/`logs`, then go
DEFAULT_USER = 1000
GPU = "nvidia.com/gpu"
# A Kubernetes quantity: a decimal number with an optional binary/decimal suffix or exponent.
_QUANTITY = re.compile(r"(\d+(\.\d*)?|\.\d+)(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei|[eE][-+]?\d+)?")
_RESOURCE = re.compile(r"([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[a-zA-Z0-9]([-a-zA-Z0-9_.]*[a-zA-Z0-9])?")
_LABEL_KEY = re.compile(r"([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?")  # an object name (DNS subdomain)
_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")


def _pairs(text: str, key: str, example: str) -> Tuple[Tuple[str, str], ...]:
    out = []
    for part in (p.strip() for p in (text or "").split(",") if p.strip()):
        name, sep, value = (x.strip() for x in part.partition("="))
        if not sep:
            raise ConfigError(key, text, f"{part!r} is not NAME=VALUE; write e.g. {example}")
        out.append((name, value))
    return tuple(out)


def resources(text: str, key: str, defaults: Tuple[Tuple[str, str], ...] = ()) -> Tuple[Tuple[str, str], ...]:
    """``cpu=2,memory=4Gi,nvidia.com/gpu=1`` over ``defaults``."""
    got = dict(defaults)
    for name, qty in _pairs(text, key, "cpu=2,memory=4Gi"):
        if not _RESOURCE.fullmatch(name) or len(name) > 253:
            raise ConfigError(key, text, f"{name!r} is not a resource name (cpu, memory, {GPU}, ...)")
        if not _QUANTITY.fullmatch(qty):
            raise ConfigError(key, text, f"{qty!r} is not a Kubernetes quantity; write e.g. 500m, 2, 4Gi")
        got[name] = qty
    return tuple(got.items())


@dataclass(frozen=True)
class Resources:
    """One pod's ``resources``: requests, and limits (``limits`` given, plus every extended resource such as
    GPUs, which Kubernetes accepts only with a limit equal to the request)."""

    requests: Tuple[Tuple[str, str], ...] = DEFAULT_REQUESTS
    limits: Tuple[Tuple[str, str], ...] = ()

    def spec(self) -> Dict[str, Dict[str, str]]:
        requests = dict(self.requests)
        limits = {**{k: v for k, v in requests.items() if "/" in k or k.startswith("hugepages-")}, **dict(self.limits)}
        for k, v in limits.items():
            requests.setdefault(k, v)  # a limit alone also requests as much, as the API server defaults it
        return {"requests": requests, "limits": limits} if limits else {"requests": requests}


@dataclass(frozen=True)
class Toleration:
    key: str
    value: str
    effect: str

    @classmethod
    def parse(cls, text: str) -> Toleration:
        """``KEY[=VALUE]:EFFECT`` (``kubectl taint``'s form)."""
        body, _, effect = text.rpartition(":")
        key, _, value = body.partition("=")
        if effect not in _EFFECTS or not _LABEL_KEY.fullmatch(key) or not _LABEL_VALUE.fullmatch(value):
            raise ConfigError("--toleration", text, f"write KEY[=VALUE]:EFFECT with EFFECT one of {', '.join(_EFFECTS)}"
                              ", e.g. nvidia.com/gpu:NoSchedule or dedicated=ml:NoSchedule")
        return cls(key, value, effect)

    def spec(self) -> Dict[str, str]:
        if self.value:
            return {"key": self.key, "operator": "Equal", "value": self.value, "effect": self.effect}
        return {"key": self.key, "operator": "Exists", "effect": self.effect}


@dataclass(frozen=True)
class PodOptions:
    pserver: Resources = Resources()
    trainer: Resources = Resources()
    node_selector: Tuple[Tuple[str, str], ...] = ()
    tolerations: Tuple[Toleration, ...] = ()
    priority_class: str = ""
    service_account: str = ""
    image_pull_secrets: Tuple[str, ...] = ()
    run_as_user: int = DEFAULT_USER
    ttl: Optional[int] = DEFAULT_TTL  # ttlSecondsAfterFinished
    deadline: Optional[int] = None  # activeDeadlineSeconds
    queue: str = ""  # Kueue's LocalQueue
    checkpoint_pvc: str = ""  # a PersistentVolumeClaim the pservers keep their checkpoints on
    # The interface gloo and NCCL bind to in a pod (GLOO_/NCCL_SOCKET_IFNAME); none by default: each binds the
    # address of the pod's hostname, its own. PADDLE_NIC names an interface of the HOSTS, never of a pod.
    nic: str = ""

    @classmethod
    def parse(cls, *, pserver_requests: str = "", trainer_requests: str = "", pserver_limits: str = "",
              trainer_limits: str = "", gpus: Optional[int] = None, node_selector: str = "",
              tolerations: Tuple[str, ...] = (), priority_class: str = "", service_account: str = "",
              image_pull_secrets: Tuple[str, ...] = (), run_as_user: Optional[int] = None, ttl: Optional[int] = None,
              deadline: Optional[int] = None, queue: str = "", checkpoint_pvc: str = "", pod_nic: str = "",
              keys: Tuple[str, str] = ("--pserver-requests", "--trainer-requests")) -> PodOptions:
        """From the flags' texts; ``keys`` name where the requests came from (a flag or a config key)."""
        tr_requests = resources(trainer_requests, keys[1], DEFAULT_REQUESTS)
        if gpus:
            tr_requests = resources(f"{GPU}={gpus}", "--gpus", tr_requests)
        selector = _pairs(node_selector, "--node-selector", "pool=gpu,kubernetes.io/arch=amd64")
        for k, v in selector:
            if not _LABEL_KEY.fullmatch(k) or not _LABEL_VALUE.fullmatch(v) or len(v) > 63:
                raise ConfigError("--node-selector", node_selector, f"{k}={v} is not a node label KEY=VALUE")
        for flag, name in [("--priority-class", priority_class), ("--service-account", service_account),
                           ("--queue", queue), ("--checkpoint-pvc", checkpoint_pvc)] + [
                              ("--image-pull-secret", s) for s in image_pull_secrets]:
            if name and (not _NAME.fullmatch(name) or len(name) > 253):
                raise ConfigError(flag, name, "must be the name of an object of the cluster (lower-case letters, "
                                  "digits, '-' and '.')")
        if pod_nic and not re.fullmatch(r"[A-Za-z0-9_.:@-]{1,15}", pod_nic):
            raise ConfigError("--pod-nic", pod_nic, "must be an interface name of the pods, such as eth0 or net1")
        if ttl is not None and ttl < -1:
            raise ConfigError("--ttl", ttl, "give seconds (0 or more), or -1 to keep the finished Jobs")
        if run_as_user is not None and run_as_user < 1:
            raise ConfigError("--run-as-user", run_as_user, "must be a user id above 0: the pods never run as root")
        return cls(Resources(resources(pserver_requests, keys[0], DEFAULT_REQUESTS),
                             resources(pserver_limits, "--pserver-limits")),
                   Resources(tr_requests, resources(trainer_limits, "--trainer-limits")), selector,
                   tuple(Toleration.parse(t) for t in tolerations), priority_class, service_account,
                   tuple(image_pull_secrets), DEFAULT_USER if run_as_user is None else run_as_user,
                   DEFAULT_TTL if ttl is None else (ttl if ttl >= 0 else None), deadline, queue or "",
                   checkpoint_pvc or "", pod_nic or "")

    def pod_spec(self) -> Dict[str, Any]:
        """What these options add to a pod's spec."""
        out: Dict[str, Any] = {"securityContext": {
            "runAsNonRoot": True, "runAsUser": self.run_as_user, "runAsGroup": self.run_as_user,
            "fsGroup": self.run_as_user, "seccompProfile": {"type": "RuntimeDefault"}}}
        if self.node_selector:
            out["nodeSelector"] = dict(self.node_selector)
        if self.tolerations:
            out["tolerations"] = [t.spec() for t in self.tolerations]
        if self.priority_class:
            out["priorityClassName"] = self.priority_class
        if self.service_account:
            out["serviceAccountName"] = self.service_account
        if self.image_pull_secrets:
            out["imagePullSecrets"] = [{"name": s} for s in self.image_pull_secrets]
        return out

    @staticmethod
    def container_security() -> Dict[str, Any]:
        return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}, "runAsNonRoot": True,
                "seccompProfile": {"type": "RuntimeDefault"}}

    def job_spec(self) -> Dict[str, Any]:
        """What these options add to each Job's spec."""
        out: Dict[str, Any] = {}
        if self.ttl is not None:
            out["ttlSecondsAfterFinished"] = self.ttl
        if self.deadline is not None:
            out["activeDeadlineSeconds"] = self.deadline
        return out


# The options, for `run --backend k8s` and `render k8s` alike (the backend declares them)
OPTIONS = (
    BackendOption("--pserver-requests", "pserver_requests", "What each pserver pod requests, e.g. cpu=2,memory=4Gi "
                  "(default: K8S_PSERVER_REQUESTS, else cpu=1,memory=1Gi).", metavar="R"),
    BackendOption("--trainer-requests", "trainer_requests", "The same for each trainer pod (default: "
                  "K8S_TRAINER_REQUESTS); an extended resource such as nvidia.com/gpu=1 is also its limit.",
                  metavar="R"),
    BackendOption("--pserver-limits", "pserver_limits", "Limits of each pserver pod, e.g. memory=8Gi.", metavar="R"),
    BackendOption("--trainer-limits", "trainer_limits", "Limits of each trainer pod.", metavar="R"),
    BackendOption("--gpus", "gpus", f"GPUs per trainer pod ({GPU}).", int, "N", 1),
    BackendOption("--node-selector", "node_selector", "Node labels the pods must run on.", metavar="K=V,..."),
    BackendOption("--toleration", "tolerations", "A taint the pods tolerate (repeatable), e.g. "
                  "nvidia.com/gpu:NoSchedule.", metavar="KEY[=VALUE]:EFFECT", multiple=True),
    BackendOption("--priority-class", "priority_class", "The pods' PriorityClass.", metavar="NAME"),
    BackendOption("--service-account", "service_account", "The pods' ServiceAccount.", metavar="NAME"),
    BackendOption("--image-pull-secret", "image_pull_secrets", "A Secret to pull the image with (repeatable).",
                  metavar="NAME", multiple=True),
    BackendOption("--run-as-user", "run_as_user", f"The pods' user id (default {DEFAULT_USER}; never root: the "
                  "restricted Pod Security Standard).", int, "UID"),
    BackendOption("--ttl", "ttl", f"Seconds the finished Jobs and their pods' logs stay (ttlSecondsAfterFinished; "
                  f"default {DEFAULT_TTL}, -1 forever).", int, "S"),
    BackendOption("--deadline", "deadline", "Fail the job after S seconds (activeDeadlineSeconds).", int, "S", 1),
    BackendOption("--queue", "queue", "The Kueue LocalQueue admitting the job (label kueue.x-k8s.io/queue-name; "
                  "check: also the JobSet rights).", metavar="NAME", check=True),
    BackendOption("--checkpoint-pvc", "checkpoint_pvc", "A PersistentVolumeClaim (shared by the pserver pods) "
                  "holding the checkpoints, so --resume_from works.", metavar="CLAIM"),
    BackendOption("--pod-nic", "pod_nic", "The pods' interface for gloo and NCCL (GLOO_SOCKET_IFNAME, "
                  "NCCL_SOCKET_IFNAME; default: none, each binds its pod's own address; PADDLE_NIC is the HOSTS'"
                  ").", metavar="IFACE"),
)


def pod_flags(opts: Mapping[str, Any]) -> Dict[str, Any]:
    """The pod options given (absent ones as ``PodOptions.parse`` defaults them), for ``K8sOptions.from_config``."""
    out: Dict[str, Any] = {}
    for o in OPTIONS:
        value = opts.get(o.dest)
        out[o.dest] = tuple(value or ()) if o.multiple else ("" if value is None and o.kind is str else value)
    return out
