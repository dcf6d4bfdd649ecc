"""``Embedding``: a ``torch.nn.Module`` whose rows live on the pservers, fetched per batch, unique ids only."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from ..train.embedding_args import refuse
from ..train.frontend import TableRows


class Embedding(TableRows, torch.nn.Module):
    """A table of ``num_embeddings`` rows of ``embedding_dim`` on the pservers: ``forward(ids)`` (any integer
    shape) returns ``ids.shape + (embedding_dim,)`` with autograd; the row gradients go out at the wrapped
    optimizer's ``step()``. A row is created the first time its id is used (uniform in ``(-init_scale,
    init_scale)``, from ``seed``), so a table of 50 million rows costs nothing until rows are touched.

    Its ``weight`` is a zero-size placeholder: it puts the table in the optimizer's parameter groups (so the
    table follows its group's update rule and hyper-parameters) and names it in ``state_dict``, where
    ``paddle_cluster.torch.state_dict`` fills in the whole table. ``name`` (default: the placeholder's name in
    ``named_parameters`` without ``.weight``) must be the same on every trainer.

    The arguments are ``torch.nn.Embedding``'s: ``padding_idx`` is that row kept at zero and given no gradient
    (it is never created on the pservers), ``sparse`` and ``device`` change nothing here, and ``max_norm``,
    ``scale_grad_by_freq``, ``_weight`` and ``_freeze`` are refused in one line. ``name``, ``init_scale`` and
    ``seed`` are keyword-only.
    """

    FRONTEND = ("paddle_cluster.torch", "opt = pct.DistributedOptimizer(torch.optim.Adam(model.parameters()), "
                "named_parameters=model.named_parameters())")

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: Optional[int] = None,
                 max_norm: Optional[float] = None, norm_type: float = 2.0, scale_grad_by_freq: bool = False,
                 sparse: bool = False, _weight: Optional[torch.Tensor] = None, _freeze: bool = False,
                 device: Any = None, dtype: Optional[torch.dtype] = None, *, name: Optional[str] = None,
                 init_scale: float = 0.01, seed: int = 0) -> None:
        super().__init__()
        self._setup_rows(num_embeddings, embedding_dim, padding_idx, name, init_scale, seed)
        # sparse: the rows always travel as rows; norm_type only matters with max_norm; device: rows are fetched
        # to the CPU and the output follows the ids' device.
        refuse("Embedding", max_norm=max_norm, scale_grad_by_freq=scale_grad_by_freq, _weight=_weight,
               _freeze=_freeze)
        self.dtype = torch.float32 if dtype is None else dtype
        self.weight = torch.nn.Parameter(torch.empty(0, dtype=self.dtype))
        self.weight._paddle_cluster_table = self  # how DistributedOptimizer tells the table from a dense parameter

    def _np_dtype(self) -> np.dtype:
        return torch.empty(0, dtype=self.dtype).numpy().dtype

    def forward(self, ids: Any) -> torch.Tensor:
        ids = torch.as_tensor(ids)
        lk = self._lookup(ids.detach().cpu().numpy())
        rows = torch.from_numpy(lk.rows)
        if torch.is_grad_enabled():
            rows.requires_grad_(True)
            self._lookups.append((lk.ids, rows))
        if lk.padded:  # the padding id's row: zeros, outside the rows whose gradients go out
            rows = torch.cat([rows, rows.new_zeros(1, self.embedding_dim)])
        out = rows[torch.from_numpy(lk.inverse)].reshape(*lk.shape, self.embedding_dim)
        return out.to(ids.device) if ids.device.type != "cpu" else out

    def zero_grad_rows(self) -> None:
        for _, rows in self._lookups:
            rows.grad = None
