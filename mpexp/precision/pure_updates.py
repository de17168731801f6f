"""Pure bf16 training: weights, gradients (and, if asked, optimizer states) held in bfloat16, and
how each optimizer step's fp32 result is rounded back into them.

bfloat16 keeps 8 significant bits: an update smaller than half a unit in the last place of its
weight (|update| < 2^-9 |w|) leaves the weight unchanged under round-to-nearest. `PureUpdates`
runs the optimizer's own step (fused or not, any of Adam, AdamW, SGD) in float32 on upcast copies
of the weights, gradients and states, then stores its result with the run's
`precision.update_rounding`:

- `nearest`: plain round-to-nearest, what `bf16-true` training does;
- `kahan`: a bfloat16 compensation buffer per parameter keeps what the rounding lost and adds it
  to the next update (Kahan summation);
- `stochastic`: rounded up or down at random, with probability by distance, so that the stored
  weight is the fp32 result in expectation; its generator is seeded from the run's seed and
  kept in the optimizer's state dict, so a resume draws what the killed run would have drawn.

The same step counts, on the device, how many elements had a nonzero update and how many of
those left the stored weight unchanged: `opt/updates_lost`, read back at each metrics flush
(`UpdatesLost`). Everything is done in optimizer hooks, so schedules, loss scalers, gradient
clipping and checkpoints see the optimizer as it is.
"""

from __future__ import annotations

import torch
from torch import nn

from mpexp.distributed import local_shard

COMPENSATION = "kahan_compensation"  # the optimizer state key of a parameter's Kahan buffer
GENERATOR = "update_rounding_generator"  # the optimizer state dict key of the generator's state


def hold_in_bf16(model: nn.Module) -> nn.Module:
    """Cast the model's parameters and buffers to bfloat16, and make it take and give float32:
    floating inputs are cast to bfloat16 on the way in, the output to float32 on the way out, so
    that the loss (and validation's sums) are computed in float32."""
    tensors = [*model.parameters(), *model.buffers()]
    # mpexp-plan's fake weights are made bfloat16 (Module.to cannot convert fake tensors)
    if any(t.is_floating_point() and t.dtype != torch.bfloat16 for t in tensors):
        model.to(torch.bfloat16)
    model.register_forward_pre_hook(_inputs_to_bf16)
    model.register_forward_hook(_output_to_float32)
    return model


def _inputs_to_bf16(_module, args):
    return tuple(a.to(torch.bfloat16) if _is_float(a) else a for a in args)


def _output_to_float32(_module, _args, output):
    return output.float() if _is_float(output) else output


def _is_float(value) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def round_stochastic(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """`x` (float32) rounded to bfloat16 at random: up with probability equal to its distance
    from the value below, so that the result is `x` in expectation. bfloat16 is float32's top 16
    bits: a random integer below 2^16 added to the bit pattern carries into them exactly that
    often, and the low 16 bits are then dropped (a truncation, which the cast leaves exact)."""
    noise = torch.randint(
        0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=generator
    )
    bits = (x.contiguous().view(torch.int32) + noise) & -65536  # 0xFFFF0000: the top 16 bits
    return bits.view(torch.float32).to(torch.bfloat16)


class UpdatesLost:
    """Per parameter, on the device: elements with a nonzero update, and those of them whose
    stored weight the step left unchanged, summed over the steps since the last `take`."""

    def __init__(self, count: int, device: torch.device) -> None:
        self.counts = torch.zeros((count, 2), dtype=torch.int64, device=device)

    def add(self, index: int, old: torch.Tensor, result: torch.Tensor, new: torch.Tensor) -> None:
        """`old`: the stored weight before the step; `result`: the optimizer's fp32 result;
        `new`: what is stored now."""
        moved = result != old.float()
        lost = moved & (new == old)
        self.counts[index] += torch.stack((lost.sum(), moved.sum()))

    def take(self) -> torch.Tensor:
        """The counts so far (lost, nonzero per parameter), and zeros from here on."""
        taken = self.counts.clone()
        self.counts.zero_()
        return taken


class PureUpdates:
    """The hooks around an optimizer's step that compute it in float32 and round its result into
    the parameters' dtype (see the module's docstring).

    `rounding` None leaves the stored dtype's own rounding (round-to-nearest, or none in float32)
    and only counts: what `diagnostics.updates_lost=true` asks of a run in another mode.
    `states` is the dtype the optimizer's states are kept in between steps (None: as the
    optimizer makes them)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        rounding: str | None,
        states: torch.dtype | None,
        seed: int,
        device: torch.device,
    ) -> None:
        self.optimizer = optimizer
        self.rounding = rounding
        self.states = states
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.lost = UpdatesLost(len(self.params), device)
        self.generator = None
        if rounding == "stochastic":
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(seed)
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._proxies: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        optimizer.register_step_pre_hook(self._before)
        optimizer.register_step_post_hook(self._after)
        optimizer.register_state_dict_post_hook(self._save)
        optimizer.register_load_state_dict_pre_hook(self._load)
        optimizer.register_load_state_dict_post_hook(self._loaded)
        optimizer.pure_updates = self  # how the diagnostics find the counts

    def _before(self, optimizer, args, kwargs) -> None:
        """The optimizer's groups pointed at float32 copies of the weights, with float32 copies
        of their gradients and states, for its own step. The parameters themselves are left
        alone: DDP's reducer and FSDP know them by their tensors, which must not change."""
        self._proxies = []
        state = optimizer.state
        for group in optimizer.param_groups:
            proxies = []
            for p in group["params"]:
                # the copy is the weight itself when that is float32: the count keeps the old one
                proxy = p.detach().float()
                old = proxy.clone() if p.dtype == torch.float32 else p.detach()
                proxy.requires_grad_(True)
                if p.grad is not None:
                    proxy.grad = p.grad.float()
                self._cast_states(p, torch.float32)
                if p in state:
                    state[proxy] = state.pop(p)
                proxies.append(proxy)
                self._proxies.append((p, proxy, old))
            group["params"] = proxies

    def _after(self, optimizer, args, kwargs) -> None:
        """The fp32 result rounded into the stored weight, in place; the states back to their
        parameters, in their dtype."""
        state = optimizer.state
        held = iter(self._proxies)
        for group in optimizer.param_groups:
            group["params"] = [next(held)[0] for _ in group["params"]]
        for p, proxy, old in self._proxies:
            if proxy in state:
                state[p] = state.pop(proxy)
            # each rank rounds its own shard of an FSDP-sharded weight
            old, result = local_shard(old), local_shard(proxy.detach())
            new = self._round(p, old, result)
            self.lost.add(self._index[id(p)], old, result, new)
            weight = local_shard(p.detach())
            if new.data_ptr() != weight.data_ptr():
                weight.copy_(new)
            self._cast_states(p, self.states)
        self._proxies = []

    def _round(self, p: torch.Tensor, old: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
        if self.rounding == "stochastic":
            return round_stochastic(result, self.generator)
        if self.rounding == "kahan":
            state = self.optimizer.state[p]
            if COMPENSATION not in state:
                state[COMPENSATION] = torch.zeros_like(p.detach())
            compensation = local_shard(state[COMPENSATION])
            # the update wanted plus what earlier roundings lost, added to the stored weight;
            # what this rounding loses in turn is kept for the next step
            wanted = result - old.float() + compensation.float()
            new = (old.float() + wanted).to(old.dtype)
            compensation.copy_(wanted - (new.float() - old.float()))
            return new
        return result.to(old.dtype)

    def _cast_states(self, p: torch.Tensor, dtype: torch.dtype | None) -> None:
        if dtype is None:
            return
        state = self.optimizer.state.get(p, {})
        for key, value in state.items():
            stored = key != COMPENSATION and _is_float(value) and value.shape == p.shape
            if stored and value.dtype != dtype:
                state[key] = value.to(dtype)

    def _save(self, optimizer, state_dict: dict) -> dict:
        if self.generator is not None:
            state_dict[GENERATOR] = self.generator.get_state()
        return state_dict

    def _load(self, optimizer, state_dict: dict) -> dict:
        """Before torch loads the states: the generator taken out, and the states kept as saved,
        for torch casts each floating state to its parameter's dtype and would round float32
        states to bfloat16."""
        state_dict = dict(state_dict)
        saved = state_dict.pop(GENERATOR, None)
        if self.generator is not None and saved is not None:
            self.generator.set_state(saved)
        self._saved = state_dict["state"]
        return state_dict

    def _loaded(self, optimizer) -> None:
        # a state dict numbers the parameters from 0, group after group
        params = (p for group in optimizer.param_groups for p in group["params"])
        for index, p in enumerate(params):
            for key, value in self._saved.get(index, {}).items():
                if _is_float(value) and value.shape == p.shape:
                    optimizer.state[p][key] = value.to(p.device)
        self._saved = {}


def stored_bytes(optimizer: torch.optim.Optimizer, model: nn.Module) -> dict:
    """Bytes of the weights, their gradients and the optimizer's states (step counters left out)
    as they are stored between steps, over the whole model (all shards); gradients at the
    weights' dtype and size, as the backward pass makes them."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    states = sum(
        v.numel() * v.element_size()
        for state in optimizer.state.values()
        for key, v in state.items()
        if _is_float(v) and v.ndim > 0
    )
    return {"bytes_weights": weights, "bytes_grads": weights, "bytes_states": states}


def watch(optimizer: torch.optim.Optimizer, cfg, device: torch.device) -> PureUpdates | None:
    """The update hooks a run's config asks for: precision=bf16_pure's rounding, or the counting
    alone where `diagnostics.updates_lost=true` asks for it in another mode; None where neither
    is (the default outside bf16_pure: no pass over the weights)."""
    p = cfg.precision
    pure = p.get("weights") == "bfloat16"
    count = cfg.diagnostics.get("updates_lost")
    if not (pure if count is None else count):
        return None
    if not pure:
        return PureUpdates(optimizer, None, None, cfg.trainer.seed, device)
    states = torch.float32 if p.optimizer_states == "float32" else torch.bfloat16
    # the same seed on every rank: DDP's replicas must round alike to stay equal
    return PureUpdates(optimizer, str(p.update_rounding), states, cfg.trainer.seed, device)
