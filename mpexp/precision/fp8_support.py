"""Whether fp8 can run here: a GPU with fp8 tensor cores (or a CPU, emulated) and torchao installed.
torchao is imported only when fp8 is asked for; without it, one readable error."""

from __future__ import annotations

import logging

import torch

from mpexp.errors import ConfigError

log = logging.getLogger(__name__)

# fp8 matrix multiplication (torch._scaled_mm) needs fp8 tensor cores: compute capability 8.9
# (Ada) or newer (Hopper 9.0, Blackwell 10.0)
FP8_CAPABILITY = (8, 9)
FP8_INSTALL = 'pip install "torchao>=0.18,<0.19"  (or the fp8 extra: pip install -e ".[fp8]")'


def check_fp8(dtype: torch.dtype | None, device: torch.device) -> None:
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
    import_torchao()


def import_torchao():
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


def torchao_version() -> str:
    import torchao

    return torchao.__version__


_warned_fp8_emulated = False


def warn_fp8_emulated_once() -> None:
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
