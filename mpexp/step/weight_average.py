"""An exponential moving average (EMA) of the model's weights, kept in float32
(`trainer.ema_decay`), validated beside the weights themselves as `val_ema/...`.

Every `trainer.ema_every` steps the average moves towards the weights: `avg = decay avg + (1 -
decay) w`, over the parameters and the floating-point buffers (BatchNorm's running statistics), as
torchvision's reference averages them. The first update, and every update up to
`trainer.ema_warmup_steps`, copies the weights instead: the weights of the learning rate's
warm-up are far from where training ends.

The average is float32 whatever the weights are: under pure bf16 an update of (1 - decay) of
the difference would mostly round away in bf16, so the average would stand still. Each update is
a few fused kernels queued after the step, the same code after an eager step or a replayed graph,
with no host read. Validation copies the average into the model's own tensors (rounded to their
dtype: what a pure bf16 model would be saved as), evaluates it on the run's own forward path, and
copies the weights back; no second model is built or compiled.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


class WeightAverage:
    """The fp32 moving average of `model`'s parameters and floating-point buffers."""

    def __init__(self, model: nn.Module, decay: float, every: int = 1, warmup_steps: int = 0):
        self.decay, self.every, self.warmup_steps = decay, every, warmup_steps
        # frozen weights (model.freeze, LoRA's base) never move: their average is themselves
        trained = [p for p in model.parameters() if p.requires_grad]
        tensors = [*trained, *model.buffers()]
        self.sources = [t for t in tensors if t.is_floating_point()]
        self.average = [t.detach().float().clone() for t in self.sources]
        self.updates = 0

    def after_step(self, step: int) -> None:
        """Update the average after optimizer step `step` (counted from 1) if one is due."""
        if step % self.every:
            return
        copy = self.updates == 0 or step <= self.warmup_steps
        if all(t.dtype == torch.float32 for t in self.sources):  # no cast: over all at once
            weights = [t.detach() for t in self.sources]
            if copy:
                torch._foreach_copy_(self.average, weights)
            else:
                torch._foreach_lerp_(self.average, weights, 1.0 - self.decay)
        else:  # 16-bit weights (pure bf16): cast one tensor at a time, never the whole model
            for average, source in zip(self.average, self.sources, strict=True):
                if copy:
                    average.copy_(source.detach())
                else:
                    average.lerp_(source.detach().float(), 1.0 - self.decay)
        self.updates += 1

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The model holds the average (in its own dtypes) inside the block, its weights after."""
        with torch.no_grad():
            kept = [t.detach().clone() for t in self.sources]
            torch._foreach_copy_(self.sources, self.average)
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(self.sources, kept)

    def state(self) -> dict:
        """What a checkpoint keeps: the average (on the host) and its update count."""
        return {"average": [t.cpu() for t in self.average], "updates": self.updates}

    def load_state(self, state: dict) -> None:
        with torch.no_grad():
            for mine, saved in zip(self.average, state["average"], strict=True):
                mine.copy_(saved)
        self.updates = state["updates"]


def weight_average(trainer, model: nn.Module) -> WeightAverage | None:
    """The run's weight average (`trainer.ema_decay`), or None without one."""
    if trainer.get("ema_decay") is None:
        return None
    return WeightAverage(model, trainer.ema_decay, trainer.ema_every, trainer.ema_warmup_steps)
