"""Per-shard atomic checkpoints: the on-disk layout, writing a shard, and which steps are complete.

Layout: ``<root>/step-%08d/pserver-%d/{shard.npz,manifest.json}``. Each pserver writes only its own
shard: the arrays go to a temporary file that is fsynced and renamed; the manifest (step, block ranges,
shapes, dtypes, sha256 of the shard file) is written the same way and LAST, so a shard without a
manifest is by definition incomplete. ``State.snapshot`` makes the ``ShardState`` saved here; loading one
back is ``resume``'s; ``complete_steps`` and ``survey`` tell the launcher what a root holds.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from . import atomic
from .errors import CheckpointUnreadable

FORMAT = 1
MANIFEST = "manifest.json"
SHARD = "shard.npz"
_STEP_RE = re.compile(r"^step-(\d{8,})$")


@dataclass
class BlockState:
    key: int
    name: str
    lo: int
    hi: int
    dtype: str
    spec: Dict[str, Any]
    step: int
    param: np.ndarray
    opt_state: Dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class TableState:
    key: int
    name: str
    width: int
    dtype: str
    init_scale: float
    seed: int
    spec: Dict[str, Any]
    step: int
    ids: np.ndarray  # int64, sorted
    rows: np.ndarray  # (len(ids), width), row i belongs to ids[i]
    slots: Dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class ShardState:
    """Everything one pserver holds."""

    step: int
    pserver_id: int
    n_pservers: int
    mode: Optional[str]
    optimizer: Optional[Dict[str, Any]]
    blocks: List[BlockState] = field(default_factory=list)
    tables: List[TableState] = field(default_factory=list)
    path: str = ""


def valid_name(name: object) -> bool:
    """A checkpoint directory name a trainer may ask for: one path component, never a location."""
    return (isinstance(name, str) and 0 < len(name) <= 255 and name not in (".", "..") and "/" not in name
            and "\\" not in name and "\0" not in name)


def default_root(job_dir: str = "") -> str:
    return os.path.join(job_dir or os.getcwd(), "checkpoints")


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:08d}")


def shard_dir(step_path: str, pserver_id: int) -> str:
    return os.path.join(step_path, f"pserver-{pserver_id}")


def unreadable(path: str, e: OSError) -> CheckpointUnreadable:
    """The error for a checkpoint that exists but cannot be read (permissions, I/O error): never "no checkpoint"."""
    return CheckpointUnreadable(f"checkpoint {path} cannot be read: {e.strerror or e}; fix its permissions or "
                                "storage, or move it away to start without it (refusing to start over it)")


def file_problem(d: str, fname: str, info: Mapping[str, Any]) -> Optional[str]:
    """Why file ``fname`` of the shard in ``d`` does not match its manifest entry (None: it does); raises
    CheckpointUnreadable when it is there but cannot be read."""
    path = os.path.join(d, fname)
    try:
        actual = atomic.file_digest(path)
    except FileNotFoundError:
        return f"{fname} missing"
    except OSError as e:
        raise unreadable(path, e) from None
    if actual != info.get("sha256"):
        return (f"{fname} checksum mismatch (sha256 {actual[:12]}..., manifest says "
                f"{str(info.get('sha256'))[:12]}...)")
    return None


def read_manifest(d: str) -> Optional[bytes]:
    """The manifest of the shard in ``d``; None when there is none (the save did not finish)."""
    path = os.path.join(d, MANIFEST)
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise unreadable(path, e) from None


def shard_problem(d: str) -> Optional[str]:
    """Why the shard in directory ``d`` is incomplete or corrupt (None: its manifest is there and every
    checksum matches); raises CheckpointUnreadable when a part of it exists but cannot be read."""
    body = read_manifest(d)
    if body is None:
        return f"{MANIFEST} missing (save did not finish)"
    try:
        files = json.loads(body.decode("utf-8"))["files"]
        for fname, info in files.items():
            why = file_problem(d, fname, info)
            if why is not None:
                return why
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        return f"corrupt manifest ({e})"
    return None


def _arr_meta(a: np.ndarray) -> Dict[str, Any]:
    return {"shape": list(a.shape), "dtype": a.dtype.str}


def save_shard(step_path: str, shard: ShardState) -> str:
    """Write ``shard`` under ``step_path/pserver-<id>/``; returns that directory."""
    d = shard_dir(step_path, shard.pserver_id)
    os.makedirs(d, exist_ok=True)
    manifest_path = os.path.join(d, MANIFEST)
    # Re-saving the same step: drop the old manifest first so a crash mid-write leaves "incomplete".
    if os.path.exists(manifest_path):
        os.unlink(manifest_path)
        atomic.fsync_dir(d)
    arrays: Dict[str, np.ndarray] = {}
    blocks_meta, tables_meta = [], []
    for b in shard.blocks:
        arrays[f"d{b.key}.param"] = b.param
        for name, a in b.opt_state.items():
            arrays[f"d{b.key}.opt.{name}"] = a
        blocks_meta.append({
            "key": b.key, "name": b.name, "lo": b.lo, "hi": b.hi, "dtype": b.dtype, "spec": b.spec,
            "step": b.step, "param": _arr_meta(b.param),
            "opt": {n: _arr_meta(a) for n, a in b.opt_state.items()},
        })
    for t in shard.tables:
        arrays[f"s{t.key}.ids"] = t.ids
        arrays[f"s{t.key}.rows"] = t.rows
        for name, a in t.slots.items():
            arrays[f"s{t.key}.slot.{name}"] = a
        tables_meta.append({
            "key": t.key, "name": t.name, "width": t.width, "dtype": t.dtype, "init_scale": t.init_scale,
            "seed": t.seed, "spec": t.spec, "step": t.step, "rows": len(t.ids),
            "slots": {n: _arr_meta(a) for n, a in t.slots.items()},
        })
    sha = atomic.save_npz_atomic(os.path.join(d, SHARD), arrays)
    manifest = {
        "format": FORMAT, "step": shard.step, "pserver_id": shard.pserver_id, "n_pservers": shard.n_pservers,
        "mode": shard.mode, "optimizer": shard.optimizer, "blocks": blocks_meta, "tables": tables_meta,
        "files": {SHARD: {"sha256": sha, "bytes": os.path.getsize(os.path.join(d, SHARD))}},
    }
    body = json.dumps(manifest, indent=1, sort_keys=True).encode("utf-8")
    atomic.write_atomic(manifest_path, lambda f: f.write(body))
    return d


def _steps(root: str) -> List[Tuple[int, str]]:
    """(step, directory) of the step directories under ``root``, ascending; none when ``root`` does not exist,
    CheckpointUnreadable when it exists but cannot be listed."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    except OSError as e:
        raise unreadable(root, e) from None
    return sorted((int(mt.group(1)), os.path.join(root, n)) for n in names if (mt := _STEP_RE.match(n)))


def list_steps(root: str) -> List[str]:
    """Step directories under ``root``, newest first."""
    return [d for _, d in reversed(_steps(root))]


def complete_steps(root: str, pserver_ids: Sequence[int]) -> List[int]:
    """The steps under ``root``, ascending, whose shards of every pserver in ``pserver_ids`` are complete
    (manifest present, every sha256 matches). What a node can offer when the launcher picks a common step."""
    return [s for s, d in _steps(root) if all(shard_problem(shard_dir(d, k)) is None for k in pserver_ids)]


def survey(root: str, pserver_ids: Sequence[int]) -> Dict[str, Any]:
    """What ``root`` holds for these pservers, for the launcher's ``--resume_from`` check before a job starts:
    ``root`` ("" when it is a directory, else what it is instead), the ``complete`` steps, ascending, and the
    newest ``incomplete`` ones: ``[step, {pserver id: why its shard is unusable}]``. CheckpointUnreadable when
    a part of it exists but cannot be read."""
    if not os.path.isdir(root):
        return {"root": "is not a directory" if os.path.exists(root) else "does not exist", "complete": [],
                "incomplete": []}
    complete: List[int] = []
    incomplete: List[Any] = []
    for s, d in _steps(root):
        problems = {}
        for k in pserver_ids:
            shard = shard_dir(d, k)
            why = shard_problem(shard) if os.path.isdir(shard) else f"no pserver-{k} shard (directory missing)"
            if why is not None:
                problems[str(k)] = why
        if problems:
            incomplete.append([s, problems])
        else:
            complete.append(s)
    return {"root": "", "complete": complete, "incomplete": incomplete[-3:]}
