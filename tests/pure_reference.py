"""Pure bf16's update as mpexp computed it before its own optimizers (mpexp/precision/
pure_optimizers.py): torch's optimizer stepping float32 copies of every weight, gradient and state
in hooks around its step, its result rounded back into the weights afterwards. The tests hold the
fused update to it: bit for bit under round-to-nearest, to an ulp under Kahan, in distribution
under stochastic rounding. It is kept here, as the reference, and nowhere else."""

from __future__ import annotations

import torch

from mpexp.precision.pure_updates import COMPENSATION, GENERATOR, UpdatesLost, round_stochastic
from mpexp.shards import local_shard


def _is_float(value) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()


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
            moved = torch.count_nonzero(result - old.float())
            self.lost.add(self._index[id(p)], moved, torch.count_nonzero(new - old))
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
