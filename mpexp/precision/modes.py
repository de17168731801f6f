"""The one place where precision switches are set: autocast dtype, TF32, fp8 and pure bf16.

A `precision` option (conf/precision/*.yaml) says what it does: `autocast` (float16, bfloat16 or
null), `tf32`, `fp8` (torchao's float8 training of Linear layers, or null) and `weights` (bfloat16:
pure bf16, whose update rounding is mpexp/precision/pure_updates.py's). It is applied once at
setup and returned as a `Precision`; fp8's conversion of the model follows once the model is built
(`convert_to_fp8`, mpexp/precision/fp8.py). The training loop only enters `precision.autocast()`
and never re-decides anything.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mpexp.errors import ConfigError
from mpexp.precision.cpu import cpu_has_native
from mpexp.precision.fp8_support import check_fp8, torchao_version, warn_fp8_emulated_once
from mpexp.precision.tf32 import set_tf32, tf32_flags

log = logging.getLogger(__name__)

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
SHORT_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}


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
    exclude: tuple[str, ...] = ()  # layers kept in bf16 by name (precision.fp8.exclude)
    min_size: int = 0  # layers with fewer features kept in bf16 (precision.fp8.min_size)
    converted: tuple[str, ...] = ()
    unconverted: dict[str, str] = field(default_factory=dict)  # layer name -> reason

    def record(self) -> dict:
        return {
            "fp8_recipe": self.recipe,
            "fp8_exclude": list(self.exclude),
            "fp8_min_size": self.min_size,
            "fp8_converted_count": len(self.converted),
            "fp8_converted": list(self.converted),
            "fp8_unconverted": dict(self.unconverted),
            "fp8_backend": f"torchao {torchao_version()}",
        }


@dataclass(frozen=True)
class PureBf16:
    """Pure bf16: the weights and gradients in bfloat16, each update rounded into them as
    `rounding` says, the optimizer's states kept in `states_dtype` (see
    mpexp/precision/pure_optimizers.py)."""

    rounding: str
    states_dtype: torch.dtype

    def record(self) -> dict:
        return {
            "weights_dtype": "bfloat16",
            "update_rounding": self.rounding,
            "optimizer_states": str(self.states_dtype).removeprefix("torch."),
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
    pure: PureBf16 | None = None  # pure bf16; None: float32 weights

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
            **(self.pure.record() if self.pure else {"weights_dtype": "float32"}),
        }


def setup_precision(cfg: Mapping[str, Any], device: torch.device) -> Precision:
    """Apply a `precision` config's switches for `device` and describe what will run.

    Nothing falls back silently: TF32 where it cannot take effect runs (and is recorded) as strict
    fp32 with a warning; 16-bit autocast that this CPU only emulates warns once that it is slow;
    fp8 stops with an error on a GPU without fp8 tensor cores or without torchao installed, and on
    a CPU runs emulated with a warning.
    """
    dtype = DTYPES[str(cfg["autocast"])] if cfg["autocast"] is not None else None
    tf32 = bool(cfg["tf32"])
    fp8_cfg = cfg.get("fp8") or {}  # a record from before fp8 was a node: null
    recipe = fp8_cfg.get("recipe")
    fp8 = None
    if recipe is not None:
        exclude = tuple(fp8_cfg.get("exclude") or ())
        fp8 = Fp8(str(recipe), exclude, int(fp8_cfg.get("min_size") or 0))
    mode = mode_name(dtype, tf32, fp8 is not None)
    pure = None
    if str(cfg.get("weights") or "float32") == "bfloat16":  # validated: no autocast, no fp8
        states = getattr(torch, str(cfg["optimizer_states"] or "bfloat16"))
        pure = PureBf16(rounding=str(cfg["update_rounding"] or "nearest"), states_dtype=states)
        mode = "bf16_pure" + ("+tf32" if tf32 else "")
    if fp8 is not None:
        check_fp8(dtype, device)
    effective = mode

    if tf32 and not _tf32_capable(device):
        # the switches stay off: the run is strict fp32, and its record says what acted
        tf32 = False
        effective = "bf16_pure" if pure else mode_name(dtype, False, fp8 is not None)
        _warn_no_tf32_once(device, effective)
    set_tf32(tf32)

    # bf16 autocast needs Ampere (sm80) or newer; older GPUs only emulate it, slowly.
    bf16 = dtype is torch.bfloat16 or pure is not None
    if bf16 and device.type == "cuda" and not _ampere_or_newer(device):
        raise ConfigError(
            f"precision={'bf16_pure' if pure else 'bf16'} needs a GPU with native bfloat16 "
            "(Ampere or newer); "
            f"{torch.cuda.get_device_name(device)} has none.\n"
            "Use precision=fp16 (with loss scaling) or precision=fp32."
        )
    if fp8 is not None:
        emulated = device.type == "cpu"
        if emulated:
            warn_fp8_emulated_once()
    elif pure is not None:
        emulated = device.type == "cpu" and not cpu_has_native(torch.bfloat16)
        if emulated:
            _warn_emulated_once(torch.bfloat16, "pure bf16")
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
        pure=pure,
    )


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


_warned_emulated: set[torch.dtype | str] = set()


def _warn_emulated_once(dtype: torch.dtype, what: str = "autocast") -> None:
    # once per process: a sweep runs its jobs in one process and the warning says the same each time
    key = dtype if what == "autocast" else what
    if key in _warned_emulated:
        return
    _warned_emulated.add(key)
    other = torch.bfloat16 if dtype is torch.float16 else torch.float16
    hint = (
        f"precision={SHORT_NAMES[other]} runs natively here"
        if cpu_has_native(other)
        else "precision=fp32 is the fast choice on this CPU"
    )
    log.warning(
        "%s is emulated on this CPU (no native %s matrix instructions): the numerics are "
        "real, but expect epochs several times slower than fp32; %s. Recorded as emulated=true.",
        f"{SHORT_NAMES[dtype]} autocast" if what == "autocast" else what,
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
