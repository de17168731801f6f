"""Pure bf16's optimizer state dict loaded (mpexp/precision/pure_step.py): torch's layout, with
the states in the dtypes the run keeps them in and in shared buffers again, the steps counted
on the host, the generator and the open window's counts of lost updates."""

from __future__ import annotations

import torch

from mpexp.precision.pure_layout import zeroed_counts, zeroed_like
from mpexp.precision.pure_updates import COMPENSATION, COUNTS, GENERATOR, HOST_COUNTS, MADE, STEPS


def load(optimizer, load_torchs, state_dict: dict) -> None:
    """`state_dict` into `optimizer`, through torch's own `load_torchs`, which would cast every
    floating state to its parameter's dtype: then the states as this run keeps them."""
    state_dict = dict(state_dict)
    saved_generator = state_dict.pop(GENERATOR, None)
    saved_counts = state_dict.pop(COUNTS, None)
    steps_taken = state_dict.pop(STEPS, None)
    host_counts = state_dict.pop(HOST_COUNTS, None)
    made = state_dict.pop(MADE, None)
    load_torchs(state_dict)
    saved = state_dict["state"]
    if steps_taken is None:  # the hook-based update's checkpoint: Adam's count says it
        counts = [s["step"] for s in saved.values() if "step" in s]
        steps_taken = int(counts[0].item()) if counts else 0  # one read, at the resume
    optimizer.steps_taken = steps_taken
    if optimizer.lost is not None and saved_counts is not None:
        optimizer.lost.counts.copy_(saved_counts)
    for index, p in enumerate(optimizer.params):  # numbered from 0, group after group
        _restore(optimizer, optimizer.state[p], saved.get(index, {}), p)
    stepped = [i for i in range(len(optimizer.params)) if "step" in saved.get(i, {})]
    if stepped:  # the unfused formula's counts, on the host: one read, at the resume
        counts = torch.stack([saved[i]["step"].float().cpu() for i in stepped])
        for i, count in zip(stepped, counts.tolist(), strict=True):
            optimizer.host_counts[i] = int(count)
    if host_counts is not None:  # saved from mpexp's own (SGD's counts only so)
        optimizer.host_counts = [int(c) for c in host_counts]
    # which step made each parameter's states (a checkpoint without it: one step made them all)
    optimizer.made = (
        [int(m) for m in made]
        if made is not None
        else [1 if optimizer.state[p] else 0 for p in optimizer.params]
    )
    for group in optimizer.param_groups:
        _regroup(optimizer, group)
    optimizer.forget_layouts()
    if optimizer.generator is not None and saved_generator is not None:
        optimizer.generator.set_state(saved_generator)


def _restore(optimizer, state: dict, saved: dict, p: torch.Tensor) -> None:
    """One parameter's loaded states in the dtypes this run keeps them in."""
    for key, value in saved.items():
        if key == "step":
            state[key] = value.to(device=p.device, dtype=torch.float32)
        elif key == COMPENSATION:
            state[key] = value.to(device=p.device, dtype=p.dtype)
        elif key in optimizer.moments:
            state[key] = value.to(device=p.device, dtype=optimizer.states_dtype)
    if optimizer.rounding == "kahan" and state and COMPENSATION not in state:
        state[COMPENSATION] = torch.zeros_like(p)  # from a nearest or stochastic run


def _regroup(optimizer, group: dict) -> None:
    """A group's loaded states moved into shared buffers as `init_states` made them: those made
    on one step together (`optimizer.made`)."""
    index = {id(p): i for i, p in enumerate(optimizer.params)}
    made: dict[int, list] = {}
    for p in group["params"]:
        if optimizer.state[p]:
            made.setdefault(optimizer.made[index[id(p)]], []).append(p)
    for params in made.values():
        _share(optimizer, group, params)


def _share(optimizer, group: dict, params: list) -> None:
    """`params`' loaded states in shared buffers, one a kind of state, and their step counts
    side by side."""
    counted = [p for p in params if "step" in optimizer.state[p]]
    if counted:
        for p, count in zip(counted, zeroed_counts(len(counted), counted[0].device), strict=True):
            count.copy_(optimizer.state[p]["step"])
            optimizer.state[p]["step"] = count
    for key in (*optimizer.keys(group), COMPENSATION):
        having = [p for p in params if key in optimizer.state[p]]
        if not having:
            continue
        dtype = optimizer.state[having[0]][key].dtype
        for p, shared in zip(having, zeroed_like(having, dtype, optimizer.chunk), strict=True):
            shared.copy_(optimizer.state[p][key])
            optimizer.state[p][key] = shared
