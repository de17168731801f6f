"""The weights a checkpoint holds of a model with frozen parameters (`model.freeze`, LoRA's base):
those that train, and every buffer, but not the frozen weights, which never change. A run resumes
by building its model again from its config, frozen weights included (a pretrained directory
read again, or the initialisation repeated from `trainer.seed`), and loading the rest.

A LoRA run (r 16) of a Llama-3-8B-shaped model then checkpoints 13.6 million adapter weights and
their AdamW states, 164 MB, instead of the 17.2 GB its frozen weights hold besides.

What identifies the frozen weights instead is their fingerprint, taken once as the model is built
and kept in every checkpoint: per frozen tensor, its dtype, shape, and the sum of its elements'
bit patterns as integers (exact, and the same on every device and in any order). A resume, a
sample or an export that built other frozen weights is refused, naming the first that differs.
"""

from __future__ import annotations

import torch
from torch import nn

# integers of each element size, whose bit patterns a checksum sums
INTEGERS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
CHUNK = 2**24  # elements summed at once: a bounded temporary for a 500-million-element embedding


def frozen_names(model: nn.Module) -> set[str]:
    """The state-dict names of the parameters that do not train (every name of a shared one)."""
    named = model.named_parameters(remove_duplicate=False)
    return {name for name, p in named if not p.requires_grad}


def trained_state(model: nn.Module) -> dict:
    """The model's state dict without its frozen parameters."""
    frozen = frozen_names(model)
    return {k: v for k, v in model.state_dict().items() if k not in frozen}


def checksum(tensor: torch.Tensor) -> torch.Tensor:
    """The sum of `tensor`'s bit patterns as int64 (0-d, on its device; integers wrap alike)."""
    bits = tensor.detach().reshape(-1).view(INTEGERS[tensor.element_size()])
    total = torch.zeros((), dtype=torch.int64, device=tensor.device)
    for chunk in bits.split(CHUNK):
        total += chunk.sum(dtype=torch.int64)
    return total


def fingerprint(model: nn.Module) -> dict[str, list] | None:
    """Per frozen parameter, [dtype, shape, checksum]; None when nothing is frozen. One read
    from the device for all of them, at set-up."""
    frozen = [(n, p) for n, p in model.named_parameters() if not p.requires_grad]
    if not frozen:
        return None
    sums = torch.stack([checksum(p) for _, p in frozen]).tolist()
    return {
        name: [str(p.dtype).removeprefix("torch."), list(p.shape), total]
        for (name, p), total in zip(frozen, sums, strict=True)
    }


def first_difference(saved: dict | None, now: dict | None) -> str | None:
    """What differs between two fingerprints, in words; None when they are the same."""
    if saved == now:
        return None
    saved, now = saved or {}, now or {}
    for name in [*saved, *(n for n in now if n not in saved)]:
        if name not in now:
            return f"{name} is frozen in the checkpoint's run, not in this model"
        if name not in saved:
            return f"{name} is frozen in this model, not in the checkpoint's run"
        if saved[name] != now[name]:
            (dtype, shape, _), (dtype_now, shape_now, _) = saved[name], now[name]
            if (dtype, shape) != (dtype_now, shape_now):
                return f"{name} was {dtype} {shape}, is {dtype_now} {shape_now}"
            return f"{name} holds other values"
    return None


def load_trained(model: nn.Module, state: dict) -> None:
    """Load a checkpoint's weights into `model`: all of them, or (a checkpoint without its frozen
    weights) all but the frozen ones, which the model holds as built. Any other name missing or
    extra is refused as load_state_dict refuses it."""
    frozen = frozen_names(model)
    if not frozen or frozen & state.keys():  # a whole state dict (as before frozen weights)
        model.load_state_dict(state)
        return
    missing, unexpected = model.load_state_dict(state, strict=False)
    if set(missing) != frozen or unexpected:
        model.load_state_dict(state)  # raises, naming the names
