"""The schemas of the precision and loss_scaling groups (conf/precision/, conf/loss_scaling/)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from mpexp.config.choices import (
    AutocastDtype,
    FloorPolicy,
    Fp8Recipe,
    StatesDtype,
    UpdateRounding,
    WeightsDtype,
)

# Optional[...] rather than `X | None`: OmegaConf reads these annotations at runtime, and the
# `|` form is not understood there on every Python version the project supports.
# ruff: noqa: UP045


@dataclass
class Fp8Config:
    # null: no fp8. A node in every precision mode (not a null node): Hydra cannot apply an
    # override like `precision.fp8.recipe=rowwise` to a null node, and fails with a traceback
    recipe: Optional[Fp8Recipe] = None
    # Linear layers kept in bf16 by name (a module's name keeps everything inside it)
    exclude: list[str] = field(default_factory=list)
    # Linear layers with fewer input or output features than this stay in bf16: their products
    # are too small for fp8's speed to pay for its casts; 0: no threshold
    min_size: int = 0


@dataclass
class PrecisionConfig:
    autocast: Optional[AutocastDtype] = None  # the forward pass's dtype; null: no autocast
    tf32: bool = False  # TF32 tensor-core math for float32 matmul and convolutions
    fp32_modules: list[str] = field(default_factory=list)
    fp8: Fp8Config = field(default_factory=Fp8Config)  # float8 Linear layers (torchao)
    # bfloat16: pure bf16 (precision=bf16_pure), no fp32 master weights
    weights: WeightsDtype = WeightsDtype.float32
    # pure bf16 only (null elsewhere): how each update is rounded into the bf16 weights, the
    # dtype of the optimizer's states between steps, the elements of the step's float32
    # workspace (null: by device, mpexp/precision/pure_step.py), and whether the update is one
    # compiled loop (null: where it pays, mpexp/precision/pure_compiled.py)
    update_rounding: Optional[UpdateRounding] = None
    optimizer_states: Optional[StatesDtype] = None
    update_chunk: Optional[int] = None
    update_compile: Optional[bool] = None


@dataclass
class LossScalingConfig:
    _target_: Optional[str] = None  # the scaler class; null: no scaling
    only_under_fp16: bool = False  # `auto`: this strategy under fp16, no scaling otherwise


@dataclass
class StaticScalingConfig(LossScalingConfig):
    scale: float = 1024.0


@dataclass
class DynamicScalingConfig(LossScalingConfig):
    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float = 1.0
    on_min_scale: FloorPolicy = FloorPolicy["raise"]


@dataclass
class HysteresisScalingConfig(DynamicScalingConfig):
    hysteresis: int = 2  # overflows tolerated before a back-off, plus one (DeepSpeed's)
    # false: the tolerance refills when the scale grows (DeepSpeed's default);
    # true: after every clean step, so only overflows in a row count (consecutive_hysteresis)
    consecutive: bool = False


@dataclass
class CalibratedScalingConfig(LossScalingConfig):
    calibration_steps: int = 20
    margin: float = 8.0
