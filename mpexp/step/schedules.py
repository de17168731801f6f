"""Learning-rate schedules that advance only on optimizer steps that really happened.

A step whose gradients overflow under loss scaling is skipped, and it must not advance the
schedule. Two ways to keep that promise, decided once at setup (`build_schedule`):

- **On the device** (`DeviceSchedule`, wherever the optimizer takes its learning rate as a
  tensor: fused and capturable optimizers): a count of the steps really taken lives on the
  device and grows by one minus the step's skip flag; after each step the next step's
  learning rate is computed from it there, into the tensor the optimizer reads. No host read,
  nothing in Python between steps, so the step stays fused, sync-free and capturable as a CUDA
  graph whatever the precision: fp16 with loss scaling and a schedule runs bf16's step path.
- **On the host** (`HostSchedule`, a LambdaLR advanced by a post-hook on `optimizer.step()`):
  for optimizers that take only a float. Unfused optimizers call `optimizer.step()` only when
  GradScaler's host read of the overflow flag says the step is real, so the hook counts real
  steps exactly; fused ones under loss scaling skip inside the kernel, which the hook cannot
  see, so that pairing is refused there.

A schedule is a function of the config's keys (and of `total_steps`, if it takes it) that returns
the learning-rate factor for a number of real steps. Written with operators and `torch` functions
that take a 0-d tensor as well as an int, it runs on the device; a factor that only takes ints
keeps the host schedule.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from hydra.utils import get_object
from torch.optim.lr_scheduler import LambdaLR

from mpexp.config import to_dict
from mpexp.errors import ConfigError
from mpexp.precision.loss_scaler import LossScaler
from mpexp.targets import spans_run

log = logging.getLogger(__name__)

Factor = Callable[[Any], Any]  # real steps taken (an int or a 0-d tensor) -> learning-rate factor


def cosine(total_steps: int, warmup_steps: int, min_lr_ratio: float) -> Factor:
    """Linear warm-up to the base rate, then half a cosine down to min_lr_ratio x base."""
    span = max(1, total_steps - warmup_steps)

    def factor(step):
        if not isinstance(step, torch.Tensor):
            return factor(torch.tensor(step)).item()
        warm = (step + 1) / max(1, warmup_steps)
        progress = ((step - warmup_steps) / span).clamp(0.0, 1.0)
        decayed = min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + torch.cos(math.pi * progress))
        return torch.where(step < warmup_steps, warm, decayed)

    return factor


def step_decay(step_size: int, gamma: float) -> Factor:
    """Multiply the rate by gamma every step_size real steps."""
    return lambda step: gamma ** (step // step_size)


def schedule_factor(cfg: Mapping[str, Any], total_steps: int) -> Factor | None:
    """The `scheduler` config's factor function (None without a schedule)."""
    target = cfg.get("_target_")
    if target is None:
        return None
    settings = {k: v for k, v in to_dict(cfg).items() if k != "_target_"}
    if spans_run(target):
        settings["total_steps"] = total_steps
    return get_object(target)(**settings)


def runs_on_device(factor: Factor | None) -> bool:
    """Whether a schedule's factor can be computed from a device tensor of the step count (no
    schedule at all: nothing to compute, so yes)."""
    if factor is None:
        return True
    try:
        value = factor(torch.zeros((), dtype=torch.long))
    except (TypeError, ValueError, RuntimeError):
        return False
    return isinstance(value, torch.Tensor) and value.numel() == 1


def takes_tensor_lr(optimizer: torch.optim.Optimizer) -> bool:
    """Whether this optimizer, as configured, steps with a tensor learning rate: tried once on a
    one-element parameter of the first parameter's device and dtype (torch's support differs by
    optimizer, implementation and version, and says so only by raising)."""
    first = optimizer.param_groups[0]["params"][0]
    param = torch.zeros(1, device=first.device, dtype=first.dtype, requires_grad=True)
    param.grad = torch.zeros_like(param)
    accepted = inspect.signature(type(optimizer)).parameters  # AdamW's defaults hold more
    settings = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    settings["lr"] = torch.tensor(1e-3, device=first.device)
    try:
        type(optimizer)([param], **settings).step()
    except (TypeError, ValueError, RuntimeError):
        return False
    return True


class DeviceSchedule:
    """The learning rate as a device tensor per parameter group, computed each step from a
    device count of the steps really taken (see the module's docstring)."""

    where = "device"

    def __init__(self, optimizer: torch.optim.Optimizer, factor: Factor | None):
        self.optimizer, self.factor = optimizer, factor
        device = optimizer.param_groups[0]["params"][0].device
        groups = optimizer.param_groups
        self.base = torch.tensor([float(g["lr"]) for g in groups], device=device)
        self.lrs = self.base.clone()  # what the optimizer reads: one element per group
        self.real_steps = torch.zeros((), dtype=torch.long, device=device)
        self._bind()
        self._set()

    def _bind(self) -> None:
        # views into one tensor: one kernel sets every group's rate
        for i, group in enumerate(self.optimizer.param_groups):
            group["lr"] = self.lrs[i]

    def _set(self) -> None:
        """The next step's rates, from the real steps taken so far (device work only)."""
        if self.factor is not None:
            torch.mul(self.base, self.factor(self.real_steps), out=self.lrs)

    def after_step(self, skipped: torch.Tensor) -> None:
        """Count the step unless it was skipped, and set the next one's rate (device work)."""
        self.real_steps.add_((skipped == 0).long())
        self._set()

    def lr(self) -> torch.Tensor:
        """The first group's rate for the coming step, on the device: a copy, which the step
        then changes (the history's `lr`)."""
        return self.lrs[0].clone()

    def state_dict(self) -> dict:
        return {"real_steps": int(self.real_steps)}  # read at a checkpoint, not per step

    def load_state_dict(self, state: dict) -> None:
        # a checkpoint of a host schedule (LambdaLR) counts its real steps as last_epoch
        steps = state["real_steps"] if "real_steps" in state else state["last_epoch"]
        self.real_steps.fill_(steps)
        self._bind()  # the optimizer's load_state_dict put the saved rates in their place
        self._set()


class HostSchedule(LambdaLR):
    """The schedule for optimizers that take only a float rate: advanced on the host by a
    post-hook on each `optimizer.step()` that runs (see the module's docstring)."""

    where = "host"

    def __init__(self, optimizer: torch.optim.Optimizer, factor: Factor):
        super().__init__(optimizer, factor)
        optimizer.register_step_post_hook(lambda *_: self.step())

    def after_step(self, skipped: torch.Tensor) -> None:
        pass  # the post-hook has advanced it if the step ran

    def lr(self) -> None:
        return None  # the host knows it: the history notes it before the step

    def load_state_dict(self, state: dict) -> None:
        if "real_steps" in state:  # a checkpoint of a device schedule
            state = {**self.state_dict(), "last_epoch": state["real_steps"]}
        super().load_state_dict(state)


Schedule = DeviceSchedule | HostSchedule


def build_schedule(
    cfg: Mapping[str, Any],
    optimizer: torch.optim.Optimizer,
    scaler: LossScaler,
    total_steps: int,
) -> Schedule | None:
    """Attach the `scheduler` config's schedule to the optimizer: on the device where the
    optimizer takes a tensor rate and the factor a tensor count, on the host otherwise (None
    without a schedule)."""
    factor = schedule_factor(cfg, total_steps)
    if factor is None:
        return None
    if runs_on_device(factor) and takes_tensor_lr(optimizer):
        return DeviceSchedule(optimizer, factor)
    name = cfg["_target_"].rpartition(".")[2]
    if getattr(optimizer, "_step_supports_amp_scaling", False) and scaler.continues_after_skip():
        raise ConfigError(
            f"The {name} schedule with a fused optimizer under loss scaling: the fused step skips "
            "overflowing steps on the device, and this schedule or optimizer cannot follow them "
            "there (its factor needs an int, or the optimizer a float rate), so it could not tell "
            "skipped steps from real ones without a host read every step. Drop optimizer.fused "
            "or use scheduler=none."
        )
    log.info(
        "The %s schedule advances on the host: %s.",
        name,
        "its factor takes no tensor"
        if not runs_on_device(factor)
        else f"{type(optimizer).__name__} as configured takes no tensor learning rate",
    )
    return HostSchedule(optimizer, factor)
