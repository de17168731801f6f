"""Pure bf16's update as one compiled elementwise pass over a batch (`precision.update_compile`).

The eager step (mpexp/precision/pure_rounding.py) upcasts a batch into a float32 workspace, runs
torch's fused kernel over it and rounds the results back: a dozen passes over memory, each about
as long as torch's whole fused step on bf16 tensors, so that Kahan's and stochastic rounding's
steps, and every step that counts lost updates, cost two to six of torch's. Here the same float32
arithmetic, the rounding and the count are one function of the batch's flat tensors (its bf16
weights and gradients, its 16-bit or float32 states, Kahan's buffer), which torch.compile turns
into one loop that reads each element once and writes it once: Triton on a GPU. Sizes are
dynamic: one compilation serves every batch of a run. On a CPU mpexp steps with the same
arithmetic written in C (mpexp/precision/pure_native.c), which stores the same bits as
torch.compile's C++ of this function (tests compare them) but vectorises what that C++ does an
element at a time.

The coefficients that depend on the step (bias corrections, the learning rate) come in as one
small float32 tensor made once per group and step (`adam_coefficients`, `sgd_coefficients`), so
that a schedule's new learning rate is not a new compilation, and nothing is read on the host.

Stochastic rounding here draws its 16 random bits per value from a hash of the element's index
and keys drawn per call from the run's rounding generator (`draw_keys`): a four-round Feistel
network on the index's two 16-bit halves, each XORed with a key. A Feistel network is a
bijection whatever its round function, so for each element a fresh uniform pair of keys each step
makes both output halves uniform, independent of each other and from step to step, which is what
makes the rounding unbiased; one hash serves two values (the weight and the first state, and a
second hash with two more keys the second state). It is all 32-bit integer arithmetic that
cannot overflow (a 16-bit half times a multiplier below 2^15), which a CPU's vector units do at
the width of float32: the 64-bit hash before it cost a CPU's loop about a tenth more. It is a
stream of its own: a run rounds the same numbers, and resumes exactly, on this path only.
"""

from __future__ import annotations

import functools
import logging
import shutil
import types
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

# the Feistel network's round multipliers: odd, below 2^15, so that a 16-bit half times one
# fits an int32 (each product's high bits are folded back into its low 16)
ROUND_MULTIPLIERS = (0x5BD1, 0x6C8B, 0x4F1D, 0x7A3F)

# the elements below which a call's hash takes an int32 index (`_noise`)
INT32_INDEX_BELOW = 1 << 31


@dataclass(frozen=True)
class Variant:
    """What one compiled update does: `algorithm` adam or sgd; `rounding` nearest, kahan or
    stochastic; `count` "" (no count), "sums" (the batch's two counts, for a batch of one
    piece) or "masks" (the two masks, summed by piece afterwards); `decoupled` AdamW's decay;
    `momentum` and `nesterov` SGD's; `sixteen` whether the states are 16-bit (rounded as the
    weights are) or float32 (stored as computed)."""

    algorithm: str
    rounding: str
    count: str = ""
    decoupled: bool = False
    momentum: bool = False
    nesterov: bool = False
    decay: bool = True  # whether weight decay is nonzero (a 0 * inf weight would be NaN)
    # whether a loss scaler hands the step its scale and overflow flag (`scaling`): the
    # gradient divided by the scale, and a step with the flag set changes nothing
    scaled: bool = False
    sixteen: bool = True
    # how a float32 value rounded to bfloat16 is had back in float32 (Kahan's remainder, the
    # count's "changed"): "split" on a CPU, "cast" on a GPU (see `_nearest`)
    exact: str = "split"

    @property
    def states(self) -> int:
        if self.algorithm == "adam":
            return 2
        return int(self.momentum)


# --- the coefficients, once per group and step ---------------------------------------------


def adam_coefficients(step: torch.Tensor, group: dict, decoupled: bool) -> torch.Tensor:
    """Adam's per-step coefficients on the step count's device: 1 - beta1, beta2, 1 - beta2,
    the second moment's bias correction's root, eps, the step size (lr over the first moment's
    bias correction), and the decay (1 - lr * weight_decay for AdamW, weight_decay for Adam)."""
    beta1, beta2 = group["betas"]
    lr, wd = group["lr"], group["weight_decay"]
    # in float64, as torch's fused kernel computes them (float32's 1 - 0.9999^t is off by 1e-4)
    step = step.double()
    one = torch.ones_like(step)
    if isinstance(lr, torch.Tensor):
        lr = lr.double()
    correction1 = 1 - torch.pow(beta1, step)
    correction2_root = (1 - torch.pow(beta2, step)).sqrt()
    size = lr / correction1
    decay = 1 - lr * wd if decoupled else wd * one
    values = (one * (1 - beta1), one * beta2, one * (1 - beta2), correction2_root,
              one * group["eps"], size, decay * one)  # fmt: skip
    return torch.stack(values).float()


def sgd_coefficients(group: dict, device: torch.device, first: bool) -> torch.Tensor:
    """SGD's: lr, weight_decay, the momentum buffer's factor and the gradient's in it (on the
    first step 0 and 1: the buffer becomes the gradient, as torch's first step makes it), and
    the momentum (Nesterov's look-ahead)."""
    lr, momentum = group["lr"], group["momentum"]
    one = torch.ones((), device=device)
    damped = 1.0 if first else 1 - group["dampening"]
    kept = 0.0 if first else momentum
    return torch.stack((lr * one, one * group["weight_decay"], one * kept, one * damped,
                        one * momentum))  # fmt: skip


# --- the arithmetic --------------------------------------------------------------------------


def _adam(v: Variant, wf, gf, states, c):
    """torch's Adam in float32 on one element: the new weight and states."""
    m, s = (t.float() for t in states)
    if v.decay and not v.decoupled:
        gf = gf + c[6] * wf  # Adam's L2 decay joins the gradient
    m = torch.lerp(m, gf, c[0])
    s = s * c[1] + gf * gf * c[2]
    denom = s.sqrt() / c[3] + c[4]
    base = wf * c[6] if v.decay and v.decoupled else wf
    return base - c[5] * (m / denom), [m, s]


def _sgd(v: Variant, wf, gf, states, c):
    """torch's SGD in float32: the new weight and momentum buffer."""
    if v.decay:
        gf = gf + c[1] * wf
    if not v.momentum:
        return wf - c[0] * gf, []
    buffer = states[0].float() * c[2] + gf * c[3]
    update = gf + c[4] * buffer if v.nesterov else buffer
    return wf - c[0] * update, [buffer]


def draw_keys(generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """A call's four 16-bit keys (two a hash), from the run's rounding generator."""
    return torch.randint(0, 1 << 16, (4,), generator=generator, device=device, dtype=torch.int32)


def _noise(count: int, keys: torch.Tensor, device: torch.device):
    """Two independent 16-bit random values per element (int32): the Feistel network of the
    element's index, keyed by `keys`' two (see the module's docstring).

    The index is int32 where the call's elements fit (a tensor of fewer than 2^31, every call
    but one stepping a larger tensor whole): its halves are those of an int64 index, which on a
    CPU cost the compiled Adam step about a quarter of its time (int64 vectors converted one
    element at a time)."""
    if count < INT32_INDEX_BELOW:
        index = torch.arange(count, device=device, dtype=torch.int32)
        left = (index >> 16) ^ keys[0]
    else:  # (a branch on the size: a compilation of its own for such a call)
        index = torch.arange(count, device=device, dtype=torch.int64)
        left = ((index >> 16) & 0xFFFF).to(torch.int32) ^ keys[0]
    right = (index & 0xFFFF).to(torch.int32) ^ keys[1]
    for multiplier in ROUND_MULTIPLIERS:
        mixed = right * multiplier
        left, right = right, left ^ ((mixed ^ (mixed >> 15)) & 0xFFFF)
    return left, right


def _round_stochastic(x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """`x` (float32) to bfloat16 up or down at random, by distance (as
    mpexp/precision/pure_updates.py's `round_stochastic`: the 16 random bits `noise` added to
    the pattern, the low 16 dropped)."""
    bits = x.view(torch.int32) + noise
    return (bits & -65536).view(torch.float32).to(torch.bfloat16)


def _nearest(v: Variant, x: torch.Tensor) -> torch.Tensor:
    """`x` rounded to bfloat16's 8 significant bits, to nearest, kept in float32.

    inductor drops a cast to bfloat16 and back as a no-op unless told to keep every such cast
    (`emulate_precision_casts`), which on a CPU slows the whole loop by a fifth. There, the
    rounding is Veltkamp's split instead: three float32 operations that leave the top 8 bits of
    `x`, rounded to nearest (a tie, one value in 2^16, may go either way), exact as long as
    the compiler fuses no multiply-add, which inductor's C++ does not (-ffp-contract=off, its
    default: `split_is_exact`). On a GPU, where Triton may fuse them and the loop is bound by
    memory, the cast is kept."""
    if v.exact == "cast":
        return x.to(torch.bfloat16).float()
    # scaled by 2^-20 (exactly) so that the product cannot overflow below float32's largest
    # value; so exact from 2^-106 up (below, 1e-32, the scaled value is subnormal), and inf
    # comes out NaN (the callers store the cast where it matters: `_update`). A guard by
    # comparisons instead cost a fifth of the loop's time.
    scaled = x * 2.0**-20
    product = scaled * 65537.0  # 2^16 + 1: the split keeps 24 - 16 bits
    return (product - (product - scaled)) * 2.0**20


def _update(v: Variant, w, g, states, carried, coefficients, keys, masks, scaling):
    """One batch, in place: `w` and `g` flat bf16, `states` flat (16-bit or float32),
    `carried` Kahan's flat bf16 buffer (or None), `keys` stochastic rounding's four (or None),
    `scaling` the loss scaler's scale and overflow flag (or None),
    `masks` two flat bf16 buffers for the count by piece (or None; under `count="sums"`, one
    flat bf16 buffer that takes the new weights). Returns the count's (moved, changed) under
    `count="sums"`."""
    wf, gf = w.float(), g.float()
    skip = None
    if v.scaled:
        gf = gf / scaling[0]
        skip = scaling[1] != 0
    arithmetic = _adam if v.algorithm == "adam" else _sgd
    new, stepped = arithmetic(v, wf, gf, states, coefficients)
    if skip is not None:  # a skipped step: every result is what was there
        new = torch.where(skip, wf, new)
    noise = []  # the weight's random bits, then each 16-bit state's
    if v.rounding == "stochastic":
        noise = [*_noise(w.numel(), keys[:2], w.device)]
        if v.sixteen and v.states == 2:
            noise += _noise(w.numel(), keys[2:], w.device)[:1]
    for i, (state, value) in enumerate(zip(states, stepped, strict=True)):
        if v.sixteen and v.rounding == "stochastic":
            value = _round_stochastic(value, noise[1 + i])
        state.copy_(value if skip is None else torch.where(skip, state, value))
    if v.rounding == "kahan":
        # optimi's order, as the eager step's: the update wanted plus what earlier roundings
        # lost, added to the stored weight and rounded; what this rounding left out is kept
        wanted = (new - wf) + carried.float()
        kept = _nearest(v, wf + wanted)
        remainder = wanted + (wf - kept)
        if skip is not None:  # not even the buffer added, and the buffer kept
            kept = torch.where(skip, wf, kept)
            remainder = torch.where(skip, carried.float(), remainder)
        carried.copy_(remainder)
    elif v.rounding == "stochastic":
        kept = _round_stochastic(new, noise[0]).float()  # exact in bfloat16 already
    else:
        kept = _nearest(v, new) if v.count else new
    # round-to-nearest stores the cast (inf stays inf), the others what they computed
    rounded = (new if v.rounding == "nearest" else kept).to(torch.bfloat16)
    if not v.count:
        w.copy_(rounded)
        return None
    moved = new != wf
    changed = moved & (kept != wf) if v.rounding == "nearest" else kept != wf
    if v.count == "masks":
        w.copy_(rounded)
        # as 1.0 and 0.0 in bf16: inductor's C++ stores a boolean as a float32, or a bf16
        # straight from the comparison, an element at a time (the step over 160 small
        # tensors took 2.4 ns an element rather than 1.4)
        masks[0].copy_(torch.where(moved, 1.0, 0.0))
        masks[1].copy_(torch.where(changed, 1.0, 0.0))
        return None
    # the weight is written to `masks[0]` (a bf16 buffer) for the caller to copy: a loop that
    # both sums what it reads of `w` and writes `w` is split in two by inductor, the first
    # holding a float32 value per element for the second
    masks[0].copy_(rounded)
    return torch.stack((moved.sum(dtype=torch.int32), changed.sum(dtype=torch.int32)))


# --- compiled once per variant ---------------------------------------------------------------


@functools.cache
def compiled(variant: Variant):
    """The variant's update, compiled. Each variant gets a code object of its own, so that
    torch.compile keeps its compilations apart rather than counting them against one
    function's limit (past which it would run the function uncompiled)."""
    update = _bound(variant)
    name = f"pure_update_{variant.algorithm}_{variant.rounding}_{variant.count or 'nocount'}"
    code = update.__code__.replace(co_name=name)
    entry = types.FunctionType(code, update.__globals__, name, None, update.__closure__)
    # a cast to bfloat16 and back kept as a rounding (`_nearest`); only where asked, as the
    # options are patched into inductor's config on every call (about 7 µs)
    options = {"emulate_precision_casts": True} if variant.exact == "cast" else None
    return torch.compile(entry, dynamic=True, fullgraph=True, options=options)


def _bound(variant: Variant):
    def update(w, g, states, carried, coefficients, keys, masks, scaling):
        return _update(variant, w, g, states, carried, coefficients, keys, masks, scaling)

    return update


def split_is_exact() -> bool:
    """Whether inductor's C++ keeps multiplies and adds apart (`_nearest`'s split needs it)."""
    import torch._inductor.config as inductor_config

    return inductor_config.cpp.enable_floating_point_contract_flag == "off"


def can_compile(device: torch.device) -> str | None:
    """Why the update cannot be compiled on `device`, or None: inductor needs a C++ compiler on
    a CPU and Triton on a GPU, and (torch 2.6 on) a switch to keep the roundings it computes."""
    import torch._inductor.config as inductor_config

    if not hasattr(inductor_config, "emulate_precision_casts"):
        return (
            f"torch {torch.__version__} cannot keep a rounding to bfloat16 inside a compiled loop"
        )
    if device.type == "cpu":
        if not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
            return "no C++ compiler (g++, c++ or clang++) on the PATH"
        return None
    if device.type == "cuda":
        try:
            from torch.utils._triton import has_triton
        except ImportError:
            return "no Triton"
        return None if has_triton() else "no Triton"
    return f"torch.compile's update is not used on {device.type}"
