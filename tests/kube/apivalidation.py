"""What the stand-in's API server refuses, as a real one does (``apiserver.py`` asks): an object that does not
decode strictly into its kind's schema (the official Python client's models, ``extra='forbid'``: an unknown field
or a wrong type; JobSet: its CRD's structural schema) or breaks a rule the server validates (enum values, names,
labels, quantities: ``validate.py``), a namespace that does not exist, a label selector that does not parse
(equality- and set-based: ``in``, ``notin``, ``!key``), and a field selector on a field the kind does not
support. Each is a ``Refusal``: the HTTP code, the Status reason and the server's message.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

VALIDATED = ("Job", "Service", "Secret", "ConfigMap", "Pod", "JobSet")
# What every kind's field selectors support, and what some kinds add (the API server's field label conversions).
FIELDS_ALL = {"metadata.name", "metadata.namespace"}
FIELDS = {
    "Pod": {"spec.nodeName", "spec.restartPolicy", "spec.schedulerName", "spec.serviceAccountName",
            "spec.hostNetwork", "status.phase", "status.podIP", "status.podIPs", "status.nominatedNodeName"},
    "Event": {"involvedObject.kind", "involvedObject.namespace", "involvedObject.name", "involvedObject.uid",
              "involvedObject.apiVersion", "involvedObject.resourceVersion", "involvedObject.fieldPath", "reason",
              "reportingComponent", "source", "type"},
    "Job": {"status.successful"},
    "Secret": {"type"},
}
_LABEL_KEY = re.compile(r"([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
_SET = re.compile(r"^\s*(\S+)\s+(in|notin)\s+\(([^)]*)\)\s*$")
_validate = None
_loaded = threading.Event()


def preload() -> None:
    """Import the models in the background (seconds): the first create need not wait for all of it."""
    def load() -> None:
        global _validate
        from . import validate

        _validate = validate
        _loaded.set()

    threading.Thread(target=load, daemon=True, name="models").start()


@dataclass(frozen=True)
class Refusal:
    code: int
    reason: str
    message: str


def terms(selector: str) -> List[str]:
    """The terms of a label selector: split on the commas outside parentheses."""
    out, depth, cur = [], 0, ""
    for ch in selector:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    return [t.strip() for t in out + [cur] if t.strip()]


def label_match(labels: Dict[str, str], selector: str) -> bool:
    """Whether ``labels`` match ``selector`` (``selector_refusal`` has checked it parses)."""
    for term in terms(selector):
        m = _SET.match(term)
        if m:
            values = {v.strip() for v in m.group(3).split(",") if v.strip()}
            if (m.group(2) == "in") != (labels.get(m.group(1)) in values):
                return False
        elif "!=" in term:
            k, v = (x.strip() for x in term.split("!=", 1))
            if labels.get(k) == v:
                return False
        elif "=" in term:
            k, v = (x.strip() for x in (term.split("==", 1) if "==" in term else term.split("=", 1)))
            if labels.get(k) != v:
                return False
        elif term.startswith("!"):
            if term[1:].strip() in labels:
                return False
        elif term not in labels:
            return False
    return True


def selector_refusal(selector: str) -> Optional[Refusal]:
    for term in terms(selector):
        m = _SET.match(term)
        if m:
            keys, values = [m.group(1)], [v.strip() for v in m.group(3).split(",")]
            if not any(values):
                return Refusal(400, "BadRequest", "unable to parse requirement: values: Invalid value: "
                                                  "[]: for 'in', 'notin' operators, values set can't be empty")
        else:
            op = "!=" if "!=" in term else "==" if "==" in term else "=" if "=" in term else ""
            key, _, value = term.partition(op) if op else (term.lstrip("!"), "", "")
            keys, values = [key.strip()], [value.strip()]
            if not op and (" " in term.strip() or "(" in term):
                return Refusal(400, "BadRequest", f"unable to parse requirement: found '{term.split()[-1]}', "
                                                  "expected: in, notin, =, ==, !=, gt, lt")
        for k in keys:
            if not _LABEL_KEY.fullmatch(k) or len(k.split("/")[-1]) > 63:
                return Refusal(400, "BadRequest", f'unable to parse requirement: key: Invalid value: "{k}": name '
                                                  "part must consist of alphanumeric characters, '-', '_' or '.'")
        for v in values:
            if not _LABEL_VALUE.fullmatch(v) or len(v) > 63:
                return Refusal(400, "BadRequest", f'unable to parse requirement: values[0]: Invalid value: "{v}": '
                                                  "a valid label must be an empty string or consist of "
                                                  "alphanumeric characters, '-', '_' or '.'")
    return None


def field_refusal(kind: str, selector: str) -> Optional[Refusal]:
    for term in (t.strip() for t in selector.split(",") if t.strip()):
        key = re.split(r"!=|==|=", term, maxsplit=1)[0].strip()
        if key not in FIELDS_ALL | FIELDS.get(kind, set()):
            return Refusal(400, "BadRequest", f'field label not supported: {key}')
    return None


def namespace_refusal(ns: str, namespaces: List[str]) -> Optional[Refusal]:
    if ns and ns not in namespaces:
        return Refusal(404, "NotFound", f'namespaces "{ns}" not found')
    return None


def object_refusal(kind: str, group: str, obj: Dict[str, Any]) -> Optional[Refusal]:
    """What the server says of ``obj`` on create (strict field validation, as kubectl asks for): an unknown field
    or a wrong type is 400 BadRequest (strict decoding), a broken rule 422 Invalid; None when it is valid."""
    if kind not in VALIDATED:
        return None
    _loaded.wait(60)
    v = _validate
    assert v is not None, "the models did not load"
    found = v.jobset_problems(obj) if kind == "JobSet" else v._one(obj)
    if not found:
        return None
    name = (obj.get("metadata") or {}).get("name", "")
    unknown = [p for p in found if "Extra inputs are not permitted" in p or "unknown" in p]
    if unknown:
        return Refusal(400, "BadRequest", f"strict decoding error: {'; '.join(unknown)}")
    return Refusal(422, "Invalid", f'{kind}{"." + group if group else ""} "{name}" is invalid: {"; ".join(found)}')
