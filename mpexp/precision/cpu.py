"""What this CPU computes natively: 16-bit autocast on a CPU without the instructions for it runs
emulated (real numerics, far slower), which mpexp.precision.modes warns about and records."""

from __future__ import annotations

import torch


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
