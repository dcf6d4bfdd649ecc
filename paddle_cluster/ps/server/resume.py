"""Loading a checkpoint: one pserver's shard read and verified, the newest usable step, and the live shards
it describes.

Loading verifies the manifest and the checksum before touching any state, so a torn or corrupt checkpoint is
refused whole, never half-loaded. A checkpoint that is there but cannot be read is an error of its own
(``CheckpointUnreadable``), never taken for "no checkpoint".
"""

from __future__ import annotations

import json
import logging
import os
import zipfile
from typing import Any, Dict, Mapping, Optional, Tuple

import numpy as np

from ..checkpoint import (
    FORMAT,
    MAX_MANIFEST,
    SHARD,
    BlockState,
    ShardState,
    TableState,
    digest_problem,
    list_steps,
    open_file,
    read_manifest,
    shard_dir,
    shard_problem,
    step_dir,
    unreadable,
)
from ..errors import CheckpointError, CheckpointUnreadable
from ..optim import OptimizerSpec
from . import manifest
from .budget import Budget, human
from .declare import JSON_HELD
from .dense import DenseBlock, DenseShared, dense_bytes
from .table import TableShard

log = logging.getLogger("paddle_cluster.ps")


def _require(path: str, missing: str) -> None:
    """``CheckpointError(missing)`` when ``path`` does not exist, ``CheckpointUnreadable`` when it cannot be
    looked at (a checkpoint that may be there is never taken for an absent one)."""
    try:
        os.stat(path)
    except FileNotFoundError:
        raise CheckpointError(missing) from None
    except OSError as e:
        raise unreadable(path, e) from None


def load_shard(step_path: str, pserver_id: int, n_pservers: int, limit: Optional[int] = None,
               finite: bool = True) -> ShardState:
    """Load and verify this pserver's shard of the checkpoint in ``step_path``; its arrays may hold at most
    ``limit`` bytes (the pserver's memory budget), checked from their headers before any is read, and (``finite``)
    no NaN or Inf. Everything is input: only regular files of the shard's directory are read (``open_file``), the
    manifest at most ``limit / JSON_HELD`` bytes, every field of it checked (``manifest.check``)."""
    d = shard_dir(step_path, pserver_id)
    _require(d, f"checkpoint {step_path}: no shard directory for pserver {pserver_id} ({d})")
    body = read_manifest(d, MAX_MANIFEST if limit is None else max(1, min(MAX_MANIFEST, limit // JSON_HELD)))
    if body is None:
        raise CheckpointError(f"checkpoint {d}: manifest.json missing (the save did not finish); refusing it")
    try:
        m = json.loads(body.decode("utf-8"))
        del body
        manifest.check(m, d)
        files = m["files"]
        step = int(m["step"])
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise CheckpointError(f"checkpoint {d}: corrupt manifest ({str(e)[:300]}); refusing it") from None
    if m.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {d}: format {m.get('format')!r}, this runtime reads {FORMAT}")
    if m.get("pserver_id") != pserver_id or m.get("n_pservers") != n_pservers:
        raise CheckpointError(
            f"checkpoint {d}: written by pserver {m.get('pserver_id')} of {m.get('n_pservers')}, "
            f"but this is pserver {pserver_id} of {n_pservers}")
    try:
        f = open_file(d, SHARD)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {d}: {SHARD} missing; refusing it") from None
    with f:
        why = digest_problem(d, f, files[SHARD])
        if why is not None:
            raise CheckpointError(f"checkpoint {d}: {why}: corrupt; refusing it")
        try:
            f.seek(0)
            arrays = read_shard(f, _expected(m), limit, os.path.join(d, SHARD))
        except OSError as e:
            raise unreadable(os.path.join(d, SHARD), e) from None
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"checkpoint {d}: manifest does not describe the shard ({e!r})") from None
    why = manifest.nonfinite(m, arrays) if finite else None
    if why is not None:
        raise CheckpointError(f"checkpoint {d}: {why}; refusing it (PADDLE_ALLOW_NONFINITE=1 accepts it)")

    def get(name: str, meta: Mapping[str, Any]) -> np.ndarray:
        a = arrays.get(name)
        if a is None:
            raise CheckpointError(f"checkpoint {d}: array {name} missing")
        if list(a.shape) != list(meta["shape"]) or a.dtype.str != meta["dtype"]:
            raise CheckpointError(f"checkpoint {d}: array {name} is {a.dtype}{a.shape}, manifest says "
                                  f"{meta['dtype']}{tuple(meta['shape'])}")
        return a

    try:
        blocks = [
            BlockState(int(b["key"]), b["name"], int(b["lo"]), int(b["hi"]), b["dtype"], b["spec"], int(b["step"]),
                       get(f"d{b['key']}.param", b["param"]),
                       {n: get(f"d{b['key']}.opt.{n}", am) for n, am in b["opt"].items()})
            for b in m["blocks"]
        ]
        tables = []
        for t in m["tables"]:
            ids = arrays.get(f"s{t['key']}.ids")
            rows = arrays.get(f"s{t['key']}.rows")
            if ids is None or rows is None or len(ids) != t["rows"] or rows.shape != (t["rows"], t["width"]):
                raise CheckpointError(f"checkpoint {d}: table {t['name']!r} rows do not match the manifest")
            # Every id is input: sorted and unique (the table's lookups and its id-space check rely on it) and
            # this pserver's own; trainer 0's definition then checks the ends against the id space it declares.
            if len(ids) > 1 and not bool(np.all(ids[1:] > ids[:-1])) or \
                    len(ids) and bool(np.any(np.mod(ids, n_pservers) != pserver_id)):
                raise CheckpointError(f"checkpoint {d}: {SHARD} member s{t['key']}.ids.npy (table {t['name']!r}): "
                                      f"ids are not sorted and unique, or belong to another pserver than "
                                      f"{pserver_id} of {n_pservers}; refusing it")
            tables.append(TableState(int(t["key"]), t["name"], int(t["width"]), t["dtype"], float(t["init_scale"]),
                                     int(t["seed"]), t["spec"], int(t["step"]), ids, rows,
                                     {n: get(f"s{t['key']}.slot.{n}", am) for n, am in t["slots"].items()}))
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint {d}: manifest does not describe the shard ({e!r})") from None
    return ShardState(step, pserver_id, n_pservers, m.get("mode"), m.get("optimizer"), blocks, tables, path=d)


def _expected(m: Mapping[str, Any]) -> Dict[str, Tuple[Tuple[int, ...], str]]:
    """Member name -> (shape, dtype) of every array the manifest ``m`` describes."""
    out: Dict[str, Tuple[Tuple[int, ...], str]] = {}

    def put(name: str, meta: Mapping[str, Any]) -> None:
        out[name] = (tuple(int(x) for x in meta["shape"]), np.dtype(meta["dtype"]).str)

    for b in m["blocks"]:
        put(f"d{b['key']}.param", b["param"])
        for n, am in b["opt"].items():
            put(f"d{b['key']}.opt.{n}", am)
    for t in m["tables"]:
        put(f"s{t['key']}.ids", {"shape": [t["rows"]], "dtype": "<i8"})
        put(f"s{t['key']}.rows", {"shape": [t["rows"], t["width"]], "dtype": t["dtype"]})
        for n, am in t["slots"].items():
            put(f"s{t['key']}.slot.{n}", am)
    return out


def read_shard(source: Any, expect: Mapping[str, Tuple[Tuple[int, ...], str]], limit: Optional[int],
               path: str = "") -> Dict[str, np.ndarray]:
    """The arrays of ``shard.npz`` (``source``: its path, or the file opened at ``path``), treated as input: every
    member is one the manifest describes (``expect``), its ``.npy`` header says the manifest's shape and dtype and
    its size in the archive is the header's plus exactly that many bytes, and all of them fit ``limit`` -- all
    checked before any array is allocated, so nothing is decompressed past a declared size. ``CheckpointError``
    names the member."""
    path = path or source
    where = os.path.basename(os.path.dirname(path)) + "/" + os.path.basename(path)
    sizes: Dict[str, int] = {}
    try:
        with zipfile.ZipFile(source) as z:
            for info in z.infolist():
                name = info.filename[:-4] if info.filename.endswith(".npy") else None
                bad = _member_problem(z, info, expect.get(name)) if name is not None else "not an array"
                if name in sizes:
                    bad = "appears twice"
                if bad is not None:
                    raise CheckpointError(f"checkpoint {where}: member {info.filename}: {bad}; refusing it")
                sizes[name] = info.file_size
            missing = sorted(set(expect) - set(sizes))
            if missing:
                raise CheckpointError(f"checkpoint {where}: member {missing[0]}.npy missing; refusing it")
            total = sum(int(np.prod(shape, dtype=object)) * np.dtype(dt).itemsize for shape, dt in expect.values())
            if limit is not None and total > limit:
                raise CheckpointError(f"checkpoint {where}: its arrays hold {human(total)}, more than this pserver's "
                                      f"memory budget of {human(limit)} (PADDLE_PSERVER_MEMORY); refusing it")
            out = {}
            for name, (shape, dt) in expect.items():
                a = np.empty(shape, dtype=dt)
                with z.open(name + ".npy") as f:
                    _header(f)
                    if a.nbytes and f.readinto(memoryview(a.reshape(-1)).cast("B")) != a.nbytes or f.read(1):
                        raise CheckpointError(f"checkpoint {where}: member {name}.npy is shorter than its header "
                                              "says; refusing it")
                out[name] = a
            return out
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, ValueError) as e:
        raise CheckpointError(f"checkpoint {where}: not a readable archive ({e}); refusing it") from None


def _header(f: Any) -> Tuple[Tuple[int, ...], bool, np.dtype]:
    """(shape, Fortran order, dtype) from the ``.npy`` header at the start of ``f``; ``f`` is left after it."""
    version = np.lib.format.read_magic(f)
    if version == (1, 0):
        return np.lib.format.read_array_header_1_0(f)
    if version == (2, 0):
        return np.lib.format.read_array_header_2_0(f)
    raise ValueError(f".npy format version {version} (this runtime writes 1.0)")


def _member_problem(z: zipfile.ZipFile, info: zipfile.ZipInfo, want: Optional[Tuple[Tuple[int, ...], str]]
                    ) -> Optional[str]:
    """Why a member of ``shard.npz`` is not the array the manifest describes (``want``), from its header alone."""
    if want is None:
        return "not in the manifest"
    try:
        with z.open(info) as f:
            shape, fortran, dtype = _header(f)
            header = f.tell() if f.seekable() else None
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as e:
        return f"bad .npy header ({e})"
    if tuple(shape) != want[0] or dtype.str != want[1] or fortran or dtype.hasobject:
        return (f"header says {dtype.str}{tuple(shape)}{' (Fortran order)' if fortran else ''}, the manifest "
                f"{want[1]}{want[0]}")
    nbytes = int(np.prod(shape, dtype=object)) * dtype.itemsize
    if header is None or info.file_size != header + nbytes:
        return f"holds {info.file_size} bytes, its header says {nbytes} bytes of data"
    return None


def _siblings_complete(step_path: str, pserver_id: int) -> Optional[str]:
    """Why the other pservers' shards visible in ``step_path`` are unusable (None: all fine).

    With a shared file system every pserver sees every shard, and all of them must agree on which step
    is the latest complete one, so each verifies its siblings too (manifest present, checksums match).
    With per-host directories a pserver sees only its own; the trainers then check at connect time that
    every pserver resumed from the same step.
    """
    try:
        names = os.listdir(step_path)
    except OSError as e:
        raise unreadable(step_path, e) from None
    for n in sorted(names):
        if not n.startswith("pserver-") or n == f"pserver-{pserver_id}":
            continue
        why = shard_problem(os.path.join(step_path, n))
        if why is not None:
            return f"{n}: {why}"
    return None


def load_latest(root: str, pserver_id: int, n_pservers: int, limit: Optional[int] = None, finite: bool = True
                ) -> Optional[ShardState]:
    """The newest complete, verified checkpoint under ``root``; None if there is none at all.

    Incomplete or corrupt ones are skipped with a log line; if checkpoints exist but none is usable,
    that is an error rather than a silent fresh start.
    """
    steps = list_steps(root)
    reasons = []
    for sp in steps:
        try:
            shard = load_shard(sp, pserver_id, n_pservers, limit, finite)
            why = _siblings_complete(sp, pserver_id)
            if why is None:
                return shard
        except CheckpointUnreadable:
            raise  # an older step is no substitute for one that is there but cannot be read
        except CheckpointError as e:
            why = str(e)
        log.warning("pserver %d: skipping checkpoint %s: %s", pserver_id, sp, why)
        reasons.append(f"{os.path.basename(sp)}: {why}")
    if steps:
        raise CheckpointError(f"no usable checkpoint under {root}: " + "; ".join(reasons))
    return None


def resolve_resume(resume: str, root: str, pserver_id: int, n_pservers: int, limit: Optional[int] = None,
                   finite: bool = True) -> Optional[ShardState]:
    """``resume`` is "" (fresh start), "latest", a step number, or a step directory path; ``limit`` and
    ``finite``: see ``load_shard``."""
    resume = resume.strip()
    if not resume:
        return None
    if resume == "latest":
        return load_latest(root, pserver_id, n_pservers, limit, finite)
    path = step_dir(root, int(resume)) if resume.isdigit() else resume
    _require(path, f"checkpoint {path} does not exist")
    shard = load_shard(path, pserver_id, n_pservers, limit, finite)
    why = _siblings_complete(path, pserver_id)
    if why is not None:
        raise CheckpointError(f"checkpoint {path} is incomplete or corrupt ({why}); refusing it")
    return shard


def restore(shard: ShardState, dense: DenseShared, budget: Budget, trainers: int = 1
            ) -> Tuple[Dict[int, DenseBlock], Dict[int, TableShard]]:
    """The live shards a loaded checkpoint describes (its dense blocks sharing ``dense``), charged to ``budget``;
    trainer 0 confirms each when it defines it again (``Shard.confirmed``)."""
    blocks: Dict[int, DenseBlock] = {}
    tables: Dict[int, TableShard] = {}
    for bs in shard.blocks:
        meta = {"name": bs.name, "lo": bs.lo, "hi": bs.hi, "shape": list(bs.param.shape), "dtype": bs.dtype}
        spec = OptimizerSpec.from_dict(bs.spec["current"])
        budget.charge(dense_bytes(meta, spec, trainers), f"block {bs.name}[{bs.lo}:{bs.hi}] of the checkpoint")
        b = DenseBlock(bs.key, meta, spec, bs.spec["declared"], bs.step, dense)
        b.confirmed = False
        b.param[...] = bs.param
        try:
            b.opt.load_state(bs.opt_state)
        except ValueError as e:
            raise CheckpointError(f"checkpoint {shard.path}: {b.label()}: {e}") from None
        b.initialized = True
        blocks[bs.key] = b
    for ts in shard.tables:
        meta = {"name": ts.name, "width": ts.width, "dtype": ts.dtype, "init_scale": ts.init_scale, "seed": ts.seed}
        t = TableShard(ts.key, meta, OptimizerSpec.from_dict(ts.spec["current"]), ts.spec["declared"], ts.step,
                       dense.sync, shard.pserver_id, shard.n_pservers, budget, dense.finite)
        t.confirmed = False
        n = len(ts.ids)
        t.grow(n)
        t.table[:n] = ts.rows
        if set(ts.slots) != set(t.state):
            raise CheckpointError(f"checkpoint {shard.path}: {t.label()} has optimizer slots "
                                  f"{sorted(ts.slots)}, expected {sorted(t.state)}")
        for k, v in ts.slots.items():
            t.state[k][:n] = v
        t.keys = np.asarray(ts.ids, dtype=np.int64).copy()
        t.pos = np.arange(n, dtype=np.int64)
        t.n = n
        tables[ts.key] = t
    return blocks, tables
