"""Learning-rate schedules that advance only on optimizer steps that really happened.

Why a step post-hook, not `scheduler.step()` in the loop: under loss scaling, a step whose gradients
overflow is skipped, and it must not advance the schedule. The decision is GradScaler's: for the
usual (non-fused) optimizers, `GradScaler.step` reads the overflow flag on the host itself and
calls `optimizer.step()` only when it is clear. So "the optimizer really stepped" is exactly
"optimizer.step() ran", and a post-hook on it advances the schedule with no extra synchronisation
and no guessing. The alternative, a schedule driven by a device-side count of real steps, would
need the learning rate as a device tensor inside the optimizer, which only the fused and capturable
optimizer variants accept (and those differ between torch versions).

Fused optimizers under loss scaling (or with trainer.on_nonfinite_loss=skip) are the exception:
they skip on the device inside `optimizer.step()`, so the hook would count skipped steps too. That
pairing is refused. Without either, a skipped step (non-finite gradients) stops the run at the
next flush, so the schedule's count past it never matters.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from hydra.utils import get_object
from torch.optim.lr_scheduler import LambdaLR

from mpexp.config import to_dict
from mpexp.errors import ConfigError
from mpexp.precision.scaling import LossScaler
from mpexp.targets import spans_run


def cosine(total_steps: int, warmup_steps: int, min_lr_ratio: float) -> Callable[[int], float]:
    """Linear warm-up to the base rate, then half a cosine down to min_lr_ratio x base."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def step_decay(step_size: int, gamma: float) -> Callable[[int], float]:
    """Multiply the rate by gamma every step_size real steps."""
    return lambda step: gamma ** (step // step_size)


def build_schedule(
    cfg: Mapping[str, Any],
    optimizer: torch.optim.Optimizer,
    scaler: LossScaler,
    total_steps: int,
) -> LambdaLR | None:
    """Attach the `scheduler` config's schedule to the optimizer (None without one).

    `_target_` is a function of the config's other keys (and of `total_steps`, if it takes it)
    that returns the learning-rate factor for each real optimizer step.
    """
    target = cfg.get("_target_")
    if target is None:
        return None
    settings = {k: v for k, v in to_dict(cfg).items() if k != "_target_"}
    if spans_run(target):
        settings["total_steps"] = total_steps
    factor = get_object(target)(**settings)
    if getattr(optimizer, "_step_supports_amp_scaling", False) and scaler.continues_after_skip():
        name = target.rpartition(".")[2]
        raise ConfigError(
            f"The {name} schedule with a fused optimizer under loss scaling: the fused step skips "
            "overflowing steps on the device, so the schedule cannot tell skipped steps from real "
            "ones without a host read every step. Drop optimizer.fused or use scheduler=none."
        )
    schedule = LambdaLR(optimizer, factor)
    optimizer.register_step_post_hook(lambda *_: schedule.step())
    return schedule
