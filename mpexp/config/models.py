"""The schemas of the model group's options (conf/model/), and the fine-tuning keys every model
takes (mpexp/finetune/)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

from omegaconf import MISSING

from mpexp.config.choices import FrozenDtype, StatesDtype

# Optional[...] rather than `X | None`: OmegaConf reads these annotations at runtime, and the
# `|` form is not understood there on every Python version the project supports.
# ruff: noqa: UP045


@dataclass
class LoraConfig:
    """LoRA adapters through peft (mpexp/finetune/lora.py): the model's weights frozen, a
    low-rank update trained beside each targeted layer."""

    r: Optional[int] = None  # the adapters' rank; null or 0: no LoRA
    alpha: Optional[float] = None  # the update is scaled by alpha / r; null: 2 r (a scale of 2)
    dropout: float = 0.0  # on the adapters' input
    # layer names as peft matches them (a name, or its end after a dot); null: the model's
    # attention projections, found by their names (ATTENTION_LAYERS in mpexp/finetune/lora.py)
    target_modules: Optional[list[str]] = None
    dtype: Optional[StatesDtype] = None  # null: float32 (bfloat16 under precision=bf16_pure)


@dataclass
class ModelConfig:
    """Every model's: its `_target_`, and the fine-tuning settings (mpexp/finetune/)."""

    _target_: str = MISSING
    # parameters trained no more, by name pattern (fnmatch over named_parameters; a module's
    # name takes all of its parameters), e.g. [wte, wpe, 'blocks.0.*']
    freeze: list[str] = field(default_factory=list)
    frozen_dtype: FrozenDtype = FrozenDtype.autocast
    lora: LoraConfig = field(default_factory=LoraConfig)


# ModelConfig's keys that no model's constructor is given (mpexp/build.py's `build`)
FINETUNE_KEYS = ("freeze", "frozen_dtype", "lora")


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


@dataclass
class HFConfig(ModelConfig):
    """model=hf (mpexp/models/hf.py): a Hugging Face transformers model, built from its config or
    loaded from a save_pretrained folder. The node is open: any key of the model type's own
    config class (`model.hidden_size=256`) is taken, and checked against that class's keys
    (mpexp/models/hf_config.py) rather than against this schema."""

    # keys beyond the declared ones are the transformers config's own (see `register`)
    OPEN: ClassVar[bool] = True

    config: Optional[str] = None  # a model type (llama, gpt2, qwen2, vit, ...); null: pretrained's
    pretrained: Optional[str] = None  # a folder written by save_pretrained: config + safetensors
    block_size: int = 64  # tokens per window a language model trains on
    fp8_head: bool = False  # precision=fp8 converts the output layer too (lm_head, classifier)
    # transformers' attention kernel (sdpa, eager, flex_attention); null: transformers' default
    attn_implementation: Optional[str] = None
