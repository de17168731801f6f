"""A run's own plan, made before its first step (`trainer.plan`, on by default on a GPU): a run
that cannot fit the device is refused before it starts, with the plan's numbers and the keys to
change, and the run records the planned peak beside the one it measures."""

from __future__ import annotations

import copy
import logging
import os

import torch
from omegaconf import DictConfig

from mpexp.errors import ConfigError, reason
from mpexp.plan.rehearsal import rehearse
from mpexp.plan.rows import held, row

GiB = 2**30
log = logging.getLogger("mpexp")


def plan_run(cfg: DictConfig, device: torch.device, processes: int = 1) -> dict | None:
    """The run's plan as `ran.plan` records it, or None where the run is not planned; raises
    ConfigError where it cannot fit. Made before the run sets its precision up: the rehearsal
    sets the CPU's (TF32 off) for itself. Under torchrun it plans one of the `processes`."""
    asked = cfg.trainer.plan
    if not (device.type == "cuda" if asked is None else asked):
        return None
    if cfg.trainer.strategy == "fsdp":  # sharded states are not rehearsed: no plan to hold to
        return None
    memory = device_memory(device)
    own = copy.deepcopy(cfg)  # the rehearsal rewrites former targets and builds its own parts
    try:
        # two micro-batches reach the step's peak (mpexp/plan/rehearsal.py): seconds, not minutes
        rehearsal = rehearse(own, device.type, micro_batches=2, processes=processes)
    except Exception as err:  # a plan is advice: a model the rehearsal cannot run still trains,
        # and one that is broken fails its own trial next, building the run's parts
        log.warning(
            "No plan for this run: rehearsing it on fake tensors failed (%s: %s). It trains "
            "unplanned; trainer.plan=false skips the rehearsal.",
            type(err).__name__,
            reason(err),
        )
        return None
    planned = row([], None, rehearsal, memory)
    if planned["missing"]:  # the rehearsal could not follow the step: nothing to hold it to
        log.warning(
            "No plan for this run's peaks: %s. It trains unplanned.",
            next(iter(planned["missing"].values())),
        )
        return None
    if planned["fits"] is False:
        peaks = planned["peak_bytes"]
        where = "the GPU's" if device.type == "cuda" else "this machine's"
        raise ConfigError(
            f"This run does not fit {where} {memory / GiB:.1f} GiB: its plan peaks at "
            f"{(peaks['train_step'] or 0) / GiB:.1f} GiB in the training step and "
            f"{(peaks['validation'] or 0) / GiB:.1f} GiB in validation, of which the weights, "
            f"gradients and optimizer states hold {held(planned['bytes']) / GiB:.1f} GiB.\n"
            f"Any one of these would fit: {'; '.join(planned['advice'])}.\n"
            "mpexp-plan with the same overrides shows the whole plan; trainer.plan=false starts "
            "the run without it."
        )
    return {
        "peak_bytes": planned["peak_bytes"],
        "bytes": planned["bytes"],
        "flops_per_step": planned["flops_per_step"],
        "host_reads_per_step": planned["host_reads_per_step"],
    }


def device_memory(device: torch.device) -> int:
    """The GPU's memory, or on a CPU the machine's."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def against_measured(plan: dict | None, summary: dict) -> dict:
    """The planned peak beside the measured one (the last interval's, a training stretch and its
    validation), and the plan's error: what summary.json and W&B's summary get."""
    if plan is None:
        return {}
    peaks = [p for p in plan["peak_bytes"].values() if p is not None]
    if not peaks:
        return {}
    out = {"mem/planned_peak_mib": max(peaks) / 2**20}
    measured = summary.get("mem/peak_allocated_mib")
    if measured:
        out["mem/plan_error"] = out["mem/planned_peak_mib"] / measured - 1
    return out
