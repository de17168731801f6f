"""The plan's rows: each combination of overrides composed as `mpexp-train` composes it,
rehearsed (mpexp/plan/rehearsal.py), and judged against the device's memory, with the keys that
would make a row that does not fit fit."""

from __future__ import annotations

import itertools
import math

import torch
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from mpexp import config
from mpexp.plan.rehearsal import Rehearsal, rehearse
from mpexp.resolvers import expand_home, register_resolvers

GiB = 2**30
# of the device's memory, what a planned peak may take and still fit: the rest is for the CUDA
# context, cuBLAS and cuDNN workspaces and the caching allocator's fragmentation, none of which
# torch.cuda.max_memory_allocated (what the plan is checked against) counts
USABLE = 0.9
# keys a preset sweeps that change nothing the plan measures
UNPLANNED_KEYS = ("trainer.seed",)


def combinations(overrides: list[str]) -> list[list[str]]:
    """One list of plain overrides per combination of the comma lists' values."""
    parsed = OverridesParser.create().parse_overrides(overrides)
    choices = []
    for text, override in zip(overrides, parsed, strict=True):
        if override.is_sweep_override():
            key = override.get_key_element()
            choices.append([f"{key}={value}" for value in override.sweep_string_iterator()])
        else:
            choices.append([text])
    return [list(combo) for combo in itertools.product(*choices)]


def plan_rows(
    overrides: list[str],
    device: str | None = None,
    device_memory: int | None = None,
    micro_batches: int | None = None,
    preset_sweeps: bool = True,
    processes: int = 1,
) -> list[dict]:
    """One row per combination of `overrides`' values (and of the values its preset sweeps,
    unless `preset_sweeps` is false)."""
    config.register()
    register_resolvers()
    rows = []
    with initialize_config_dir(config_dir=str(config.config_dir()), version_base="1.3"):
        for combo in combinations(expand_home(list(overrides))):
            for own in with_preset_sweeps(combo) if preset_sweeps else [combo]:
                full = compose(config_name="train", overrides=own, return_hydra_config=True)
                choices = full.hydra.runtime.choices
                cfg = compose(config_name="train", overrides=own)
                device_type = device or ("cpu" if cfg.trainer.device == "cpu" else "cuda")
                memory = device_memory or visible_memory(device_type)
                rehearsal = rehearse(cfg, device_type, micro_batches, processes)
                rows.append(row(own, choices.get("precision"), rehearsal, memory))
    return rows


def with_preset_sweeps(overrides: list[str]) -> list[list[str]]:
    """`overrides` once per combination of the values its preset sweeps (`hydra.sweeper.params`,
    as `-m` would run them), leaving out those the overrides set themselves and seeds."""
    full = compose(config_name="train", overrides=overrides, return_hydra_config=True)
    params = OmegaConf.select(full, "hydra.sweeper.params") or {}
    given = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    swept = [
        f"{key}={value}"
        for key, value in params.items()
        if key not in given and key not in UNPLANNED_KEYS and isinstance(value, str)
    ]
    if not swept:
        return [overrides]
    parsed = OverridesParser.create().parse_overrides(swept)
    # lists and ranges, as the basic sweeper runs them; a search's intervals (Optuna's learning
    # rates) change no byte
    listed = [
        text
        for text, p in zip(swept, parsed, strict=True)
        if p.is_choice_sweep() or p.is_range_sweep()
    ]
    return [overrides + combo for combo in combinations(listed)] if listed else [overrides]


def visible_memory(device_type: str) -> int | None:
    """The visible GPU's memory, where the plan is for one and there is one."""
    if device_type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory
    return None


def row(
    overrides: list[str],
    precision: str | None,
    rehearsal: Rehearsal,
    memory: int | None,
) -> dict:
    """A row of the plan, as printed and as `--json` writes it."""
    peaks = [p for p in rehearsal.peak_bytes.values() if p is not None]
    peak = max(peaks) if peaks else None
    fits = None if memory is None or peak is None else peak <= USABLE * memory
    return {
        "overrides": list(overrides),
        "precision": precision or rehearsal.precision,
        "device": rehearsal.device,
        "parameters": rehearsal.parameters,
        "trainable_parameters": rehearsal.trainable_parameters,
        "bytes": rehearsal.bytes,
        "bytes_per_parameter": round(held(rehearsal.bytes) / max(rehearsal.parameters, 1), 2),
        "peak_bytes": rehearsal.peak_bytes,
        "largest": rehearsal.largest,
        "flops_per_step": rehearsal.flops_per_step,
        "samples_per_step": rehearsal.samples_per_step,
        "tokens_per_step": rehearsal.tokens_per_step,
        "micro_batch": rehearsal.micro_batch,
        "processes": rehearsal.processes,
        "device_memory": memory,
        "fits": fits,
        "advice": advice(rehearsal, memory) if fits is False else [],
        "missing": rehearsal.missing,
        "host_reads_per_step": rehearsal.host_reads,
    }


def held(b: dict[str, int]) -> int:
    """Bytes held between steps, of a row's `bytes` (the compensation is among the optimizer's)."""
    return b["weights"] + b["gradients"] + b["optimizer"] + b["buffers"] + b["weight_average"]


def advice(rehearsal: Rehearsal, memory: int) -> list[str]:
    """The keys that would make a row fit, estimated from the row's own numbers: what a step
    holds beyond its weights, gradients and states grows with its micro-batch. Under torchrun
    (`processes`), each process runs its share: the keys keep the shares whole."""
    budget = USABLE * memory
    kept = held(rehearsal.bytes)
    if kept >= budget:
        per = kept / max(rehearsal.parameters, 1)
        out = [
            f"the weights, gradients and optimizer states alone hold {kept / GiB:.1f} GiB "
            f"({per:.0f} bytes a parameter): a smaller model"
        ]
        if per > 9:
            out.append("precision=bf16_pure (8 bytes a parameter under Adam)")
        return out
    n = rehearsal.processes
    share = rehearsal.samples_per_step // n  # one process's samples a step
    runs = share // rehearsal.micro_batch  # and its micro-batches
    peak = max(p for p in rehearsal.peak_bytes.values() if p is not None)
    shrink = (peak - kept) / (budget - kept)  # the micro-batch must be this many times less
    out = []
    steps = next((d for d in range(math.ceil(runs * shrink), share + 1) if share % d == 0), None)
    if steps is not None and steps > runs:
        out.append(
            f"trainer.accumulate={steps * n} (micro-batches of {share // steps}; about "
            f"{kept / GiB + (peak - kept) * runs / steps / GiB:.1f} GiB at the peak)"
        )
    smaller = int(share / shrink) // runs * runs * n
    if smaller >= runs * n:
        out.append(f"dataset.batch_size={smaller} (a smaller optimizer batch)")
    return out


def composition_error(err: BaseException) -> str | None:
    """The one message Hydra's composition gives (an unknown option, a bad override), as
    mpexp-train prints it; None for an error that is no such mistake."""
    if isinstance(err, HydraException | OmegaConfBaseException):
        return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return None
