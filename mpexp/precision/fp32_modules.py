"""precision.fp32_modules: named submodules that run outside autocast, in float32."""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn

from mpexp.errors import ConfigError
from mpexp.precision.modes import Precision

log = logging.getLogger(__name__)


def run_in_float32(model: nn.Module, names: list[str], precision: Precision) -> list[str]:
    """Make the named submodules run outside autocast, in float32 (selective autocast).

    The way "How to Use Mixed Precision Training in PyTorch" shows it, and the PyTorch blog post
    advises for precision-sensitive regions: inside the module autocast is off and its floating
    inputs are cast to float32, so it computes in float32 with its float32 weights.
    """
    if not names:
        return []
    modules = dict(model.named_modules())
    unknown = [n for n in names if n not in modules or n == ""]
    if unknown:
        known = ", ".join(n for n in modules if n)
        raise ConfigError(
            f"precision.fp32_modules names {', '.join(map(repr, unknown))}, which the model does "
            f"not have. Its submodules are: {known}."
        )
    if precision.autocast_dtype is None:
        log.warning(
            "precision.fp32_modules=%s has no effect under precision=%s: nothing runs under "
            "autocast%s.",
            list(names),
            precision.mode,
            " (and TF32 is a global switch that cannot be turned off per module)"
            if precision.mode == "tf32"
            else "",
        )
        return []
    for name in names:
        _forward_in_float32(modules[name], precision.device_type)
    return list(names)


def _forward_in_float32(module: nn.Module, device_type: str) -> None:
    inner = module.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        with torch.autocast(device_type=device_type, enabled=False):
            return inner(*map(_to_float32, args), **{k: _to_float32(v) for k, v in kwargs.items()})

    module.forward = forward


def _to_float32(value):
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.float()
    return value
