"""A changed workspace sent as only its changed files, against a tree a node already holds.

The launcher knows, for each workspace archive it caches, what every file was (its SHA-256 and whether it is
executable, or a link's target: kept when it was packed, or read from the archive of one packed as it was
sent). A node that lacks the new archive names its most recent cached tree (its ``base``); when the launcher
made that one too, it sends a delta archive: the new and changed files, and ``.paddle-delta.json`` listing the
files to take unchanged from the base tree. The node hard-links those, adds the delta and keeps the result
under the new archive's hash (``node/trees.py``).
"""

from __future__ import annotations

import hashlib
import json
import os
import tarfile
import tempfile
from functools import partial
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from paddle_cluster.node.trees import DELTA_NAME

from .dispatch import CHUNK, WORTH_DELTA, Package, _tar, entry_id


def manifest(cache_dir: str, sha: str) -> Optional[Dict[str, str]]:
    """What each file of the archive ``sha`` made in ``cache_dir`` was; None when this launcher did not make it
    (or it was evicted meanwhile). A new workspace's archive, packed while it was sent, was hashed once, as a
    whole: its entries are read from the cached archive now."""
    for meta in Path(cache_dir).glob("*.json"):
        try:
            doc = json.loads(meta.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(doc, dict) or doc.get("sha256") != sha:
            continue
        if isinstance(doc.get("manifest"), dict):
            return doc["manifest"]
        return _entries(str(meta.with_suffix(".tar")))
    return None


def _entries(archive: str) -> Optional[Dict[str, str]]:
    """``dispatch.entry_id`` of every file and link of one of our archives; None when it cannot be read."""
    out: Dict[str, str] = {}
    try:
        with tarfile.open(archive, "r:") as tar:
            for info in tar:
                content = None
                if info.isfile():
                    content = hashlib.sha256()
                    f = tar.extractfile(info)
                    assert f is not None
                    for b in iter(partial(f.read, CHUNK), b""):
                        content.update(b)
                out[info.name] = entry_id(info, content)
    except (OSError, tarfile.TarError):
        return None
    return out


def make(pkg: Package, directory: str, cache_dir: str, base: str, out_dir: str) -> Optional[Tuple[Package, int]]:
    """The delta archive of workspace ``directory`` (packed as ``pkg``) against the archive ``base``, and how
    many files it carries; None when the base is unknown here or the delta would not be worth it."""
    new, old = manifest(cache_dir, pkg.sha256), manifest(cache_dir, base)
    if new is None or old is None or base == pkg.sha256:
        return None
    changed = [arc for arc, what in sorted(new.items()) if old.get(arc) != what]
    keep = sorted(arc for arc, what in new.items() if old.get(arc) == what)
    size = sum(os.lstat(os.path.join(directory, arc)).st_size for arc in changed)
    if size > WORTH_DELTA * pkg.size:
        return None
    with tempfile.TemporaryDirectory(prefix="paddle-delta-") as tmp:
        listing = Path(tmp) / DELTA_NAME
        listing.write_text(json.dumps({"base": base, "keep": keep}))
        entries: List[Tuple[Path, str]] = [(Path(directory) / arc, arc) for arc in changed]
        out = _tar(entries + [(listing, DELTA_NAME)], out_dir, "delta-")
    return out, len(changed)
