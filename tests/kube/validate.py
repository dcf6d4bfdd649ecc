"""Offline validation of Kubernetes manifests, for tests (no API server can run here: REFERENCE §6).

Each document is validated against the official ``kubernetes`` client's model for its apiVersion + kind
(pydantic, ``extra='forbid'``: misspelled fields, wrong types, missing required fields). The models do not
check enum values, names, label syntax or quantities, nor whether the documents fit together, so
``problems`` adds those checks for every field the renderer writes.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Tuple

import pydantic
from kubernetes.client import models as M

MODELS = {("v1", "Secret"): M.V1Secret, ("v1", "Service"): M.V1Service, ("v1", "ConfigMap"): M.V1ConfigMap,
          ("v1", "Pod"): M.V1Pod, ("batch/v1", "Job"): M.V1Job}
ENUMS = {  # field path (with [] for list items) -> the values the API server accepts
    "spec.completionMode": {"NonIndexed", "Indexed"},
    "spec.template.spec.restartPolicy": {"Never", "OnFailure"},  # a Job's pods may not use Always
    "spec.type": {"ClusterIP", "NodePort", "LoadBalancer", "ExternalName"},
    "spec.ports[].protocol": {"TCP", "UDP", "SCTP"},
    "spec.template.spec.containers[].ports[].protocol": {"TCP", "UDP", "SCTP"},
    "spec.template.spec.containers[].imagePullPolicy": {"Always", "Never", "IfNotPresent"},
    "type": {"Opaque"},  # the only Secret type the renderer may write
    "spec.template.spec.tolerations[].operator": {"Exists", "Equal"},
    "spec.template.spec.tolerations[].effect": {"NoSchedule", "PreferNoSchedule", "NoExecute"},
    "spec.template.spec.securityContext.seccompProfile.type": {"RuntimeDefault", "Localhost", "Unconfined"},
    "spec.template.spec.containers[].securityContext.seccompProfile.type": {"RuntimeDefault", "Localhost",
                                                                            "Unconfined"},
}
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DNS_1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
LABEL_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
PORT_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
QUANTITY = re.compile(r"(\d+(\.\d*)?|\.\d+)(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei|[eE][-+]?\d+)?")
ENV_NAME = re.compile(r"[-._a-zA-Z][-._a-zA-Z0-9]*")


def values_at(doc: Any, path: str) -> Iterator[Tuple[str, Any]]:
    """(concrete path, value) of every value at ``path`` (``a.b[].c``), skipping what is absent."""
    parts = path.split(".")
    stack: List[Tuple[str, Any, List[str]]] = [("", doc, parts)]
    while stack:
        where, node, rest = stack.pop()
        if not rest:
            yield where.lstrip("."), node
            continue
        key, many = rest[0].rstrip("[]"), rest[0].endswith("[]")
        if not isinstance(node, dict) or key not in node:
            continue
        if many:
            for i, item in enumerate(node[key] or []):
                stack.append((f"{where}.{key}[{i}]", item, rest[1:]))
        else:
            stack.append((f"{where}.{key}", node[key], rest[1:]))


def _name_ok(pattern: re.Pattern, value: Any, limit: int) -> bool:
    return isinstance(value, str) and len(value) <= limit and bool(pattern.fullmatch(value))


def _labels(where: str, labels: Mapping[str, Any]) -> List[str]:
    out = []
    for key, value in (labels or {}).items():
        prefix, _, name = key.rpartition("/")
        if (prefix and not _name_ok(SUBDOMAIN, prefix, 253)) or not _name_ok(LABEL_NAME, name, 63):
            out.append(f"{where}: label key {key!r} is not a qualified name")
        if not _name_ok(LABEL_VALUE, value, 63):
            out.append(f"{where}: label {key}={value!r} is not a valid label value")
    return out


def _one(doc: Dict[str, Any]) -> List[str]:
    kind, version = doc.get("kind"), doc.get("apiVersion")
    meta = doc.get("metadata") or {}
    what = f"{kind} {meta.get('name')}"
    model = MODELS.get((version, kind))
    if model is None:
        return [f"{what}: no such kind here: apiVersion {version!r}, kind {kind!r}"]
    try:
        model.model_validate(doc)
    except pydantic.ValidationError as e:
        return [f"{what}: {err['loc']}: {err['msg']}" for err in e.errors()]
    out = []
    for path, allowed in ENUMS.items():
        for where, value in values_at(doc, path):
            if value not in allowed:
                out.append(f"{what}: {where} = {value!r} is not one of {sorted(allowed)}")
    name_rule = DNS_1035 if kind == "Service" else DNS_LABEL
    if not _name_ok(name_rule, meta.get("name"), 63):
        out.append(f"{what}: metadata.name is not a DNS label")
    if "namespace" in meta and not _name_ok(DNS_LABEL, meta["namespace"], 63):
        out.append(f"{what}: metadata.namespace {meta['namespace']!r} is not a DNS label")
    out += _labels(f"{what} metadata", meta.get("labels"))
    for path in ("spec.template.metadata.labels", "spec.selector"):
        for where, labels in values_at(doc, path):
            out += _labels(f"{what} {where}", labels)
    for where, c in values_at(doc, "spec.template.spec.containers[]"):
        if not _name_ok(DNS_LABEL, c.get("name"), 63):
            out.append(f"{what}: {where}.name is not a DNS label")
        for e in c.get("env") or []:
            if not ENV_NAME.fullmatch(e["name"]):
                out.append(f"{what}: {where}: env name {e['name']!r} is not valid")
        for kind_ in ("requests", "limits"):
            for res, qty in ((c.get("resources") or {}).get(kind_) or {}).items():
                if not QUANTITY.fullmatch(qty):
                    out.append(f"{what}: {where}.resources.{kind_}.{res} = {qty!r} is not a quantity")
    for path in ("spec.ports[].name", "spec.template.spec.containers[].ports[].name"):
        for where, value in values_at(doc, path):
            if not _name_ok(PORT_NAME, value, 15) or not re.search("[a-z]", value):
                out.append(f"{what}: {where} = {value!r} is not a port name (IANA_SVC_NAME, at most 15)")
    for where, value in values_at(doc, "spec.template.spec.subdomain"):
        if not _name_ok(DNS_LABEL, value, 63):
            out.append(f"{what}: {where} is not a DNS label")
    return out


def _fit(docs: List[Dict[str, Any]]) -> List[str]:
    """Whether the documents refer to each other correctly."""
    out = []
    secrets = {(d["metadata"].get("namespace"), d["metadata"]["name"]):
               set(d.get("stringData") or {}) | set(d.get("data") or {}) for d in docs if d.get("kind") == "Secret"}
    services = {(d["metadata"].get("namespace"), d["metadata"]["name"]): d["spec"]
                for d in docs if d.get("kind") == "Service"}
    for d in docs:
        if d.get("kind") != "Job":
            continue
        ns, name = d["metadata"].get("namespace"), d["metadata"]["name"]
        pod = d["spec"]["template"]
        sub = pod["spec"].get("subdomain")
        if sub is not None:
            svc = services.get((ns, sub))
            if svc is None or svc.get("clusterIP") != "None":
                out.append(f"Job {name}: subdomain {sub!r} names no headless Service of namespace {ns}")
            elif not set((svc.get("selector") or {}).items()) <= set((pod["metadata"].get("labels") or {}).items()):
                out.append(f"Job {name}: Service {sub} does not select its pods")
            if len(f"{name}-{d['spec'].get('completions', 1) - 1}") > 63:
                out.append(f"Job {name}: its last pod's hostname would exceed 63 characters")
        volumes = {v["name"] for v in pod["spec"].get("volumes") or []}
        for c in pod["spec"]["containers"]:
            for e in c.get("env") or []:
                ref = (e.get("valueFrom") or {}).get("secretKeyRef")
                if ref and ref["key"] not in secrets.get((ns, ref["name"]), set()):
                    out.append(f"Job {name}: env {e['name']} refers to {ref['name']}/{ref['key']}, which no Secret "
                               "of these manifests holds")
            for v in pod["spec"].get("volumes") or []:
                ref = v.get("secret")
                keys = [i["key"] for i in (ref or {}).get("items") or []]
                if ref and not set(keys) <= secrets.get((ns, ref["secretName"]), set()):
                    out.append(f"Job {name}: volume {v['name']} refers to {ref['secretName']} {keys}, which no "
                               "Secret of these manifests holds")
            for m in c.get("volumeMounts") or []:
                if m["name"] not in volumes:
                    out.append(f"Job {name}: volumeMount {m['name']} names no volume of the pod")
    return out


def problems(docs: List[Dict[str, Any]]) -> List[str]:
    """Everything wrong with ``docs``; [] when each is valid and they fit together."""
    out = [p for d in docs for p in _one(d)]
    return out or _fit(docs)


def env_of(container: Mapping[str, Any]) -> Dict[str, str]:
    """The literal variables of a rendered container (those not taken from a Secret or field)."""
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


# -- the restricted Pod Security Standard (kubernetes.io/docs/concepts/security/pod-security-standards) -----------

RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}


def pod_templates(doc: Dict[str, Any]) -> Iterator[Tuple[str, Dict[str, Any]]]:
    """(where, pod spec) of every pod a document makes: a Job's template, each replicated Job of a JobSet."""
    for where, spec in values_at(doc, "spec.template.spec"):
        yield where, spec
    for where, spec in values_at(doc, "spec.replicatedJobs[].template.spec.template.spec"):
        yield where, spec


def restricted_problems(docs: List[Dict[str, Any]]) -> List[str]:
    """Where the pods of ``docs`` break the restricted profile (and the baseline one it includes); [] if none."""
    out = []
    for d in docs:
        for where, pod in pod_templates(d):
            what = f"{d['kind']} {d['metadata']['name']} {where}"
            psc = pod.get("securityContext") or {}
            for host in ("hostNetwork", "hostPID", "hostIPC"):
                if pod.get(host):
                    out.append(f"{what}: {host} is not allowed")
            for v in pod.get("volumes") or []:
                kinds = set(v) - {"name"}
                if not kinds <= RESTRICTED_VOLUMES:
                    out.append(f"{what}: volume {v['name']} of type {sorted(kinds)} is not allowed")
            if psc.get("runAsUser") == 0:
                out.append(f"{what}: securityContext.runAsUser 0 (root)")
            for c in (pod.get("containers") or []) + (pod.get("initContainers") or []):
                csc = c.get("securityContext") or {}
                cw = f"{what} container {c.get('name')}"
                if csc.get("privileged"):
                    out.append(f"{cw}: privileged")
                if csc.get("allowPrivilegeEscalation") is not False:
                    out.append(f"{cw}: allowPrivilegeEscalation must be false")
                caps = csc.get("capabilities") or {}
                if "ALL" not in (caps.get("drop") or []):
                    out.append(f"{cw}: capabilities must drop ALL")
                if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
                    out.append(f"{cw}: capabilities may add only NET_BIND_SERVICE")
                if csc.get("runAsNonRoot", psc.get("runAsNonRoot")) is not True:
                    out.append(f"{cw}: runAsNonRoot must be true (pod or container)")
                if csc.get("runAsUser", psc.get("runAsUser")) == 0:
                    out.append(f"{cw}: runAsUser 0 (root)")
                seccomp = (csc.get("seccompProfile") or psc.get("seccompProfile") or {}).get("type")
                if seccomp not in ("RuntimeDefault", "Localhost"):
                    out.append(f"{cw}: seccompProfile.type must be RuntimeDefault or Localhost, not {seccomp}")
                for p in c.get("ports") or []:
                    if p.get("hostPort"):
                        out.append(f"{cw}: hostPort {p['hostPort']}")
    return out


# -- JobSet (jobset.x-k8s.io), against an excerpt of its CRD's schema (jobset_v1alpha2_spec.json says which) --

JOBSET = json.loads((Path(__file__).parent / "jobset_v1alpha2_spec.json").read_text())
_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "integer": int}


def _schema(where: str, value: Any, s: Dict[str, Any]) -> List[str]:
    """What the API server's structural-schema validation says of ``value`` (CEL rules aside); an unknown field,
    which it would silently drop, is a problem too."""
    t = s.get("type")
    if t and (not isinstance(value, _TYPES[t]) or (t == "integer" and isinstance(value, bool))):
        return [f"{where}: {value!r} is not of type {t}"]
    out = []
    if "enum" in s and value not in s["enum"]:
        out.append(f"{where}: {value!r} is not one of {s['enum']}")
    if t == "integer":
        if "minimum" in s and value < s["minimum"]:
            out.append(f"{where}: {value} is below {s['minimum']}")
        if s.get("format") == "int32" and not -2**31 <= value < 2**31:
            out.append(f"{where}: {value} is not an int32")
    if t == "object" and "properties" in s:
        for k in s.get("required", []):
            if k not in value:
                out.append(f"{where}: {k} is required")
        for k, v in value.items():
            if k in s["properties"]:
                out += _schema(f"{where}.{k}", v, s["properties"][k])
            elif not s.get("x-kubernetes-preserve-unknown-fields"):
                out.append(f"{where}.{k}: unknown field (the API server would drop it)")
    if t == "array" and "items" in s:
        for i, v in enumerate(value):
            out += _schema(f"{where}[{i}]", v, s["items"])
    return out


def jobset_problems(doc: Dict[str, Any]) -> List[str]:
    """Everything wrong with a JobSet document: its schema, its metadata (V1ObjectMeta) and each replicated Job's
    template as a batch/v1 Job (the official model plus the checks of ``problems``)."""
    what = f"JobSet {(doc.get('metadata') or {}).get('name')}"
    out = []
    if doc.get("apiVersion") != f"{JOBSET['group']}/{JOBSET['version']}" or doc.get("kind") != JOBSET["kind"]:
        out.append(f"{what}: apiVersion/kind {doc.get('apiVersion')}/{doc.get('kind')} is not "
                   f"{JOBSET['group']}/{JOBSET['version']} {JOBSET['kind']}")
    unknown = set(doc) - {"apiVersion", "kind", "metadata", "spec"}
    out += [f"{what}: unknown top-level field {k}" for k in sorted(unknown)]
    try:
        M.V1ObjectMeta.model_validate(doc.get("metadata") or {})
    except pydantic.ValidationError as e:
        out += [f"{what}: metadata {err['loc']}: {err['msg']}" for err in e.errors()]
    out += _labels(f"{what} metadata", (doc.get("metadata") or {}).get("labels"))
    out += [f"{what}: {p}" for p in _schema("spec", doc.get("spec"), JOBSET["spec"])]
    for rj in (doc.get("spec") or {}).get("replicatedJobs") or []:
        tmpl = rj.get("template") or {}
        try:
            M.V1JobTemplateSpec.model_validate(tmpl)
        except pydantic.ValidationError as e:
            out += [f"{what}: replicatedJobs {rj.get('name')} template {err['loc']}: {err['msg']}"
                    for err in e.errors()]
            continue
        as_job = {"apiVersion": "batch/v1", "kind": "Job", "spec": tmpl.get("spec"),
                  "metadata": {"name": f"{doc['metadata']['name']}-{rj.get('name')}", **(tmpl.get("metadata") or {})}}
        out += _one(as_job)
    return out
