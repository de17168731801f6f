"""What a run shared among processes holds beyond one process's plain step: DDP's gradient
buckets, rehearsed, and FSDP's shards and gathered units, estimated from the unsharded rehearsal.
"""

from __future__ import annotations

import math

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from mpexp.plan.held import SHARDED


class Buckets:
    """DDP's buckets as the run has them (`gradient_as_bucket_view=True`, mpexp/distributed.py):
    one flat storage per gradient dtype, made as DDP wraps the model and kept for the whole
    run, every gradient a view of it. So the gradients are held through the forward pass and
    validation too, and are summed into in place."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        sizes: dict[torch.dtype, int] = {}
        for p in self.params:
            sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel()
        self.flat = {dtype: torch.zeros(n, dtype=dtype) for dtype, n in sizes.items()}
        self.point()

    def point(self) -> None:
        """Each gradient a view of its bucket, as DDP's hooks leave it after each backward: the
        optimizer's `zero_grad(set_to_none=True)` drops the views, not the buckets."""
        offsets = dict.fromkeys(self.flat, 0)
        for p in self.params:
            at = offsets[p.dtype]
            p.grad = torch.as_strided(self.flat[p.dtype], p.shape, p.stride(), at)
            offsets[p.dtype] = at + p.numel()

    def storages(self) -> list[torch.Tensor]:
        return list(self.flat.values())


def fsdp_share(
    held: dict[str, int],
    peaks: dict[str, int | None],
    model: torch.nn.Module,
    compute: torch.dtype,
    reduce: torch.dtype,
    processes: int,
) -> tuple[dict[str, int], dict[str, int | None]]:
    """One FSDP rank's bytes and peaks, estimated from the unsharded rehearsal's: the weights,
    gradients, optimizer states and average in shares of `processes`; beside them, while a
    step runs, the units gathered whole (mpexp/distributed.py's units: the root's own
    parameters for the whole pass, the largest unit and the next one it prefetches, in the
    `compute` dtype) and the largest unit's gradients before they are reduced (in `reduce`).
    What the eager rehearsal held of 16-bit weight copies for the backward pass stays counted:
    the estimate leans high."""
    shared = {k: math.ceil(v / processes) if k in SHARDED else v for k, v in held.items()}
    units = model.fsdp_units() if hasattr(model, "fsdp_units") else list(model.children())
    sizes = [
        sum(p.numel() for p in unit.parameters())
        for unit in units
        if not isinstance(unit, _BatchNorm)
    ]
    largest = max(sizes, default=0)
    root = sum(p.numel() for p in model.parameters()) - sum(sizes)
    size, reduced = compute.itemsize, reduce.itemsize
    gathered = (root + 2 * largest) * size
    shared["fsdp_gathered"] = gathered + largest * (size + reduced)
    saved = sum(held[k] - shared[k] for k in SHARDED if k in held)
    out = {
        phase: None if peak is None else peak - saved + shared["fsdp_gathered"]
        for phase, peak in peaks.items()
    }
    if out.get("validation") is not None:  # no gradients in validation
        out["validation"] -= largest * (size + reduced)
    return shared, out
