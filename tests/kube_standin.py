"""A stand-in for a Kubernetes cluster and its ``kubectl``, for tests (no API server can run here: REFERENCE §6).

``python kube_standin.py controller DIR`` is the cluster: it keeps the objects in ``DIR/objects.json`` and runs
the controllers the launcher depends on, in one loop -- the Job controller for Indexed Jobs (one pod per
index named ``<job>-<index>-<suffix>``, hostname ``<job>-<index>``, the completion index as annotation, label
and ``JOB_COMPLETION_INDEX``; ``completions``, ``parallelism``, ``backoffLimit``, ``activeDeadlineSeconds``,
``ttlSecondsAfterFinished``; conditions ``Complete``/``Failed``, the remaining pods terminated when the Job
fails), the scheduler (each node holds a few pods, spread over the nodes the node selector allows; each pod
is in a network namespace of its own with its own IP, as on Kubernetes; beyond that the pod stays Pending,
Unschedulable), the kubelet (each pod a real process, PID 1 of a PID namespace of its own: the container's
command, args, workingDir and env -- Secret references resolved -- its hostname, emptyDir/configMap volumes
bind-mounted,
its output the pod's log, terminationGracePeriodSeconds between SIGTERM and SIGKILL, the image a name for
this checkout) and the cluster DNS (``<hostname>.<subdomain>.<ns>.svc`` for pods a headless Service selects,
in an /etc/hosts every pod shares). Deletion is foreground: a Job goes once its pods are gone.

``python kube_standin.py kubectl ARGS`` is ``kubectl`` (the fixture puts a ``kubectl`` script running it first
on PATH): the subset the launcher uses -- ``auth can-i``, ``apply``/``create -f -`` (a Job's pod template is
immutable: applying a different one fails as the API server does, the other objects of the stream still
apply), ``get`` by type, name and label selector (``-o json|name|wide``, ``--watch --output-watch-events``),
``delete`` (selector, ``--cascade``, ``--wait``, ``--grace-period=0 --force``), ``logs [--follow] [--tail]``.
"""

from __future__ import annotations

import copy
import fcntl
import json
import os
import secrets
import sys
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

KINDS = {  # what kubectl accepts -> (apiVersion, kind)
    "pods": ("v1", "Pod"), "pod": ("v1", "Pod"), "po": ("v1", "Pod"),
    "jobs.batch": ("batch/v1", "Job"), "jobs": ("batch/v1", "Job"), "job": ("batch/v1", "Job"),
    "job.batch": ("batch/v1", "Job"),
    "services": ("v1", "Service"), "service": ("v1", "Service"), "svc": ("v1", "Service"),
    "secrets": ("v1", "Secret"), "secret": ("v1", "Secret"),
    "configmaps": ("v1", "ConfigMap"), "configmap": ("v1", "ConfigMap"), "cm": ("v1", "ConfigMap"),
    "events": ("v1", "Event"), "event": ("v1", "Event"), "ev": ("v1", "Event"),
    "resourcequotas": ("v1", "ResourceQuota"), "resourcequota": ("v1", "ResourceQuota"),
    "quota": ("v1", "ResourceQuota"),
    "serviceaccounts": ("v1", "ServiceAccount"), "serviceaccount": ("v1", "ServiceAccount"),
    "sa": ("v1", "ServiceAccount"),
    "jobsets.jobset.x-k8s.io": ("jobset.x-k8s.io/v1alpha2", "JobSet"),
    "jobset.jobset.x-k8s.io": ("jobset.x-k8s.io/v1alpha2", "JobSet"), "jobsets": ("jobset.x-k8s.io/v1alpha2", "JobSet"),
    "priorityclasses": ("scheduling.k8s.io/v1", "PriorityClass"),
    "priorityclass": ("scheduling.k8s.io/v1", "PriorityClass"), "pc": ("scheduling.k8s.io/v1", "PriorityClass"),
}
RESOURCE = {"Pod": "pod", "Job": "job.batch", "Service": "service", "Secret": "secret", "ConfigMap": "configmap",
            "Event": "event", "ResourceQuota": "resourcequota", "ServiceAccount": "serviceaccount",
            "PriorityClass": "priorityclass.scheduling.k8s.io", "JobSet": "jobset.jobset.x-k8s.io"}
PLURAL = {"Pod": "pods", "Job": "jobs.batch", "Service": "services", "Secret": "secrets", "ConfigMap": "configmaps",
          "Event": "events", "ResourceQuota": "resourcequotas", "ServiceAccount": "serviceaccounts",
          "PriorityClass": "priorityclasses.scheduling.k8s.io", "JobSet": "jobsets.jobset.x-k8s.io"}
CLUSTER_SCOPED = {"PriorityClass"}
QUEUE = "kueue.x-k8s.io/queue-name"
JOBSETS = "jobsets.jobset.x-k8s.io"  # kept under the namespace ""
INDEX = "batch.kubernetes.io/job-completion-index"
TICK = 0.05
EMPTY = json.dumps({"objects": {}, "rv": 0, "events": []})


def now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _key(kind: str, ns: str, name: str) -> str:
    return f"{kind}/{ns}/{name}"


class Store:
    """The objects, in one JSON file changed under an exclusive lock (kubectl and the controller share it).

    Written only when an edit changed something, and parsed by a poller only when it did: every ``TICK`` the
    controller edits and each ``get --watch`` and ``logs --follow`` polls, five of them per job running."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.path = root / "objects.json"
        self.lock = root / "objects.lock"
        self._seen = EMPTY  # the text this process last read

    def _text(self) -> str:
        try:
            self._seen = self.path.read_text()
        except FileNotFoundError:
            self._seen = EMPTY
        return self._seen

    def changed(self) -> bool:
        """Whether the objects changed since this process last read them: a poller's cheap check (reading the
        file costs little beside parsing it; no lock: the file is replaced whole)."""
        before = self._seen
        return self._text() != before

    @contextmanager
    def edit(self) -> Iterator[Dict[str, Any]]:
        with open(self.lock, "a") as lk:
            fcntl.flock(lk, fcntl.LOCK_EX)
            text = self._text()
            doc = json.loads(text)
            yield doc
            new = json.dumps(doc)
            if new != text:
                tmp = self.path.with_suffix(".tmp")
                tmp.write_text(new)
                os.replace(tmp, self.path)

    def read(self) -> Dict[str, Any]:
        with open(self.lock, "a") as lk:
            fcntl.flock(lk, fcntl.LOCK_SH)
            return json.loads(self._text())

    def config(self) -> Dict[str, Any]:
        return json.loads((self.root / "cluster.json").read_text())

    def log(self, ns: str, pod: str) -> Path:
        return self.root / "logs" / ns / f"{pod}.log"


def touch(doc: Dict[str, Any], obj: Dict[str, Any], kind: str = "MODIFIED") -> None:
    """Bump the resource version and record a watch event."""
    doc["rv"] += 1
    obj["metadata"]["resourceVersion"] = str(doc["rv"])
    doc["events"].append({"type": kind, "object": copy.deepcopy(obj)})
    doc["events"] = doc["events"][-2000:]


def matches(labels: Dict[str, str], selector: str) -> bool:
    for term in (t.strip() for t in selector.split(",") if t.strip()):
        if "!=" in term:
            k, v = term.split("!=", 1)
            if labels.get(k) == v:
                return False
        elif "=" in term:
            k, v = term.split("==", 1) if "==" in term else term.split("=", 1)
            if labels.get(k) != v:
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


# -- kubectl ------------------------------------------------------------------------------------------------------

class Fail(Exception):
    pass


def _parse(argv: List[str]) -> Tuple[List[str], Dict[str, str]]:
    words, flags = [], {}
    it = iter(argv)
    for a in it:
        if a.startswith("--") and "=" in a:
            k, v = a[2:].split("=", 1)
            flags[k] = v
        elif a in ("--namespace", "-n", "--selector", "-l", "--output", "-o", "--filename", "-f", "--tail",
                   "--grace-period", "--cascade", "--field-selector", "--timeout", "--type", "--patch", "-p"):
            flags[{"-n": "namespace", "-l": "selector", "-o": "output", "-f": "filename", "-p": "patch"}.get(
                a, a[2:])] = next(it)
        elif a.startswith("--") or a in ("-w",):
            flags[{"-w": "watch"}.get(a, a[2:])] = "true"
        else:
            words.append(a)
    return words, flags


def _targets(words: List[str]) -> Tuple[List[str], List[Tuple[str, str]]]:
    """(kinds, [(kind, name)]) from ``pods,jobs`` / ``pods NAME`` / ``job.batch/NAME service/NAME``."""
    if words and "/" in words[0]:
        out = []
        for w in words:
            t, name = w.split("/", 1)
            out.append((KINDS[t][1], name))
        return [], out
    kinds = [KINDS[t][1] for t in words[0].split(",")] if words else []
    return kinds, [(kinds[0], n) for n in words[1:]]


def _selected(doc: Dict[str, Any], ns: str, kinds: List[str], named: List[Tuple[str, str]],
              selector: str) -> List[Dict[str, Any]]:
    out = []
    if named:
        for kind, name in named:
            obj = doc["objects"].get(_key(kind, "" if kind in CLUSTER_SCOPED else ns, name))
            if obj is not None:
                out.append(obj)
        return out
    for kind in kinds:
        where = f"{kind}/{'' if kind in CLUSTER_SCOPED else ns}/"
        for key, obj in sorted(doc["objects"].items()):
            if key.startswith(where) and matches(obj["metadata"].get("labels") or {}, selector):
                out.append(obj)
    return out


def kubectl(argv: List[str], store: Store) -> int:
    words, flags = _parse(argv)
    ns = flags.get("namespace", "default")
    verb, rest = words[0], words[1:]
    if verb == "auth":  # can-i VERB RESOURCE [--subresource S]: "no" (exit 1) for what KUBE_STANDIN_DENY lists
        asked = f"{rest[1]} {rest[2]}" + (f"/{flags['subresource']}" if flags.get("subresource") else "")
        denied = {d.strip() for d in os.environ.get("KUBE_STANDIN_DENY", "").split(",")}
        print("no" if asked in denied else "yes")
        return 1 if asked in denied else 0
    if verb == "api-resources":  # --api-group=G --output name
        group = flags.get("api-group", "")
        have = [r for r in PLURAL.values() if store.config().get("jobset", True) or r != JOBSETS]
        print("\n".join(r for r in sorted(have) if r.endswith(f".{group}")))
        return 0
    if verb in ("apply", "create"):
        return _apply(store, ns, sys.stdin.read(), create=verb == "create")
    if verb == "get":
        return _get(store, ns, rest, flags)
    if verb == "delete":
        return _delete(store, ns, rest, flags)
    if verb == "patch":
        return _patch(store, ns, rest, flags)
    if verb == "logs":
        return _logs(store, ns, rest[0].split("/", 1)[-1], flags)
    raise Fail(f"unknown command {verb!r} for kubectl (stand-in)")


def _apply(store: Store, ns: str, text: str, create: bool) -> int:
    import yaml

    errors = []
    for d in (d for d in yaml.safe_load_all(text) if d):
        kind, meta = d["kind"], d["metadata"]
        if kind == "JobSet" and not store.config().get("jobset", True):
            errors.append(f'error: resource mapping not found for name: "{meta["name"]}" namespace: "{ns}" from '
                          f'"STDIN": no matches for kind "JobSet" in version "{d["apiVersion"]}"')
            continue
        if kind in CLUSTER_SCOPED:
            meta["namespace"] = ""
        meta.setdefault("namespace", ns)
        with store.edit() as doc:
            key = _key(kind, meta["namespace"], meta["name"])
            old = doc["objects"].get(key)
            if old is not None and create:
                errors.append(f'Error from server (AlreadyExists): error when creating "STDIN": '
                              f'{PLURAL[kind]} "{meta["name"]}" already exists')
                continue
            if old is not None and kind == "Job" and any(old["spec"].get(f) != d["spec"].get(f)
                                                         for f in ("template", "completions", "completionMode")):
                errors.append(f'The Job "{meta["name"]}" is invalid: spec.template: Invalid value: '
                              'core.PodTemplateSpec{...}: field is immutable')
                continue
            obj = copy.deepcopy(d)
            obj["metadata"].update(uid=old["metadata"]["uid"] if old else secrets.token_hex(8),
                                   creationTimestamp=old["metadata"]["creationTimestamp"] if old else now())
            if kind == "Secret" and "stringData" in obj:
                obj.setdefault("data", {}).update(obj.pop("stringData"))  # (kept plain: a test double)
            if kind in ("Job", "JobSet"):
                obj["status"] = old["status"] if old else {}
                obj["metadata"].setdefault("labels", {})
                if not old and obj["metadata"]["labels"].get(QUEUE) in store.config().get("queues", {}):
                    obj["spec"]["suspend"] = True  # Kueue's webhook: a queued workload runs once admitted
            doc["objects"][key] = obj
            touch(doc, obj, "MODIFIED" if old else "ADDED")
        print(f"{RESOURCE[kind]}/{meta['name']} {'configured' if old else 'created'}")
    for e in errors:
        print(e, file=sys.stderr)
    return 1 if errors else 0


def _get(store: Store, ns: str, words: List[str], flags: Dict[str, str]) -> int:
    kinds, named = _targets(words)
    selector = flags.get("selector", "")
    output = flags.get("output", "")
    if flags.get("watch"):
        return _watch(store, ns, kinds, selector)
    items = _selected(store.read(), ns, kinds, named, selector)
    if named and len(items) < len(named) and not flags.get("ignore-not-found"):
        missing = [n for k, n in named if not any(i["metadata"]["name"] == n and i["kind"] == k for i in items)]
        print(f'Error from server (NotFound): "{missing[0]}" not found', file=sys.stderr)
        return 1
    if output == "json":
        print(json.dumps({"apiVersion": "v1", "kind": "List", "items": items}, indent=2))
    elif output == "name":
        for i in items:
            print(f"{RESOURCE[i['kind']]}/{i['metadata']['name']}")
    else:
        for i in items:
            st = i.get("status") or {}
            print(f"{RESOURCE[i['kind']]}/{i['metadata']['name']}  {st.get('phase', '')}")
        if not items:
            print(f"No resources found in {ns} namespace.", file=sys.stderr)
    return 0


def _watch(store: Store, ns: str, kinds: List[str], selector: str) -> int:
    """``get --watch --output-watch-events -o json``: the current objects as ADDED, then every change."""
    doc = store.read()
    seen = len(doc["events"]) and doc["rv"]
    for obj in _selected(doc, ns, kinds, [], selector):
        print(json.dumps({"type": "ADDED", "object": obj}, indent=2), flush=True)
    while True:
        time.sleep(TICK)
        if not store.changed():
            continue
        doc = store.read()
        for ev in doc["events"]:
            o = ev["object"]
            if (int(o["metadata"]["resourceVersion"]) > seen and o["kind"] in kinds
                    and o["metadata"].get("namespace") == ns and matches(o["metadata"].get("labels") or {}, selector)):
                print(json.dumps(ev, indent=2), flush=True)
        seen = doc["rv"]


def _delete(store: Store, ns: str, words: List[str], flags: Dict[str, str]) -> int:
    kinds, named = _targets(words)
    force = flags.get("force") == "true" and flags.get("grace-period") == "0"
    with store.edit() as doc:
        items = _selected(doc, ns, kinds, named, flags.get("selector", ""))
        for obj in items:
            meta = obj["metadata"]
            if force and obj["kind"] == "Pod":
                meta["forceKill"] = True
            if not meta.get("deletionTimestamp"):
                meta["deletionTimestamp"] = now()
                meta["deletionStarted"] = time.time()
                if flags.get("cascade", "background") == "foreground" and obj["kind"] == "Job":
                    meta["finalizers"] = ["foregroundDeletion"]
                touch(doc, obj)
    for obj in items:
        print(f'{RESOURCE[obj["kind"]]} "{obj["metadata"]["name"]}" {"force " if force else ""}deleted')
    if flags.get("wait", "true") == "true":
        keys = {_key(o["kind"], ns, o["metadata"]["name"]) for o in items}
        while keys & set(store.read()["objects"]):
            time.sleep(TICK)
    return 0


def _patch(store: Store, ns: str, words: List[str], flags: Dict[str, str]) -> int:
    """``patch TYPE/NAME... --type merge --patch JSON``: metadata only (what the launcher patches)."""
    _, named = _targets(words)
    change = json.loads(flags["patch"])
    with store.edit() as doc:
        for kind, name in named:
            obj = doc["objects"].get(_key(kind, ns, name))
            if obj is None:
                print(f'Error from server (NotFound): {PLURAL[kind]} "{name}" not found', file=sys.stderr)
                return 1
            for key, value in change.get("metadata", {}).items():  # a merge patch merges maps, replaces lists
                meta = obj["metadata"]
                meta[key] = {**(meta.get(key) or {}), **value} if isinstance(value, dict) else value
            touch(doc, obj)
            print(f"{RESOURCE[kind]}/{name} patched")
    return 0


def _logs(store: Store, ns: str, pod: str, flags: Dict[str, str]) -> int:
    key = _key("Pod", ns, pod)
    obj = store.read()["objects"].get(key)
    if obj is None:
        print(f'Error from server (NotFound): pods "{pod}" not found', file=sys.stderr)
        return 1
    path = store.log(ns, pod)
    if not path.exists():
        print(f'Error from server (BadRequest): container "{obj["spec"]["containers"][0]["name"]}" in pod "{pod}" '
              'is waiting to start: ContainerCreating', file=sys.stderr)
        return 1
    with open(path, "rb") as f:
        data = f.read()
        lines = data.splitlines(keepends=True)
        if "tail" in flags and int(flags["tail"]) >= 0:
            lines = lines[-int(flags["tail"]):] if int(flags["tail"]) else []
        sys.stdout.buffer.write(b"".join(lines))
        sys.stdout.flush()
        if flags.get("follow") != "true":
            return 0
        while True:
            chunk = f.read()
            if chunk:
                sys.stdout.buffer.write(chunk)
                sys.stdout.flush()
                continue
            if not store.changed():
                time.sleep(TICK)
                continue
            cur = store.read()["objects"].get(key)
            if cur is None or (cur.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                sys.stdout.buffer.write(f.read())
                return 0
            time.sleep(TICK)


def kubectl_main(argv: List[str]) -> int:
    store = Store(Path(os.environ["KUBE_STANDIN"]))
    try:
        return kubectl(argv, store)
    except Fail as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    if sys.argv[1] == "kubectl":
        sys.exit(kubectl_main(sys.argv[2:]))
    from kube_standin_cluster import controller_main

    sys.exit(controller_main(Path(sys.argv[2])))
