"""The typed schema behind conf/'s YAML: what each key is, so that Hydra checks it while composing.

People edit YAML; these dataclasses sit behind it (through `defaults:` entries naming
`/<group>_<kind>_schema`), so a wrong type (`trainer.epochs=abc`) or a value outside a closed
choice (`trainer.device=gpu`) is refused by Hydra itself, before a run directory exists. Hydra's `+`
prefix can still add keys a schema does not have; `mpexp.validate.unknown_keys` finds those.
Range and cross-field checks (a positive learning rate, a batch larger than the accumulation
count) live in `mpexp.validate` too.

A group option without a schema (a user's own model YAML, say) is composed as Hydra always does.

The schemas live by group: choices.py (the closed sets of strings), trainer.py (trainer,
diagnostics, wandb, the whole config), datasets.py, models.py, numerics.py (precision, loss
scaling), optimizers.py (optimizer, scheduler); this module registers them and names them all.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from mpexp.config.choices import (  # noqa: F401  (the package's names)
    AutocastDtype,
    Choice,
    Device,
    FloorPolicy,
    Fp8Recipe,
    FrozenDtype,
    Loader,
    NonfiniteLoss,
    StatesDtype,
    Strategy,
    UpdateRounding,
    WandbMode,
    WeightsDtype,
)
from mpexp.config.datasets import (  # noqa: F401  (the package's names)
    DATA_ROOT,
    TEXT_CACHE,
    CropFlipConfig,
    DatasetConfig,
    DownloadedTextConfig,
    ImageFolderDatasetConfig,
    InMemoryDatasetConfig,
    ResizedCropFlipConfig,
    SyntheticDatasetConfig,
    TextDatasetConfig,
    TokensDatasetConfig,
    TorchvisionDatasetConfig,
    WindowsConfig,
)
from mpexp.config.models import (  # noqa: F401  (the package's names)
    FINETUNE_KEYS,
    GPTConfig,
    HFConfig,
    LoraConfig,
    ModelConfig,
    ResidualConfig,
    ResNetConfig,
    SimpleCNNConfig,
    TimmConfig,
    ViTConfig,
)
from mpexp.config.numerics import (  # noqa: F401  (the package's names)
    CalibratedScalingConfig,
    DynamicScalingConfig,
    Fp8Config,
    HysteresisScalingConfig,
    LossScalingConfig,
    PrecisionConfig,
    StaticScalingConfig,
)
from mpexp.config.optimizers import (  # noqa: F401  (the package's names)
    AdamConfig,
    CosineConfig,
    OptimizerConfig,
    SchedulerConfig,
    SGDConfig,
    StepDecayConfig,
)
from mpexp.config.trainer import (  # noqa: F401  (the package's names)
    DiagnosticsConfig,
    TrainConfig,
    TrainerConfig,
    WandbConfig,
)

GROUPS = ("dataset", "model", "precision", "loss_scaling", "optimizer", "scheduler", "experiment")


def run_length(trainer, steps_per_epoch: int) -> tuple[int, int]:
    """The run's last epoch and its optimizer steps in all, from `trainer.epochs` or
    `trainer.max_steps` (the run then stops at that step, mid-epoch if need be)."""
    if trainer.max_steps is None:
        return trainer.epochs, trainer.epochs * steps_per_epoch
    return -(-trainer.max_steps // steps_per_epoch), trainer.max_steps


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
        "hf": HFConfig,
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
            store.store(name=f"{group}_{name}_schema", node=open_where_free(schema))


def open_where_free(schema: type) -> DictConfig:
    """The schema as a node, open to keys of the user's where they are free-form: the whole
    node where the schema says so (`OPEN`: model=hf takes any of a transformers config's keys),
    else its `dict[str, Any]` fields (a library's own keyword arguments: `model.kwargs`). Either
    then takes `model.kwargs.drop_path_rate=0.1` as well as Hydra's `+model.kwargs...`, while the
    declared keys keep their types (OmegaConf honours a node's own struct flag over the struct
    mode Hydra sets on the root)."""
    node = OmegaConf.structured(schema)
    if getattr(schema, "OPEN", False):
        node._set_flag("struct", False)
        return node
    for key in node:
        child = node._get_node(key)
        if isinstance(child, DictConfig) and OmegaConf.get_type(child) is dict:
            OmegaConf.set_struct(child, False)
    return node


def config_dir() -> Path:
    """conf/: shipped inside the package in a wheel, at the repository's top in a checkout."""
    package = Path(__file__).resolve().parents[1]  # mpexp/
    packaged = package / "conf"
    return packaged if packaged.is_dir() else package.parent / "conf"


def to_dict(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """A config (or any mapping) as plain Python values, choices as their strings: what JSON, W&B,
    checkpoints and the constructors that `_target_` names are given."""
    if isinstance(cfg, DictConfig):
        return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    return dict(cfg)
