"""The stand-in's JobSet controller and Kueue (``__init__.py`` says what else is modelled).

JobSet (jobset.x-k8s.io/v1alpha2): a JobSet makes its headless Service (``network.enableDNSHostnames``: named
after it, selecting its pods) and one Job ``<JobSet>-<replicated Job>-<i>`` per replica, whose pods are in the
JobSet's subdomain; its ``spec.suspend`` is its Jobs'; it is ``Completed`` once every Job of
``successPolicy.targetReplicatedJobs`` is (its Jobs still active then deleted), and ``Failed`` (its Jobs
deleted, ``failurePolicy.maxRestarts`` 0) once any Job failed; ``ttlSecondsAfterFinished`` deletes it, and the
garbage collector its Jobs and Service.

Kueue: the cluster's queues (``cluster.json`` ``queues``: LocalQueue name -> the CPUs of its ClusterQueue's one
flavor) admit the workloads labelled ``kueue.x-k8s.io/queue-name`` (a JobSet, or a Job of no JobSet: each is one
workload) in StrictFIFO order (higher priority first -- the value of the first pod set's PriorityClass --, then the
order they came), each once the CPUs its pods request fit beside those of the workloads admitted and not finished;
its webhook created them suspended (apiserver.py), admission resumes them. Each has its ``Workload``
(kueue.x-k8s.io/v1beta1, owned by it) with Kueue's conditions: ``QuotaReserved`` False ``Inadmissible`` for a
LocalQueue that does not exist, False ``Pending`` with the flavor assigner's message while it waits (``insufficient
unused quota``) or can never fit (``request > maximum capacity``), then ``QuotaReserved`` and ``Admitted`` True.
Preemption within the ClusterQueue (``withinClusterQueue: LowerPriority``): a workload that does not fit evicts
admitted ones of lower priority (the lowest first, the latest admitted first among equals) until it would:
``Evicted`` True ``Preempted``, ``Preempted`` True ``InClusterQueue``, ``Requeued`` True, its Job(Set) suspended
again (the Job controller deletes its pods). An evicted workload holds its quota until its pods are gone; it is
back in line and admitted again once it fits (``Evicted`` then False, "Previously: ...").
"""

from __future__ import annotations

import copy
import secrets
import time
from typing import Any, Dict, List, Tuple

from .admission import pod_usage, qty
from .store import QUEUE, _key, now, touch

JOBSET_NAME = "jobset.sigs.k8s.io/jobset-name"
REPLICATED_JOB = "jobset.sigs.k8s.io/replicatedjob-name"


def _done(obj: Dict[str, Any]) -> bool:
    return any(c["type"] in ("Complete", "Completed", "Failed") and c["status"] == "True"
               for c in (obj.get("status") or {}).get("conditions") or [])


def _owned(objs: Dict[str, Any], owner: Dict[str, Any], kind: str) -> List[Dict[str, Any]]:
    uid = owner["metadata"]["uid"]
    return [o for k, o in objs.items() if k.startswith(f"{kind}/{owner['metadata']['namespace']}/")
            and any(r["uid"] == uid for r in o["metadata"].get("ownerReferences") or [])]


def jobset(cluster, doc: Dict[str, Any], key: str) -> None:
    objs = doc["objects"]
    js = objs[key]
    meta, spec = js["metadata"], js["spec"]
    ns, name = meta["namespace"], meta["name"]
    jobs = _owned(objs, js, "Job")
    ref = {"apiVersion": js["apiVersion"], "kind": "JobSet", "name": name, "uid": meta["uid"], "controller": True}
    if meta.get("deletionTimestamp"):
        for j in jobs:
            _delete(doc, j)
        if not jobs:
            touch(doc, objs.pop(key), "DELETED")
        return
    st = js.setdefault("status", {})
    before = copy.deepcopy(st)
    conds = st.setdefault("conditions", [])
    if _key("Service", ns, name) not in objs:
        svc = {"apiVersion": "v1", "kind": "Service",
               "metadata": {"name": name, "namespace": ns, "uid": secrets.token_hex(8), "creationTimestamp": now(),
                            "ownerReferences": [ref]},
               "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": {JOBSET_NAME: name}}}
        objs[_key("Service", ns, name)] = svc
        touch(doc, svc, "ADDED")
    if not _done(js):
        for rj in spec["replicatedJobs"]:
            for i in range(rj.get("replicas", 1)):
                jname = f"{name}-{rj['name']}-{i}"
                jkey = _key("Job", ns, jname)
                if jkey in objs:
                    if objs[jkey]["spec"].get("suspend", False) != spec.get("suspend", False):
                        objs[jkey]["spec"]["suspend"] = spec.get("suspend", False)
                        touch(doc, objs[jkey])
                    continue
                tmpl = copy.deepcopy(rj["template"])
                labels = {**(tmpl.get("metadata") or {}).get("labels", {}), JOBSET_NAME: name,
                          REPLICATED_JOB: rj["name"]}
                jspec = tmpl["spec"]
                jspec["suspend"] = spec.get("suspend", False)
                pod = jspec["template"]
                pod.setdefault("metadata", {}).setdefault("labels", {}).update({JOBSET_NAME: name,
                                                                                REPLICATED_JOB: rj["name"]})
                pod["spec"]["subdomain"] = name
                job = {"apiVersion": "batch/v1", "kind": "Job", "spec": jspec, "status": {},
                       "metadata": {"name": jname, "namespace": ns, "labels": labels, "uid": secrets.token_hex(8),
                                    "creationTimestamp": now(), "ownerReferences": [ref]}}
                objs[jkey] = job
                touch(doc, job, "ADDED")
                cluster.event(doc, js, "Normal", "SuccessfulCreate", f"Created job: {jname}")
        failed = [j for j in jobs if any(c["type"] == "Failed" and c["status"] == "True"
                                         for c in (j.get("status") or {}).get("conditions") or [])]
        target = (spec.get("successPolicy") or {}).get("targetReplicatedJobs") or [rj["name"] for rj in
                                                                                   spec["replicatedJobs"]]
        wanted = [j for j in jobs if j["metadata"]["labels"].get(REPLICATED_JOB) in target]
        if failed:
            conds.append({"type": "Failed", "status": "True", "reason": "FailedJobs", "lastTransitionTime": now(),
                          "message": f"jobset failed due to one or more job failures "
                                     f"({failed[0]['metadata']['name']})"})
            for j in jobs:
                if not _done(j):
                    _delete(doc, j)
        elif wanted and all(any(c["type"] == "Complete" and c["status"] == "True"
                                for c in (j.get("status") or {}).get("conditions") or []) for j in wanted):
            conds.append({"type": "Completed", "status": "True", "reason": "AllJobsCompleted",
                          "lastTransitionTime": now(), "message": "jobset completed successfully"})
            for j in jobs:  # as the JobSet controller does once it finished: its Jobs still active are deleted
                if not _done(j):
                    _delete(doc, j)
    if _done(js):
        st.setdefault("_done", time.time())
        ttl = spec.get("ttlSecondsAfterFinished")
        if ttl is not None and time.time() - st["_done"] >= ttl:
            meta["deletionTimestamp"] = now()
    if st != before:
        touch(doc, js)


def _delete(doc: Dict[str, Any], obj: Dict[str, Any]) -> None:
    if not obj["metadata"].get("deletionTimestamp"):
        obj["metadata"]["deletionTimestamp"] = now()
        touch(doc, obj)


def _cpus(workload: Dict[str, Any]) -> float:
    """What a workload's pods request of CPU, all of them at once."""
    if workload["kind"] == "Job":
        templates = [(workload["spec"], 1)]
    else:
        templates = [(rj["template"]["spec"], rj.get("replicas", 1)) for rj in workload["spec"]["replicatedJobs"]]
    return sum(pod_usage(s["template"]["spec"]).get("requests.cpu", 0) * s.get("parallelism", 1) * n
               for s, n in templates)


def _pod_spec(w: Dict[str, Any]) -> Dict[str, Any]:
    """The pod template's spec of a workload's first pod set."""
    job = w["spec"] if w["kind"] == "Job" else w["spec"]["replicatedJobs"][0]["template"]["spec"]
    return job["template"]["spec"]


def priority(objs: Dict[str, Any], w: Dict[str, Any]) -> int:
    """Kueue's priority of a workload: the value of its first pod set's PriorityClass (0 without one)."""
    pc = _pod_spec(w).get("priorityClassName")
    return int((objs.get(f"PriorityClass//{pc}") or {}).get("value", 0)) if pc else 0


def workloads(objs: Dict[str, Any], queue: str) -> List[Dict[str, Any]]:
    """The workloads of ``queue`` not finished, in StrictFIFO order: higher priority first, then as they came."""
    return sorted((o for k, o in objs.items() if k.startswith(("JobSet/", "Job/"))
                   and (o["metadata"].get("labels") or {}).get(QUEUE) == queue
                   and not o["metadata"].get("ownerReferences") and not o["metadata"].get("deletionTimestamp")
                   and not _done(o)), key=lambda o: (-priority(objs, o), o["metadata"]["creationTimestamp"],
                                                     int(o["metadata"]["resourceVersion"])))


def pending_workloads(objs: Dict[str, Any], ns: str, queue: str) -> Dict[str, Any]:
    """Kueue's visibility API for a LocalQueue (``/apis/visibility.kueue.x-k8s.io/v1beta1/namespaces/NS/localqueues/
    Q/pendingworkloads``): its workloads not admitted yet, in line, each named after and owned by its object."""
    waiting = [w for w in workloads(objs, queue) if w["spec"].get("suspend")]
    items = []
    for i, w in enumerate(waiting):
        meta = w["metadata"]
        if meta["namespace"] != ns:
            continue
        items.append({"metadata": {"name": f"{w['kind'].lower()}-{meta['name']}-{meta['uid'][:5]}",
                                   "namespace": ns, "creationTimestamp": meta["creationTimestamp"],
                                   "ownerReferences": [{"apiVersion": w["apiVersion"], "kind": w["kind"],
                                                        "name": meta["name"], "uid": meta["uid"]}]},
                      "priority": priority(objs, w), "localQueueName": queue, "positionInClusterQueue": i,
                      "positionInLocalQueue": len(items)})
    return {"kind": "PendingWorkloadsSummary", "apiVersion": "visibility.kueue.x-k8s.io/v1beta1",
            "metadata": {"creationTimestamp": None}, "items": items}


CLUSTER_QUEUE = "cluster-queue"
FLAVOR = "default-flavor"
WORKLOAD_API = "kueue.x-k8s.io/v1beta1"


def workload_of(objs: Dict[str, Any], owner: Dict[str, Any]) -> Dict[str, Any]:
    """The Workload Kueue keeps for a queued JobSet or Job, made on first sight (owned by it: it goes with it)."""
    meta = owner["metadata"]
    name = f"{owner['kind'].lower()}-{meta['name']}-{meta['uid'][:5]}"
    key = _key("Workload", meta["namespace"], name)
    if key not in objs:
        objs[key] = {"apiVersion": WORKLOAD_API, "kind": "Workload",
                     "metadata": {"name": name, "namespace": meta["namespace"], "uid": secrets.token_hex(8),
                                  "creationTimestamp": now(), "labels": {"kueue.x-k8s.io/job-uid": meta["uid"]},
                                  "ownerReferences": [{"apiVersion": owner["apiVersion"], "kind": owner["kind"],
                                                       "name": meta["name"], "uid": meta["uid"],
                                                       "controller": True}]},
                     "spec": {"queueName": (meta.get("labels") or {}).get(QUEUE, ""), "active": True},
                     "status": {"conditions": []}}
    return objs[key]


def set_conditions(doc: Dict[str, Any], wl: Dict[str, Any], *conds: Tuple[str, str, str, str]) -> None:
    """(type, status, reason, message) onto the Workload, each replacing its type's; touched if any changed."""
    have = wl["status"]["conditions"]
    changed = False
    for type_, status, reason, message in conds:
        old = next((c for c in have if c["type"] == type_), None)
        if old is not None and (old["status"], old["reason"], old["message"]) == (status, reason, message):
            continue
        have[:] = [c for c in have if c["type"] != type_] + [{
            "type": type_, "status": status, "reason": reason, "message": message, "lastTransitionTime": now()}]
        changed = True
    if changed:
        touch(doc, wl, "MODIFIED" if wl["metadata"].get("resourceVersion") else "ADDED")


def _admitted(wl: Dict[str, Any]) -> bool:
    return any(c["type"] == "Admitted" and c["status"] == "True" for c in wl["status"]["conditions"])


def _pod_set(w: Dict[str, Any]) -> str:
    return w["spec"]["replicatedJobs"][0]["name"] if w["kind"] == "JobSet" else "main"


def _evicted(wl: Dict[str, Any]) -> bool:
    return any(c["type"] == "Evicted" and c["status"] == "True" for c in wl["status"]["conditions"])


def _has_pods(objs: Dict[str, Any], w: Dict[str, Any]) -> bool:
    label = JOBSET_NAME if w["kind"] == "JobSet" else "job-name"
    ns, name = w["metadata"]["namespace"], w["metadata"]["name"]
    return any(k.startswith(f"Pod/{ns}/") and (p["metadata"].get("labels") or {}).get(label) == name
               for k, p in objs.items())


def _holds_quota(objs: Dict[str, Any], w: Dict[str, Any]) -> bool:
    """Admitted, or evicted with pods still stopping: Kueue releases an evicted workload's quota once they are gone."""
    return not w["spec"].get("suspend") or (_evicted(workload_of(objs, w)) and _has_pods(objs, w))


def kueue(cluster, doc: Dict[str, Any]) -> None:
    objs = doc["objects"]
    queues = cluster.cfg.get("queues") or {}
    named = {(o["metadata"].get("labels") or {}).get(QUEUE) for k, o in objs.items()
             if k.startswith(("JobSet/", "Job/"))} - {None, ""}
    for queue in sorted(named | set(queues)):
        workloads_ = workloads(objs, queue)
        if queue not in queues:
            for w in workloads_:
                set_conditions(doc, workload_of(objs, w), ("QuotaReserved", "False", "Inadmissible",
                                                           f"LocalQueue {queue} doesn't exist"))
            continue
        cap = qty(queues[queue])
        used = sum(_cpus(w) for w in workloads_ if _holds_quota(objs, w))
        head_waits = False
        for w in workloads_:
            wl = workload_of(objs, w)
            if not w["spec"].get("suspend"):
                if not _admitted(wl):  # (admitted before the stand-in kept Workloads)
                    _admit(cluster, doc, w, wl)
                continue
            need = _cpus(w)
            if need > cap:
                set_conditions(doc, wl, ("QuotaReserved", "False", "Pending",
                                         f"couldn't assign flavors to pod set {_pod_set(w)}: insufficient quota for "
                                         f"cpu in flavor {FLAVOR}, request > maximum capacity ({need:g} > {cap:g})"))
                continue  # never fits: it does not hold the line
            if not head_waits and used + need > cap:
                _preempt_for(cluster, doc, w, workloads_, used + need - cap)
            if head_waits or used + need > cap:
                head_waits = True  # StrictFIFO: the head waits, and those behind it
                set_conditions(doc, wl, ("QuotaReserved", "False", "Pending",
                                         f"couldn't assign flavors to pod set {_pod_set(w)}: insufficient unused "
                                         f"quota for cpu in flavor {FLAVOR}, {used + need - cap:g} more needed"))
                continue
            used += need
            w["spec"]["suspend"] = False
            touch(doc, w)
            _admit(cluster, doc, w, wl)


def _admit(cluster, doc: Dict[str, Any], w: Dict[str, Any], wl: Dict[str, Any]) -> None:
    conds = [("QuotaReserved", "True", "QuotaReserved", f"Quota reserved in ClusterQueue {CLUSTER_QUEUE}"),
             ("Admitted", "True", "Admitted", "The workload is admitted")]
    evicted = next((c for c in wl["status"]["conditions"] if c["type"] == "Evicted" and c["status"] == "True"), None)
    if evicted is not None:
        conds.append(("Evicted", "False", "QuotaReserved", f"Previously: {evicted['message']}"))
    set_conditions(doc, wl, *conds)
    cluster.event(doc, w, "Normal", "Started", f"Admitted by clusterQueue {CLUSTER_QUEUE}")


def _preempt_for(cluster, doc: Dict[str, Any], w: Dict[str, Any], queued: List[Dict[str, Any]],
                 short: float) -> None:
    """Kueue's preemption within the ClusterQueue (LowerPriority): evict admitted workloads of lower priority than
    ``w``, the lowest first and the latest admitted among equals, if freeing ``short`` CPUs that way is possible
    (else none); ``w`` is admitted on a later pass, once their pods are gone."""
    objs = doc["objects"]
    mine = priority(objs, w)
    admitted = [v for v in queued if not v["spec"].get("suspend") and priority(objs, v) < mine]
    admitted.sort(key=lambda v: v["metadata"]["creationTimestamp"], reverse=True)
    admitted.sort(key=lambda v: priority(objs, v))  # (stable: the latest first among equals)
    # Quota that evicted workloads release once their pods are gone is not taken twice.
    short -= sum(_cpus(v) for v in queued if v["spec"].get("suspend") and _holds_quota(objs, v))
    victims, freed = [], 0.0
    for v in admitted:
        if freed >= short:
            break
        victims.append(v)
        freed += _cpus(v)
    if not victims or freed < short:
        return
    uid = w["metadata"]["uid"]
    why = f"Preempted to accommodate a workload (UID: {workload_of(objs, w)['metadata']['uid']}, JobUID: {uid}) " \
          "due to prioritization in the ClusterQueue"
    for v in victims:
        set_conditions(doc, workload_of(objs, v), ("Evicted", "True", "Preempted", why),
                       ("Preempted", "True", "InClusterQueue", why),
                       ("QuotaReserved", "False", "Pending", why),
                       ("Admitted", "False", "NoReservation", "The workload has no reservation"),
                       ("Requeued", "True", "Preempted", why))
        v["spec"]["suspend"] = True  # the Job controller deletes its pods
        touch(doc, v)
        cluster.event(doc, v, "Normal", "Preempted", why)
