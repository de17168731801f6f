"""The schema of the `trainer`, `diagnostics` and `wandb` nodes, and of the whole `train` config
(conf/train.yaml)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING

from mpexp.config.choices import Device, NonfiniteLoss, Strategy, WandbMode

# Optional[...] rather than `X | None`: OmegaConf reads these annotations at runtime, and the
# `|` form is not understood there on every Python version the project supports.
# ruff: noqa: UP045


@dataclass
class TrainerConfig:
    epochs: Optional[int] = 10  # null with max_steps: as many as it takes
    max_steps: Optional[int] = None  # optimizer steps in all, instead of whole epochs
    eval_every_steps: Optional[int] = None  # null: validate (and checkpoint) at each epoch's end
    device: Device = Device.auto
    seed: int = 42
    log_every: int = 50
    progress: Optional[bool] = None  # null: a bar on a terminal only
    strategy: Strategy = Strategy.single
    cudnn_benchmark: bool = True
    # null: decided by the device (on for CUDA, off for a CPU), see
    # mpexp.step.performance.plan_speed
    channels_last: Optional[bool] = None
    compile: Optional[bool] = None
    compile_mode: str = "default"  # torch.compile's names contain '-': checked in mpexp.validate
    cuda_graph: Optional[bool] = None
    eager: bool = False  # compile and cuda_graph off where they are null
    deterministic: bool = False
    checkpoint_every_steps: Optional[int] = None
    keep_checkpoints: int = 1
    resume: Optional[str] = None
    accumulate: int = 1
    clip_grad_norm: Optional[float] = None
    z_loss: float = 0.0  # a language model's auxiliary loss on its logits' log-normaliser
    on_nonfinite_loss: NonfiniteLoss = NonfiniteLoss["raise"]
    peak_tflops: Optional[float] = None  # null: from mpexp.step.flops.PEAK_TFLOPS by GPU name
    # plan the run on fake tensors before its first step (mpexp/plan/): null on a GPU only, where
    # the allocator's peak is what the plan predicts; a CPU's resident memory holds more
    plan: Optional[bool] = None
    # GPU only: after training, this many steps timed on one batch kept on the device
    # (perf/compute_only_samples_per_s), the step's own rate without the data path; 0: none, for
    # they are extra steps on the trained weights (the checkpoints are written before them)
    compute_only_steps: int = 0
    # classifiers' recipe (mpexp/tasks/classification.py, mpexp/data/mixing.py,
    # mpexp/step/weight_average.py); every default leaves training as it was before them
    label_smoothing: float = 0.0  # share of each target spread over the classes; torchvision: 0.1
    mixup_alpha: float = 0.0  # Beta(a, a) draws each batch's mixing weight; 0: no mixup
    cutmix_alpha: float = 0.0  # the same for CutMix; with both > 0, each batch takes one at random
    # an fp32 exponential moving average of the weights, validated as val_ema/...; null: none.
    # Per update: torchvision's 0.99998 is per sample-epoch, see conf/experiment/imagenet_resnet50
    ema_decay: Optional[float] = None
    # steps between updates: torchvision's 32; each update is a pass over the weights
    ema_every: int = 32
    # updates up to this step copy the weights instead of averaging them (torchvision restarts
    # the average through the learning rate's warm-up, whose weights are far from the final ones)
    ema_warmup_steps: int = 0


@dataclass
class DiagnosticsConfig:
    grad_stats_every: int = 0
    overflow_attribution: bool = False
    max_names: int = 8
    # opt/updates_lost, the share of nonzero updates that left a weight unchanged; null: on
    # under precision=bf16_pure only (elsewhere a copy of the weights each step); false under
    # bf16_pure skips the count only, never the rounding
    updates_lost: Optional[bool] = None


@dataclass
class WandbConfig:
    mode: WandbMode = WandbMode.auto
    project: str = "mpexp"
    entity: Optional[str] = None
    group: Optional[str] = None
    tags: list[str] = field(default_factory=list)
    init_timeout: float = 90.0
    log_checkpoints: bool = False
    samples: int = 0  # a language model's texts sampled at the end, logged as a table


@dataclass
class TrainConfig:
    """The whole `train` config. Groups are `Any` here: each option brings its own schema."""

    dataset: Any = MISSING
    model: Any = MISSING
    precision: Any = MISSING
    loss_scaling: Any = MISSING
    optimizer: Any = MISSING
    scheduler: Any = MISSING
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    diagnostics: DiagnosticsConfig = field(default_factory=DiagnosticsConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
