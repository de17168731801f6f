"""What the run's speed came to: the speed switches as they took effect (a model that cannot be
compiled trains eagerly), every compilation timed, the set-up time left out of the epochs' speed,
and the step's own rate with the data path out of the way (compute-only)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
from omegaconf import DictConfig

from mpexp.data.base import Batch
from mpexp.distributed import World
from mpexp.errors import reason
from mpexp.step.history import StepHistory
from mpexp.step.objective import Objective, eager, uncompiled
from mpexp.step.parts import Parts
from mpexp.step.performance import Compilations
from mpexp.step.stepper import Stepper
from mpexp.system import synchronize
from mpexp.tracking.tracker import Tracker

log = logging.getLogger("mpexp")


@dataclass
class SpeedRecord:
    """The speed switches' record for one run, and a compiled model's way back to eager."""

    parts: Parts
    stepper: Stepper
    history: StepHistory
    tracker: Tracker
    world: World
    trainer: DictConfig  # cfg.trainer: compute_only_steps, log_every
    # every compilation, in training and in validation: timed, and survived by the eager model
    compiles: Compilations = field(default_factory=Compilations)
    val_compile_s: float = 0.0  # the time validation spent compiling
    compile_failed: bool = False
    last_batch: Batch | None = None  # what compute_only_steps time the step on
    # the model with its loss as evaluation calls it: what `forward` wraps (DDP, a compiled
    # graph), eager where the run is; under FSDP2 its units stay compiled until compiling fails
    objective: torch.nn.Module = field(init=False)
    compiled: bool = field(init=False)  # whether the model runs compiled (until it fails to)

    def __post_init__(self) -> None:
        parts, under = self.parts, eager(self.parts.forward)
        self.objective = (
            under if isinstance(under, Objective) else Objective(parts.model, parts.data.task)
        )
        speed = parts.speed
        self.compiled = speed is not None and speed.compile
        if self.compiled:
            self.stepper.setup_steps = max(self.stepper.setup_steps, 1)
            self.stepper.on_compile_error = self.train_eagerly
            self.stepper.compiles = self.compiles

    def train_eagerly(self, err: Exception) -> torch.nn.Module:
        """The model cannot be compiled: warn once and train (and evaluate) it eagerly; DDP, if
        any, stays around it."""
        log.warning(
            "torch.compile could not compile the model (%s); training it eagerly instead "
            "(recorded as compile: false). trainer.compile=false skips the attempt.",
            reason(err),
        )
        self.parts.forward = uncompiled(self.parts.forward)
        self.objective = eager(self.parts.forward)
        self.compiled = False
        self.compile_failed = True
        return self.parts.forward

    def stop_compiling(self, err: Exception) -> None:
        """Validation's compilation failed: the model trains (and is evaluated) eagerly from
        here on."""
        self.stepper.on_compile_error = None
        self.stepper.model = self.train_eagerly(err)

    def ran(self) -> dict:
        """The speed switches as they took effect: a model that could not be compiled, or a
        step that could not be captured, ran eagerly."""
        speed = self.parts.speed
        if speed is None:
            return {}
        ran = self.stepper.describe()
        if speed.compile and self.compile_failed:
            ran["compile"] = False
        return ran

    def setup_time(self) -> dict:
        """Set-up time of the run's steps (compilation, CUDA graph capture) and validation's
        compilation, when it had any."""
        if not self.stepper.setup_steps:
            return {}
        return {"perf/compile_s": self.stepper.setup_s + self.val_compile_s}

    def compute_only(self, step: int) -> dict[str, float]:
        """The step's own rate (`perf/compute_only_samples_per_s`), timed after training on the
        last batch, kept on the device, for `trainer.compute_only_steps` steps: with the data
        path out of the way, each precision's speedup is the step's. These steps change the
        weights after the last checkpoint; their history rows are read and dropped."""
        steps = self.trainer.compute_only_steps
        if not steps or self.last_batch is None:
            return {}
        inputs, targets = self.last_batch
        synchronize(self.world.device)
        began = time.perf_counter()
        for i in range(1, steps + 1):
            self.stepper.step(step + i, inputs, targets)
            if i % self.trainer.log_every == 0:
                self.history.flush()  # the ring holds log_every rows: read, not logged
        synchronize(self.world.device)
        seconds = time.perf_counter() - began
        self.history.flush(wait=True)
        rate = steps * len(targets) * self.world.size / seconds
        measured = {"perf/compute_only_samples_per_s": rate}
        self.tracker.log({"step": step, **measured})
        log.info(
            "Compute only (%d steps on one batch kept on the device): %.0f samples/s",
            steps,
            rate,
        )
        return measured
