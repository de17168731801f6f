"""LoRA through peft: the model's weights frozen, and beside each targeted layer a trained
low-rank update, `alpha / r * B A x` (Hu et al. 2021), with A drawn at random and B zero, so
that training starts from the model as it was.

`peft.get_peft_model` puts its LoRA layers into the model in place: the model keeps its class,
its methods and its module names (a targeted `blocks.0.attn.qkv` becomes a peft layer of that
name, holding the frozen layer as `base_layer` and the adapters as `lora_A.default` and
`lora_B.default`), so every precision mode, DDP, FSDP and the diagnostics see the model they
always see. The PeftModel that peft returns around it is kept for the export (export.py).

The adapters are stored and updated in `model.lora.dtype`: float32 by default, over a base that
autocast computes in bf16 or fp16, as fine-tuning recipes keep them (their matrix products still
run in the autocast dtype); bfloat16 under precision=bf16_pure, which holds every trained weight
in bf16.
"""

from __future__ import annotations

import torch
from torch import nn

from mpexp.errors import ConfigError, reason
from mpexp.finetune.names import listed

PEFT_INSTALL = 'pip install -e ".[hf]"  (or pip install "peft>=0.21")'

# The attention projections that model.lora.target_modules=null adapts, by the names libraries
# give them: the first of these sets whose every name is a child of one module (an attention
# layer) anywhere in the model, in every module that has them all. Scoped to that module, a
# name that other layers use too (`proj` of timm's patch embedding, GPT-2's MLP `c_proj`) is
# taken only where it is an attention layer's.
ATTENTION_LAYERS = (
    ("q_proj", "k_proj", "v_proj", "o_proj"),  # Llama, Mistral, Qwen2, Gemma (transformers)
    ("q_proj", "k_proj", "v_proj", "out_proj"),  # OPT, BART, CLIP (transformers)
    ("qkv", "proj"),  # mpexp's GPT and ViT, timm's ViTs
    ("c_attn", "c_proj"),  # GPT-2 (transformers' Conv1D layers)
    ("query", "key", "value"),  # BERT, ViT (transformers): their output projection is apart
    ("query_key_value", "dense"),  # GPT-NeoX, Falcon (transformers)
)


def import_peft(r: int):
    """peft, or a ConfigError naming the install that brings it."""
    try:
        import peft
    except ImportError:
        raise ConfigError(
            f"model.lora.r={r} trains LoRA adapters through peft, which is not installed here: "
            f"{PEFT_INSTALL}."
        ) from None
    return peft


def layers(model: nn.Module) -> list[str]:
    """The names of the model's layers: modules that hold parameters of their own."""
    return [name for name, module in model.named_modules() if name and module._parameters]


def attention_projections(model: nn.Module) -> list[str]:
    """The full names of the model's attention projections (ATTENTION_LAYERS); none found: []."""
    modules = list(model.named_modules())
    for children in ATTENTION_LAYERS:
        found = [
            f"{name}.{child}" if name else child
            for name, module in modules
            if all(child in module._modules for child in children)
            for child in children
        ]
        if found:
            return found
    return []


def targets(model: nn.Module, asked: list[str] | None) -> list[str]:
    """The layers to adapt: `asked` (each a module's name, or its end after a dot, as peft
    matches them), checked to name something; null: the attention projections."""
    what = type(model).__name__
    if asked is None:
        found = attention_projections(model)
        if not found:
            looked = ", ".join("/".join(names) for names in ATTENTION_LAYERS)
            raise ConfigError(
                f"model.lora.target_modules=null adapts a model's attention projections, found by "
                f"their names ({looked}); {what} has none. Name the layers to adapt, e.g. "
                f"model.lora.target_modules=[...] from its layers: {listed(layers(model))}."
            )
        return found
    if not asked:
        raise ConfigError("model.lora.target_modules=[] adapts nothing: name layers, or null.")
    names = [name for name, _ in model.named_modules() if name]
    missing = [t for t in asked if not any(n == t or n.endswith(f".{t}") for n in names)]
    if missing:
        raise ConfigError(
            f"model.lora.target_modules: {', '.join(map(repr, missing))} names no module of "
            f"{what}. Its layers: {listed(layers(model))}."
        )
    return list(asked)


def adapter_dtype(asked: str | None, pure: bool) -> torch.dtype:
    """The adapters' dtype: `model.lora.dtype`, or float32 (bfloat16 under pure bf16; float32
    there is refused before the model is built, mpexp/validate.py)."""
    if asked is None:
        return torch.bfloat16 if pure else torch.float32
    return getattr(torch, asked)


def add_lora(model: nn.Module, settings, pure: bool):
    """Put LoRA adapters into `model` in place (model.lora's `settings`), everything else
    frozen; peft's PeftModel around it, for the export."""
    r = settings.r
    peft = import_peft(r)
    config = peft.LoraConfig(
        r=r,
        lora_alpha=settings.alpha if settings.alpha is not None else 2 * r,
        lora_dropout=settings.dropout,
        target_modules=targets(model, settings.target_modules),
        bias="none",
    )
    dtype = adapter_dtype(settings.dtype, pure)
    try:
        adapted = peft.get_peft_model(model, config, autocast_adapter_dtype=False)
    except (ValueError, TypeError, RuntimeError, KeyError) as err:
        raise ConfigError(
            f"model.lora: peft cannot adapt {type(model).__name__}'s layers "
            f"{', '.join(config.target_modules)}: {reason(err)}. Its layers: "
            f"{listed(layers(model))}."
        ) from None
    for parameter in model.parameters():
        if parameter.requires_grad:  # the adapters: peft froze everything else
            parameter.data = parameter.data.to(dtype)
    return adapted
