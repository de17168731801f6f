"""Sharded tensors as FSDP2 leaves them (DTensor): this rank's part of one, the process group
they are sharded over, and whether torch combines an overflow flag across the shards itself.

Below both mpexp/distributed.py, which shards a model, and mpexp/precision/, whose scalers and
pure bf16 updates work on the shards, so that neither imports the other for it.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist


@functools.cache
def _dtensor_class() -> type | None:
    """DTensor, the type of FSDP2's sharded parameters and gradients (None without it)."""
    if not dist.is_available():
        return None
    try:
        from torch.distributed.tensor import DTensor  # public from torch 2.5
    except ImportError:
        try:
            from torch.distributed._tensor import DTensor
        except ImportError:
            return None
    return DTensor


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a sharded (DTensor) tensor; any other tensor as it is."""
    dtensor = _dtensor_class()
    if dtensor is not None and isinstance(tensor, dtensor):
        return tensor.to_local()
    return tensor


def shard_group(params: list[torch.Tensor]):
    """The process group over which `params` are sharded (FSDP2), or None if they are not."""
    dtensor = _dtensor_class()
    sharded = [p for p in params if dtensor is not None and isinstance(p, dtensor)]
    return sharded[0].device_mesh.get_group() if sharded else None


def all_reduce(values: torch.Tensor, op: str, group) -> torch.Tensor:
    """`values` combined over `group` with ReduceOp `op` ("SUM", "MAX"), in place and returned."""
    dist.all_reduce(values, op=getattr(dist.ReduceOp, op), group=group)
    return values


def dtensor_combines_overflow_flags() -> bool:
    """Whether torch's DTensor dispatch all-reduces the overflow flag itself when GradScaler
    unscales sharded gradients, which makes the scaler's own all-reduce redundant.

    Newer torch versions register a handler for the unscale op for this (torch 2.14 has it);
    older ones compute each rank's flag from its shard alone. Asked of torch at run time rather
    than inferred from a version number."""
    dtensor = _dtensor_class()
    handlers = getattr(getattr(dtensor, "_op_dispatcher", None), "_custom_op_handlers", {})
    return torch.ops.aten._amp_foreach_non_finite_check_and_unscale_.default in handlers
