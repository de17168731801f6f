"""A run's own plan, made before its first step (`trainer.plan`, on by default on a GPU): a run
that cannot fit the device is refused before it starts, with the plan's numbers and the keys to
change, and the run records the planned need beside what it measures.

Under torchrun rank 0 plans and the others take its answer. The plan is kept in the run
directory (plan.json, under a key made of the config, the device's memory and the processes):
a resume of the same config takes it from there instead of rehearsing again."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from pathlib import Path

import torch
from omegaconf import DictConfig

from mpexp import __version__, config
from mpexp.distributed import World
from mpexp.errors import ConfigError, reason
from mpexp.plan.devices import TYPICAL_MFU
from mpexp.plan.held import model_bytes
from mpexp.plan.rows import USABLE, Target, plan_one

GiB = 2**30
PLAN_FILE = "plan.json"
log = logging.getLogger("mpexp")


def plan_run(cfg: DictConfig, world: World, run_dir: Path) -> dict | None:
    """The run's plan as `ran.plan` records it, or None where the run is not planned; raises
    ConfigError, on every rank, where it cannot fit. Made before the run sets its precision up:
    the rehearsal sets the CPU's (TF32 off) for itself."""
    asked = cfg.trainer.plan
    if not (world.device.type == "cuda" if asked is None else asked):
        return None
    outcome = _outcome(cfg, world, Path(run_dir)) if world.is_main else None
    plan, refusal = world.from_rank_zero(outcome)
    if refusal is not None:
        raise ConfigError(refusal)
    return plan


def _outcome(cfg: DictConfig, world: World, run_dir: Path) -> tuple[dict | None, str | None]:
    """Rank 0's answer for every rank: (the plan, None), (None, why the run cannot start), or
    (None, None) where it trains unplanned."""
    memory = device_memory(world.device)
    key = plan_key(cfg, world, memory)
    kept = _kept_plan(run_dir, key)
    if kept is not None:
        log.info("The plan of this config, as %s keeps it.", run_dir / PLAN_FILE)
        return kept, None
    try:
        planned = _planned(cfg, world, memory)
    except ConfigError as refused:
        return None, str(refused)
    except Exception as err:  # a plan is advice: a model the rehearsal cannot run still trains,
        # and one that is broken fails its own trial next, building the run's parts
        log.warning(
            "No plan for this run: rehearsing it on fake tensors failed (%s: %s). It trains "
            "unplanned; trainer.plan=false skips the rehearsal.",
            type(err).__name__,
            reason(err),
        )
        return None, None
    if planned is not None and run_dir.is_dir():
        with contextlib.suppress(OSError):  # a plan not kept is made again by a resume
            (run_dir / PLAN_FILE).write_text(json.dumps({"key": key, "plan": planned}) + "\n")
    return planned, None


def _planned(cfg: DictConfig, world: World, memory: int) -> dict | None:
    device = world.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    # two micro-batches reach the step's peak (mpexp/plan/rehearsal.py): seconds, not minutes
    target = Target(device.type, memory, name, world.size, micro_batches=2)
    planned = plan_one(cfg, [], None, target)  # rehearsed on copies: the run's config stays
    if planned["missing"]:  # the rehearsal could not follow the step: nothing to hold it to
        log.warning(
            "No plan for this run's peaks: %s. It trains unplanned.",
            next(iter(planned["missing"].values())),
        )
        return None
    needed = planned["need_bytes"]
    if planned["fits"] is False:
        peaks = planned["peak_bytes"]
        where = "the GPU's" if device.type == "cuda" else "this machine's"
        graph = (
            " (its step is a CUDA graph, whose pool stays reserved while validation runs beside it)"
            if planned["captured"]
            else ""
        )
        raise ConfigError(
            f"This run does not fit {where} {memory / GiB:.1f} GiB (of which the plan takes at "
            f"most {USABLE:.0%}): it needs {needed / GiB:.1f} GiB{graph}, its plan peaking at "
            f"{peaks['train_step'] / GiB:.1f} GiB in the training step and "
            f"{peaks['validation'] / GiB:.1f} GiB in validation, of which the weights, "
            f"gradients and optimizer states hold {model_bytes(planned['bytes']) / GiB:.1f} GiB.\n"
            f"Any one of these would fit: {'; '.join(planned['advice'])}.\n"
            "mpexp-plan with the same overrides shows the whole plan; trainer.plan=false starts "
            "the run without it."
        )
    seconds = planned["seconds_per_step"]
    log.info(
        "Planned: %.2f GiB of the device's %.1f GiB%s.",
        needed / GiB,
        memory / GiB,
        f"; about {seconds:.2g} s a step at {TYPICAL_MFU:.0%} of its peak (an estimate)"
        if seconds
        else "",
    )
    keys = ("peak_bytes", "need_bytes", "bytes", "flops_per_step", "host_reads_per_step")
    return {
        **{k: planned[k] for k in keys},
        "captured": planned["captured"],
        "estimated": planned["estimated"],
        "seconds_per_step": seconds,  # an estimate, at mfu_assumed
        "mfu_assumed": planned["mfu_assumed"],
    }


def plan_key(cfg: DictConfig, world: World, memory: int) -> str:
    """What a plan depends on: the config (a resume's trainer.resume aside), the device's
    memory, the processes, and the versions that build and rehearse it."""
    own = config.to_dict(cfg)
    own["trainer"].pop("resume", None)
    said = {
        "config": own,
        "device": [world.device.type, memory, world.size],
        "versions": [__version__, torch.__version__],
    }
    return hashlib.sha256(json.dumps(said, sort_keys=True, default=str).encode()).hexdigest()


def _kept_plan(run_dir: Path, key: str) -> dict | None:
    """The plan the run directory keeps under `key`, if any."""
    try:
        kept = json.loads((run_dir / PLAN_FILE).read_text())
    except (OSError, ValueError):
        return None
    return kept.get("plan") if isinstance(kept, dict) and kept.get("key") == key else None


def device_memory(device: torch.device) -> int:
    """The GPU's memory, or on a CPU the machine's."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def against_measured(plan: dict | None, summary: dict) -> dict:
    """The planned need beside the measured peak (the last interval's, a training stretch and
    its validation), and the plan's error: what summary.json and W&B's summary get. A step
    captured as a CUDA graph is measured by the allocator's reserved bytes, which hold its
    pool; the allocated peak of its replays leaves the pool's activations out."""
    if plan is None:
        return {}
    needed = plan.get("need_bytes")
    if needed is None:  # a plan recorded before the need was
        known = [p for p in plan["peak_bytes"].values() if p is not None]
        needed = max(known) if known else None
    if needed is None:
        return {}
    out = {"mem/planned_peak_mib": needed / 2**20}
    against = "mem/peak_reserved_mib" if plan.get("captured") else "mem/peak_allocated_mib"
    measured = summary.get(against)
    if measured:
        out["mem/plan_error"] = out["mem/planned_peak_mib"] / measured - 1
    return out
