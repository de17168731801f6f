"""fp8 training through torchao: the conversion of a model's Linear layers to torchao's fp8 ones,
once the model is built and before DDP/FSDP wrap it or torch.compile traces it, and the check that
every micro-batch puts a number of rows through them that fp8's matrix products can take."""

from __future__ import annotations

import dataclasses
import logging
import math

import torch
from torch import nn

from mpexp.errors import ConfigError
from mpexp.precision.fp8_support import import_torchao
from mpexp.precision.modes import Precision

log = logging.getLogger(__name__)

# both sizes of an fp8 matrix multiply must be multiples of 16 (torch._scaled_mm's rule); layers
# that break it are left in bf16 on every device, so that CPU and GPU runs convert the same ones
FP8_MULTIPLE = 16
# peft's names for a LoRA layer's adapters (mpexp/finetune/lora.py): left alone, as fine-tuning
# recipes leave them, while the frozen layer beside them (`base_layer`) converts
LORA_ADAPTERS = ("lora_A", "lora_B")
ADAPTER_REASON = "a LoRA adapter: its thin products stay in bf16, its weights in model.lora.dtype"


def convert_to_fp8(
    model: nn.Module, precision: Precision, fp32_modules: list[str], compiled: bool
) -> tuple[nn.Module, Precision]:
    """Swap the model's Linear layers for torchao's fp8 ones, where fp8 can take them; return the
    model and the Precision that records which were converted and why the others were not.

    Called once the model is on its device and before DDP/FSDP wrap it or torch.compile traces it.
    A Linear layer stays as it was (in bf16 under autocast) when its sizes are not multiples of 16
    (a 10-class head), when precision.fp32_modules or precision.fp8.exclude names it or a module
    around it, when it has fewer input or output features than precision.fp8.min_size, or when it
    sits in an nn.MultiheadAttention, which uses its weight without calling it, or when the model
    names it in its `fp8_left_out` ({name: why}: model=hf's output layer, timm's classifier).
    Without fp8, the model and precision come back unchanged.
    """
    if precision.fp8 is None:
        return model, precision
    float8 = import_torchao()
    config = float8.Float8LinearConfig.from_recipe_name(precision.fp8.recipe)
    # on a CPU, torchao's emulation: the same casts and scales, the products summed in float32
    config = dataclasses.replace(config, emulate=precision.emulated)
    modules = dict(model.named_modules())
    unknown = [k for k in precision.fp8.exclude if k not in modules]
    if unknown:
        raise ConfigError(
            f"precision.fp8.exclude names {', '.join(unknown)}, which {type(model).__name__} does "
            f"not have; its modules include {', '.join(list(modules)[1:6])}."
        )
    reasons: dict[str, str | None] = {}
    # a model may name Linear layers it keeps as they are, and why (a transformers model's
    # output layer, timm's classifier)
    declared: dict[str, str] = getattr(model, "fp8_left_out", {})

    def convertible(module: nn.Module, name: str) -> bool:
        reasons[name] = _fp8_unconvertible(
            module, name, modules, fp32_modules, precision.fp8, declared
        )
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
        "; ".join(_unconverted_listed(unconverted)) or "none",
    )
    if precision.device_type == "cuda" and not compiled:
        log.warning(
            "precision=fp8 without trainer.compile=true: each cast to fp8 (an amax, a scale, a "
            "cast, per operand of every converted layer) runs as kernels of its own, which eats "
            "most of fp8's speedup; torchao's speedups are measured compiled."
        )
    return model, dataclasses.replace(precision, fp8=fp8)


def linear_rows(model: nn.Module, example: torch.Tensor) -> dict[str, list[int]]:
    """The rows each Linear layer multiplies per sample, at each of its calls: its input's
    leading dimensions for `example`, a batch of one (65 for a ViT on 64 patches: its tokens and
    the class token). Traced once with forward pre-hooks, in eval mode and without gradients, so
    that no statistics change and no random number is drawn."""
    rows: dict[str, list[int]] = {}

    def hook(name: str):
        def record(module: nn.Module, args: tuple) -> None:
            rows.setdefault(name, []).append(math.prod(args[0].shape[:-1]))

        return record

    handles = [
        module.register_forward_pre_hook(hook(name))
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear)
    ]
    training = model.training
    try:
        model.eval()
        with torch.no_grad():
            model(example)
    finally:
        model.train(training)
        for handle in handles:
            handle.remove()
    return rows


def check_fp8_rows(
    precision: Precision, rows: dict[str, list[int]], batch: int, accumulate: int, last: int
) -> None:
    """Refuse, before training, micro-batches whose rows through a converted layer (samples x
    its `linear_rows`) are not a multiple of 16.

    A layer's weight gradient is the product of its output's gradient and its input, which sums
    over the micro-batch's rows; in fp8 on a GPU that is torch._scaled_mm, which takes only
    multiples of 16 there (torchao pads nothing by default), so such a run would fail in its first
    backward pass. The CPU's emulation has no such limit, but is refused alike: emulation must
    not hide a configuration that fails on the GPU. `batch` is per process, split into
    `accumulate` micro-batches; `last` is the size of a last, smaller batch (0: none)."""
    if precision.fp8 is None:
        return
    calls = [(name, n) for name in precision.fp8.converted for n in rows.get(name, ())]
    # every layer takes micro-batches of a multiple of this many samples: 16 / gcd(rows, 16)
    step = max((FP8_MULTIPLE // math.gcd(n, FP8_MULTIPLE) for _, n in calls), default=1)
    # the micro-batches as train_step cuts them (Tensor.chunk)
    sizes = {len(chunk) for chunk in torch.arange(batch).chunk(accumulate)}
    if last:  # a last, smaller batch (dataset.drop_last=false) splits into its own micro-batches
        sizes |= {len(chunk) for chunk in torch.arange(last).chunk(accumulate)}
    bad = sorted(size for size in sizes if size % step)
    if not bad:
        return
    samples = bad[0]
    name, per = next((name, n) for name, n in calls if samples * n % FP8_MULTIPLE)
    whole = step * accumulate  # batches of a multiple of this split into micro-batches fp8 takes
    if batch % whole:
        below, above = batch // whole * whole, (batch // whole + 1) * whole
        fix = f"dataset.batch_size={below} or {above}" if below else f"dataset.batch_size={above}"
        fewer = [k for k in range(1, accumulate) if batch % k == 0 and batch // k % step == 0]
        if fewer:
            fix += f", or trainer.accumulate={fewer[-1]}"
    else:
        fix = f"dataset.drop_last=true (the last batch holds {last} samples)"
    raise ConfigError(
        f"precision=fp8 cannot train micro-batches of {samples} samples (dataset.batch_size="
        f"{batch} per process, trainer.accumulate={accumulate}): the fp8 layer {name} takes "
        f"{per} rows per sample, {samples * per:,} per micro-batch, and the fp8 matrix product "
        f"that gives its weight gradient sums over them, which on a GPU takes only a multiple of "
        f"{FP8_MULTIPLE} (torch._scaled_mm; torchao does not pad). Micro-batches must hold a "
        f"multiple of {step} samples: use {fix}. A CPU refuses it too, where emulation would "
        "run it: the same configuration must not train on one device and fail on the other."
    )


def _fp8_unconvertible(
    module: nn.Module,
    name: str,
    modules: dict[str, nn.Module],
    fp32_modules: list[str],
    fp8,
    declared: dict[str, str],
) -> str | None:
    """Why fp8 leaves this Linear layer alone, or None when it converts it."""
    if any(_inside(name, keep) for keep in fp32_modules):
        return "in precision.fp32_modules: runs in float32"
    if any(_inside(name, keep) for keep in fp8.exclude):
        return "in precision.fp8.exclude: runs in bf16"
    if any(part in LORA_ADAPTERS for part in name.split(".")):
        return ADAPTER_REASON
    if name in declared:
        return declared[name]
    parent = modules.get(name.rpartition(".")[0])
    if isinstance(parent, nn.MultiheadAttention):
        return "inside nn.MultiheadAttention, which uses the weight without calling the layer"
    sizes = (module.in_features, module.out_features)
    if any(size % FP8_MULTIPLE for size in sizes):
        return (
            f"{sizes[0]} inputs, {sizes[1]} outputs: fp8 matrix multiplication needs multiples "
            f"of {FP8_MULTIPLE}"
        )
    if min(sizes) < fp8.min_size:
        # a product this thin is bound by memory, not arithmetic: fp8's casts (an amax, a scale
        # and a cast per operand) cost more than its faster multiply saves
        return (
            f"{sizes[0]} inputs, {sizes[1]} outputs: below precision.fp8.min_size="
            f"{fp8.min_size}, too small for fp8 to pay"
        )
    return None


def _unconverted_listed(unconverted: dict[str, str]) -> list[str]:
    """The layers fp8 left alone, each with its reason; LoRA's adapters (two a targeted layer,
    hundreds in a large model) counted in one entry."""
    adapters = sum(reason == ADAPTER_REASON for reason in unconverted.values())
    listed = [f"{n}: {r}" for n, r in unconverted.items() if r != ADAPTER_REASON]
    if adapters:
        listed.append(
            f"{adapters} LoRA adapters (lora_A, lora_B): their thin products stay in bf16, "
            "their weights in model.lora.dtype"
        )
    return listed


def _inside(name: str, module: str) -> bool:
    return name == module or name.startswith(module + ".")


def _to_cpu_autocast_dtype(module: nn.Module, args: tuple) -> tuple | None:
    # torchao's fp8 layer casts its input to the autocast dtype itself on CUDA only (it reads
    # CUDA's autocast state); doing the same under CPU autocast keeps emulated numerics those of
    # the GPU: bf16 activations, scaled and cast to fp8
    if torch.is_autocast_enabled("cpu"):
        return (args[0].to(torch.get_autocast_dtype("cpu")), *args[1:])
    return None
