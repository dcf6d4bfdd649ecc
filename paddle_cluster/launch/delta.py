"""A changed workspace sent as only its changed files, against a tree a node already holds.

The launcher keeps, beside each workspace archive it made, what every file was (its SHA-256 and whether it is
executable, or a link's target). A node that lacks the new archive names its most recent cached tree (its
``base``); when the launcher made that one too, it sends a delta archive: the new and changed files, and
``.paddle-delta.json`` listing the files to take unchanged from the base tree. The node hard-links those, adds
the delta and keeps the result under the new archive's hash (``node/trees.py``).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from paddle_cluster.node.trees import DELTA_NAME

from .dispatch import Package, _tar

WORTH = 0.5  # a delta is sent only when it is at most this fraction of the whole archive


def manifest(cache_dir: str, sha: str) -> Optional[Dict[str, str]]:
    """What each file of the archive ``sha`` made in ``cache_dir`` was; None when this launcher did not make it."""
    for meta in Path(cache_dir).glob("*.json"):
        try:
            doc = json.loads(meta.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict) and doc.get("sha256") == sha and isinstance(doc.get("manifest"), dict):
            return doc["manifest"]
    return None


def make(pkg: Package, directory: str, cache_dir: str, base: str, out_dir: str) -> Optional[Tuple[Package, int]]:
    """The delta archive of workspace ``directory`` (packed as ``pkg``) against the archive ``base``, and how
    many files it carries; None when the base is unknown here or the delta would not be worth it."""
    new, old = manifest(cache_dir, pkg.sha256), manifest(cache_dir, base)
    if new is None or old is None or base == pkg.sha256:
        return None
    changed = [arc for arc, what in sorted(new.items()) if old.get(arc) != what]
    keep = sorted(arc for arc, what in new.items() if old.get(arc) == what)
    size = sum(os.lstat(os.path.join(directory, arc)).st_size for arc in changed)
    if size > WORTH * pkg.size:
        return None
    with tempfile.TemporaryDirectory(prefix="paddle-delta-") as tmp:
        listing = Path(tmp) / DELTA_NAME
        listing.write_text(json.dumps({"base": base, "keep": keep}))
        entries: List[Tuple[Path, str]] = [(Path(directory) / arc, arc) for arc in changed]
        out = _tar(entries + [(listing, DELTA_NAME)], out_dir, "delta-")
    return out, len(changed)
