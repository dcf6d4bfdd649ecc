"""What the Kubernetes backend needs the API server to let it do in the job's namespace (``NEEDS``), and
``check --backend k8s``: one ``kubectl auth can-i`` for each, a row each."""

from __future__ import annotations

import shlex
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import ClassVar, List, Tuple

from ...config import ClusterConfig
from ...errors import ClusterError
from . import manifests
from .kubectl import Kubectl, KubectlMissing
from .settings import NAMESPACE, K8sSettings

WORKLOADS = "workloads.kueue.x-k8s.io"
LISTED = "run and kill delete the job's objects by label"
OWNED = (("get", "run looks for objects of the job's names before it creates them"), ("list", LISTED),
         ("patch", "run gives them to the Jobs (ownerReferences), so Kubernetes deletes them with the Jobs"),
         ("delete", "run and kill delete the job's objects"))  # of the Service, Secret and ConfigMap


@dataclass(frozen=True)
class Need:
    """A permission the backend uses: ``kubectl auth can-i VERB RESOURCE`` must say yes."""

    verb: str
    resource: str  # as kubectl names it; ``pods/log``: the pods' log (a subresource)
    why: str  # what of paddle-cluster does it
    at_run: bool = False  # run asks for it before it creates anything


NEEDS: Tuple[Need, ...] = (
    Need("create", "jobs.batch", "run creates the pserver and trainer Jobs", True),
    Need("get", "jobs.batch", "run looks for objects of the job's names before it creates them"),
    Need("list", "jobs.batch", LISTED),
    Need("watch", "jobs.batch", "run and kill wait until the Jobs are gone"),
    Need("delete", "jobs.batch", "run and kill delete the job's Jobs", True),
    *[need for kind, why, at_run in (
        ("services", "run creates the headless Service by which the pods find each other", True),
        ("secrets", "run creates the Secret holding the job's key", True),
        ("configmaps", "run --job_dispatch_package puts the workspace in a ConfigMap", False))
      for need in (Need("create", kind, why, at_run), *(Need(verb, kind, does) for verb, does in OWNED))],
    Need("get", "pods", "status, logs and kill read the job's pods"),
    Need("list", "pods", "run, status, logs and kill find the job's pods by label"),
    Need("watch", "pods", "run follows the pods' states"),
    Need("patch", "pods", "kill marks the pods, so a run following them ends 'stopped by paddle-cluster kill'"),
    Need("delete", "pods", "a second Ctrl+C deletes the pods without their grace period"),
    Need("get", "pods/log", "run, logs and kill read the pods' output"),
    Need("list", "events", "run says why the cluster holds or refuses the job (quota, admission, image pulls)"),
    Need("watch", "events", "run says why the cluster holds or refuses the job (quota, admission, image pulls)"),
)

# A job as one JobSet (--jobset, --queue): those too.
JOBSET_NEEDS: Tuple[Need, ...] = (
    Need("create", manifests.JOBSET_RESOURCE, "run creates the JobSet (--queue, --jobset)", True),
    Need("get", manifests.JOBSET_RESOURCE, "run looks for objects of the job's names before it creates them"),
    Need("list", manifests.JOBSET_RESOURCE, LISTED),
    Need("delete", manifests.JOBSET_RESOURCE, "run and kill delete the job's JobSet"),
)
# A job in a Kueue queue (--queue): Kueue's verdict on it, its Workload's conditions.
QUEUE_NEEDS: Tuple[Need, ...] = (
    Need("list", WORKLOADS, "run --queue reads Kueue's verdict on the job (its Workload: admitted, inadmissible "
         "and why, evicted)"),
)


@dataclass(frozen=True)
class PermissionRow:
    """A row of ``check --backend k8s``: whether kubectl's current context may ``verb`` ``resource`` there."""

    namespace: str
    verb: str
    resource: str
    ok: bool
    needed_by: str
    problem: str = ""

    HEADERS: ClassVar[Tuple[str, ...]] = ("namespace", "verb", "resource", "allowed", "needed by")
    WRAP: ClassVar[Tuple[str, ...]] = ("needed by",)
    NOUN: ClassVar[str] = "permission(s)"

    def cells(self) -> List[str]:
        return [self.namespace, self.verb, self.resource, "yes" if self.ok else "NO", self.needed_by]

    def failure(self) -> str:
        return self.problem


def refusal(k: Kubectl, need: Need) -> str:
    """The line for a permission kubectl says we do not have: what, where, who needs it, the fix."""
    asked = shlex.join(k.can_i(need.verb, need.resource))
    return (f"may not {need.verb} {need.resource} in namespace {k.namespace} ('{asked}' says no; {need.why}): ask "
            f"your cluster's admin to grant it (a Role and RoleBinding in {k.namespace}), or choose another "
            "namespace (--namespace, K8S_NAMESPACE)")


def first_answer(k: Kubectl, who: str) -> bool:
    """Whether kubectl may do ``NEEDS[0]``: the first question to the API server, so a context that does not
    answer is said once, by ``who`` (the command), with the fix."""
    try:
        return k.may(NEEDS[0].verb, NEEDS[0].resource)
    except KubectlMissing:
        raise
    except ClusterError as e:
        raise ClusterError(f"{who}: kubectl's current context did not answer: {e}; point kubectl at your cluster "
                           "(KUBECONFIG or ~/.kube/config; 'kubectl config current-context' shows which it "
                           "uses)") from None


def check(cfg: ClusterConfig, jobset: bool = False, queue: bool = False) -> List[PermissionRow]:
    """Every need of ``NEEDS`` (and ``JOBSET_NEEDS`` for a job as a JobSet, ``QUEUE_NEEDS`` in a Kueue queue) asked
    of the API server in K8S_NAMESPACE (the first alone: a context that does not answer is one error, not one per
    permission)."""
    needs = NEEDS + (JOBSET_NEEDS if jobset or queue else ()) + (QUEUE_NEEDS if queue else ())
    namespace = K8sSettings.of(cfg).namespace
    if not manifests.namespace_ok(namespace):
        raise NAMESPACE.error(cfg, manifests.NAMESPACE_FIX)
    k = Kubectl(namespace, "")
    answers = [first_answer(k, "check --backend k8s")]
    with ThreadPoolExecutor(8) as pool:  # each answer is a round trip to the API server
        answers += pool.map(lambda n: k.may(n.verb, n.resource), needs[1:])
    return [PermissionRow(k.namespace, n.verb, n.resource, ok, n.why, "" if ok else refusal(k, n))
            for n, ok in zip(needs, answers)]
