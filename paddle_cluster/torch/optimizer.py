"""``DistributedOptimizer``: a ``torch.optim`` optimizer whose update the pservers apply; ``rank``, ``size``,
and the final model (``state_dict``, ``save``)."""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import numpy as np
import torch

from ..ps.optim import OptimizerSpec
from ..train import bridge, frontend
from ..train.bridge import Group, TableDef, rank, shutdown, size  # noqa: F401  (this module's API, as torch users call it)
from ..train.frontend import Compression, Frontend, compression_of, param_names  # noqa: F401
from ..train.overlap import Overlap
from .buffers import HOW, BufferSync, model_of
from .embedding import Embedding

# torch.optim class -> the server rule; the options each may set (any other non-default one is refused).
SUPPORTED = {"SGD": "sgd", "Adagrad": "adagrad", "Adam": "adam", "AdamW": "adamw"}
_ONE_LINE = ("supported: torch.optim.SGD (momentum, dampening, nesterov, weight_decay), Adagrad (lr_decay, "
             "initial_accumulator_value, eps, weight_decay), Adam and AdamW (betas, eps, weight_decay, amsgrad)")
# Options that change how torch computes, never what: ignored.
_HOW = {"foreach", "fused", "capturable", "differentiable", "params", "param_names", "initial_lr"}

_NO_NEW_GROUP = ("add_param_group after DistributedOptimizer wrapped the optimizer is not supported: the parameters "
                 "are defined on the pservers when it is wrapped; add every group before wrapping (one to train "
                 "later can start with lr=0 and get its rate from a scheduler or by hand)")


def spec_of(optimizer: torch.optim.Optimizer, group: Dict[str, Any]) -> OptimizerSpec:
    """The server rule doing what ``optimizer`` does to ``group``; ValueError (one line) for anything else."""
    kind = type(optimizer).__name__
    if type(optimizer) is not getattr(torch.optim, kind, None) or kind not in SUPPORTED:
        what = f"torch.optim.{kind}" if type(optimizer) is getattr(torch.optim, kind, None) else \
            f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
        raise ValueError(f"DistributedOptimizer: {what} is not supported; {_ONE_LINE}")
    # A key the constructor does not take is bookkeeping (a scheduler's max_lr, base_momentum...): torch ignores it.
    g = {k: v for k, v in group.items() if k not in _HOW and k in optimizer.defaults}
    if g.pop("maximize", False):
        raise ValueError(f"DistributedOptimizer: torch.optim.{kind}(maximize=True) is not supported; {_ONE_LINE}")
    spec = {"name": SUPPORTED[kind], "lr": float(g.pop("lr")), "weight_decay": float(g.pop("weight_decay", 0.0))}
    if kind == "SGD":
        momentum, dampening, nesterov = float(g.pop("momentum", 0.0)), float(g.pop("dampening", 0.0)), \
            bool(g.pop("nesterov", False))
        if momentum:
            spec.update(name="momentum", momentum=momentum, dampening=dampening, nesterov=nesterov)
    elif kind == "Adagrad":
        g.pop("initial_accumulator_value", None)  # torch fills every group's sum from the constructor's value
        spec.update(eps=float(g.pop("eps")), lr_decay=float(g.pop("lr_decay", 0.0)),
                    initial_accumulator_value=float(optimizer.defaults.get("initial_accumulator_value", 0.0)))
    else:
        beta1, beta2 = g.pop("betas")
        spec.update(beta1=float(beta1), beta2=float(beta2), eps=float(g.pop("eps")),
                    amsgrad=bool(g.pop("amsgrad", False)))
        if g.pop("decoupled_weight_decay", False):
            spec["name"] = "adamw"
    other = {k: v for k, v in g.items() if v not in (None, False, 0)}
    if other:
        raise ValueError(f"DistributedOptimizer: torch.optim.{kind} option(s) {other} not supported; {_ONE_LINE}")
    try:
        return OptimizerSpec.from_dict(spec)
    except ValueError as e:
        raise ValueError(f"DistributedOptimizer: torch.optim.{kind} {spec}: {e}") from None


class DistributedOptimizer(Frontend, torch.optim.Optimizer):
    """Wraps a ``torch.optim`` optimizer (SGD, Adagrad, Adam, AdamW): ``zero_grad()``, ``loss.backward()``,
    ``step()`` is the whole loop. ``step()`` sends the gradients (dense and embedding rows) and loads the new
    values into the parameters in place; the pservers apply the wrapped optimizer's rule with each parameter
    group's hyper-parameters, and a change to them (an LR scheduler stepping either optimizer) from the next
    step on. A parameter without a gradient in a step (``grad`` None) counts as zero in the trainers' mean, and
    is not updated at all when no trainer has one (as torch and DDP); one with ``requires_grad=False`` when
    wrapped stays on the trainer, as it is. Every trainer starts from trainer 0's values (or a resumed
    checkpoint's: ``start_step`` is then the step it continues from). ``mode``: "sync" (every step averages all
    trainers' gradients) or "async". ``buffers`` (sync mode): "broadcast" (trainer 0's before each training
    forward, as DDP), "average" or None (each trainer its own), for ``model`` (default: the module
    ``named_parameters`` came from). One per trainer process."""

    FROZEN = "requires_grad=False"

    def __init__(self, optimizer: torch.optim.Optimizer,
                 named_parameters: Optional[Iterable[Tuple[str, torch.nn.Parameter]]] = None,
                 mode: str = "sync", *, model: Optional[torch.nn.Module] = None,
                 buffers: Optional[str] = "broadcast", overlap: bool = True,
                 compression: Any = None, **connect_kw: Any) -> None:
        bridge.vacant()
        compression = compression_of(compression)
        if buffers not in HOW:
            raise ValueError(f"DistributedOptimizer(buffers={buffers!r}): expected 'broadcast' (trainer 0's before "
                             "each forward, as DDP), 'average' or None (each trainer its own)")
        model = model if model is not None else model_of(named_parameters)
        specs = [spec_of(optimizer, g) for g in optimizer.param_groups]
        # positional names by default: the same on every trainer that builds the same optimizer
        names = param_names([(p, f"group{i}.param{j}") for i, g in enumerate(optimizer.param_groups)
                             for j, p in enumerate(g["params"])], named_parameters)
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self.param_groups, self.state = optimizer.param_groups, optimizer.state  # one set: a scheduler on either
        self.optimizer = optimizer
        self.specs = specs
        self.dense: List[Tuple[str, torch.nn.Parameter]] = []
        self.embeddings: List[Embedding] = []
        # requires_grad=False when wrapped: never sent, never registered (torch leaves them as they are).
        self.frozen: List[Tuple[str, torch.nn.Parameter]] = []
        groups: List[Group] = []
        tables: List[TableDef] = []
        for spec, g in zip(specs, optimizer.param_groups):
            groups.append(Group(spec))
            for p in g["params"]:
                if p.requires_grad:
                    self._place(groups[-1], names[id(p)], p, tables)
                else:
                    self.frozen.append((names[id(p)], p))
        self._connect(mode, connect_kw, {n: p.detach().cpu().numpy() for n, p in self.dense}, tables, groups,
                      compression)
        # Sync mode: each gradient leaves as backward produces it, once a step showed when that is (overlap.py).
        self.overlap = Overlap({n: p.numel() * p.element_size() for n, p in self.dense}, self._grad_of, self._mark,
                               self._hypers_or_none, self.bridge.send_early) \
            if overlap and mode == "sync" and self.dense else None
        self._params = dict(self.dense)
        self.bridge.ps.defer_split = True  # _load_step reads a parameter split over lanes there
        if self.overlap is not None:
            for n, p in self.dense:
                p.register_post_accumulate_grad_hook(lambda _p, n=n: self.overlap.ready(n))  # type: ignore[union-attr]
        # DDP's buffers: sync mode only (async trainers do not step together); alone there is no one to match.
        self.buffers = BufferSync(model, self.bridge, buffers) \
            if model is not None and buffers and mode == "sync" and self.bridge.size > 1 else None

    def _load(self, values: Dict[str, np.ndarray]) -> None:
        with torch.no_grad():
            for name, p in self.dense:
                p.copy_(torch.from_numpy(values[name]))

    def _load_step(self, values: Dict[str, np.ndarray]) -> None:
        """Each parameter's part copied from where the client holds it: a parameter split over same-host lanes
        straight from them (``PSClient.defer_split``), one copy a step, not two."""
        ps = self.bridge.ps
        with torch.no_grad():
            for name, p in self.dense:
                parts = ps.value_parts(name)
                if len(parts) == 1 or not p.is_contiguous():
                    whole = parts[0][2] if len(parts) == 1 else np.concatenate([v for _, _, v in parts])
                    p.copy_(torch.from_numpy(whole).reshape(p.shape))
                    continue
                flat = p.view(-1)
                for lo, hi, v in parts:
                    flat[lo:hi].copy_(torch.from_numpy(v))

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        if getattr(self, "bridge", None) is not None:  # torch.optim.Optimizer.__init__ adds the wrapped groups
            raise ValueError(_NO_NEW_GROUP)
        super().add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if getattr(self, "overlap", None) is not None:
            self.overlap.before_zero_grad()
        self._synced = False
        super().zero_grad(set_to_none)
        for emb in self.embeddings:
            emb.zero_grad_rows()

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """Send this step's gradients, load the values after it into the parameters."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grads = self._grads()
        rows = self._row_grads(grads)
        if len(self.param_groups) != len(self.specs):  # add_param_group on the wrapped optimizer
            raise ValueError(_NO_NEW_GROUP)
        # The groups' options now (an LR scheduler may have changed them): the bridge sends what changed.
        hypers = self._hypers()
        if self.overlap is not None:
            self.overlap.before_step(hypers)
        averaged, self._synced = self._synced, False
        self._end_step(self.bridge.step(grads, rows, hypers, averaged=averaged))
        if self.overlap is not None:
            self.overlap.after_step()
        self.optimizer._opt_called = True  # an LR scheduler made on the wrapped optimizer sees it stepped
        return loss

    def _hypers(self) -> List[Dict[str, Any]]:
        return [spec_of(self.optimizer, g).to_dict() for g in self.param_groups]

    def _hypers_or_none(self) -> Optional[List[Dict[str, Any]]]:
        """(During backward.) The groups' hyper-parameters, None for what ``step()`` refuses (a group added, an
        option not supported): those gradients wait for ``step()``, which says why in one line."""
        if len(self.param_groups) != len(self.specs):
            return None
        try:
            return self._hypers()
        except ValueError:
            return None

    def _grads(self) -> Dict[str, Optional[np.ndarray]]:
        """Each dense parameter's gradient now (None: it has none)."""
        self._refuse_thawed([n for n, p in self.frozen if p.grad is not None])
        return {n: self._grad_of(n) for n, _ in self.dense}

    def _grad_of(self, name: str) -> Optional[np.ndarray]:
        g = self._params[name].grad
        return None if g is None else (g.to_dense() if g.is_sparse else g).detach().cpu().numpy()

    def _mark(self, name: str) -> Optional[Tuple[int, int, int]]:
        """What changes when ``name``'s gradient does: its tensor, storage, and in-place version (overlap.py)."""
        g = self._params[name].grad
        return None if g is None else (id(g), g.data_ptr(), g._version)

    def synchronize(self) -> None:
        """Horovod's: leave in every ``p.grad`` the gradient this step applies, all trainers' averaged (None where
        no trainer has one), nothing applied yet: clip or inspect it, then ``step()`` (under
        ``skip_synchronize()``, as Horovod scripts write it) applies exactly that gradient. Sync mode. Costs one
        more round trip: the gradients go to the pservers and their average comes back, then the step sends the
        final gradient (trainer 0; the others send zeros) as a step without it would. Embedding tables' row
        gradients are not in it: they go at ``step()`` as always."""
        if self.overlap is not None:
            self.overlap.before_sync()
        avg = self.bridge.synchronize(self._grads())
        with torch.no_grad():
            for n, p in self.dense:
                a = avg[n]
                p.grad = None if a is None else torch.from_numpy(a).to(device=p.device, dtype=p.dtype)
        self._synced = True


def state_dict(model: torch.nn.Module, tables: str = "auto", final_wait: float = 600.0) -> Dict[str, torch.Tensor]:
    """``model.state_dict()`` with the values the pservers hold now. ``tables="whole"``: each ``Embedding``'s
    ``weight`` is the whole table (the rows that exist, the others at their initial value), which a plain
    ``torch.nn.Embedding`` of the same size loads; ``"rows"``: ``<weight>.ids`` and ``<weight>.rows``, the rows
    that exist; ``"auto"`` (the default): whole up to 1 GiB, rows above (said once on stderr). Async mode: trainer
    0 first waits (``final_wait`` s at most) for the other trainers to finish."""
    tables_of = [(n, m) for n, m in model.named_modules() if isinstance(m, Embedding)]
    return frontend.model_state(model.state_dict, tables_of, tables, final_wait, torch.from_numpy)


def save(model: torch.nn.Module, path: str, tables: str = "auto") -> Optional[str]:
    """Trainer 0 writes ``state_dict(model, tables)`` (the pservers' parameters, trainer 0's buffers) to ``path``
    with ``torch.save``, atomically; the path written (None on other trainers, which write nothing). If writing
    fails, the pservers save a checkpoint of this step first and the error says where (the job's model is never
    lost to a failed save)."""
    return bridge.save_atomically(path, lambda tmp: torch.save(state_dict(model, tables), tmp))
