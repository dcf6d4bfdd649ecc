"""What the stand-in's API server admits and its scheduler places, as a real cluster's do: a pod is refused when
its ServiceAccount or PriorityClass does not exist or a ResourceQuota of its namespace requires what it does not
give or has no room left (the Job controller then records ``FailedCreate`` with the API server's words); it is
placed on a node whose labels its node selector matches, whose taints it tolerates and whose allocatable
resources hold its requests beside those of the pods already there, else it stays Pending with the scheduler's
message (``0/4 nodes are available: 1 Insufficient nvidia.com/gpu, ...``)."""

from __future__ import annotations

from collections import Counter
from typing import Any, Dict, Iterable, List

_SUFFIX = {"Ki": 2 ** 10, "Mi": 2 ** 20, "Gi": 2 ** 30, "Ti": 2 ** 40, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9,
           "T": 1e12}
TERMINAL = ("Succeeded", "Failed")


def qty(text: Any) -> float:
    text = str(text)
    for suffix in sorted(_SUFFIX, key=len, reverse=True):
        if text.endswith(suffix):
            return float(text[:-len(suffix)]) * _SUFFIX[suffix]
    return float(text)


def _show(resource: str, value: float) -> str:
    if "memory" in resource:
        return f"{value / 2 ** 30:g}Gi"
    return f"{value * 1000:g}m" if value != int(value) else f"{value:g}"


def pod_usage(spec: Dict[str, Any]) -> Dict[str, float]:
    """What a pod counts against a quota: ``requests.X`` (also plain ``cpu``/``memory``), ``limits.X``, ``pods``.
    A limit alone also requests as much, as the API server defaults it."""
    out: Dict[str, float] = {"pods": 1}
    for c in spec.get("containers") or []:
        res = c.get("resources") or {}
        requests = {**(res.get("limits") or {}), **(res.get("requests") or {})}
        for name, value in requests.items():
            for key in (f"requests.{name}", *([name] if name in ("cpu", "memory") else [])):
                out[key] = out.get(key, 0) + qty(value)
        for name, value in (res.get("limits") or {}).items():
            out[f"limits.{name}"] = out.get(f"limits.{name}", 0) + qty(value)
    return out


def _live_pods(objs: Dict[str, Any], ns: str = "") -> Iterable[Dict[str, Any]]:
    return (p for k, p in objs.items() if k.startswith(f"Pod/{ns}/" if ns else "Pod/")
            and (p.get("status") or {}).get("phase") not in TERMINAL)


def refusal(objs: Dict[str, Any], ns: str, spec: Dict[str, Any]) -> str:
    """Why the API server refuses a pod of ``spec`` in ``ns`` ("" when it admits it)."""
    sa = spec.get("serviceAccountName")
    if sa and sa != "default" and f"ServiceAccount/{ns}/{sa}" not in objs:
        return f'error looking up service account {ns}/{sa}: serviceaccount "{sa}" not found'
    pc = spec.get("priorityClassName")
    if pc and f"PriorityClass//{pc}" not in objs:
        return f"no PriorityClass with name {pc} was found"
    want = pod_usage(spec)
    for key, quota in sorted(objs.items()):
        if not key.startswith(f"ResourceQuota/{ns}/"):
            continue
        name, hard = quota["metadata"]["name"], quota["spec"].get("hard") or {}
        missing = sorted(r for r in hard if r != "pods" and r not in want)
        if missing:
            containers = ",".join(c["name"] for c in spec.get("containers") or [])
            return f"failed quota: {name}: must specify {','.join(missing)} for: {containers}"
        used: Dict[str, float] = {}
        for p in _live_pods(objs, ns):
            for r, v in pod_usage(p["spec"]).items():
                used[r] = used.get(r, 0) + v
        over = sorted(r for r in hard if want.get(r, 0) + used.get(r, 0) > qty(hard[r]))
        if over:
            return (f"exceeded quota: {name}, requested: {','.join(f'{r}={_show(r, want[r])}' for r in over)}, "
                    f"used: {','.join(f'{r}={_show(r, used.get(r, 0))}' for r in over)}, "
                    f"limited: {','.join(f'{r}={hard[r]}' for r in over)}")
    return ""


def _tolerates(tolerations: List[Dict[str, Any]], taint: Dict[str, Any]) -> bool:
    for t in tolerations:
        if t.get("effect") and t["effect"] != taint["effect"]:
            continue
        if t.get("operator") == "Exists" and t.get("key") in (None, "", taint["key"]):
            return True
        if t.get("key") == taint["key"] and t.get("value", "") == taint.get("value", ""):
            return True
    return False


def place(objs: Dict[str, Any], nodes: List[Dict[str, Any]], pod: Dict[str, Any]):
    """(node, sandbox) for ``pod``, the least loaded node that fits (the default scheduler spreads likewise), or
    (None, the scheduler's message)."""
    spec = pod["spec"]
    want = spec.get("nodeSelector") or {}
    need = {r[len("requests."):]: v for r, v in pod_usage(spec).items() if r.startswith("requests.")}
    reasons: Counter = Counter()
    fits = []
    live = list(_live_pods(objs))
    for node in nodes:
        if not all((node.get("labels") or {}).get(k) == v for k, v in want.items()):
            reasons["node(s) didn't match Pod's node affinity/selector"] += 1
            continue
        taints = [t for t in node.get("taints") or [] if t["effect"] in ("NoSchedule", "NoExecute")
                  and not _tolerates(spec.get("tolerations") or [], t)]
        if taints:
            reasons[f"node(s) had untolerated taint {{{taints[0]['key']}: {taints[0].get('value', '')}}}"] += 1
            continue
        mine = [p for p in live if p["spec"].get("nodeName") == node["name"]]
        held = {p["status"].get("podIP") for p in mine}
        free = [s for s in node["pods"] if s["ip"] not in held]
        if not free:
            reasons["Too many pods"] += 1
            continue
        used: Dict[str, float] = {}
        for p in mine:
            for r, v in pod_usage(p["spec"]).items():
                used[r] = used.get(r, 0) + v
        short = [r for r, v in need.items() if used.get(f"requests.{r}", 0) + v > qty(node["allocatable"].get(r, 0))]
        if short:
            for r in short:
                reasons[f"Insufficient {r}"] += 1
            continue
        fits.append((len(mine), node, free[0]))
    if not fits:
        n = len(nodes)
        why = ", ".join(sorted(f"{count} {reason}" for reason, count in reasons.items()))
        return None, (f"0/{n} nodes are available: {why}. preemption: 0/{n} nodes are available: {n} Preemption is "
                      "not helpful for scheduling.")
    _, node, sandbox = min(fits, key=lambda f: f[0])
    return (node, sandbox), ""

