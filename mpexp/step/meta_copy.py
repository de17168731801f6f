"""A model's copy on the meta device, for what is learned from its shapes alone (its FLOPs, what
keeps its step from a CUDA graph) without memory or compute, the model itself left as it was."""

from __future__ import annotations

import copy

import torch
from torch import nn


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of `model` whose parameters and buffers are meta tensors of the same shapes, dtypes
    and requires_grad, made without copying one: deepcopy finds each already copied (its memo), so
    a model that fills the GPU is never there twice (deepcopy, then `.to("meta")`, would briefly
    be). A weight tied to another stays tied: both are one object, copied once."""
    memo: dict[int, torch.Tensor] = {}
    for param in model.parameters():
        meta = torch.empty_like(param, device="meta")
        memo[id(param)] = nn.Parameter(meta, requires_grad=param.requires_grad)
    for buffer in model.buffers():
        memo[id(buffer)] = torch.empty_like(buffer, device="meta")
    return copy.deepcopy(model, memo)
