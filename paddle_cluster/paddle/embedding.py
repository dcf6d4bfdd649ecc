"""``Embedding``: a ``paddle.nn.Layer`` whose rows live on the pservers, fetched per batch, unique ids only."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import paddle

from ..train.embedding_args import refuse
from ..train.frontend import TableRows


class Embedding(TableRows, paddle.nn.Layer):
    """A table of ``num_embeddings`` rows of ``embedding_dim`` on the pservers: ``forward(ids)`` (any integer
    shape) returns ``ids.shape + [embedding_dim]`` with autograd; the row gradients go out at the wrapped
    optimizer's ``step()``. A row is created the first time its id is used (uniform in ``(-init_scale,
    init_scale)``, from ``seed``), so a table of 50 million rows costs nothing until rows are touched.

    Its ``weight`` is a zero-row placeholder: it puts the table in the optimizer's parameters (so the table
    follows its group's update rule and hyper-parameters) and names it in ``state_dict``, where
    ``paddle_cluster.paddle.state_dict`` fills in the whole table. ``name`` (default: the placeholder's Paddle
    name, e.g. ``embedding_0.w_0``) must be the same on every trainer.

    The arguments are ``paddle.nn.Embedding``'s: ``padding_idx`` is that row output as zeros and given no
    gradient (it is never created on the pservers), ``sparse`` and ``device`` change nothing here, and
    ``max_norm``, ``scale_grad_by_freq``, ``_weight``, ``_freeze`` and ``weight_attr`` are refused in one line.
    """

    FRONTEND = ("paddle_cluster.paddle", "opt = ppc.DistributedOptimizer(paddle.optimizer.Adam("
                "parameters=model.parameters()))")

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: Optional[int] = None,
                 max_norm: Optional[float] = None, norm_type: float = 2.0, *, scale_grad_by_freq: bool = False,
                 sparse: bool = False, _weight: Any = None, _freeze: bool = False, device: Any = None,
                 dtype: Optional[str] = None, weight_attr: Any = None, name: Optional[str] = None,
                 init_scale: float = 0.01, seed: int = 0) -> None:
        super().__init__()
        self._setup_rows(num_embeddings, embedding_dim, padding_idx, name, init_scale, seed)
        # sparse: the rows always travel as rows; norm_type only matters with max_norm; device: rows are fetched
        # to the CPU.
        refuse("Embedding", max_norm=max_norm, scale_grad_by_freq=scale_grad_by_freq, _weight=_weight,
               _freeze=_freeze, weight_attr=weight_attr)
        self.weight = self.create_parameter([0, embedding_dim], dtype=dtype or "float32")
        self.weight._paddle_cluster_table = self  # how DistributedOptimizer tells the table from a dense parameter

    def _np_dtype(self) -> np.dtype:
        return np.dtype(self.weight.numpy().dtype)

    def forward(self, ids: Any) -> paddle.Tensor:
        lk = self._lookup(ids.numpy() if isinstance(ids, paddle.Tensor) else np.asarray(ids))
        grad = paddle.is_grad_enabled()
        rows = paddle.to_tensor(lk.rows, stop_gradient=not grad)
        if grad:
            self._lookups.append((lk.ids, rows))
        if lk.padded:  # the padding id's row: zeros, outside the rows whose gradients go out
            rows = paddle.concat([rows, paddle.zeros([1, self.embedding_dim], dtype=rows.dtype)])
        return paddle.gather(rows, paddle.to_tensor(lk.inverse)).reshape([*lk.shape, self.embedding_dim])

    def clear_rows(self) -> None:
        """(clear_grad.) Forget the lookups whose gradients were computed: what a later backward adds is new."""
        self._lookups = [(ids, rows) for ids, rows in self._lookups if rows.grad is None]
