"""The schemas of the optimizer and scheduler groups (conf/optimizer/, conf/scheduler/)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from omegaconf import MISSING

# Optional[...] rather than `X | None`: OmegaConf reads these annotations at runtime, and the
# `|` form is not understood there on every Python version the project supports.
# ruff: noqa: UP045


@dataclass
class OptimizerConfig:
    _target_: str = MISSING
    _partial_: bool = True  # built once the model's parameters exist
    lr: float = 1e-4
    weight_decay: float = 0.0
    fused: Optional[bool] = None  # null: the fused kernel where torch has it (CUDA; CPU: 2.4+)
    # mpexp's, not the optimizer's: false exempts 1-D parameters (biases, norm gains) from weight
    # decay (mpexp.step.performance.parameter_groups)
    decay_norms_and_biases: bool = True


@dataclass
class AdamConfig(OptimizerConfig):
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])


@dataclass
class SGDConfig(OptimizerConfig):
    momentum: float = 0.9


@dataclass
class SchedulerConfig:
    _target_: Optional[str] = None  # a function of the run's total steps giving lr factors


@dataclass
class CosineConfig(SchedulerConfig):
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0


@dataclass
class StepDecayConfig(SchedulerConfig):
    step_size: int = 1000
    gamma: float = 0.1
