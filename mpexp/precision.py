"""The one place where precision modes are defined: autocast dtype and TF32 switches.

A mode is decided once at setup and returned as a `Precision`; the training loop only enters
`precision.autocast()` and never re-decides anything.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch

from mpexp.errors import ConfigError

log = logging.getLogger(__name__)

# mode -> (autocast dtype, TF32 wanted)
MODES: dict[str, tuple[torch.dtype | None, bool]] = {
    "fp32": (None, False),
    "tf32": (None, True),
    "fp16": (torch.float16, False),
    "bf16": (torch.bfloat16, False),
}


@dataclass(frozen=True)
class Precision:
    """What runs: the requested mode, and what it amounts to on this device."""

    mode: str
    effective: str
    device_type: str
    autocast_dtype: torch.dtype | None

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


def setup_precision(mode: str, device: torch.device) -> Precision:
    """Apply a precision mode's global switches for `device` and describe what will run."""
    if mode not in MODES:
        raise ConfigError(f"precision={mode!r} is not a mode; choose one of: {', '.join(MODES)}.")
    dtype, tf32 = MODES[mode]
    set_tf32(tf32)
    effective = mode

    if tf32 and not _tf32_capable(device):
        where = "on CPU" if device.type == "cpu" else f"on {torch.cuda.get_device_name(device)}"
        log.warning(
            "precision=tf32 has no effect %s (TF32 needs an Ampere or newer CUDA GPU): "
            "this run computes in strict fp32 and is recorded as effective_precision=fp32.",
            where,
        )
        effective = "fp32"

    # bf16 autocast needs Ampere (sm80) or newer; older GPUs only emulate it, slowly.
    if dtype is torch.bfloat16 and device.type == "cuda" and not _ampere_or_newer(device):
        raise ConfigError(
            f"precision=bf16 needs a GPU with native bfloat16 (Ampere or newer); "
            f"{torch.cuda.get_device_name(device)} has none.\n"
            "Use precision=fp16 (with loss scaling) or precision=fp32."
        )

    return Precision(mode=mode, effective=effective, device_type=device.type, autocast_dtype=dtype)


def _tf32_capable(device: torch.device) -> bool:
    return device.type == "cuda" and _ampere_or_newer(device)


def _ampere_or_newer(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (8, 0)
