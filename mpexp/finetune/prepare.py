"""The model as built, made ready for fine-tuning as its config says: LoRA adapters first
(`model.lora`, which freezes everything else but the layers the build made anew), then
`model.freeze`'s patterns (over every parameter, adapters included). A model without these keys
(a model group option without mpexp's schema) trains whole, as it always did.

A layer the build made anew rather than loaded (a pretrained classifier's head made again for
the data's class count) is named in the model's `made_anew` (mpexp/models/timm_models.py,
hf.py): under LoRA it trains whole, in float32, beside the adapters, since a random layer left
frozen would never learn the data's classes."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from mpexp.errors import ConfigError
from mpexp.finetune.freeze import freeze
from mpexp.finetune.frozen_dtype import hold_frozen
from mpexp.finetune.lora import add_lora, import_peft
from mpexp.finetune.names import outline

log = logging.getLogger(__name__)


@dataclass
class FineTuning:
    """What fine-tuning did to a model, for the run's record and the export."""

    # peft's PeftModel around the model (its adapters merged or saved by mpexp/finetune/
    # export.py); None without LoRA
    adapters: object | None = None
    lora: dict | None = None  # model.lora as it took effect, as the run records it
    trainable: int = 0  # elements of the parameters that train
    frozen_setting: str = "autocast"  # model.frozen_dtype
    frozen_dtype: str | None = None  # what the frozen parameters are held in (None: none)

    def hold_frozen(
        self,
        model: nn.Module,
        autocast: torch.dtype | None,
        fp32_modules: list[str],
        sharded: bool = False,
    ) -> None:
        """Hold the frozen layers that autocast casts anyway in its dtype (frozen_dtype.py),
        once precision has converted the model and before DDP or FSDP wrap it; `sharded`
        (FSDP) keeps them float32, gathered in the autocast dtype by FSDP itself."""
        autocast = None if sharded else autocast
        self.frozen_dtype = hold_frozen(model, autocast, fp32_modules, self.frozen_setting)

    def record(self) -> dict:
        """What the run records of it under `ran`."""
        return {
            "trainable_parameters": self.trainable,
            "lora": self.lora,
            "frozen_dtype": self.frozen_dtype,
        }


def trainable_parameters(model: nn.Module) -> int:
    """The elements of the parameters that train."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def train_made_anew(model: nn.Module, pure: bool) -> list[str]:
    """Unfreeze the modules the build made anew (`model.made_anew`), which LoRA froze with the
    rest, in float32 (pure bf16 holds them in bf16 with every trained weight); their names,
    said in the log."""
    names = list(getattr(model, "made_anew", None) or [])
    modules = dict(model.named_modules())
    for name in names:
        for parameter in modules[name].parameters():
            parameter.data = parameter.data.float()
            parameter.requires_grad_(True)
    if names:
        log.info(
            "LoRA: %s made anew by the build (not in the pretrained weights): trained whole, "
            "in %s, beside the adapters.",
            ", ".join(names),
            "bf16 (precision=bf16_pure)" if pure else "float32",
        )
    return names


def import_peft_if_asked(node) -> None:
    """peft, where `node` (the model group's config) asks for LoRA, imported now: before a model
    is built under `torch.device("meta")`, which would put an import's module-level tensors on
    the meta device too."""
    lora = node.get("lora")
    if lora is not None and lora.get("r"):
        import_peft(lora.r)


def fine_tune(model: nn.Module, node, pure: bool = False) -> FineTuning:
    """Apply `node`'s (the model group's config) fine-tuning keys to `model`, in place; `pure`:
    the run holds its weights in bf16 (precision=bf16_pure)."""
    lora, patterns = node.get("lora"), list(node.get("freeze") or [])
    tuning = FineTuning()
    if lora is not None and lora.get("r"):
        tuning.adapters = add_lora(model, lora, pure)
        config = tuning.adapters.peft_config["default"]
        adapted = [n for n, m in model.named_modules() if hasattr(m, "lora_A")]
        dtype = next(p.dtype for p in model.parameters() if p.requires_grad)
        tuning.lora = {
            "r": config.r,
            "alpha": config.lora_alpha,
            "dropout": config.lora_dropout,
            "layers": len(adapted),
            "target_modules": outline(adapted),  # blocks.*.attn.qkv: one name for all blocks
            "dtype": str(dtype).removeprefix("torch."),
            "parameters": trainable_parameters(model),  # the adapters'
        }
        whole = train_made_anew(model, pure)
        if whole:  # which modules train whole, and their elements beside the adapters'
            adapters = tuning.lora["parameters"]
            tuning.lora["trained_whole"] = whole
            tuning.lora["trained_whole_parameters"] = trainable_parameters(model) - adapters
    if patterns:
        freeze(model, patterns)
    tuning.trainable = trainable_parameters(model)
    if not tuning.trainable:
        raise ConfigError(
            f"model.freeze={patterns} freezes every parameter of {type(model).__name__}: "
            "nothing would train. Leave some out of the patterns."
        )
    tuning.frozen_setting = str(node.get("frozen_dtype") or "autocast")
    return tuning
