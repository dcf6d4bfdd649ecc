"""The launcher's memory of the jobs of each config: the latest (``kill``, ``status``, ``logs`` and ``plot``
default to it) and, per job, its backend and that backend's handle (``where``), so those commands find any job
on its engine. One small JSON file per config under ``$XDG_STATE_HOME/paddle-cluster/``. Launches from this
machine may run at the same moment: every change is made under the directory's lock (``cache.locked``) and
written whole to a temporary of its own, then renamed into place."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Set

from . import cache
from .config import ClusterConfig
from .errors import ClusterError


def _state_file(cfg: ClusterConfig) -> Path:
    source = cfg.source if cfg.is_builtin_default else os.path.abspath(cfg.source)
    key = hashlib.sha1(json.dumps([source, [h.text for h in cfg.hosts], cfg.root_dir]).encode()).hexdigest()[:16]
    base = Path(os.environ.get("XDG_STATE_HOME", Path.home() / ".local" / "state")) / "paddle-cluster"
    return base / f"{key}.json"


def _read(cfg: ClusterConfig) -> Dict[str, Any]:
    try:
        doc = json.loads(_state_file(cfg).read_text())
        return doc if isinstance(doc, dict) else {}
    except (OSError, ValueError):
        return {}


def _update(cfg: ClusterConfig, change: Callable[[Dict[str, Any]], Any]) -> Any:
    """``change(doc)`` applied to this config's record under the lock, and saved; what ``change`` returned."""
    path = _state_file(cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    with cache.locked(str(path.parent)):
        doc = _read(cfg)
        out = change(doc)
        tmp = cache.temp_name(str(path.parent), "journal")
        try:
            Path(tmp).write_text(json.dumps(doc))
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
    return out


KEPT = 20  # jobs whose outcome and handle are remembered per config


def remember(cfg: ClusterConfig, job_name: str, workspace: Optional[str],
             where: Optional[Dict[str, str]] = None) -> None:
    """``where``: the job's backend and what it needs to find the job again (``Request.handle``: Kubernetes its
    namespace, Slurm its job id)."""
    def change(doc: Dict[str, Any]) -> None:
        outcomes = {k: v for k, v in doc.get("outcomes", {}).items() if k != job_name}
        jobs = {k: v for k, v in doc.get("jobs", {}).items() if k != job_name}
        jobs[job_name] = where or {}
        doc.update({"latest": job_name, "workspace": workspace, "where": where or {},
                    "outcomes": dict(list(outcomes.items())[-KEPT:]), "jobs": dict(list(jobs.items())[-KEPT:])})
    _update(cfg, change)


def record_outcome(cfg: ClusterConfig, job_name: str, exit_code: int, outcome: str, message: str) -> None:
    """How ``run`` ended the job, as it printed it; ``status`` shows the same."""
    _update(cfg, lambda doc: doc.setdefault("outcomes", {}).__setitem__(job_name, {
        "exit_code": exit_code, "outcome": outcome, "message": message.splitlines()[0] if message else ""}))


def default_job_name(cfg: ClusterConfig, reserve: bool = True) -> str:
    """``JOB<date><time>``, with ``-2``, ``-3``... when a job started from this machine (of any config: two may
    share hosts and ROOT_DIR) already has that name: two runs started within one second would otherwise meet in
    one job directory. ``reserve=False`` (a dry run, which writes nothing): the stamp, not kept as taken."""
    stamp = datetime.now().strftime("JOB%Y%m%d%H%M%S")
    return reserve_name(cfg, stamp) if reserve else stamp


def reserve_name(cfg: ClusterConfig, stamp: str) -> str:
    """``stamp``, or ``stamp-2``, ``stamp-3``... the first that no job started from this machine has, kept as
    taken at once: launches started in the same second get different names."""
    def change(doc: Dict[str, Any]) -> str:
        used, name, k = job_names(cfg), stamp, 1
        while name in used:
            k += 1
            name = f"{stamp}-{k}"
        doc["reserved"] = [*doc.get("reserved", []), name][-50:]
        return name
    return _update(cfg, change)


def outcome(cfg: ClusterConfig, job_name: str) -> Optional[Dict[str, Any]]:
    """The recorded outcome of ``job_name`` (None: still running, or started elsewhere)."""
    return _read(cfg).get("outcomes", {}).get(job_name)


def _latest(cfg: ClusterConfig) -> Dict[str, Any]:
    doc = _read(cfg)
    if not isinstance(doc.get("latest"), str):
        raise ClusterError("no job of this configuration was started from this machine; name one with --job_name")
    return doc


def job_names(cfg: ClusterConfig) -> Set[str]:
    """The names of jobs the journal still knows (the latest, those with an outcome, the names given out) for
    every config on this machine: configs may share hosts and a ROOT_DIR, where one name twice would be one job
    directory for two."""
    names: Set[str] = set()
    for path in _state_file(cfg).parent.glob("*.json"):
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict):
            names |= {n for n in [doc.get("latest"), *doc.get("outcomes", {}), *doc.get("reserved", [])]
                      if isinstance(n, str)}
    return names


def latest_job(cfg: ClusterConfig) -> str:
    return _latest(cfg)["latest"]


def where(cfg: ClusterConfig, job_name: str) -> Dict[str, str]:
    """What ``remember`` kept about where ``job_name`` runs (``backend``, the handle); {} for a job it does not
    know (started on another machine, or long ago)."""
    doc = _read(cfg)
    jobs = doc.get("jobs") if isinstance(doc.get("jobs"), dict) else {}
    if isinstance(jobs.get(job_name), dict):
        return dict(jobs[job_name])
    return dict(doc.get("where") or {}) if doc.get("latest") == job_name else {}  # a journal of before "jobs"
