"""Loss-scaling strategies, all with torch.amp.GradScaler's interface.

Every strategy is a GradScaler (scale, unscale_, step, update, state_dict), so the training step
is the same code whatever the strategy: a disabled scaler is a no-op. Each one also exposes the
scale it applied and whether the last step was skipped as device tensors, so the loop can keep a
complete scale history without a host-device synchronisation per step.
"""

from __future__ import annotations

import logging

import torch
from omegaconf import DictConfig

from mpexp.precision import Precision

log = logging.getLogger(__name__)

STRATEGIES = ("auto", "none", "static", "dynamic")


class LossScaler(torch.amp.GradScaler):
    """GradScaler plus device-side views of the current scale and the last step's overflow."""

    strategy = "dynamic"

    def __init__(self, device: torch.device, **kwargs):
        super().__init__(device.type, **kwargs)
        self._device = device
        self._found_inf = torch.zeros((), device=device)
        self._one = torch.ones((), device=device)
        self._sum_overflow_over_ranks = False

    def scale_tensor(self) -> torch.Tensor:
        """The current scale as a device tensor (1.0 when disabled).

        It is the scaler's own tensor, which `update()` changes in place: copy it (the loop stacks
        it into its history) before calling `update()`.
        """
        if not self._enabled:
            return self._one
        if self._scale is None:
            self._lazy_init_scale_growth_tracker(self._device)
        return self._scale

    def found_inf(self) -> torch.Tensor:
        """1.0 if the last `step` was skipped for non-finite gradients, else 0.0 (device tensor)."""
        return self._found_inf

    def skip_together(self) -> None:
        """Sum the overflow flags over all ranks before each step is taken or skipped.

        Needed when each rank unscales different gradients (FSDP shards): one rank may find an
        inf that the others cannot see, and all must skip that step and back the scale off
        alike, as torch's ShardedGradScaler does.
        """
        self._sum_overflow_over_ranks = True

    def unscale_(self, optimizer) -> None:
        super().unscale_(optimizer)
        if self._enabled and self._sum_overflow_over_ranks:
            per_device = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
            for found_inf in per_device.values():
                torch.distributed.all_reduce(found_inf)  # on the device: no host sync

    def step(self, optimizer, *args, **kwargs):
        result = super().step(optimizer, *args, **kwargs)
        if self._enabled:
            per_device = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
            # sum of per-device flags: stays on the device, read in the next metrics flush
            self._found_inf = sum(v.to(self._device) for v in per_device.values()).clamp(max=1)
        return result

    def describe(self) -> dict:
        """The scaler's settings for the run record."""
        if not self._enabled:
            return {"loss_scaling": "none"}
        return {
            "loss_scaling": self.strategy,
            "init_scale": self._init_scale,
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
        }


class StaticLossScaler(LossScaler):
    """A constant scale: overflowing steps are skipped, the scale never moves."""

    strategy = "static"

    def __init__(self, device: torch.device, scale: float):
        super().__init__(device, init_scale=scale)
        self._static_scale = float(scale)

    def update(self, new_scale=None) -> None:
        # GradScaler.update with an explicit scale resets the per-step state and keeps the scale
        super().update(self._static_scale if new_scale is None else new_scale)

    def describe(self) -> dict:
        return {"loss_scaling": "static", "scale": self._static_scale}


def resolve_strategy(name: str, precision: Precision) -> str:
    """Turn `auto` into a concrete strategy and warn about unusual explicit choices."""
    if name == "auto":
        return "dynamic" if precision.autocast_dtype is torch.float16 else "none"
    if name in ("static", "dynamic") and precision.autocast_dtype is not torch.float16:
        log.warning(
            "loss_scaling=%s under precision=%s: gradients in %s do not underflow like fp16's, "
            "so the scaler only adds work. Honoured as asked; loss_scaling=auto picks none here.",
            name,
            precision.mode,
            "bfloat16" if precision.autocast_dtype is torch.bfloat16 else "float32",
        )
    if name == "none" and precision.autocast_dtype is torch.float16:
        log.info("fp16 without loss scaling: small gradients will underflow to zero (as intended?)")
    return name


def build_scaler(cfg: DictConfig, precision: Precision, device: torch.device) -> LossScaler:
    """The scaler for a `loss_scaling` config under a precision mode."""
    strategy = resolve_strategy(cfg.name, precision)
    if strategy == "none":
        return LossScaler(device, enabled=False)
    if strategy == "static":
        return StaticLossScaler(device, scale=cfg.scale)
    return LossScaler(
        device,
        init_scale=cfg.init_scale,
        growth_factor=cfg.growth_factor,
        backoff_factor=cfg.backoff_factor,
        growth_interval=cfg.growth_interval,
    )
