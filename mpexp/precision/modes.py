"""The one place where precision switches are set: autocast dtype, TF32 and fp8.

A `precision` option (conf/precision/*.yaml) says what it does: `autocast` (float16, bfloat16 or
null), `tf32` and `fp8` (torchao's float8 training of Linear layers, or null). It is applied once at
setup and returned as a `Precision`; fp8's conversion of the model follows once the model is built
(`convert_to_fp8`). The training loop only enters `precision.autocast()` and never re-decides
anything.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mpexp.errors import ConfigError

log = logging.getLogger(__name__)

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
SHORT_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}


# fp8 matrix multiplication (torch._scaled_mm) needs fp8 tensor cores: compute capability 8.9
# (Ada) or newer (Hopper 9.0, Blackwell 10.0)
FP8_CAPABILITY = (8, 9)
# both sizes of an fp8 matrix multiply must be multiples of 16 (torch._scaled_mm's rule); layers
# that break it are left in bf16 on every device, so that CPU and GPU runs convert the same ones
FP8_MULTIPLE = 16
FP8_INSTALL = 'pip install "torchao>=0.18,<0.19"  (or the fp8 extra: pip install -e ".[fp8]")'


def mode_name(autocast_dtype: torch.dtype | None, tf32: bool, fp8: bool = False) -> str:
    """fp32, tf32, fp16, bf16 or fp8; a mode that also asks for TF32 is e.g. `fp16+tf32`."""
    if autocast_dtype is None:
        return "tf32" if tf32 else "fp32"
    return ("fp8" if fp8 else SHORT_NAMES[autocast_dtype]) + ("+tf32" if tf32 else "")


@dataclass(frozen=True)
class Fp8:
    """fp8 training through torchao: its recipe, and once the model is converted
    (`convert_to_fp8`), which Linear layers compute in fp8 and why the others do not."""

    recipe: str
    converted: tuple[str, ...] = ()
    unconverted: dict[str, str] = field(default_factory=dict)  # layer name -> reason

    def record(self) -> dict:
        return {
            "fp8_recipe": self.recipe,
            "fp8_converted_count": len(self.converted),
            "fp8_converted": list(self.converted),
            "fp8_unconverted": dict(self.unconverted),
            "fp8_backend": f"torchao {_torchao_version()}",
        }


@dataclass(frozen=True)
class Precision:
    """What runs: the requested mode, and what it amounts to on this device."""

    mode: str
    effective: str
    device_type: str
    autocast_dtype: torch.dtype | None
    # not at the device's native speed: 16-bit autocast on a CPU without native instructions for
    # it, fp16 convolutions on any CPU (check_fp16_convolutions_on_cpu); fp8 on a CPU (always)
    emulated: bool = False
    fp8: Fp8 | None = None  # fp8 training of Linear layers; None: none

    def autocast(self, cache: bool = True) -> contextlib.AbstractContextManager:
        """The forward-pass context: autocast to the mode's dtype, or nothing.

        `cache=False` casts each weight where it is used instead of keeping its cast for the
        region: the same values (each weight is used once per forward pass), and what PyTorch
        requires of autocast while a CUDA graph is captured.
        """
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(
            device_type=self.device_type, dtype=self.autocast_dtype, cache_enabled=cache
        )

    def record(self) -> dict:
        """The precision facts that every run writes to its config and summary.

        `precision` is the mode asked for, `effective_precision` what it amounts to here. The TF32
        switches (`tf32_matmul`, `tf32_cudnn`, `float32_matmul_precision`) are PyTorch's as this
        run set them, and they are what acts: where TF32 cannot take effect (a CPU, a GPU older
        than Ampere) `setup_precision` turns them off, so that a `tf32` run there records, and
        computes, strict fp32 (`tf32_matmul: false`, `float32_matmul_precision: highest`).
        """
        return {
            "precision": self.mode,
            "effective_precision": self.effective,
            "autocast_dtype": str(self.autocast_dtype).removeprefix("torch.")
            if self.autocast_dtype
            else "none",
            "emulated": self.emulated,
            **tf32_flags(),
            **(self.fp8.record() if self.fp8 else {}),
        }


def tf32_flags() -> dict:
    """The global TF32 switches as PyTorch holds them now."""
    return {
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "tf32_cudnn": torch.backends.cudnn.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }


def set_tf32(enabled: bool) -> None:
    """Switch TF32 for matmul and cuDNN together.

    PyTorch leaves cuDNN's TF32 on by default, so strict fp32 has to turn it off explicitly.
    """
    torch.set_float32_matmul_precision("high" if enabled else "highest")
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled


def setup_precision(cfg: Mapping[str, Any], device: torch.device) -> Precision:
    """Apply a `precision` config's switches for `device` and describe what will run.

    Nothing falls back silently: TF32 where it cannot take effect runs (and is recorded) as strict
    fp32 with a warning; 16-bit autocast that this CPU only emulates warns once that it is slow;
    fp8 stops with an error on a GPU without fp8 tensor cores or without torchao installed, and on
    a CPU runs emulated with a warning.
    """
    dtype = DTYPES[str(cfg["autocast"])] if cfg["autocast"] is not None else None
    tf32 = bool(cfg["tf32"])
    fp8 = Fp8(recipe=str(cfg["fp8"]["recipe"])) if cfg.get("fp8") is not None else None
    mode = mode_name(dtype, tf32, fp8 is not None)
    if fp8 is not None:
        _check_fp8(dtype, device)
    effective = mode

    if tf32 and not _tf32_capable(device):
        # the switches stay off: the run is strict fp32, and its record says what acted
        tf32 = False
        effective = mode_name(dtype, False, fp8 is not None)
        _warn_no_tf32_once(device, effective)
    set_tf32(tf32)

    # bf16 autocast needs Ampere (sm80) or newer; older GPUs only emulate it, slowly.
    if dtype is torch.bfloat16 and device.type == "cuda" and not _ampere_or_newer(device):
        raise ConfigError(
            f"precision=bf16 needs a GPU with native bfloat16 (Ampere or newer); "
            f"{torch.cuda.get_device_name(device)} has none.\n"
            "Use precision=fp16 (with loss scaling) or precision=fp32."
        )
    if fp8 is not None:
        emulated = device.type == "cpu"
        if emulated:
            _warn_fp8_emulated_once()
    else:
        emulated = dtype is not None and device.type == "cpu" and not cpu_has_native(dtype)
        if emulated:
            _warn_emulated_once(dtype)

    return Precision(
        mode=mode,
        effective=effective,
        device_type=device.type,
        autocast_dtype=dtype,
        emulated=emulated,
        fp8=fp8,
    )


def _check_fp8(dtype: torch.dtype | None, device: torch.device) -> None:
    """fp8 can run here, or a ConfigError says why not and what to do instead."""
    if dtype is not torch.bfloat16:
        raise ConfigError(
            "precision.fp8 needs precision.autocast=bfloat16: the layers that fp8 does not "
            "convert run under bf16 autocast, as torchao's float8 training expects. "
            "precision=fp8 sets it."
        )
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < FP8_CAPABILITY:
        major, minor = torch.cuda.get_device_capability(device)
        raise ConfigError(
            f"precision=fp8 needs a GPU with fp8 tensor cores (compute capability 8.9 or newer: "
            f"Ada, Hopper, Blackwell); {torch.cuda.get_device_name(device)} is {major}.{minor}.\n"
            "Use precision=bf16 here, or trainer.device=cpu to see fp8's numerics emulated "
            "(slowly)."
        )
    _import_torchao()


def _import_torchao():
    """torchao.float8, imported only when fp8 is asked for; without it, one readable error."""
    # torch logs a deprecation notice about an enum torchao registers, once, at import: about
    # the two libraries, not about this run
    pytree_log = logging.getLogger("torch.utils._pytree")
    level = pytree_log.level
    pytree_log.setLevel(logging.ERROR)
    try:
        import torchao.float8
    except ImportError as err:
        raise ConfigError(
            f"precision=fp8 needs torchao, which is not installed here ({err}).\n"
            f"Install it with: {FP8_INSTALL}"
        ) from None
    finally:
        pytree_log.setLevel(level)
    return torchao.float8


def _torchao_version() -> str:
    import torchao

    return torchao.__version__


_warned_no_tf32: set[str] = set()


def _warn_no_tf32_once(device: torch.device, effective: str) -> None:
    where = "on CPU" if device.type == "cpu" else f"on {torch.cuda.get_device_name(device)}"
    if where in _warned_no_tf32:  # once per process, as the 16-bit warning
        return
    _warned_no_tf32.add(where)
    log.warning(
        "TF32 has no effect %s (it needs an Ampere or newer CUDA GPU): this run leaves the TF32 "
        "switches off, computes float32 work in strict fp32 and is recorded as "
        "effective_precision=%s, tf32_matmul=false.",
        where,
        effective,
    )


_warned_fp8_emulated = False


def _warn_fp8_emulated_once() -> None:
    global _warned_fp8_emulated
    if _warned_fp8_emulated:  # once per process, as the 16-bit warning
        return
    _warned_fp8_emulated = True
    log.warning(
        "precision=fp8 runs emulated on CPU (torchao's emulate mode): the numerics are real "
        "(values cast to e4m3/e5m2 at torchao's scales, products summed in float32), the speed "
        "is not: expect it slower than bf16 here. fp8's speed needs a CUDA GPU of compute "
        "capability 8.9 or newer (Ada, Hopper). Recorded as emulated=true."
    )


def cpu_has_native(dtype: torch.dtype) -> bool:
    """Whether this CPU computes `dtype` matrix work natively (oneDNN's own test: AVX-512 BF16 or
    AMX for bfloat16, AVX-512 FP16 or AMX-FP16 for float16)."""
    probe = {
        torch.bfloat16: "_is_mkldnn_bf16_supported",
        torch.float16: "_is_mkldnn_fp16_supported",
    }[dtype]
    try:
        return bool(getattr(torch.ops.mkldnn, probe)())
    except (AttributeError, RuntimeError):  # an older torch or a build without oneDNN
        return False


_warned_emulated: set[torch.dtype | str] = set()


def _warn_emulated_once(dtype: torch.dtype) -> None:
    # once per process: a sweep runs its jobs in one process and the warning says the same each time
    if dtype in _warned_emulated:
        return
    _warned_emulated.add(dtype)
    other = torch.bfloat16 if dtype is torch.float16 else torch.float16
    hint = (
        f"precision={SHORT_NAMES[other]} runs natively here"
        if cpu_has_native(other)
        else "precision=fp32 is the fast choice on this CPU"
    )
    log.warning(
        "%s autocast is emulated on this CPU (no native %s matrix instructions): the numerics are "
        "real, but expect epochs several times slower than fp32; %s. Recorded as emulated=true.",
        SHORT_NAMES[dtype],
        str(dtype).removeprefix("torch."),
        hint,
    )


def check_fp16_convolutions_on_cpu(model: nn.Module, precision: Precision) -> Precision:
    """fp16 autocast of a model with convolutions on a CPU: slow even where the CPU computes
    float16 natively (AVX-512 FP16), because PyTorch's CPU backward of a float16 convolution takes
    a slow generic path (SimpleCNN trained 36 times slower than in fp32 on such a CPU, while its
    bf16 steps were as fast as fp32's). Warns once and records the run as emulated: not at the
    CPU's native speed. Linear layers are unaffected."""
    if (
        precision.device_type != "cpu"
        or precision.autocast_dtype is not torch.float16
        or precision.emulated  # already warned: the CPU has no float16 instructions at all
        or not any(isinstance(m, nn.modules.conv._ConvNd) for m in model.modules())
    ):
        return precision
    if "fp16-convolutions" not in _warned_emulated:
        _warned_emulated.add("fp16-convolutions")
        hint = (
            "precision=bf16 runs natively here"
            if cpu_has_native(torch.bfloat16)
            else "precision=fp32 is the fast choice on this CPU"
        )
        log.warning(
            "fp16 autocast of convolutions is slow on a CPU: PyTorch computes their backward "
            "pass on a slow generic path, even on this CPU, which has float16 instructions. The "
            "numerics are real, but expect epochs many times slower than fp32; %s. Recorded as "
            "emulated=true.",
            hint,
        )
    return dataclasses.replace(precision, emulated=True)


def _tf32_capable(device: torch.device) -> bool:
    return device.type == "cuda" and _ampere_or_newer(device)


def _ampere_or_newer(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (8, 0)


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
    float8 = _import_torchao()
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


def run_in_float32(model: nn.Module, names: list[str], precision: Precision) -> list[str]:
    """Make the named submodules run outside autocast, in float32 (selective autocast).

    The way "How to Use Mixed Precision Training in PyTorch" shows it, and the PyTorch blog post
    advises for precision-sensitive regions: inside the module autocast is off and its floating
    inputs are cast to float32, so it computes in float32 with its float32 weights.
    """
    if not names:
        return []
    modules = dict(model.named_modules())
    unknown = [n for n in names if n not in modules or n == ""]
    if unknown:
        known = ", ".join(n for n in modules if n)
        raise ConfigError(
            f"precision.fp32_modules names {', '.join(map(repr, unknown))}, which the model does "
            f"not have. Its submodules are: {known}."
        )
    if precision.autocast_dtype is None:
        log.warning(
            "precision.fp32_modules=%s has no effect under precision=%s: nothing runs under "
            "autocast%s.",
            list(names),
            precision.mode,
            " (and TF32 is a global switch that cannot be turned off per module)"
            if precision.mode == "tf32"
            else "",
        )
        return []
    for name in names:
        _forward_in_float32(modules[name], precision.device_type)
    return list(names)


def _forward_in_float32(module: nn.Module, device_type: str) -> None:
    inner = module.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        with torch.autocast(device_type=device_type, enabled=False):
            return inner(*map(_to_float32, args), **{k: _to_float32(v) for k, v in kwargs.items()})

    module.forward = forward


def _to_float32(value):
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.float()
    return value
