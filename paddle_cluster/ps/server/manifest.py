"""A checkpoint's manifest read as input: every field it has is checked against what a save writes -- the keys,
kinds and ranges of each block and table, names of 1 to ``MAX_NAME`` characters, optimizer specs without
unknown keys, and exactly the optimizer slots (names and shapes) the spec keeps -- before anything it describes
is read. A resumed checkpoint's values and optimizer state are finite too (``nonfinite``). A violation is a
``CheckpointError`` naming the file and the member, which ends the pserver with exit 3."""

from __future__ import annotations

import math
from typing import Any, Dict, Mapping, Optional, Tuple

import numpy as np

from ..checkpoint import FORMAT, MANIFEST, SHARD, files_problem
from ..errors import CheckpointError
from ..optim import OptimizerSpec, slots
from ..wire import protocol as P
from .declare import MAX_DIMS, MAX_NAME, MODES
from .finite import all_finite

_BLOCK_KEYS = frozenset({"key", "name", "lo", "hi", "dtype", "spec", "step", "param", "opt"})
_TABLE_KEYS = frozenset({"key", "name", "width", "dtype", "init_scale", "seed", "spec", "step", "rows", "slots"})
_TOP_KEYS = frozenset({"format", "step", "pserver_id", "n_pservers", "mode", "optimizer", "blocks", "tables",
                       "files"})
Shape = Tuple[Tuple[int, ...], str]


class _Bad(Exception):
    """One field of the manifest is not what a save writes (the message says which)."""


def check(m: Any, d: str) -> None:
    """Raise ``CheckpointError`` naming ``d``'s manifest and the field unless ``m`` (the parsed manifest) is one a
    save could have written."""
    try:
        _check(m)
    except _Bad as e:
        raise CheckpointError(f"checkpoint {d}/{MANIFEST}: {e}; refusing it") from None


def _check(m: Any) -> None:
    if not isinstance(m, dict):
        raise _Bad(f"a JSON {type(m).__name__}, not an object")
    if m.get("format") != FORMAT:
        return  # the caller's message names the format
    _keys(m, _TOP_KEYS, "the manifest")
    for k in ("step", "pserver_id", "n_pservers"):
        _int(m[k], k)
    if m["mode"] not in (None, *MODES):
        raise _Bad(f"mode {str(m['mode'])[:40]!r}: expected one of {', '.join(MODES)}")
    if m["optimizer"] is not None:
        _spec(m["optimizer"], "optimizer")
    why = files_problem(m["files"])
    if why is not None:
        raise _Bad(why)
    for k in ("blocks", "tables"):
        if not isinstance(m[k], list):
            raise _Bad(f"{k} is a {type(m[k]).__name__}, not a list")
    for kind, items in (("block", m["blocks"]), ("table", m["tables"])):
        seen = set()
        for i, item in enumerate(items):
            what = f"{kind} {i}"
            if not isinstance(item, dict):
                raise _Bad(f"{what} is a {type(item).__name__}, not an object")
            _keys(item, _BLOCK_KEYS if kind == "block" else _TABLE_KEYS, what)
            key = _int(item["key"], f"{what} key")
            if key in seen:
                raise _Bad(f"{what}: key {key} appears twice")
            seen.add(key)
            what = f"{kind} {i} ({_name(item['name'], what)!r})"
            (_block if kind == "block" else _table)(item, what)


def _keys(d: Mapping[str, Any], want: frozenset, what: str) -> None:
    if set(d) != want:
        extra, missing = sorted(map(str, set(d) - want))[:3], sorted(want - set(d))[:3]
        raise _Bad(f"{what} has unknown keys {[k[:40] for k in extra]} or lacks {missing}")


def _int(v: Any, what: str, low: int = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not low <= v < 1 << 63:
        raise _Bad(f"{what} is {str(v)[:40]!r}, not an integer of at least {low}")
    return v


def _name(v: Any, what: str) -> str:
    if not isinstance(v, str) or not 0 < len(v) <= MAX_NAME:
        size = f"{len(v)} characters" if isinstance(v, str) else f"a {type(v).__name__}"
        raise _Bad(f"{what}'s name is {size}: a name is a string of 1 to {MAX_NAME} characters")
    return v


def _dtype(v: Any, what: str) -> np.dtype:
    try:
        dt = np.dtype(v) if isinstance(v, str) else None
        P.dtype_code(dt)
    except (TypeError, ValueError):
        dt = None
    if dt is None:
        raise _Bad(f"{what}: dtype {str(v)[:40]!r} is not one a pserver holds")
    return dt


def _spec(v: Any, what: str) -> OptimizerSpec:
    if not isinstance(v, dict):
        raise _Bad(f"{what} is a {type(v).__name__}, not an optimizer spec")
    try:
        return OptimizerSpec.from_dict(v)
    except (TypeError, ValueError) as e:
        raise _Bad(f"{what}: {str(e)[:300]}") from None


def _specs(item: Mapping[str, Any], what: str) -> OptimizerSpec:
    """The spec the shard's optimizer runs (``current``); ``declared`` is checked alike."""
    s = item["spec"]
    if not isinstance(s, dict) or set(s) != {"declared", "current"}:
        raise _Bad(f"{what}: spec has keys {sorted(map(str, s))[:3] if isinstance(s, dict) else s!r}, "
                   "a save writes declared and current")
    declared, current = _spec(s["declared"], f"{what} declared optimizer"), _spec(s["current"], f"{what} optimizer")
    if slots(declared) != slots(current):
        raise _Bad(f"{what}: its declared and current optimizers keep different state")
    return current


def _meta(v: Any, what: str) -> Shape:
    if not isinstance(v, dict) or set(v) != {"shape", "dtype"} or not isinstance(v["shape"], list) \
            or len(v["shape"]) > MAX_DIMS:
        raise _Bad(f"{what}: not an array's shape and dtype")
    return tuple(_int(x, f"{what} dimension") for x in v["shape"]), _dtype(v["dtype"], what).str


def _slots(got: Any, spec: OptimizerSpec, shaped: Shape, counted: Shape, what: str) -> None:
    """``got`` (name -> array meta) must be exactly the slots ``spec`` keeps: shaped like the parameter
    (``shaped``), and its step count ("t", ``counted``) when it counts steps."""
    names, counts = slots(spec)
    want: Dict[str, Shape] = {n: shaped for n in names}
    if counts:
        want["t"] = counted
    if not isinstance(got, dict) or set(got) != set(want):
        have = sorted(map(str, got))[:5] if isinstance(got, dict) else type(got).__name__
        raise _Bad(f"{what}: optimizer slots {have}, {spec.name} keeps {sorted(want)}")
    for n, meta in got.items():
        if _meta(meta, f"{what} slot {n}") != want[n]:
            raise _Bad(f"{what}: slot {n} is {_meta(meta, n)[1]}{_meta(meta, n)[0]}, {spec.name} keeps "
                       f"{want[n][1]}{want[n][0]}")


def _block(b: Mapping[str, Any], what: str) -> None:
    lo, hi = _int(b["lo"], f"{what} lo"), _int(b["hi"], f"{what} hi")
    _int(b["step"], f"{what} step")
    if hi < lo:
        raise _Bad(f"{what}: hi {hi} below lo {lo}")
    dt = _dtype(b["dtype"], what)
    param = _meta(b["param"], f"{what} param")
    if param[1] != dt.str:
        raise _Bad(f"{what}: param is {param[1]}, the block {dt.str}")
    _slots(b["opt"], _specs(b, what), param, ((1,), np.dtype(np.int64).str), what)


def _table(t: Mapping[str, Any], what: str) -> None:
    width, rows = _int(t["width"], f"{what} width", 1), _int(t["rows"], f"{what} rows")
    _int(t["step"], f"{what} step")
    if isinstance(t["seed"], bool) or not isinstance(t["seed"], int):
        raise _Bad(f"{what}: seed {str(t['seed'])[:40]!r} is not an integer")
    dt = _dtype(t["dtype"], what)
    scale = t["init_scale"]
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise _Bad(f"{what}: init_scale {str(scale)[:40]!r} is not a finite number")
    _slots(t["slots"], _specs(t, what), ((rows, width), dt.str), ((rows,), np.dtype(np.int64).str), what)


def nonfinite(m: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> Optional[str]:
    """The first member of ``arrays`` (the shard the manifest ``m`` describes) holding NaN or Inf, or a negative
    step count, with what it belongs to (None: all finite)."""
    owner = {f"d{b['key']}.": f"block {b['name']}[{b['lo']}:{b['hi']}]" for b in m["blocks"]}
    owner.update({f"s{t['key']}.": f"table {t['name']!r}" for t in m["tables"]})
    for name, a in arrays.items():
        bad = bool(np.any(a < 0)) if name.endswith((".opt.t", ".slot.t")) else not all_finite(a)
        if bad:
            whose = owner.get(name[:name.index(".") + 1], "")
            return (f"{SHARD} member {name}.npy ({whose}) holds "
                    f"{'a negative step count' if name.endswith('.t') else 'NaN or Inf'}")
    return None
