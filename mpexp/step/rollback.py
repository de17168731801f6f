"""Skipped steps leave the model's buffers as they were.

A forward pass in training mode changes more than activations: BatchNorm updates its running mean
and variance and counts the batch. GradScaler skips an overflowing step (or, with
trainer.on_nonfinite_loss=skip, a step whose loss is not finite) by not calling the optimizer, but
by then the forward pass has already folded that batch into the running statistics, inf and NaN
included: training goes on (it normalises with batch statistics), while every later evaluation,
which uses the running ones, is NaN. So the buffers are saved before the forward pass and put back
when the step turns out to be skipped.

Both happen on the device, with no host read: the skip flag is a device tensor, and the saved or
the current values are selected by it. The buffers are small, but a copy and a select per buffer
would be dozens of kernel launches per step for a deep network (DeepCNN has 42 buffers), so each
dtype's buffers are handled together: one multi-tensor copy to save them, one concatenation, one
select and one multi-tensor copy to restore them, whatever the number of layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class _SameKind:
    """Buffers of one device and dtype, and flat storage for their saved values."""

    buffers: list[torch.Tensor]
    flat: list[torch.Tensor]  # each buffer as a 1-D view, made once
    saved: torch.Tensor  # 1-D
    views: list[torch.Tensor]  # `saved` cut into the buffers' shapes


class BufferRollback:
    """Saves a module's buffers before each step and restores them if the step is skipped."""

    def __init__(self, buffers: list[torch.Tensor]):
        kinds: dict[tuple, list[torch.Tensor]] = {}
        for buffer in buffers:
            kinds.setdefault((buffer.device, buffer.dtype), []).append(buffer)
        self._kinds = []
        for (device, dtype), same in kinds.items():
            saved = torch.empty(sum(b.numel() for b in same), dtype=dtype, device=device)
            pieces = saved.split([b.numel() for b in same])
            views = [v.view(b.shape) for v, b in zip(pieces, same, strict=True)]
            self._kinds.append(_SameKind(same, [b.view(-1) for b in same], saved, views))

    @classmethod
    def for_step(cls, model: nn.Module, can_skip: bool) -> BufferRollback:
        """The rollback for `model`'s training steps: nothing to do when no step can be skipped
        (no loss scaling and no non-finite-loss guard) or the model has no buffers."""
        return cls(list(model.buffers()) if can_skip else [])

    def save(self) -> None:
        """Copy the buffers aside; call before the step's first forward pass."""
        for kind in self._kinds:
            torch._foreach_copy_(kind.views, kind.buffers)

    def restore_if(self, skipped: torch.Tensor) -> None:
        """Put the saved values back where `skipped` (a device flag, 1.0 or 0.0) is set."""
        if not self._kinds:
            return
        skip = skipped.to(torch.bool)
        for kind in self._kinds:
            current = torch.cat(kind.flat)
            # select, never arithmetic: the values to replace may well be inf or NaN
            torch.where(skip.to(kind.saved.device), kind.saved, current, out=kind.saved)
            torch._foreach_copy_(kind.buffers, kind.views)
