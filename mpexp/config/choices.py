"""The closed sets of strings that config keys take (`trainer.device=cpu`): Hydra refuses any
other value while composing."""

from __future__ import annotations

from enum import Enum


class Choice(str, Enum):
    """A closed set of strings. A str, so `cfg.trainer.device == "cpu"` holds, and it prints and
    serialises as its value."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class Device(Choice):
    auto = "auto"  # CUDA when present
    cuda = "cuda"
    cpu = "cpu"


class Strategy(Choice):
    single = "single"
    ddp = "ddp"
    fsdp = "fsdp"


class WandbMode(Choice):
    auto = "auto"  # online with an API key, else offline
    online = "online"
    offline = "offline"
    disabled = "disabled"


class Loader(Choice):
    device = "device"
    dataloader = "dataloader"


class AutocastDtype(Choice):
    float16 = "float16"
    bfloat16 = "bfloat16"


class Fp8Recipe(Choice):
    """torchao's float8 training recipes that mpexp offers (Float8LinearRecipeName)."""

    tensorwise = "tensorwise"  # one scale per tensor; e4m3 forward, e5m2 gradients; fastest
    rowwise = "rowwise"  # one scale per row, rounded down to a power of two; e4m3 throughout
    # rowwise, but the weight's gradient computed in high precision (bf16), not in fp8
    rowwise_with_gw_hp = "rowwise_with_gw_hp"


class WeightsDtype(Choice):
    float32 = "float32"  # fp32 weights (master weights, under autocast)
    bfloat16 = "bfloat16"  # pure bf16: weights, gradients and the forward pass in bf16


class UpdateRounding(Choice):
    """How a pure bf16 step's fp32 result is stored (mpexp/precision/pure_updates.py)."""

    nearest = "nearest"  # round to nearest: an update below half an ulp is lost
    kahan = "kahan"  # a bf16 compensation buffer per parameter carries what rounding lost
    stochastic = "stochastic"  # rounded up or down at random, the fp32 result in expectation


class StatesDtype(Choice):
    float32 = "float32"
    bfloat16 = "bfloat16"


class FrozenDtype(Choice):
    """What frozen Linear layers are held in (mpexp/finetune/frozen_dtype.py)."""

    autocast = "autocast"  # the dtype autocast casts them to at every use: the same numbers
    float32 = "float32"


# `raise` is a keyword, so these two are built by name
NonfiniteLoss = Choice("NonfiniteLoss", {"raise": "raise", "skip": "skip"})
FloorPolicy = Choice("FloorPolicy", {"raise": "raise", "continue": "continue"})
