"""What a rehearsed run holds on its device from step to step, by kind: each storage counted
once, under one kind, and named, so that the lists of the largest tensors say whose it is."""

from __future__ import annotations

import torch

from mpexp.plan.live_bytes import LiveBytes
from mpexp.precision.pure_updates import COMPENSATION

# the kinds of a row's `bytes`, each its own storages, which add up to what the row holds
# (docs/plan.md says what each is); `compensation` is a part of `optimizer`, given on its own
HELD = (
    "weights", "gradients", "optimizer", "buffers", "fp8_scales", "weight_average",
    "ddp_buckets", "fsdp_gathered", "data", "next_batch", "gpu_decoder",
)  # fmt: skip
# what FSDP shares among its ranks
SHARDED = ("weights", "gradients", "optimizer", "compensation", "weight_average")
# the data's kinds (TrainingData.device_bytes), as the lists of the largest tensors name them
DATA_NAMES = {
    "data": "the data set, held on the device (dataset.loader=device)",
    "next_batch": "the next batch, copied while the step runs",
    "gpu_decoder": "decoding the next batch's JPEGs (dataset.decode=gpu, an estimate)",
}


def held_bytes(
    tracker: LiveBytes,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    extras: dict[str, list[torch.Tensor]],
    fp8: tuple[str, ...] = (),
) -> dict[str, int]:
    """The bytes of each kind in HELD (and `compensation`). `extras` are the storages of the
    kinds the model and optimizer do not own (weight_average, ddp_buckets, the data's); `fp8`
    names the modules fp8 converted, whose buffers are its scales."""
    weights = list(model.parameters())
    names = {id(p): n for n, p in model.named_parameters()}
    extra = {id(t.untyped_storage()) for tensors in extras.values() for t in tensors}
    for n, p in model.named_parameters():
        tracker.name(p, f"weight {n}")
        if p.grad is not None and id(p.grad.untyped_storage()) not in extra:
            tracker.name(p.grad, f"gradient of {n}")
    # under DDP the gradients are views of its buckets: counted there
    grads = [p.grad for p in weights if p.grad is not None]
    grads = [g for g in grads if id(g.untyped_storage()) not in extra]
    states, compensation = [], []
    for p, state in optimizer.state.items():
        for key, value in state.items():
            if not isinstance(value, torch.Tensor) or value.ndim == 0:
                continue  # step counters
            tracker.name(value, f"{key} of {names.get(id(p), 'a parameter')}")
            (compensation if key == COMPENSATION else states).append(value)
    scales = [b for name in fp8 for b in model.get_submodule(name).buffers()]
    buffers = [b for b in model.buffers() if all(b is not s for s in scales)]
    out = nothing_held()
    out.update(
        weights=tracker.live_bytes(weights),
        gradients=tracker.live_bytes(grads),
        optimizer=tracker.live_bytes(states + compensation),
        compensation=tracker.live_bytes(compensation),
        # BatchNorm's statistics; fp8's amax histories where a recipe keeps them
        buffers=tracker.live_bytes(buffers),
        fp8_scales=tracker.live_bytes(scales),
        **{kind: tracker.live_bytes(tensors) for kind, tensors in extras.items()},
    )
    return out


def gib(value: int | None) -> str:
    """Bytes in GiB, or in MiB below one GiB (with the unit), as the plan prints them."""
    if value is None:
        return "-"
    return f"{value / 2**30:.2f} GiB" if value >= 2**30 else f"{value / 2**20:.1f} MiB"


def nothing_held() -> dict[str, int]:
    """A row's `bytes` before anything is followed: every kind at 0."""
    return {**dict.fromkeys(HELD, 0), "compensation": 0}


def held(b: dict[str, int]) -> int:
    """Bytes held from step to step, of a row's `bytes`."""
    return sum(b.get(kind, 0) for kind in HELD)


def model_bytes(b: dict[str, int]) -> int:
    """What the model's training holds of it (a row's `bytes` less the data's): what grows with
    its parameters."""
    return sum(b.get(kind, 0) for kind in HELD if kind not in DATA_NAMES)


def allocate_data(tracker: LiveBytes, kinds: dict[str, int]) -> dict[str, list[torch.Tensor]]:
    """Storages of the sizes the data keeps on the device (TrainingData.device_bytes), made
    while `tracker` follows them, so that the peaks and the largest tensors include them."""
    made = {}
    for kind, nbytes in kinds.items():
        tensor = torch.empty(nbytes, dtype=torch.uint8)
        tracker.name(tensor, DATA_NAMES.get(kind, kind))
        made[kind] = [tensor]
    return made
