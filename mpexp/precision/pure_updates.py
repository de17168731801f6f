"""Pure bf16 training: weights, gradients (and, if asked, optimizer states) held in bfloat16, and
how each optimizer step's fp32 result is rounded back into them.

bfloat16 keeps 8 significant bits: an update smaller than half a unit in the last place of its
weight (|update| < 2^-9 |w|) leaves the weight unchanged under round-to-nearest. Pure bf16's
optimizers (mpexp/precision/pure_optimizers.py) compute each step in float32, a chunk at a time,
and store its result with the run's `precision.update_rounding`:

- `nearest`: plain round-to-nearest, what `bf16-true` training does;
- `kahan`: a bfloat16 compensation buffer per parameter keeps what the rounding lost and adds it
  to the next update (Kahan summation);
- `stochastic`: rounded up or down at random, with probability by distance, so that the stored
  weight is the fp32 result in expectation; its generator is seeded from the run's seed and
  kept in the optimizer's state dict, so a resume draws what the killed run would have drawn.

The same step counts, on the device, how many elements had a nonzero update and how many of
those left the stored weight unchanged: `opt/updates_lost`, read back at each metrics flush
(`UpdatesLost`). Here: the rounding, the count, the model held in bf16, the bytes a run holds,
and the count alone for runs with float32 weights (`CountUpdates`).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from mpexp.shards import local_shard

# the generators a captured step draws from besides the device's default one: a CUDA graph
# registers them, so that each replay draws new numbers (mpexp/step/step_graph.py)
GRAPH_GENERATORS: weakref.WeakSet[torch.Generator] = weakref.WeakSet()

COMPENSATION = "kahan_compensation"  # the optimizer state key of a parameter's Kahan buffer
GENERATOR = "update_rounding_generator"  # the optimizer state dict key of the generator's state
COUNTS = "updates_lost_counts"  # and of the lost-update counts since the last flush
STEPS = "pure_steps_taken"  # and of the steps the optimizer has taken (which of them count)
# and of each parameter's count of steps on the host (SGD keeps no "step" state to say it), and
# of which of its steps made its states: the states made on one step share buffers, and a
# resumed run lays them out so again (`pure_state._regroup`), so that each batch takes the
# path (compiled or eager, each with its own stream of stochastic rounding) it took before
HOST_COUNTS = "pure_host_counts"
MADE = "pure_states_made"


def hold_in_bf16(model: nn.Module, output_to_float32: bool = True) -> nn.Module:
    """Cast the model's parameters and buffers to bfloat16, and make it take and give float32:
    floating inputs are cast to bfloat16 on the way in, the output to float32 on the way out, so
    that the loss (and validation's sums) are computed in float32; without `output_to_float32`,
    the output stays bfloat16, for a task whose loss upcasts it itself
    (`Task.takes_16_bit_output`)."""
    tensors = [*model.parameters(), *model.buffers()]
    # mpexp-plan's fake weights are made bfloat16 (Module.to cannot convert fake tensors)
    if any(t.is_floating_point() and t.dtype != torch.bfloat16 for t in tensors):
        model.to(torch.bfloat16)
    model.register_forward_pre_hook(_inputs_to_bf16)
    if output_to_float32:
        model.register_forward_hook(_output_to_float32)
    return model


def _inputs_to_bf16(_module, args):
    return tuple(a.to(torch.bfloat16) if _is_float(a) else a for a in args)


def _output_to_float32(_module, _args, output):
    return output.float() if _is_float(output) else output


def _is_float(value) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def round_stochastic(
    x: torch.Tensor,
    generator: torch.Generator,
    out: torch.Tensor | None = None,
    scratch: StochasticScratch | None = None,
) -> torch.Tensor:
    """`x` (float32) rounded to bfloat16 at random: up with probability equal to its distance
    from the value below, so that the result is `x` in expectation. bfloat16 is float32's top 16
    bits: a random integer below 2^16 added to the bit pattern carries into them exactly that
    often, and the low 16 bits are then dropped (a truncation, which the cast leaves exact).
    Written into `out` if given, with `scratch`'s integers (a chunked update reuses both)."""
    count = x.numel()
    scratch = scratch or StochasticScratch(count, x.device)
    bits = scratch.noise(count, generator)
    bits.add_(x.contiguous().view(torch.int32).view(-1))
    bits.bitwise_and_(-65536)  # 0xFFFF0000: the top 16 bits
    result = bits.view(torch.float32).view(x.shape)
    if out is None:
        return result.to(torch.bfloat16)
    return out.copy_(result)


class StochasticScratch:
    """The integers stochastic rounding draws and adds, for up to `size` elements."""

    def __init__(self, size: int, device: torch.device) -> None:
        self.words = torch.empty((size + 3) // 4, dtype=torch.int64, device=device)
        self.bits = torch.empty(size, dtype=torch.int32, device=device)

    @classmethod
    def over(cls, words: torch.Tensor, bits: torch.Tensor) -> StochasticScratch:
        """Scratch in buffers that are already there (a step's workspace)."""
        scratch = cls.__new__(cls)
        scratch.words, scratch.bits = words, bits
        return scratch

    def noise(self, count: int, generator: torch.Generator) -> torch.Tensor:
        """`count` integers drawn uniformly from [0, 2^16), as int32: each 64-bit draw gives
        four (a CPU's generator makes 32 bits at a time, so this draws an eighth of what one
        call of `randint` per element would)."""
        words = self.words[: (count + 3) // 4]
        words.random_(-(2**63), None, generator=generator)  # every 64-bit pattern alike
        bits = self.bits[:count]
        bits.copy_(words.view(torch.int16)[:count])  # sign-extended: the low 16 bits kept
        return bits.bitwise_and_(0xFFFF)


class UpdatesLost:
    """Per parameter, on the device: elements with a nonzero update, and those of them whose
    stored weight the step left unchanged, summed over the steps since the last `take`."""

    def __init__(self, count: int, device: torch.device) -> None:
        self.counts = torch.zeros((count, 2), dtype=torch.int64, device=device)

    def add(self, index: int, moved: torch.Tensor, changed: torch.Tensor) -> None:
        """`moved`: how many elements' fp32 result differs from the stored weight before the
        step; `changed`: how many stored weights differ now (a count of nonzero differences:
        a CPU counts a float tensor's nonzeros several times faster than a boolean's trues).
        A changed weight had a nonzero update: the lost ones are the moved less the changed."""
        self.counts[index] += torch.stack((moved - changed, moved))

    def add_pieces(self, owners: torch.Tensor, moved: torch.Tensor, changed: torch.Tensor) -> None:
        """The same for a batch's pieces at once: `owners` their parameters' indices, `moved`
        and `changed` their counts (as floats: sums of masks)."""
        pairs = torch.stack((moved - changed, moved), 1).to(torch.int64)
        self.counts.index_add_(0, owners, pairs)

    def take(self) -> torch.Tensor:
        """The counts so far (lost, nonzero per parameter), and zeros from here on."""
        taken = self.counts.clone()
        self.counts.zero_()
        return taken


class CountUpdates:
    """The count alone, for a run with float32 weights that asks for it
    (`diagnostics.updates_lost=true`): the optimizer's own step stores its result as computed,
    so nothing is lost, and the count says how many elements moved. A copy of the weights is
    kept across each step to tell."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.lost = UpdatesLost(len(self.params), self.params[0].device)
        self._old: list[torch.Tensor] = []
        optimizer.register_step_pre_hook(self._before)
        optimizer.register_step_post_hook(self._after)
        optimizer.pure_updates = self  # how the diagnostics find the counts

    def _before(self, *_) -> None:
        self._old = [local_shard(p.detach()).clone() for p in self.params]

    def _after(self, *_) -> None:
        for index, (p, old) in enumerate(zip(self.params, self._old, strict=True)):
            moved = torch.count_nonzero(local_shard(p.detach()) - old)
            self.lost.add(index, moved, moved)  # float32 stores what it computes
        self._old = []


def stored_bytes(optimizer: torch.optim.Optimizer, model: nn.Module) -> dict:
    """Bytes of the weights, their gradients and the optimizer's states (step counters left out)
    as they are stored between steps, over the whole model (all shards); gradients at the
    trained weights' dtype and size, as the backward pass makes them."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    # frozen weights (model.freeze, LoRA's base) have none
    grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    states = sum(
        v.numel() * v.element_size()
        for state in optimizer.state.values()
        for key, v in state.items()
        if _is_float(v) and v.ndim > 0
    )
    held = {"bytes_weights": weights, "bytes_grads": grads, "bytes_states": states}
    return {**held, "bytes_step_peak": _step_peak(optimizer, sum(held.values()))}


def _step_peak(optimizer: torch.optim.Optimizer, held: int) -> int | None:
    """The most the optimizer's step holds at once: what is held between steps and the step's
    own temporaries, where they are known: pure bf16's chunks (a bound), none for torch's fused
    kernels; None for torch's other implementations, whose temporaries depend on which runs."""
    temporaries = getattr(optimizer, "step_temporary_bytes", None)
    if temporaries is not None:
        return held + temporaries()
    return held if optimizer.defaults.get("fused") else None
