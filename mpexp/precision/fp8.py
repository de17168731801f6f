"""fp8 training through torchao: the conversion of a model's Linear layers to torchao's fp8 ones,
once the model is built and before DDP/FSDP wrap it or torch.compile traces it."""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from mpexp.errors import ConfigError
from mpexp.precision.fp8_support import import_torchao
from mpexp.precision.modes import Precision

log = logging.getLogger(__name__)

# both sizes of an fp8 matrix multiply must be multiples of 16 (torch._scaled_mm's rule); layers
# that break it are left in bf16 on every device, so that CPU and GPU runs convert the same ones
FP8_MULTIPLE = 16


def convert_to_fp8(
    model: nn.Module, precision: Precision, fp32_modules: list[str], compiled: bool
) -> tuple[nn.Module, Precision]:
    """Swap the model's Linear layers for torchao's fp8 ones, where fp8 can take them; return the
    model and the Precision that records which were converted and why the others were not.

    Called once the model is on its device and before DDP/FSDP wrap it or torch.compile traces it.
    A Linear layer stays as it was (in bf16 under autocast) when its sizes are not multiples of 16
    (a 10-class head), when precision.fp32_modules names it or a module around it, or when it sits
    in an nn.MultiheadAttention, which uses its weight without calling it. Without fp8, the model
    and precision come back unchanged.
    """
    if precision.fp8 is None:
        return model, precision
    float8 = import_torchao()
    config = float8.Float8LinearConfig.from_recipe_name(precision.fp8.recipe)
    # on a CPU, torchao's emulation: the same casts and scales, the products summed in float32
    config = dataclasses.replace(config, emulate=precision.emulated)
    modules = dict(model.named_modules())
    reasons: dict[str, str | None] = {}

    def convertible(module: nn.Module, name: str) -> bool:
        reasons[name] = _fp8_unconvertible(module, name, modules, fp32_modules)
        return reasons[name] is None

    model = float8.convert_to_float8_training(model, module_filter_fn=convertible, config=config)
    converted = tuple(n for n, reason in reasons.items() if reason is None)
    unconverted = {n: reason for n, reason in reasons.items() if reason is not None}
    if not converted:
        listed = "; ".join(f"{n or 'the model'}: {r}" for n, r in unconverted.items())
        raise ConfigError(
            "precision=fp8 has nothing to convert: fp8 computes nn.Linear layers whose sizes are "
            f"multiples of {FP8_MULTIPLE}, and this model has none "
            f"({listed or 'no Linear layer at all'}).\n"
            "Use a model made of such layers (model=vit) or precision=bf16."
        )
    if precision.device_type == "cpu":
        for name in converted:
            model.get_submodule(name).register_forward_pre_hook(_to_cpu_autocast_dtype)
    fp8 = dataclasses.replace(precision.fp8, converted=converted, unconverted=unconverted)
    log.info(
        "fp8 (%s%s): %d Linear layers converted; left as they were (in bf16 unless said): %s",
        fp8.recipe,
        ", emulated" if precision.emulated else "",
        len(converted),
        "; ".join(f"{n}: {r}" for n, r in unconverted.items()) or "none",
    )
    if precision.device_type == "cuda" and not compiled:
        log.warning(
            "precision=fp8 without trainer.compile=true: each cast to fp8 (an amax, a scale, a "
            "cast, per operand of every converted layer) runs as kernels of its own, which eats "
            "most of fp8's speedup; torchao's speedups are measured compiled."
        )
    return model, dataclasses.replace(precision, fp8=fp8)


def _fp8_unconvertible(
    module: nn.Module, name: str, modules: dict[str, nn.Module], fp32_modules: list[str]
) -> str | None:
    """Why fp8 leaves this Linear layer alone, or None when it converts it."""
    if any(name == keep or name.startswith(keep + ".") for keep in fp32_modules):
        return "in precision.fp32_modules: runs in float32"
    parent = modules.get(name.rpartition(".")[0])
    if isinstance(parent, nn.MultiheadAttention):
        return "inside nn.MultiheadAttention, which uses the weight without calling the layer"
    sizes = (module.in_features, module.out_features)
    if any(size % FP8_MULTIPLE for size in sizes):
        return (
            f"{sizes[0]} inputs, {sizes[1]} outputs: fp8 matrix multiplication needs multiples "
            f"of {FP8_MULTIPLE}"
        )
    return None


def _to_cpu_autocast_dtype(module: nn.Module, args: tuple) -> tuple | None:
    # torchao's fp8 layer casts its input to the autocast dtype itself on CUDA only (it reads
    # CUDA's autocast state); doing the same under CPU autocast keeps emulated numerics those of
    # the GPU: bf16 activations, scaled and cast to fp8
    if torch.is_autocast_enabled("cpu"):
        return (args[0].to(torch.get_autocast_dtype("cpu")), *args[1:])
    return None
