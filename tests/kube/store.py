"""The stand-in's objects (one JSON file every process of the stand-in shares) and the helpers over them."""

from __future__ import annotations

import copy
import fcntl
import json
import os
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Dict, Iterator

QUEUE = "kueue.x-k8s.io/queue-name"
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

