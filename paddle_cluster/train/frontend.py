"""The framework-neutral half of both frontends (``paddle_cluster.torch``, ``paddle_cluster.paddle``), written
once: how a ``DistributedOptimizer`` sorts its parameters, connects, checks a step and ends it, and what an
``Embedding`` keeps of its lookups. Each frontend adds its framework's tensors; nothing here imports one."""

from __future__ import annotations

from typing import Any, Callable, ContextManager, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from . import bridge
from .bridge import Bridge, Group, Lookup, TableDef
from .embedding_args import padding_index


def param_names(params: Sequence[Tuple[Any, str]], named: Optional[Iterable[Tuple[str, Any]]]) -> Dict[int, str]:
    """Each parameter's name by ``id``: ``named`` (a model's ``named_parameters()``) if given, else the default
    name paired with it; ValueError (one line) naming the parameters ``named`` lacks."""
    if named is None:
        return {id(p): default for p, default in params}
    by_param: Dict[int, str] = {}
    for name, p in named:
        by_param.setdefault(id(p), name)
    missing = [default for p, default in params if id(p) not in by_param]
    if missing:
        raise ValueError(f"DistributedOptimizer: the optimizer's parameters {missing} are not in "
                         "named_parameters: pass the named_parameters() of the model the optimizer trains")
    return by_param


class Compression:
    """Horovod's names for ``DistributedOptimizer(compression=...)``: ``none`` (the default) and ``fp16`` (each
    float32 gradient crosses the network as float16: half the bytes; the pservers update in float32)."""

    none = None
    fp16 = "fp16"


def compression_of(value: Any) -> Optional[str]:
    """``compression`` checked (ValueError in one line naming the choices)."""
    if value not in (None, "none", "fp16"):
        raise ValueError(f"DistributedOptimizer(compression={value!r}): expected None or 'fp16' "
                         "(Compression.none, Compression.fp16)")
    return None if value in (None, "none") else value


class Frontend:
    """What both ``DistributedOptimizer``s do alike. A subclass sets ``FROZEN`` (how its framework spells a
    parameter left out of training) and defines ``_load`` (copy values into its parameters)."""

    FROZEN = ""
    bridge: Bridge
    dense: List[Tuple[str, Any]]
    embeddings: List[Any]
    _synced: bool

    def _place(self, group: Group, name: str, p: Any, tables: List[TableDef]) -> None:
        """Put parameter ``p`` (named ``name``) in ``group``: an ``Embedding``'s placeholder as its table (named
        after its layer), any other as a dense parameter."""
        emb = getattr(p, "_paddle_cluster_table", None)
        if emb is None:
            group.names.append(name)
            self.dense.append((name, p))
            return
        tables.append(emb.table(name[:-len(".weight")] if name.endswith(".weight") else name))
        group.tables.append(emb.name)
        self.embeddings.append(emb)

    def _connect(self, mode: str, connect_kw: Mapping[str, Any], dense: Mapping[str, np.ndarray],
                 tables: Sequence[TableDef], groups: Sequence[Group], compression: Optional[str] = None) -> None:
        """Connect, define the model on the pservers, become the process's one, and start from their values;
        the dense gradients go compressed (``Compression``) from the first step on."""
        self.bridge = Bridge(mode, **connect_kw)
        self.bridge.ps.compress(compression)
        try:
            start = self.bridge.define(dense, tables, groups)
        except BaseException:
            self.bridge.close()
            raise
        bridge.hold(self)
        self._load(start)
        for emb in self.embeddings:
            emb._bridge = self.bridge
        self.start_step = self.bridge.start_step
        self._synced = False  # p.grad holds this step's average (synchronize())

    def _load(self, values: Dict[str, np.ndarray]) -> None:
        raise NotImplementedError

    def _load_step(self, values: Dict[str, np.ndarray]) -> None:
        """A step's values into the parameters (a frontend may read them where the client holds them instead)."""
        self._load(values)

    def _refuse_thawed(self, thawed: Sequence[str]) -> None:
        """A parameter frozen when wrapped is not on the pservers: a gradient for it now is refused in one line."""
        if thawed:
            raise RuntimeError(f"DistributedOptimizer: {', '.join(thawed)} had {self.FROZEN} when the optimizer "
                               f"was wrapped, so they are not on the pservers; set {self.FROZEN.split('=')[0]} "
                               "before wrapping")

    def _row_grads(self, grads: Mapping[str, Optional[np.ndarray]]) -> Dict[str, List[Tuple[np.ndarray, np.ndarray]]]:
        """The step's embedding row gradients; RuntimeError (one line) when nothing has a gradient."""
        rows = {emb.name: emb.row_grads() for emb in self.embeddings}
        if all(g is None for g in grads.values()) and not any(rows.values()) and not self._synced:
            raise RuntimeError("DistributedOptimizer.step() before backward(): no parameter has a gradient; call "
                               "loss.backward() first")
        return rows

    def _end_step(self, values: Dict[str, np.ndarray]) -> None:
        self._load_step(values)
        for emb in self.embeddings:
            emb.end_step()

    def skip_synchronize(self) -> ContextManager[None]:
        """``with opt.skip_synchronize(): opt.step()`` applies the gradients ``synchronize()`` left in ``p.grad``
        (Horovod's spelling; ``step()`` right after ``synchronize()`` does the same)."""
        return bridge.skipping_synchronize(self._synced)

    def save_checkpoint(self, name: Optional[str] = None) -> Any:
        """Trainer 0: the pservers save the parameters, embedding rows and optimizer state of this step (under
        the job's checkpoint directory; ``paddle-cluster run --resume_from`` continues from it). Other
        trainers: nothing (None)."""
        return self.bridge.save_checkpoint(name)


def model_state(state_dict: Callable[[], Dict[str, Any]], tables: Iterable[Tuple[str, Any]], what: str,
                final_wait: float, tensor: Callable[[np.ndarray], Any]) -> Dict[str, Any]:
    """Both frontends' ``state_dict(model)``: loads the pservers' dense values into the process's
    DistributedOptimizer's parameters, then ``state_dict()`` (the model's) with each ``Embedding``'s ``weight``
    (``tables``: their ``(prefix, layer)`` pairs) the whole table or, as ``weight.ids`` and ``weight.rows``, its
    existing rows (``what``: ``Bridge.final``'s ``tables``); ``tensor`` makes a framework tensor of an array."""
    ctx = bridge.held("state_dict(model)")
    values, final = ctx.bridge.final(what, final_wait)
    ctx._load(values)
    out = state_dict()
    for prefix, m in tables:
        key = f"{prefix}.weight" if prefix else "weight"
        if not isinstance(final[m.name], tuple):
            if m.padding_idx is not None:  # never created on the pservers: zeros, as the framework's row
                final[m.name][m.padding_idx] = 0
            out[key] = tensor(final[m.name])
        else:
            del out[key]
            ids, rows = final[m.name]
            out[f"{key}.ids"], out[f"{key}.rows"] = tensor(ids), tensor(rows)
    return out


class TableRows:
    """What both ``Embedding`` layers keep alike: the table's size and initial rows, the bridge once the optimizer
    is wrapped, and this step's lookups (their unique ids and the rows tensor autograd fills). A subclass gives
    ``FRONTEND`` (its module and an example wrapping, for the error before wrapping) and ``_np_dtype``."""

    FRONTEND: Tuple[str, str] = ("", "")

    def _setup_rows(self, num_embeddings: int, embedding_dim: int, padding_idx: Optional[int],
                    name: Optional[str], init_scale: float, seed: int) -> None:
        for what, v in (("num_embeddings", num_embeddings), ("embedding_dim", embedding_dim)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Embedding: {what}={v!r}: expected a positive integer")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = padding_index("Embedding", num_embeddings, padding_idx)
        self.name, self.init_scale, self.seed = name, float(init_scale), int(seed)
        self._bridge: Optional[Bridge] = None
        self._lookups: List[Tuple[np.ndarray, Any]] = []  # this step's (unique ids, rows leaf tensor)

    def _np_dtype(self) -> np.dtype:
        raise NotImplementedError

    def table(self, name: str) -> TableDef:
        """(DistributedOptimizer.) Its definition, named ``name`` unless it was given one."""
        self.name = self.name or name
        return TableDef(self.name, self.num_embeddings, self.embedding_dim, self.init_scale, self.seed,
                        self._np_dtype())

    def _lookup(self, ids: np.ndarray) -> Lookup:
        """The rows of ``ids`` from the pservers; RuntimeError (one line, the fix) before the optimizer is wrapped."""
        if self._bridge is None:
            what = (f"Embedding {self.name!r}" if self.name else
                    f"Embedding({self.num_embeddings}, {self.embedding_dim})")  # unnamed until the optimizer names it
            module, example = self.FRONTEND
            raise RuntimeError(f"{what}: forward before its table is on the pservers (its rows live there); wrap "
                               f"the optimizer holding the model's parameters in {module}.DistributedOptimizer "
                               f"before the first forward: {example}")
        return self._bridge.lookup(self.name, ids, self.padding_idx)

    def row_grads(self) -> List[Tuple[np.ndarray, np.ndarray]]:
        """(DistributedOptimizer.) This step's row gradients, one ``(unique ids, grads)`` per lookup used."""
        return [(ids, rows.grad.numpy()) for ids, rows in self._lookups if rows.grad is not None]

    def end_step(self) -> None:
        self._lookups = []

    def extra_repr(self) -> str:
        pad = "" if self.padding_idx is None else f", padding_idx={self.padding_idx}"
        return f"{self.num_embeddings}, {self.embedding_dim}{pad}, name={self.name!r} (rows on the pservers)"
