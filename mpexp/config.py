"""The typed schema behind conf/'s YAML: what each key is, so that Hydra checks it while composing.

People edit YAML; these dataclasses sit behind it (through `defaults:` entries naming
`/<group>_<kind>_schema`), so a wrong type (`trainer.epochs=abc`) or a value outside a closed
choice (`trainer.device=gpu`) is refused by Hydra itself, before a run directory exists. Hydra's `+`
prefix can still add keys a schema does not have; `unknown_keys` finds those. Range and cross-field
checks (a positive learning rate, a batch larger than the accumulation count) live in
`mpexp.validate`.

A group option without a schema (a user's own model YAML, say) is composed as Hydra always does.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

# Optional[...] rather than `X | None`: OmegaConf reads these annotations at runtime, and the
# `|` form is not understood there on every Python version the project supports.
# ruff: noqa: UP045

GROUPS = ("dataset", "model", "precision", "loss_scaling", "optimizer", "scheduler", "experiment")


class Choice(str, Enum):
    """A closed set of strings. A str, so `cfg.trainer.device == "cpu"` holds, and it prints and
    serialises as its value."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class Device(Choice):
    auto = "auto"  # CUDA when present
    cuda = "cuda"
    cpu = "cpu"


class Strategy(Choice):
    single = "single"
    ddp = "ddp"
    fsdp = "fsdp"


class WandbMode(Choice):
    auto = "auto"  # online with an API key, else offline
    online = "online"
    offline = "offline"
    disabled = "disabled"


class Loader(Choice):
    device = "device"
    dataloader = "dataloader"


class AutocastDtype(Choice):
    float16 = "float16"
    bfloat16 = "bfloat16"


class Fp8Recipe(Choice):
    """torchao's float8 training recipes that mpexp offers (Float8LinearRecipeName)."""

    tensorwise = "tensorwise"  # one scale per tensor; e4m3 forward, e5m2 gradients; fastest
    rowwise = "rowwise"  # one scale per row, rounded down to a power of two; e4m3 throughout
    # rowwise, but the weight's gradient computed in high precision (bf16), not in fp8
    rowwise_with_gw_hp = "rowwise_with_gw_hp"


class WeightsDtype(Choice):
    float32 = "float32"  # fp32 weights (master weights, under autocast)
    bfloat16 = "bfloat16"  # pure bf16: weights, gradients and the forward pass in bf16


class UpdateRounding(Choice):
    """How a pure bf16 step's fp32 result is stored (mpexp/precision/pure_updates.py)."""

    nearest = "nearest"  # round to nearest: an update below half an ulp is lost
    kahan = "kahan"  # a bf16 compensation buffer per parameter carries what rounding lost
    stochastic = "stochastic"  # rounded up or down at random, the fp32 result in expectation


class StatesDtype(Choice):
    float32 = "float32"
    bfloat16 = "bfloat16"


# `raise` is a keyword, so these two are built by name
NonfiniteLoss = Choice("NonfiniteLoss", {"raise": "raise", "skip": "skip"})
FloorPolicy = Choice("FloorPolicy", {"raise": "raise", "continue": "continue"})


def run_length(trainer, steps_per_epoch: int) -> tuple[int, int]:
    """The run's last epoch and its optimizer steps in all, from `trainer.epochs` or
    `trainer.max_steps` (the run then stops at that step, mid-epoch if need be)."""
    if trainer.max_steps is None:
        return trainer.epochs, trainer.epochs * steps_per_epoch
    return -(-trainer.max_steps // steps_per_epoch), trainer.max_steps


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


# --- dataset -------------------------------------------------------------------------------------


@dataclass
class DatasetConfig:
    _target_: str = MISSING
    batch_size: int = 256
    drop_last: bool = True
    loader: Loader = Loader.device
    num_workers: int = 2


@dataclass
class CropFlipConfig:
    """The training batches' augmentation, done on the device (mpexp/data/augment.py)."""

    crop_padding: int = 0  # zeros around each image, then a random crop of its size; 0: none
    flip: bool = False  # mirror half of the images left to right


@dataclass
class InMemoryDatasetConfig(DatasetConfig):
    augment: CropFlipConfig = field(default_factory=CropFlipConfig)


# Where downloaded datasets live: one folder per user, not a `data/` in every folder a run starts
# from; MPEXP_DATA_DIR moves it (a shared or faster disk), dataset.root=... overrides both
DATA_ROOT = "${oc.env:MPEXP_DATA_DIR,'~/.cache/mpexp/data'}"


@dataclass
class TorchvisionDatasetConfig(InMemoryDatasetConfig):
    root: str = DATA_ROOT
    download: bool = True


@dataclass
class SyntheticDatasetConfig(InMemoryDatasetConfig):
    train_size: int = 8192
    val_size: int = 1024
    channels: int = 1
    height: int = 28
    width: int = 28
    num_classes: int = 10
    noise: float = 0.8
    seed: int = 0


@dataclass
class ResizedCropFlipConfig(CropFlipConfig):
    """An image folder's augmentation: a random resized crop in the DataLoader's workers, then
    the in-memory sets' crop and flip on the device."""

    # the crop's share of the image's area, drawn from this range (aspect ratio 3/4 to 4/3); null:
    # no random crop, training images resized and centre-cropped as validation's are
    crop_scale: Optional[list[float]] = field(default_factory=lambda: [0.08, 1.0])
    flip: bool = True


@dataclass
class ImageFolderDatasetConfig:
    """dataset=image_folder: no `loader` key, for its images are always read by DataLoader
    workers."""

    _target_: str = MISSING
    path: Optional[str] = None  # train/, val/ (valid/) and test/ class folders, or ones to split
    val_fraction: float = 0.1  # of each class, where there is no val/
    split_seed: int = 0  # that split's draw: the same for every trainer.seed
    image_size: int = 224  # the square the model sees
    resize_size: Optional[int] = None  # validation's resize before its centre crop; null: 8/7 x
    mean: Optional[list[float]] = None  # per channel (RGB), in [0, 1]; null: computed at setup
    std: Optional[list[float]] = None
    stats_images: int = 1000  # training images the mean and std are computed from
    augment: ResizedCropFlipConfig = field(default_factory=ResizedCropFlipConfig)
    batch_size: int = 256
    drop_last: bool = True
    num_workers: int = 4
    cache: str = "none"  # resized: every image stored once, resized, and read without decoding
    cache_dir: str = "${oc.env:MPEXP_DATA_DIR,'~/.cache/mpexp/data'}/images"  # where it is kept
    cache_side: Optional[int] = None  # training's stored shorter side; null: what its crop needs
    decode: str = "cpu"  # gpu: JPEGs decoded on the CUDA device; auto: gpu for JPEGs on CUDA


TEXT_CACHE = "${oc.env:MPEXP_DATA_DIR,'~/.cache/mpexp/data'}/text"


@dataclass
class WindowsConfig:
    """Token windows of a text corpus (mpexp/data/text.py)."""

    _target_: str = MISSING
    # tokens a window gives the model; null: none known (a model's block_size, interpolated)
    block_size: Optional[int] = None
    train_size: int = 4096  # windows per epoch
    val_size: int = 256  # validation windows
    val_fraction: float = 0.1  # the corpus's tail that validates
    cache_dir: str = TEXT_CACHE  # where the token file and its key are written
    # byte (a vocabulary of 256), bpe (learned from the training part, vocab_size tokens) or the
    # path of a Hugging Face tokenizer.json
    tokenizer: str = "byte"
    vocab_size: Optional[int] = None  # bpe's to learn; else null: the tokenizer's
    batch_size: int = 32
    drop_last: bool = True


@dataclass
class TextDatasetConfig(WindowsConfig):
    path: Optional[str] = None  # a UTF-8 file or a folder; null: Python's standard library


@dataclass
class DownloadedTextConfig(WindowsConfig):
    root: str = DATA_ROOT
    download: bool = True


@dataclass
class TokensDatasetConfig:
    """Pre-tokenized train.bin / val.bin in nanoGPT's layout (mpexp/data/tokens.py)."""

    _target_: str = MISSING
    path: Optional[str] = None  # the folder of train.bin and val.bin
    vocab_size: Optional[int] = None  # null: nanoGPT's meta.pkl's, else GPT-2's 50257
    dtype: Optional[str] = None  # uint16 or uint32; null: uint16 up to 65,536 tokens, else uint32
    bytes_per_token: Optional[float] = None  # of the text the tokens encode; null: no val/bpb
    block_size: Optional[int] = None
    train_size: int = 4096
    val_size: int = 256
    val_fraction: float = 0.1  # of train.bin, only where there is no val.bin
    batch_size: int = 32
    drop_last: bool = True


# --- model ---------------------------------------------------------------------------------------


@dataclass
class ModelConfig:
    _target_: str = MISSING


@dataclass
class SimpleCNNConfig(ModelConfig):
    width: int = 64


@dataclass
class ResidualConfig(ModelConfig):
    """ResNets (mpexp/models/resnet.py)."""

    # the last BatchNorm of each residual branch starts at gamma 0, so that each block starts as
    # the identity (Goyal et al. 2017); false: torchvision's default, as runs before the key
    zero_init_residual: bool = False


@dataclass
class ResNetConfig(ResidualConfig):
    weights: Optional[str] = None  # torchvision's ImageNet weights (e.g. IMAGENET1K_V1); null: none


@dataclass
class ViTConfig(ModelConfig):
    patch_size: Optional[int] = None  # pixels per patch side; null: from the image size
    max_tokens: int = 1024  # patches per image beyond which a patch size is refused
    width: int = 192
    depth: int = 6
    heads: int = 3
    mlp_ratio: int = 4


@dataclass
class TimmConfig(ModelConfig):
    """model=timm (mpexp/models/timm_models.py)."""

    name: Optional[str] = None  # any of timm.list_models(): resnet50, convnext_tiny, ...
    pretrained: Optional[str] = None  # a local weights file (.safetensors, .pth, .bin)
    fp8_head: bool = False  # precision=fp8 converts the classifier too (else: the blocks only)
    kwargs: dict[str, Any] = field(default_factory=dict)  # more of timm.create_model's arguments


@dataclass
class GPTConfig(ModelConfig):
    block_size: int = 64  # the context: tokens per window
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    bias: bool = True  # false: no bias in any Linear or LayerNorm
    qk_norm: bool = False  # normalise each head's queries and keys before their product


# --- precision -----------------------------------------------------------------------------------


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
    # pure bf16 only (null elsewhere): how each update is rounded into the bf16 weights, and the
    # dtype of the optimizer's states between steps
    update_rounding: Optional[UpdateRounding] = None
    optimizer_states: Optional[StatesDtype] = None


# --- loss scaling --------------------------------------------------------------------------------


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


# --- optimizer -----------------------------------------------------------------------------------


@dataclass
class OptimizerConfig:
    _target_: str = MISSING
    _partial_: bool = True  # built once the model's parameters exist
    lr: float = 1e-4
    weight_decay: float = 0.0
    fused: Optional[bool] = None  # null: the fused kernel on CUDA, off on CPU
    # mpexp's, not the optimizer's: false exempts 1-D parameters (biases, norm gains) from weight
    # decay (mpexp.step.performance.parameter_groups)
    decay_norms_and_biases: bool = True


@dataclass
class AdamConfig(OptimizerConfig):
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])


@dataclass
class SGDConfig(OptimizerConfig):
    momentum: float = 0.9


# --- scheduler -----------------------------------------------------------------------------------


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


SCHEMAS: dict[str, dict[str, type]] = {
    "dataset": {
        "torchvision": TorchvisionDatasetConfig,
        "synthetic": SyntheticDatasetConfig,
        "image_folder": ImageFolderDatasetConfig,
        "text": TextDatasetConfig,
        "downloaded_text": DownloadedTextConfig,
        "tokens": TokensDatasetConfig,
    },
    "model": {
        "base": ModelConfig,
        "simplecnn": SimpleCNNConfig,
        "resnet": ResNetConfig,
        "resnet_cifar": ResidualConfig,
        "vit": ViTConfig,
        "timm": TimmConfig,
        "gpt": GPTConfig,
    },
    "precision": {"base": PrecisionConfig},
    "loss_scaling": {
        "none": LossScalingConfig,
        "static": StaticScalingConfig,
        "dynamic": DynamicScalingConfig,
        "hysteresis": HysteresisScalingConfig,
        "calibrated": CalibratedScalingConfig,
    },
    "optimizer": {"adam": AdamConfig, "sgd": SGDConfig},
    "scheduler": {"none": SchedulerConfig, "cosine": CosineConfig, "step": StepDecayConfig},
}


def register() -> None:
    """Put the schemas into Hydra's ConfigStore, where conf/'s `defaults:` entries find them.

    At the top level, as `<group>_<kind>_schema`, not in a config group of their own: `--help`
    and tab completion list every group, and these are no options a run chooses.
    """
    store = ConfigStore.instance()
    store.store(name="train_schema", node=TrainConfig)
    for group, schemas in SCHEMAS.items():
        for name, schema in schemas.items():
            store.store(name=f"{group}_{name}_schema", node=open_dicts(schema))


def open_dicts(schema: type) -> DictConfig:
    """The schema with its free-form dicts (`dict[str, Any]` fields, such as a library's own
    keyword arguments: `model.kwargs`) open to keys of the user's, which then take
    `model.kwargs.drop_path_rate=0.1` as well as Hydra's `+model.kwargs.drop_path_rate=0.1`."""
    node = OmegaConf.structured(schema)
    for key in node:
        child = node._get_node(key)
        if isinstance(child, DictConfig) and OmegaConf.get_type(child) is dict:
            OmegaConf.set_struct(child, False)
    return node


def config_dir() -> Path:
    """conf/: shipped inside the package in a wheel, at the repository's top in a checkout."""
    packaged = Path(__file__).with_name("conf")
    return packaged if packaged.is_dir() else Path(__file__).resolve().parents[1] / "conf"


def to_dict(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """A config (or any mapping) as plain Python values, choices as their strings: what JSON, W&B,
    checkpoints and the constructors that `_target_` names are given."""
    if isinstance(cfg, DictConfig):
        return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    return dict(cfg)


def unknown_keys(cfg: DictConfig, prefix: str = "", schema: type | None = None) -> list[str]:
    """Keys that a node's schema (its own, or `schema`) does not declare: added with Hydra's `+`
    prefix, which bypasses the schema. Each comes with the closest declared key, if one is close."""
    found = []
    schema = schema or OmegaConf.get_type(cfg)
    declared = {f.name for f in fields(schema)} if is_dataclass(schema) else None
    for key in cfg:
        name = f"{prefix}{key}"
        if declared is not None and key not in declared:
            close = difflib.get_close_matches(str(key), sorted(declared), n=1)
            found.append(f"{name} (did you mean {prefix}{close[0]}?)" if close else name)
            continue
        node = cfg._get_node(key)
        if isinstance(node, DictConfig) and not node._is_missing() and not node._is_none():
            found += unknown_keys(node, f"{name}.")
    return found
