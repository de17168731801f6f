"""The plan's rows: each combination of overrides composed as `mpexp-train` composes it,
rehearsed (mpexp/plan/rehearsal.py), and judged against the device's memory, with the keys that
would make a row that does not fit fit, each planned again to be sure."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from mpexp import config
from mpexp.plan.advice import fitting_advice
from mpexp.plan.devices import TYPICAL_MFU, step_seconds
from mpexp.plan.held import model_bytes
from mpexp.plan.rehearsal import Rehearsal, rehearse
from mpexp.resolvers import expand_home, register_resolvers

# of the device's memory, what a plan's need may take and still fit: the rest is for what the
# plan leaves out (MARGIN_LEAVES_OUT), none of which torch.cuda.max_memory_allocated counts
USABLE = 0.9
MARGIN_LEAVES_OUT = (
    "the CUDA context (0.3 to 1 GiB a process)",
    "the caching allocator's rounding and fragmentation",
    "cuBLAS and cuDNN workspaces",
    "NCCL's buffers under DDP or FSDP",
    "Inductor's autotuning (trainer.compile_mode=max-autotune)",
)
# keys a preset sweeps that change nothing the plan measures
UNPLANNED_KEYS = ("trainer.seed",)


@dataclass(frozen=True)
class Target:
    """What rows are planned for: the device type (None: cpu where trainer.device=cpu, else
    cuda), its memory and name where known (None: the visible GPU's), the processes that share
    the run (torchrun's), the micro-batches rehearsed of each step (None: all; two reach the
    peak), and the share of the device's peak a step's time is estimated at."""

    device: str | None = None
    memory: int | None = None
    name: str | None = None
    processes: int = 1
    micro_batches: int | None = 2
    mfu: float = TYPICAL_MFU


def combinations(overrides: list[str]) -> list[list[str]]:
    """One list of plain overrides per combination of the comma lists' values (a value listed
    twice, once)."""
    parsed = OverridesParser.create().parse_overrides(overrides)
    choices = []
    for text, override in zip(overrides, parsed, strict=True):
        if override.is_sweep_override():
            key = override.get_key_element()
            values = dict.fromkeys(override.sweep_string_iterator())
            choices.append([f"{key}={value}" for value in values])
        else:
            choices.append([text])
    return [list(combo) for combo in itertools.product(*choices)]


def plan_rows(
    overrides: list[str], target: Target | None = None, preset_sweeps: bool = True
) -> list[dict]:
    """One row per combination of `overrides`' values (and of the values its preset sweeps,
    unless `preset_sweeps` is false)."""
    target = target or Target()
    config.register()
    register_resolvers()
    rows = []
    with initialize_config_dir(config_dir=str(config.config_dir()), version_base="1.3"):
        for combo in combinations(expand_home(list(overrides))):
            full = compose(config_name="train", overrides=combo, return_hydra_config=True)
            for own in with_preset_sweeps(combo, full) if preset_sweeps else [combo]:
                if own != combo:
                    full = compose(config_name="train", overrides=own, return_hydra_config=True)
                choices = full.hydra.runtime.choices
                rows.append(plan_one(without_hydra(full), own, choices.get("precision"), target))
    return rows


def without_hydra(full: DictConfig) -> DictConfig:
    """The config as mpexp-train's run gets it, from one composed with Hydra's own node (one
    composition less: each takes a second)."""
    cfg = copy.deepcopy(full)
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg


def plan_one(cfg: DictConfig, overrides: list[str], precision: str | None, target: Target) -> dict:
    """The row of one composed config (left as it was), its advice planned again."""
    device_type = target.device or ("cpu" if cfg.trainer.device == "cpu" else "cuda")
    memory, name = target.memory, target.name
    if memory is None:
        memory, name = visible_device(device_type)
    again = replanner(cfg, device_type, target)
    rehearsal = again({})
    judged = row(overrides, precision, rehearsal, memory)
    if judged["fits"] is False:
        judged["advice"] = fitting_advice(rehearsal, USABLE * memory, again, need)
    seconds = step_seconds(
        judged["flops_per_step"], name, judged["precision"], rehearsal.processes, target.mfu
    )
    judged["device_name"] = name
    judged["seconds_per_step"] = seconds  # an estimate
    judged["mfu_assumed"] = target.mfu if seconds is not None else None
    return judged


def replanner(cfg: DictConfig, device_type: str, target: Target) -> Callable[[dict], Rehearsal]:
    """`cfg` rehearsed with some keys set otherwise ({"trainer.accumulate": 8}), each time on
    a copy of its own (a rehearsal rewrites the config it is given)."""

    def again(keys: dict) -> Rehearsal:
        own = copy.deepcopy(cfg)
        for key, value in keys.items():
            OmegaConf.update(own, key, value)
        return rehearse(own, device_type, target.micro_batches, target.processes)

    return again


def with_preset_sweeps(overrides: list[str], full: DictConfig) -> list[list[str]]:
    """`overrides` once per combination of the values its preset sweeps (`hydra.sweeper.params`
    of `full`, their composition, as `-m` would run them), leaving out those the overrides set
    themselves and seeds."""
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


def visible_device(device_type: str) -> tuple[int | None, str | None]:
    """The visible GPU's memory and name, where the plan is for one and there is one."""
    if device_type == "cuda" and torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(0)
        return properties.total_memory, properties.name
    return None, None


def need(rehearsal: Rehearsal) -> int | None:
    """What the device must hold for the run: the larger of its peaks; for a step captured as
    a CUDA graph, whose pool stays reserved while validation (and the diagnostics' pass) run
    eagerly beside it, the step's peak and what validation allocates on top of what it starts
    with. None where the peaks could not be followed."""
    step, validation = rehearsal.peak_bytes["train_step"], rehearsal.peak_bytes["validation"]
    if step is None or validation is None:
        return None
    if rehearsal.captured and rehearsal.validation_extra is not None:
        return step + rehearsal.validation_extra
    return max(step, validation)


def row(
    overrides: list[str],
    precision: str | None,
    rehearsal: Rehearsal,
    memory: int | None,
) -> dict:
    """A row of the plan, as printed and as `--json` writes it (its advice: `plan_one`'s)."""
    needed = need(rehearsal)
    fits = None if memory is None or needed is None else needed <= USABLE * memory
    planned = not rehearsal.missing
    return {
        "overrides": list(overrides),
        "precision": precision or rehearsal.precision,
        "device": rehearsal.device,
        "parameters": rehearsal.parameters,
        "trainable_parameters": rehearsal.trainable_parameters,
        "bytes": rehearsal.bytes,
        # where the step could not be followed, what it holds is not known either
        "bytes_per_parameter": round(model_bytes(rehearsal.bytes) / max(rehearsal.parameters, 1), 2)
        if planned
        else None,
        "peak_bytes": rehearsal.peak_bytes,
        "need_bytes": needed,
        "captured": rehearsal.captured,
        "strategy": rehearsal.strategy,
        "estimated": rehearsal.estimated,
        "largest": rehearsal.largest,
        "flops_per_step": rehearsal.flops_per_step,
        "samples_per_step": rehearsal.samples_per_step,
        "tokens_per_step": rehearsal.tokens_per_step,
        "micro_batch": rehearsal.micro_batch,
        "processes": rehearsal.processes,
        "device_memory": memory,
        "fits": fits,
        "advice": [],
        "missing": rehearsal.missing,
        "host_reads_per_step": rehearsal.host_reads,
        "optimizer_workspace": rehearsal.workspace,
    }


def composition_error(err: BaseException) -> str | None:
    """The message Hydra's composition gives (an unknown option, a mistyped key, a bad
    override), whole, as mpexp-train prints it (Hydra's run_and_report: the error, then the
    OmegaConf error behind it); None for an error that is no such mistake."""
    if not isinstance(err, HydraException | OmegaConfBaseException):
        return None
    said = [str(err).strip() or type(err).__name__]
    if isinstance(err.__cause__, OmegaConfBaseException):
        said.append(str(err.__cause__).rstrip())
    return "\n".join(said)
