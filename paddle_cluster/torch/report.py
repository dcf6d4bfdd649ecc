"""``report`` (this trainer's metrics records, for ``paddle-cluster top`` and ``plot``) and ``average`` (a value
averaged over every trainer), for PyTorch scripts: ``train.report`` with tensors."""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Union

import torch

from ..train import report as _report


def report(metrics: Mapping[str, Any], step: Optional[int] = None) -> Dict[str, Any]:
    """Append ``metrics`` (name -> number or one-element tensor, e.g. ``{"loss": loss}``) to this trainer's
    metrics records at ``step`` (default: the steps the DistributedOptimizer has taken); the record written."""
    return _report.report(metrics, step)


def average(value: Union[float, torch.Tensor]) -> Union[float, torch.Tensor]:
    """``value`` averaged over every trainer (each passes its own; every trainer calls it at the same point): a
    float for a number, a tensor of the same shape, dtype and device for a tensor. For a ReduceLROnPlateau, an
    early stop or a validation score that must follow the whole job, not this trainer's shard."""
    if isinstance(value, torch.Tensor):
        mean = _report.average(value.detach().cpu().double().numpy())
        return torch.from_numpy(mean).reshape(value.shape).to(dtype=value.dtype, device=value.device)
    return float(_report.average([float(value)])[0])
