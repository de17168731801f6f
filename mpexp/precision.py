"""The one place where precision switches are set: autocast dtype and TF32.

A `precision` option (conf/precision/*.yaml) says what it does: `autocast` (float16, bfloat16 or
null) and `tf32`. It is applied once at setup and returned as a `Precision`; the training loop
only enters `precision.autocast()` and never re-decides anything.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mpexp.errors import ConfigError

log = logging.getLogger(__name__)

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
SHORT_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}


def mode_name(autocast_dtype: torch.dtype | None, tf32: bool) -> str:
    """fp32, tf32, fp16 or bf16; a 16-bit mode that also asks for TF32 is e.g. `fp16+tf32`."""
    if autocast_dtype is None:
        return "tf32" if tf32 else "fp32"
    return SHORT_NAMES[autocast_dtype] + ("+tf32" if tf32 else "")


@dataclass(frozen=True)
class Precision:
    """What runs: the requested mode, and what it amounts to on this device."""

    mode: str
    effective: str
    device_type: str
    autocast_dtype: torch.dtype | None
    emulated: bool = False  # 16-bit autocast on a CPU without native instructions for it

    def autocast(self) -> contextlib.AbstractContextManager:
        """The forward-pass context: autocast to the mode's dtype, or nothing."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.autocast_dtype)

    def record(self) -> dict:
        """The precision facts that every run writes to its config and summary."""
        return {
            "precision": self.mode,
            "effective_precision": self.effective,
            "autocast_dtype": str(self.autocast_dtype).removeprefix("torch.")
            if self.autocast_dtype
            else "none",
            "emulated": self.emulated,
            **tf32_flags(),
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
    fp32 with a warning; 16-bit autocast that this CPU only emulates warns once that it is slow.
    """
    dtype = DTYPES[str(cfg["autocast"])] if cfg["autocast"] is not None else None
    tf32 = bool(cfg["tf32"])
    mode = mode_name(dtype, tf32)
    set_tf32(tf32)
    effective = mode

    if tf32 and not _tf32_capable(device):
        where = "on CPU" if device.type == "cpu" else f"on {torch.cuda.get_device_name(device)}"
        effective = mode_name(dtype, False)
        log.warning(
            "TF32 has no effect %s (it needs an Ampere or newer CUDA GPU): this run computes "
            "float32 work in strict fp32 and is recorded as effective_precision=%s.",
            where,
            effective,
        )

    # bf16 autocast needs Ampere (sm80) or newer; older GPUs only emulate it, slowly.
    if dtype is torch.bfloat16 and device.type == "cuda" and not _ampere_or_newer(device):
        raise ConfigError(
            f"precision=bf16 needs a GPU with native bfloat16 (Ampere or newer); "
            f"{torch.cuda.get_device_name(device)} has none.\n"
            "Use precision=fp16 (with loss scaling) or precision=fp32."
        )
    emulated = dtype is not None and device.type == "cpu" and not cpu_has_native(dtype)
    if emulated:
        _warn_emulated_once(dtype)

    return Precision(
        mode=mode,
        effective=effective,
        device_type=device.type,
        autocast_dtype=dtype,
        emulated=emulated,
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


_warned_emulated: set[torch.dtype] = set()


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


def _tf32_capable(device: torch.device) -> bool:
    return device.type == "cuda" and _ampere_or_newer(device)


def _ampere_or_newer(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (8, 0)


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
