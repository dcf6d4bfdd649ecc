"""The stand-in's API server: the Kubernetes REST API over the stand-in's store (store.py), plain HTTP on
loopback, as much of it as the real ``kubectl`` uses for every command the k8s backend runs -- so those command
lines are parsed and sent by the real client and its output is the real client's.

Served: legacy discovery (``/api``, ``/apis``, each group's resource list) and OpenAPI v3 enough for kubectl to
leave field validation to the server; create (409 AlreadyExists), get, list (``labelSelector``, ``fieldSelector``
on ``metadata.name``/``metadata.namespace``), merge patch, delete (``propagationPolicy``, ``gracePeriodSeconds``:
foreground deletion, force), watch (chunked events after ``resourceVersion``; one older than the events kept, or
every watch open when ``expire_watches`` is called, ends with a 410 Expired ERROR event, as after a compaction),
``pods/log`` (``tailLines``, ``follow``: 400 while the container waits; the current file of a rotated log, a
follower moved on to the next), and SelfSubjectAccessReview (JSON, or
the protobuf kubectl's typed client posts). Users: kubectl sends no token over plain HTTP, so a kubeconfig's user
is the one it impersonates (``as``: the ``Impersonate-User`` header); ``users.json`` lists what each is denied
(``verb resource`` pairs, as RBAC would deny them), in ``auth can-i`` and with 403 on every request. Kueue's
webhook suspends a queued Job or JobSet on creation, and its visibility API lists a LocalQueue's pending workloads
(``pendingworkloads``, their positions in line).
"""

from __future__ import annotations

import base64
import copy
import json
import os
import secrets
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple
from urllib.parse import parse_qs, urlsplit

from . import apivalidation as check
from .store import QUEUE, TICK, Store, _key, now, touch
from .workloads import pending_workloads

VISIBILITY = "visibility.kueue.x-k8s.io"  # Kueue's visibility API: its LocalQueues' pending workloads, in line

# (group, version, plural) -> (kind, namespaced, singular, short names)
RESOURCES: Dict[Tuple[str, str, str], Tuple[str, bool, str, List[str]]] = {
    ("", "v1", "pods"): ("Pod", True, "pod", ["po"]),
    ("", "v1", "services"): ("Service", True, "service", ["svc"]),
    ("", "v1", "secrets"): ("Secret", True, "secret", []),
    ("", "v1", "configmaps"): ("ConfigMap", True, "configmap", ["cm"]),
    ("", "v1", "events"): ("Event", True, "event", ["ev"]),
    ("", "v1", "resourcequotas"): ("ResourceQuota", True, "resourcequota", ["quota"]),
    ("", "v1", "serviceaccounts"): ("ServiceAccount", True, "serviceaccount", ["sa"]),
    ("batch", "v1", "jobs"): ("Job", True, "job", []),
    ("scheduling.k8s.io", "v1", "priorityclasses"): ("PriorityClass", False, "priorityclass", ["pc"]),
    ("jobset.x-k8s.io", "v1alpha2", "jobsets"): ("JobSet", True, "jobset", []),
    ("kueue.x-k8s.io", "v1beta1", "workloads"): ("Workload", True, "workload", ["wl"]),
    ("authorization.k8s.io", "v1", "selfsubjectaccessreviews"): ("SelfSubjectAccessReview", False,
                                                                  "selfsubjectaccessreview", []),
}
VERBS = ["create", "delete", "get", "list", "patch", "watch"]
NAMESPACES = ["default", "kube-system", "kube-public"]  # those a cluster starts with
STATUS_SUBRESOURCE = ("Pod", "Job", "JobSet", "Workload", "ResourceQuota", "Service")


def _gv(group: str, version: str) -> str:
    return f"{group}/{version}" if group else version


def expire_watches(root: Path) -> None:
    """End every watch open now with 410 Expired, as an API server does after compacting its history."""
    (root / "watches_expired").write_text(str(time.time()))


class Gone(Exception):
    pass


class APIServer:
    def __init__(self, root: Path) -> None:
        self.store = Store(root)
        self.root = root
        self.cfg = self.store.config()

    def resources(self) -> Dict[Tuple[str, str, str], Tuple[str, bool, str, List[str]]]:
        return {k: v for k, v in RESOURCES.items() if self.cfg.get("jobset", True) or k[0] != "jobset.x-k8s.io"}

    def denied(self, user: str) -> List[str]:
        try:
            return json.loads((self.root / "users.json").read_text()).get(user, [])
        except (OSError, ValueError):
            return []


def _proto(data: bytes) -> Dict[int, List[Any]]:
    """The fields of a protobuf message: number -> values (bytes for length-delimited ones, else ints)."""
    out: Dict[int, List[Any]] = {}
    i = 0

    def varint() -> int:
        nonlocal i
        shift = value = 0
        while True:
            b = data[i]
            i += 1
            value |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                return value

    while i < len(data):
        key = varint()
        field, wire = key >> 3, key & 7
        if wire == 0:
            value: Any = varint()
        elif wire == 2:
            n = varint()
            value, i = data[i:i + n], i + n
        elif wire == 1:
            value, i = data[i:i + 8], i + 8
        else:
            value, i = data[i:i + 4], i + 4
        out.setdefault(field, []).append(value)
    return out


def status(code: int, reason: str, message: str, **details: Any) -> Dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "details": details, "code": code}


def merge(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge(out.get(k), v)
    return out


def _fields_match(obj: Dict[str, Any], selector: str) -> bool:
    for term in (t for t in selector.split(",") if t):
        key, _, value = term.partition("=")
        value = value.lstrip("=")
        got: Any = obj
        for part in key.split("."):
            got = got.get(part) if isinstance(got, dict) else None
        if str(got) != value:
            return False
    return True


class Handler(BaseHTTPRequestHandler):
    server_version = "kube-standin"
    protocol_version = "HTTP/1.1"
    api: APIServer

    def log_message(self, fmt: str, *args: Any) -> None:
        if os.environ.get("KUBE_APISERVER_LOG"):
            sys.stderr.write(f"{self.command} {self.path} {self.headers.get('Impersonate-User')} {fmt % args}\n")

    # -- replies ---------------------------------------------------------------------------------------------------
    def reply(self, code: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def fail(self, code: int, reason: str, message: str, **details: Any) -> None:
        self.reply(code, status(code, reason, message, **details))

    def start_stream(self, content_type: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def chunk(self, data: bytes) -> None:
        if data:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

    def end_stream(self) -> None:
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def body(self) -> Any:
        n = int(self.headers.get("Content-Length") or 0)
        return json.loads(self.rfile.read(n) or b"{}")

    def review(self) -> Dict[str, Any]:
        """The SelfSubjectAccessReview posted: JSON, or protobuf as kubectl's typed client sends it."""
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n)
        if "protobuf" not in (self.headers.get("Content-Type") or ""):
            review = json.loads(raw or b"{}")
            review.setdefault("spec", {}).setdefault("resourceAttributes", {})
            return review
        # The envelope (runtime.Unknown: 2 = the object), the review (2 = spec), its spec (1 = resourceAttributes).
        attrs = _proto(_proto(_proto(_proto(raw[4:])[2][0])[2][0])[1][0])
        names = {1: "namespace", 2: "verb", 3: "group", 4: "version", 5: "resource", 6: "subresource", 7: "name"}
        return {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview", "metadata": {},
                "spec": {"resourceAttributes": {names[k]: v[0].decode() for k, v in attrs.items() if k in names}}}

    # -- routing ---------------------------------------------------------------------------------------------------
    def do_GET(self) -> None:
        self.route("GET")

    def do_POST(self) -> None:
        self.route("POST")

    def do_PATCH(self) -> None:
        self.route("PATCH")

    def do_DELETE(self) -> None:
        self.route("DELETE")

    def route(self, method: str) -> None:
        url = urlsplit(self.path)
        q = {k: v[-1] for k, v in parse_qs(url.query).items()}
        parts = [p for p in url.path.split("/") if p]
        try:
            if method == "GET" and self.discovery(parts):
                return
            if method == "GET" and parts[:3] == ["apis", VISIBILITY, "v1beta1"] and len(parts) == 8 and \
                    parts[3] == "namespaces" and parts[5:8:2] == ["localqueues", "pendingworkloads"]:
                return self.pending_workloads(parts[4], parts[6])
            target = self.target(parts)
            if target is None:
                return self.fail(404, "NotFound", "the server could not find the requested resource")
            self.serve(method, q, *target)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def discovery(self, parts: List[str]) -> bool:
        res = self.api.resources()
        if parts == ["version"]:
            self.reply(200, {"major": "1", "minor": "32", "gitVersion": "v1.32.0-standin", "platform": "linux/amd64"})
        elif parts == ["api"]:
            self.reply(200, {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": [
                {"clientCIDR": "0.0.0.0/0", "serverAddress": self.headers.get("Host", "")}]})
        elif parts == ["apis"]:
            groups = sorted({(g, v) for g, v, _ in res if g})
            self.reply(200, {"kind": "APIGroupList", "apiVersion": "v1", "groups": [
                {"name": g, "versions": [{"groupVersion": _gv(g, v), "version": v}],
                 "preferredVersion": {"groupVersion": _gv(g, v), "version": v}} for g, v in groups]})
        elif parts == ["api", "v1"] or (len(parts) == 3 and parts[0] == "apis"):
            g, v = ("", "v1") if parts[0] == "api" else (parts[1], parts[2])
            listed = [(k, r) for k, r in res.items() if k[:2] == (g, v)]
            if not listed:
                return False
            out = []
            for (_, _, plural), (kind, namespaced, singular, short) in listed:
                verbs = ["create"] if kind == "SelfSubjectAccessReview" else VERBS
                out.append({"name": plural, "singularName": singular, "namespaced": namespaced, "kind": kind,
                            "verbs": verbs, **({"shortNames": short} if short else {})})
                if kind == "Pod":
                    out.append({"name": "pods/log", "singularName": "", "namespaced": True, "kind": "Pod",
                                "verbs": ["get"]})
            self.reply(200, {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": _gv(g, v),
                             "resources": out})
        elif parts[:2] == ["openapi", "v3"]:
            self.openapi(parts[2:], res)
        elif parts == ["openapi", "v2"]:
            # (older kubectl) An OpenAPI v2 document without definitions, in protobuf: kubectl validates no kind.
            def field(n: int, data: bytes) -> bytes:
                return bytes([n << 3 | 2, len(data)]) + data

            doc = field(1, b"2.0") + field(2, field(1, b"Kubernetes") + field(2, b"v1.32.0")) + field(8, b"")
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(len(doc)))
            self.end_headers()
            self.wfile.write(doc)
        else:
            return False
        return True

    def openapi(self, rest: List[str], res: Dict[Tuple[str, str, str], Any]) -> None:
        """What kubectl reads to learn that the server validates fields itself (``fieldValidation``): a PATCH
        operation per kind with that parameter."""
        gvs = sorted({(g, v) for g, v, _ in res})
        if not rest:
            self.reply(200, {"paths": {("api/" if not g else f"apis/{g}/") + v: {
                "serverRelativeURL": f"/openapi/v3/{'api/' if not g else f'apis/{g}/'}{v}?hash=1"} for g, v in gvs}})
            return
        g, v = ("", rest[1]) if rest[0] == "api" else (rest[1], rest[2])
        paths = {}
        for (rg, rv, plural), (kind, namespaced, _, _) in res.items():
            if (rg, rv) != (g, v):
                continue
            base = f"/api/{v}" if not g else f"/apis/{g}/{v}"
            path = f"{base}/namespaces/{{namespace}}/{plural}/{{name}}" if namespaced else f"{base}/{plural}/{{name}}"
            paths[path] = {"patch": {"x-kubernetes-group-version-kind": {"group": g, "version": v, "kind": kind},
                                     "parameters": [{"name": "fieldValidation", "in": "query",
                                                     "schema": {"type": "string", "uniqueItems": True}}],
                                     "responses": {"200": {"description": "OK"}}}}
        self.reply(200, {"openapi": "3.0.0", "info": {"title": "Kubernetes", "version": "v1.32.0"}, "paths": paths,
                         "components": {"schemas": {}}})

    def target(self, parts: List[str]) -> Optional[Tuple[str, str, str, str, str, str, str]]:
        """(group, version, plural, kind, namespace, name, subresource) of a resource path."""
        if parts[:2] == ["api", "v1"]:
            g, v, rest = "", "v1", parts[2:]
        elif len(parts) >= 3 and parts[0] == "apis":
            g, v, rest = parts[1], parts[2], parts[3:]
        else:
            return None
        ns = ""
        if len(rest) >= 2 and rest[0] == "namespaces":
            ns, rest = rest[1], rest[2:]
        if not rest:
            return None
        r = self.api.resources().get((g, v, rest[0]))
        if r is None:
            return None
        return g, v, rest[0], r[0], ns, rest[1] if len(rest) > 1 else "", rest[2] if len(rest) > 2 else ""

    # -- the API ---------------------------------------------------------------------------------------------------
    def user(self) -> Tuple[str, List[str]]:
        user = self.headers.get("Impersonate-User") or "system:anonymous"
        return user, self.api.denied(user)

    def serve(self, method: str, q: Dict[str, str], g: str, v: str, plural: str, kind: str, ns: str, name: str,
              sub: str) -> None:
        user, denied = self.user()
        if kind == "SelfSubjectAccessReview":
            review = self.review()
            a = review["spec"]["resourceAttributes"]
            asked = f"{a.get('verb')} {a.get('resource')}{'.' + a['group'] if a.get('group') else ''}" + (
                f"/{a['subresource']}" if a.get("subresource") else "")
            review["status"] = {"allowed": asked not in denied}
            return self.reply(201, review)
        verb = {"POST": "create", "PATCH": "patch", "DELETE": "delete"}.get(method) or (
            "watch" if q.get("watch") in ("true", "1") else "get" if name else "list")
        resource = f"{plural}{'.' + g if g else ''}{'/' + sub if sub else ''}"
        if f"{verb} {resource}" in denied:
            what = f'{plural}{"." + g if g else ""}' + (f' "{name}"' if name else "")
            return self.fail(403, "Forbidden", f'{what} is forbidden: User "{user}" cannot {verb} resource '
                             f'"{plural}" in API group "{g}" in the namespace "{ns}"', kind=plural)
        gv = _gv(g, v)
        if sub == "log":
            return self.log(ns, name, q)
        if self.refuse(check.selector_refusal(q.get("labelSelector", "")) or
                       check.field_refusal(kind, q.get("fieldSelector", ""))):
            return
        if method == "POST":
            obj = self.body()
            if self.refuse(check.namespace_refusal(ns, self.api.cfg.get("namespaces") or NAMESPACES) or
                           check.object_refusal(kind, g, obj)):
                return
            if q.get("dryRun") == "All":  # validated, defaulted, answered: not stored
                return self.reply(201, {**obj, "apiVersion": obj.get("apiVersion", gv), "kind": kind})
            return self.create(gv, kind, f"{plural}{'.' + g if g else ''}", ns, obj)
        if method == "DELETE":
            return self.delete(kind, plural, g, ns, name, self.body())
        if method == "PATCH":
            return self.patch(kind, plural, g, ns, name, self.body(), sub)
        if verb == "watch":
            return self.watch(kind, ns, name, q)
        doc = self.api.store.read()
        if name:
            obj = doc["objects"].get(_key(kind, ns, name))
            if obj is None:
                return self.not_found(plural, g, name)
            return self.reply(200, obj)
        items = [o for k, o in sorted(doc["objects"].items()) if k.startswith(f"{kind}/{ns}/" if ns else f"{kind}/")
                 and self.selected(o, q)]
        self.reply(200, {"kind": f"{kind}List", "apiVersion": gv, "metadata": {"resourceVersion": str(doc["rv"])},
                         "items": items})

    def not_found(self, plural: str, g: str, name: str) -> None:
        self.fail(404, "NotFound", f'{plural}{"." + g if g else ""} "{name}" not found', name=name, kind=plural,
                  **({"group": g} if g else {}))

    @staticmethod
    def selected(obj: Dict[str, Any], q: Dict[str, str]) -> bool:
        return check.label_match(obj["metadata"].get("labels") or {}, q.get("labelSelector", "")) and \
            _fields_match(obj, q.get("fieldSelector", ""))

    def refuse(self, refusal: Optional[check.Refusal]) -> bool:
        if refusal is not None:
            self.fail(refusal.code, refusal.reason, refusal.message)
        return refusal is not None

    def create(self, gv: str, kind: str, plural: str, ns: str, obj: Dict[str, Any]) -> None:
        meta = obj.setdefault("metadata", {})
        if kind == "PriorityClass":
            ns = ""
        meta["namespace"] = ns if ns else meta.get("namespace", "")
        if kind == "PriorityClass":
            meta.pop("namespace")
        with self.api.store.edit() as doc:
            key = _key(kind, ns, meta["name"])
            if key in doc["objects"]:
                return self.fail(409, "AlreadyExists", f'{plural} "{meta["name"]}" already exists',
                                 name=meta["name"], kind=plural)
            meta.update(uid=secrets.token_hex(8), creationTimestamp=now())
            if kind == "PriorityClass":
                meta["namespace"] = ""
            obj.setdefault("apiVersion", gv)
            obj["kind"] = kind
            if kind == "Secret" and "stringData" in obj:
                data = obj.setdefault("data", {})
                for k, text in obj.pop("stringData").items():
                    data[k] = base64.b64encode(text.encode()).decode()
            if kind in ("Job", "JobSet"):
                obj["status"] = {}
                labels = meta.setdefault("labels", {})
                if labels.get(QUEUE) and not meta.get("ownerReferences"):
                    # Kueue's webhook: a queued workload runs once admitted (its queue existing or not)
                    obj["spec"]["suspend"] = True
            doc["objects"][key] = obj
            touch(doc, obj, "ADDED")
        self.reply(201, obj)

    def patch(self, kind: str, plural: str, g: str, ns: str, name: str, change: Dict[str, Any], sub: str = "") -> None:
        with self.api.store.edit() as doc:
            obj = doc["objects"].get(_key(kind, ns, name))
            if obj is None:
                return self.not_found(plural, g, name)
            if kind in STATUS_SUBRESOURCE:
                # status is a subresource: a patch of the object leaves it, one of .../status changes it alone
                change = {"status": change.get("status")} if sub == "status" else \
                    {k: v for k, v in change.items() if k != "status"}
            new = merge(obj, change)
            obj.clear()
            obj.update(new)
            touch(doc, obj)
        self.reply(200, obj)

    def delete(self, kind: str, plural: str, g: str, ns: str, name: str, opts: Dict[str, Any]) -> None:
        with self.api.store.edit() as doc:
            obj = doc["objects"].get(_key(kind, ns, name))
            if obj is None:
                return self.not_found(plural, g, name)
            meta = obj["metadata"]
            if opts.get("gracePeriodSeconds") == 0 and kind == "Pod":
                meta["forceKill"] = True
            if not meta.get("deletionTimestamp"):
                meta["deletionTimestamp"] = now()
                if opts.get("propagationPolicy") == "Foreground" and kind in ("Job", "JobSet"):
                    meta["finalizers"] = ["foregroundDeletion"]
                touch(doc, obj)
            out = copy.deepcopy(obj)
        self.reply(200, out)

    def watch(self, kind: str, ns: str, name: str, q: Dict[str, str]) -> None:
        store = Store(self.api.root)  # its own: changed() remembers what this watch last read
        doc = store.read()
        since = int(q.get("resourceVersion") or 0) or doc["rv"]
        oldest = min((int(e["object"]["metadata"]["resourceVersion"]) for e in doc["events"]), default=doc["rv"])
        self.start_stream("application/json")
        expired = self.api.root / "watches_expired"
        opened = time.time()
        if since < oldest - 1:
            return self.gone(since, oldest)
        deadline = time.monotonic() + float(q.get("timeoutSeconds") or 1800)
        fresh = True  # the changes since resourceVersion already made (kubectl listed, then watches) come first
        while time.monotonic() < deadline:
            if expired.exists() and float(expired.read_text() or 0) > opened:
                sys.stderr.write(f"watch of {kind} in {ns or 'all namespaces'} expired (410)\n")
                return self.gone(since, oldest)
            if fresh or store.changed():
                doc = doc if fresh else store.read()
                fresh = False
                for ev in doc["events"]:
                    o = ev["object"]
                    rv = int(o["metadata"]["resourceVersion"])
                    if rv <= since or o["kind"] != kind or (ns and o["metadata"].get("namespace") != ns) or \
                            not self.selected(o, q):
                        continue
                    self.chunk(json.dumps(ev).encode() + b"\n")
                    since = rv
                since = max(since, doc["rv"])
            time.sleep(TICK)
        self.end_stream()

    def gone(self, since: int, oldest: int) -> None:
        self.chunk(json.dumps({"type": "ERROR", "object": status(
            410, "Expired", f"too old resource version: {since} ({oldest})")}).encode() + b"\n")
        self.end_stream()

    def pending_workloads(self, ns: str, queue: str) -> None:
        if queue not in (self.api.cfg.get("queues") or {}):
            return self.fail(404, "NotFound", f'localqueues.kueue.x-k8s.io "{queue}" not found')
        self.reply(200, pending_workloads(Store(self.api.root).read()["objects"], ns, queue))

    def log(self, ns: str, name: str, q: Dict[str, str]) -> None:
        store = Store(self.api.root)
        key = _key("Pod", ns, name)
        obj = store.read()["objects"].get(key)
        if obj is None:
            return self.not_found("pods", "", name)
        path = store.log(ns, name)
        if not path.exists():
            return self.fail(400, "BadRequest", f'container "{obj["spec"]["containers"][0]["name"]}" in pod '
                             f'"{name}" is waiting to start: ContainerCreating')
        self.start_stream("text/plain")
        f = open(path, "rb")  # the current file only: what the kubelet rotated away is not served
        try:
            lines = f.read().splitlines(keepends=True)
            if "tailLines" in q:
                lines = lines[-int(q["tailLines"]):] if int(q["tailLines"]) else []
            self.chunk(b"".join(lines))
            while q.get("follow") == "true":
                data = f.read()
                if data:
                    self.chunk(data)
                    continue
                if _rotated(path, f):  # the kubelet's follower moves on to the new file, the old one read out
                    self.chunk(f.read())
                    f.close()
                    f = open(path, "rb")
                    continue
                if store.changed():
                    cur = store.read()["objects"].get(key)
                    if cur is None or (cur.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                        self.chunk(f.read())
                        break
                time.sleep(TICK)
        finally:
            f.close()
        self.end_stream()


def _rotated(path: Path, f) -> bool:
    try:
        return os.stat(path).st_ino != os.fstat(f.fileno()).st_ino
    except FileNotFoundError:  # between the rename and the new file
        return False


def serve(root: Path, port_file: Path) -> None:
    check.preload()
    api = APIServer(root)
    handler = type("BoundHandler", (Handler,), {"api": api})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    port_file.write_text(str(httpd.server_address[1]))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        while True:
            time.sleep(3600)
    finally:
        httpd.shutdown()
