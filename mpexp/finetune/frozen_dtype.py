"""`model.frozen_dtype=autocast`: frozen layers held in the run's autocast dtype.

Autocast casts a Linear or convolution layer's weight and bias to its dtype at every use (the
training step's autocast keeps no cast between uses: `Precision.autocast(cache=False)`), so a
frozen layer held in that dtype computes exactly what its float32 copy would, in half the
bytes and without the casts. What LoRA's "float32 adapters over a bf16 base" needs.

Only layers for which that holds are held so: a Linear, a convolution or transformers' Conv1D
(addmm, which autocast casts alike) whose parameters are all frozen and used by no other
module (a tied embedding is no Linear's alone), outside precision.fp32_modules (which run
outside autocast), and not converted to fp8 (torchao scales and casts its weight from its own
dtype). Under FSDP the shards stay float32: FSDP2 gathers them in the autocast dtype itself,
and before torch 2.7 it refuses parameters of mixed dtypes in one unit.
"""

from __future__ import annotations

import torch
from torch import nn

CASTS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def autocast_casts(module: nn.Module) -> bool:
    """Whether autocast casts this layer's parameters at every use (see the module's doc)."""
    kind = type(module)
    transformers_conv1d = kind.__name__ == "Conv1D" and kind.__module__.startswith("transformers")
    return kind in CASTS or transformers_conv1d


def hold_frozen(
    model: nn.Module, autocast: torch.dtype | None, fp32_modules: list[str], setting: str
) -> str | None:
    """Cast the frozen layers that autocast casts anyway to `autocast` (see the module's doc),
    with `setting` (model.frozen_dtype) autocast; the dtype the frozen layers are held in,
    as the run records it (None: nothing is frozen)."""
    frozen = [p for p in model.parameters() if not p.requires_grad]
    if not frozen:
        return None
    if autocast is None or setting != "autocast":
        return str(frozen[0].dtype).removeprefix("torch.")
    owners: dict[int, int] = {}
    for module in model.modules():
        for parameter in module._parameters.values():
            if parameter is not None:
                owners[id(parameter)] = owners.get(id(parameter), 0) + 1
    for name, module in model.named_modules():
        own = [p for p in module._parameters.values() if p is not None]
        if (
            own
            and autocast_casts(module)
            and not any(p.requires_grad or owners[id(p)] > 1 for p in own)
            and not any(name == keep or name.startswith(f"{keep}.") for keep in fp32_modules)
        ):
            for key, parameter in module._parameters.items():
                if parameter is not None:
                    module._parameters[key] = nn.Parameter(
                        parameter.detach().to(autocast), requires_grad=False
                    )
    return held_in(model)


def held_in(model: nn.Module) -> str:
    """The dtypes of the frozen parameters, by bytes held: `bfloat16`, or
    `bfloat16 (92%), float32` where some stay float32 (norms, embeddings)."""
    held: dict[str, int] = {}
    for p in model.parameters():
        if not p.requires_grad:
            name = str(p.dtype).removeprefix("torch.")
            held[name] = held.get(name, 0) + p.numel() * p.element_size()
    total = sum(held.values())
    ranked = sorted(held, key=held.get, reverse=True)
    if len(ranked) == 1:
        return ranked[0]
    return f"{ranked[0]} ({held[ranked[0]] / total:.0%} of their bytes), " + ", ".join(ranked[1:])
