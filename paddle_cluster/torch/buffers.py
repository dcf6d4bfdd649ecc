"""Buffers (BatchNorm's running statistics) kept alike on every trainer, as DDP keeps them: before each training
forward of the model, every trainer takes trainer 0's buffers (``"broadcast"``, DDP's ``broadcast_buffers=True``)
or the trainers' mean (``"average"``), through pserver 0 (``PSClient.sum_over_trainers``)."""

from __future__ import annotations

import inspect
from typing import Any, List, Optional, Tuple

import numpy as np
import torch

from ..train.bridge import Bridge

HOW = ("broadcast", "average", None)


def model_of(named_parameters: Any) -> Optional[torch.nn.Module]:
    """The module whose ``named_parameters()`` generator this is (not started yet), else None."""
    frame = getattr(named_parameters, "gi_frame", None)
    if not inspect.isgenerator(named_parameters) or frame is None:
        return None
    owner = frame.f_locals.get("self")
    return owner if isinstance(owner, torch.nn.Module) else None


class BufferSync:
    """Keeps ``model``'s buffers alike on every trainer (``how``: "broadcast" or "average") before each forward
    in training mode with gradients on; an eval or no-grad forward (trainer 0's validation alone) is left
    alone, so it needs no other trainer."""

    def __init__(self, model: torch.nn.Module, bridge: Bridge, how: str) -> None:
        self.bridge, self.how = bridge, how
        self.buffers: List[Tuple[str, torch.Tensor]] = [(n, b) for n, b in model.named_buffers() if b is not None]
        self.handle = model.register_forward_pre_hook(self._before_forward) if self.buffers else None

    def _before_forward(self, module: torch.nn.Module, args: Any) -> None:
        if module.training and torch.is_grad_enabled():
            self.sync()

    def sync(self) -> None:
        flat = np.concatenate([b.detach().cpu().double().numpy().reshape(-1) for _, b in self.buffers])
        if self.how == "broadcast" and self.bridge.rank != 0:
            flat[:] = 0.0  # trainer 0's values plus zeros: exactly trainer 0's
        total, n = self.bridge.ps.sum_over_trainers(flat)
        values = total if self.how == "broadcast" else total / max(1, n)
        at = 0
        with torch.no_grad():
            for _, b in self.buffers:
                part = values[at:at + b.numel()].reshape(b.shape)
                at += b.numel()
                if not b.is_floating_point():
                    part = np.rint(part)
                b.copy_(torch.from_numpy(np.asarray(part)).to(b.dtype))

    def close(self) -> None:
        if self.handle is not None:
            self.handle.remove()
