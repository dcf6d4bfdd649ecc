"""``DistributedOptimizer``: a ``paddle.optimizer`` optimizer whose update the pservers apply; ``rank``, ``size``,
and the final model (``state_dict``, ``save``)."""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Tuple

import numpy as np
import paddle
from paddle.regularizer import L2Decay

from ..ps.optim import OptimizerSpec
from ..train import bridge, frontend
from ..train.bridge import Group, TableDef, rank, shutdown, size  # noqa: F401  (this module's API, as paddle users call it)
from ..train.frontend import Compression, Frontend, compression_of, param_names  # noqa: F401
from ..train.overlap import Overlap
from .embedding import Embedding

# paddle.optimizer class -> the server rule.
SUPPORTED = {"SGD": "sgd", "Momentum": "momentum", "Adagrad": "adagrad", "Adam": "adam", "AdamW": "adamw"}
_ONE_LINE = ("supported: paddle.optimizer.SGD, Momentum (momentum, use_nesterov), Adagrad (epsilon, "
             "initial_accumulator_value), Adam (beta1, beta2, epsilon, amsgrad) and AdamW (those, its decoupled "
             "weight_decay, apply_decay_param_fun), each with a float or LRScheduler learning_rate, parameter "
             "groups, weight_decay a float or L2Decay, grad_clip a paddle.nn.ClipGradByGlobalNorm, ClipGradByNorm "
             "or ClipGradByValue")
# Applied to the step's gradient averaged over the trainers (``synchronize``), as Paddle clips the whole batch's.
_CLIPS = (paddle.nn.ClipGradByGlobalNorm, paddle.nn.ClipGradByNorm, paddle.nn.ClipGradByValue)

def _refuse(what: str, why: str = "") -> ValueError:
    return ValueError(f"DistributedOptimizer: {what} is not supported{f' ({why})' if why else ''}; {_ONE_LINE}")


def _float(v: Any) -> float:
    return float(v.item() if isinstance(v, paddle.Tensor) else v)


def _l2(reg: Any, where: str) -> float:
    """The coefficient of an L2 weight decay (None: 0); anything else (L1Decay) refused."""
    if reg is None:
        return 0.0
    if isinstance(reg, (int, float)):
        return float(reg)
    if isinstance(reg, L2Decay):
        return float(reg._coeff)
    raise _refuse(f"weight decay {type(reg).__name__} ({where})")


def spec_of(optimizer: paddle.optimizer.Optimizer, group: Optional[Dict[str, Any]], param: Any
            ) -> Tuple[OptimizerSpec, float]:
    """The server rule doing what ``optimizer`` does to ``param`` (in parameter group ``group``, None without
    groups) and the parameter's learning-rate multiplier (a group's or ParamAttr's ``learning_rate``);
    ValueError (one line) for anything else."""
    kind = type(optimizer).__name__
    if type(optimizer) is not getattr(paddle.optimizer, kind, None) or kind not in SUPPORTED:
        raise _refuse(f"paddle.optimizer.{kind}" if type(optimizer) is getattr(paddle.optimizer, kind, None)
                      else f"{type(optimizer).__module__}.{type(optimizer).__qualname__}")
    g = group or {}
    if param.dtype not in (paddle.float32, paddle.float64):
        raise _refuse(f"parameter {param.name} of {param.dtype}", "float32 and float64 parameters are")
    clip = g.get("grad_clip", optimizer._grad_clip)
    if clip is not None and type(clip) not in _CLIPS:
        raise _refuse(f"grad_clip={type(clip).__module__}.{type(clip).__qualname__}")
    mult = param.optimize_attr.get("learning_rate", 1.0) if param.optimize_attr else 1.0
    if not isinstance(mult, (int, float)):
        raise _refuse(f"a tensor learning_rate on parameter {param.name}")
    opt = optimizer._default_dict
    spec: Dict[str, Any] = {"name": SUPPORTED[kind], "lr": 1.0}
    if kind == "AdamW":
        if getattr(optimizer, "_lr_ratio", None) is not None:
            raise _refuse("paddle.optimizer.AdamW(lr_ratio=...)")
        if param.regularizer is not None:
            raise _refuse(f"a regularizer on parameter {param.name} under AdamW")
        fun = optimizer._apply_decay_param_fun
        spec["weight_decay"] = _float(g.get("weight_decay", opt["weight_decay"])) \
            if fun is None or fun(param.name) else 0.0
    elif kind == "Momentum":  # paddle fuses an L2Decay into the momentum kernel; it lives in its own keys
        if _float(g.get("rescale_grad", opt["rescale_grad"])) != 1.0:
            raise _refuse("paddle.optimizer.Momentum(rescale_grad != 1)")
        if param.regularizer is not None:
            decay = _l2(param.regularizer, f"parameter {param.name}")
        else:
            _l2(optimizer.regularization, "the optimizer's weight_decay")
            decay = _float(g.get("regularization_coeff", opt["regularization_coeff"]))
        spec.update(weight_decay=decay, momentum=_float(g.get("momentum", opt["momentum"])),
                    nesterov=bool(g.get("use_nesterov", opt["use_nesterov"])))
    else:
        # The parameter's regularizer wins (a group's weight_decay is set there), else the optimizer's.
        reg = param.regularizer if param.regularizer is not None else optimizer.regularization
        spec["weight_decay"] = _l2(reg, f"parameter {param.name}")
    if kind == "Adagrad":
        spec.update(eps=_float(g.get("epsilon", opt["epsilon"])),
                    initial_accumulator_value=_float(g.get("initial_accumulator_value",
                                                           opt["initial_accumulator_value"])))
    elif kind in ("Adam", "AdamW"):
        spec.update(beta1=_float(g.get("beta1", opt["beta1"])), beta2=_float(g.get("beta2", opt["beta2"])),
                    eps=_float(g.get("epsilon", opt["epsilon"])), amsgrad=bool(getattr(optimizer, "_amsgrad", False)))
    try:
        return OptimizerSpec.from_dict(spec), float(mult)
    except ValueError as e:
        raise ValueError(f"DistributedOptimizer: paddle.optimizer.{kind} {spec}: {e}") from None


def _dense_grad(p: Any) -> Optional[np.ndarray]:
    """``p``'s gradient as a whole array (a ``paddle.nn.Embedding(sparse=True)``'s is its rows only)."""
    g = p.grad
    if g is None or not g.is_selected_rows():
        return None if g is None else g.numpy()
    dense = np.zeros(p.shape, dtype=g.numpy().dtype)
    np.add.at(dense, np.asarray(g.rows(), dtype=np.int64), g._get_tensor_from_selected_rows().numpy())
    return dense


class DistributedOptimizer(Frontend):
    """Wraps a ``paddle.optimizer`` optimizer (SGD, Momentum, Adagrad, Adam, AdamW) and trains its parameters on the
    pservers: ``loss.backward()``, ``step()``, ``clear_grad()`` is the whole loop. ``step()`` sends the gradients
    (dense and embedding rows) and loads the new values into the parameters in place; the pservers apply the wrapped
    optimizer's rule with each parameter's hyper-parameters, and its learning rate as ``get_lr()`` gives it at each
    step (an LRScheduler stepping, ``set_lr``) from that step on. Every trainer starts from trainer 0's values (or a
    resumed checkpoint's: ``start_step`` is then the step it continues from). A ``grad_clip`` clips the step's
    gradient averaged over the trainers (``Bridge.synchronize``: one more round trip per step), as Paddle clips the
    whole batch's. Parameters with ``stop_gradient=True`` stay local, as paddle.optimizer skips them; one whose
    ``grad`` is None in a step counts as zero in the trainers' mean and is not updated at all when no trainer has
    one (as paddle.optimizer skips it; ``clear_grad()`` sets gradients to zero, which are applied, as Paddle does).
    Parameters are named by their Paddle names (the same on every trainer that builds the same model), or by
    ``named_parameters`` (``model.named_parameters()``) if given. ``mode``: "sync" (every step averages all
    trainers' gradients) or "async". One per trainer process."""

    FROZEN = "stop_gradient=True"

    def __init__(self, optimizer: paddle.optimizer.Optimizer,
                 named_parameters: Optional[Iterable[Tuple[str, Any]]] = None, mode: str = "sync",
                 overlap: bool = True, compression: Any = None,
                 **connect_kw: Any) -> None:
        bridge.vacant()
        compression = compression_of(compression)
        groups = optimizer._param_groups or []
        entries = [(g, p) for g in groups for p in g["params"]] if groups and isinstance(groups[0], dict) \
            else [(None, p) for p in groups]
        # stop_gradient=True when wrapped: never sent, never registered (paddle.optimizer skips them).
        self.frozen = [p for _, p in entries if p.stop_gradient]
        entries = [(g, p) for g, p in entries if not p.stop_gradient]
        names = param_names([(p, p.name) for _, p in entries], named_parameters)
        by_rule: Dict[Tuple[Any, ...], Tuple[Group, float]] = {}
        self.dense: List[Tuple[str, Any]] = []
        self.embeddings: List[Embedding] = []
        tables: List[TableDef] = []
        for g, p in entries:
            spec, mult = spec_of(optimizer, g, p)
            group, _ = by_rule.setdefault((tuple(sorted(spec.to_dict().items())), mult), (Group(spec), mult))
            self._place(group, names[id(p)], p, tables)
        self.optimizer = optimizer
        self.clips = self._clips(optimizer, entries, names)
        if self.clips and mode != "sync":
            raise _refuse(f"grad_clip with mode={mode!r}", "clipping needs the step's averaged gradient: mode='sync'")
        self.groups = [g for g, _ in by_rule.values()]
        self.mults = [m for _, m in by_rule.values()]
        self._connect(mode, connect_kw, {n: p.numpy() for n, p in self.dense}, tables, self.groups, compression)
        # Sync mode: each gradient leaves as backward produces it, once a step showed when that is (overlap.py);
        # a grad_clip needs the averaged gradient first (synchronize), so its gradients go at step().
        self._params = dict(self.dense)
        self.overlap = Overlap({n: int(np.prod(p.shape)) * (4 if p.dtype == paddle.float32 else 8)
                                for n, p in self.dense}, self._grad_of, self._mark, self._hypers,
                               self.bridge.send_early) \
            if overlap and mode == "sync" and self.dense and not self.clips else None
        if self.overlap is not None:
            for n, p in self.dense:  # runs once backward has accumulated p's gradient (train/private.py)
                p._register_backward_hook(lambda *_, n=n: self.overlap.ready(n))  # type: ignore[union-attr]

    @staticmethod
    def _clips(optimizer: Any, entries: List[Tuple[Any, Any]], names: Dict[int, str]
               ) -> List[Tuple[Any, List[Tuple[str, Any]]]]:
        """Each ``grad_clip`` (the optimizer's, or a parameter group's) and the dense parameters it clips together,
        as ``paddle.optimizer`` applies it: over all of them, or a group's over that group."""
        by: Dict[int, Tuple[Any, List[Tuple[str, Any]]]] = {}
        for g, p in entries:
            clip = (g or {}).get("grad_clip", optimizer._grad_clip)
            if clip is not None and getattr(p, "_paddle_cluster_table", None) is None:
                by.setdefault(id(g), (clip, []))[1].append((names[id(p)], p))
        return list(by.values())

    def _clipped(self, grads: Dict[str, Optional[np.ndarray]]) -> Dict[str, Optional[np.ndarray]]:
        """The step's gradient averaged over the trainers, clipped by each ``grad_clip`` with Paddle's own."""
        avg = self.bridge.synchronize(grads)
        for clip, params in self.clips:
            pairs = [(p, paddle.to_tensor(avg[n])) for n, p in params if avg[n] is not None]
            named = {id(p): n for n, p in params}
            for p, g in clip(pairs):
                avg[named[id(p)]] = g.numpy()
        return avg

    def _load(self, values: Dict[str, np.ndarray]) -> None:
        for name, p in self.dense:
            p.set_value(values[name])

    def step(self) -> None:
        """Send this step's gradients, load the values after it into the parameters."""
        grads = self._grads()
        rows = self._row_grads(grads)
        hypers = self._hypers()
        if self.overlap is not None:
            self.overlap.before_step(hypers)
        averaged, self._synced = self._synced or bool(self.clips), False
        if self.clips:  # clipping needs the whole step's gradient: averaged first, applied once as it is
            grads = self._clipped(grads)
        self._end_step(self.bridge.step(grads, rows, hypers, averaged=averaged))
        if self.overlap is not None:
            self.overlap.after_step()

    def _hypers(self) -> List[Dict[str, float]]:
        lr = float(self.optimizer.get_lr())
        return [{"lr": lr * m} for m in self.mults]

    def minimize(self, loss: Any, startup_program: Any = None, parameters: Any = None, no_grad_set: Any = None
                 ) -> Tuple[List[Any], List[Tuple[Any, Any]]]:
        """As paddle's dygraph ``minimize``: ``step()`` after ``loss.backward()``; the (parameter, gradient)
        pairs it used."""
        pairs = [(p, p.grad) for _, p in self.dense if p.grad is not None]
        self.step()
        return [], pairs

    def _grads(self) -> Dict[str, Optional[np.ndarray]]:
        """Each dense parameter's gradient now (None: it has none)."""
        self._refuse_thawed([p.name for p in self.frozen if p.grad is not None])
        return {n: _dense_grad(p) for n, p in self.dense}

    def _grad_of(self, name: str) -> Optional[np.ndarray]:
        return _dense_grad(self._params[name])

    def _mark(self, name: str) -> Optional[Tuple[int, int]]:
        """What changes when ``name``'s gradient does: its storage and in-place version (overlap.py)."""
        g = self._params[name].grad
        return None if g is None else (g.data_ptr(), g.inplace_version)

    def synchronize(self) -> None:
        """As ``paddle_cluster.torch``'s (Horovod's): every ``p.grad`` becomes the gradient this step applies, all
        trainers' averaged (None where no trainer has one), nothing applied yet: clip or inspect it (e.g.
        ``paddle.nn.utils.clip_grad_norm_``), then ``step()`` applies exactly that gradient. Sync mode; one more
        round trip (docs/pytorch.md). With a ``grad_clip`` the optimizer does this itself at ``step()``."""
        if self.clips:
            raise RuntimeError("DistributedOptimizer.synchronize(): the optimizer has a grad_clip, which step() "
                               "applies to the averaged gradient itself; drop grad_clip or the synchronize() call")
        if self.overlap is not None:
            self.overlap.before_sync()
        avg = self.bridge.synchronize(self._grads())
        for n, p in self.dense:
            a = avg[n]
            if a is None:
                p.clear_gradient(False)
            elif p.grad is None or p.grad.is_selected_rows():
                p._set_grad_ivar(paddle.to_tensor(a))
            else:
                p.grad.set_value(a)
        self._synced = True

    def clear_grad(self, set_to_zero: bool = True) -> None:
        if self.overlap is not None:
            self.overlap.before_zero_grad()
        self._synced = False
        self.optimizer.clear_grad(set_to_zero)
        for emb in self.embeddings:
            emb.clear_rows()

    clear_gradients = clear_grad

    def get_lr(self) -> float:
        return self.optimizer.get_lr()

    def set_lr(self, value: float) -> None:
        self.optimizer.set_lr(value)


def state_dict(model: paddle.nn.Layer, tables: str = "auto", final_wait: float = 600.0) -> Dict[str, paddle.Tensor]:
    """``model.state_dict()`` with the values the pservers hold now. ``tables="whole"``: each ``Embedding``'s
    ``weight`` is the whole table (the rows that exist, the others at their initial value), which a plain
    ``paddle.nn.Embedding`` of the same size loads; ``"rows"``: ``<weight>.ids`` and ``<weight>.rows``, the rows
    that exist; ``"auto"`` (the default): whole up to 1 GiB, rows above (said once on stderr). Async mode: trainer
    0 first waits (``final_wait`` s at most) for the other trainers to finish."""
    tables_of = [(n, m) for n, m in model.named_sublayers(include_self=True) if isinstance(m, Embedding)]
    return frontend.model_state(model.state_dict, tables_of, tables, final_wait, paddle.to_tensor)


def save(model: paddle.nn.Layer, path: str, tables: str = "auto") -> Optional[str]:
    """Trainer 0 writes ``state_dict(model, tables)`` (the pservers' parameters, trainer 0's buffers) to ``path``
    with ``paddle.save``, atomically; the path written (None on other trainers, which write nothing). If writing
    fails, the pservers save a checkpoint of this step first and the error says where (the job's model is never
    lost to a failed save)."""
    return bridge.save_atomically(path, lambda tmp: paddle.save(state_dict(model, tables), tmp))
