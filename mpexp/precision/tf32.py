"""TF32's switches, through the one API this torch reads them by.

torch 2.9 switches TF32 per backend with `fp32_precision` ("ieee" or "tf32": cuBLAS's matrix
products, cuDNN's convolutions and recurrent layers; "none" follows the global
`torch.backends.fp32_precision`). It still takes the older flags (`allow_tf32`,
`set_float32_matmul_precision`), but once a process has set the newer API anywhere (user code, a
library), reading an older flag raises a RuntimeError about a mix of the two. So where the newer
API exists mpexp sets and reads it alone, and on older torch the older flags alone: never both.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

# whether this torch has the per-backend `fp32_precision` switches (torch 2.9 on)
PER_BACKEND = hasattr(torch.backends.cuda.matmul, "fp32_precision") and hasattr(
    torch.backends.cudnn, "conv"
)


def _backends() -> list:
    """The backends whose float32 precision a run switches: cuBLAS, cuDNN's convolutions and its
    recurrent layers (what `allow_tf32` switched)."""
    cudnn = torch.backends.cudnn
    return [torch.backends.cuda.matmul, cudnn.conv, cudnn.rnn]


def _precision(backend) -> str:
    """A backend's float32 precision, "none" resolved to the global one (and that to "ieee")."""
    own = backend.fp32_precision
    if own != "none":
        return own
    every = torch.backends.fp32_precision
    return every if every != "none" else "ieee"


def set_tf32(enabled: bool) -> None:
    """Switch TF32 for matrix products and cuDNN together; strict float32 elsewhere.

    PyTorch leaves cuDNN's TF32 on by default, so strict fp32 has to turn it off explicitly.
    """
    if PER_BACKEND:
        torch.backends.fp32_precision = "ieee"  # strict wherever a run does not switch
        for backend in _backends():
            backend.fp32_precision = "tf32" if enabled else "ieee"
        return
    torch.set_float32_matmul_precision("high" if enabled else "highest")
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled


def tf32_flags() -> dict:
    """The TF32 switches as PyTorch holds them now (`float32_matmul_precision` as torch names
    the matrix products' setting: "high" with TF32, "highest" without)."""
    if PER_BACKEND:
        matmul = _precision(torch.backends.cuda.matmul) == "tf32"
        return {
            "tf32_matmul": matmul,
            "tf32_cudnn": _precision(torch.backends.cudnn.conv) == "tf32",
            "float32_matmul_precision": "high" if matmul else "highest",
        }
    return {
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "tf32_cudnn": torch.backends.cudnn.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }


def switches() -> tuple:
    """Every switch `set_tf32` sets, as it is now: what `put_back` restores."""
    if PER_BACKEND:
        return (torch.backends.fp32_precision, *(b.fp32_precision for b in _backends()))
    return (
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.get_float32_matmul_precision(),
    )


def put_back(saved: tuple) -> None:
    """The switches as `switches()` gave them."""
    if PER_BACKEND:
        torch.backends.fp32_precision = saved[0]
        for backend, value in zip(_backends(), saved[1:], strict=True):
            backend.fp32_precision = value
        return
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[:2]
    torch.set_float32_matmul_precision(saved[2])


@contextlib.contextmanager
def exact_float32_matmul() -> Iterator[None]:
    """float32 matrix products without TF32 for the block; the run's setting put back after."""
    if PER_BACKEND:
        matmul = torch.backends.cuda.matmul
        kept, matmul.fp32_precision = matmul.fp32_precision, "ieee"
        try:
            yield
        finally:
            matmul.fp32_precision = kept
        return
    kept = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = kept
