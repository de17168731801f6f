"""The Stepper: one training step with its bookkeeping on the device (history row, scale update,
diagnostics), run eagerly, compiled, or captured as a CUDA graph and replayed."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mpexp.errors import UserError
from mpexp.precision.loss_scaler import LossScaler
from mpexp.precision.modes import Precision
from mpexp.step.diagnostics import Diagnostics
from mpexp.step.history import StepHistory
from mpexp.step.parts import Parts
from mpexp.step.performance import Compilations
from mpexp.step.rollback import BufferRollback
from mpexp.step.schedules import DeviceSchedule, Schedule
from mpexp.step.step_graph import WARMUP_STEPS, CudaGraph, StepGraph
from mpexp.step.train_step import train_step
from mpexp.system import synchronize


@dataclass
class Stepper:
    """What one training step touches; `step` is the loop's whole per-step work.

    The step's device work (`_device_work`) is the same code eagerly and in a CUDA graph: with
    `graph`, it is captured once after the warm-up steps and replayed for every step that can be
    (see mpexp/step/step_graph.py); the others run it eagerly.
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: LossScaler
    precision: Precision
    history: StepHistory
    diagnostics: Diagnostics
    accumulate: int = 1
    clip_grad_norm: float | None = None
    graph: StepGraph | None = None
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy  # the task's
    schedule: Schedule | None = None
    # eager steps whose time is set-up, not training: compilation at the first, the CUDA graph's
    # warm-up and capture (timed with a synchronisation each, so few)
    setup_steps: int = 0

    def __post_init__(self) -> None:
        # a skipped step must leave BatchNorm's statistics alone where training goes on after it
        self.buffers = BufferRollback.for_step(
            self.model, can_skip=self.scaler.continues_after_skip()
        )
        self.setup_s = 0.0  # time taken by the set-up steps so far, and by later compilations
        self.steps_taken = 0
        # with a compiled model: what trains eagerly instead when it cannot be compiled, and
        # what counts its compilations
        self.on_compile_error: Callable[[Exception], torch.nn.Module] | None = None
        self.compiles: Compilations | None = None
        self._shapes: set[torch.Size] = set()  # the input shapes compiled for so far

    @classmethod
    def with_graph(cls, *args, **kwargs) -> Stepper:
        """A Stepper whose steps are captured once and replayed (`new_graph`: the graph type)."""
        new_graph = kwargs.pop("new_graph", CudaGraph)
        stepper = cls(*args, **kwargs)
        stepper.graph = StepGraph(
            stepper._captured_work, stepper._forget_step, stepper.history.before_replay, new_graph
        )
        stepper.setup_steps = max(stepper.setup_steps, WARMUP_STEPS + 1)
        return stepper

    @classmethod
    def for_parts(
        cls,
        parts: Parts,
        history: StepHistory,
        diagnostics: Diagnostics,
        accumulate: int,
        clip_grad_norm: float | None,
    ) -> Stepper:
        """The run's Stepper: of `parts.forward`, the model with its loss, captured where the
        speed switches say so."""
        speed = parts.speed
        make = cls.with_graph if speed is not None and speed.cuda_graph else cls
        return make(
            parts.forward,
            parts.optimizer,
            parts.scaler,
            parts.precision,
            history,
            diagnostics,
            accumulate,
            clip_grad_norm,
            loss_fn=None,  # the objective computes it, compiled with the model
            schedule=parts.schedule,
        )

    def step(self, step: int, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        """The optimizer step, its history row and the scale update; a skipped step leaves the
        model's buffers (BatchNorm statistics) as they were. No host-device synchronisation: a
        GPU test runs this in CUDA's sync-debug error mode."""
        # read first: a real step advances the schedule (a device schedule's rate: in the row)
        on_device = isinstance(self.schedule, DeviceSchedule)
        self.history.note(step, None if on_device else self.optimizer.param_groups[0]["lr"])
        inspect = self.diagnostics.inspector(step)
        if inspect is not None:
            self.diagnostics.measure_attention(step, inputs.chunk(self.accumulate))
        timed = self.steps_taken < self.setup_steps
        compiled_s = self.compiles.seconds if self.compiles is not None else 0.0
        if timed:
            synchronize(inputs.device)
            began = time.perf_counter()
        if not self._replayed(inputs, targets, inspect):
            self._eager(inputs, targets, inspect)
        if inspect is not None:
            self.diagnostics.after_update(step)
        if timed:
            synchronize(inputs.device)
            self.setup_s += time.perf_counter() - began
        elif self.compiles is not None:
            # a later step that compiled (a batch of a new shape): its compilation is set-up too,
            # as the compiler's host time (no synchronisation in an untimed step)
            self.setup_s += self.compiles.seconds - compiled_s
        self.steps_taken += 1

    def _replayed(self, inputs, targets, inspect) -> bool:
        """Whether the step ran as a replay of the captured graph."""
        if self.graph is None or inspect is not None or not self.scaler.capturable():
            return False
        return self.graph.run(inputs, targets)

    def _eager(self, inputs, targets, inspect) -> None:
        if self.graph is not None and self.graph.captured:
            # the graph's gradients are its own: an eager step starts from none, as it would
            self.optimizer.zero_grad(set_to_none=True)
        warming = self.graph is not None and not self.graph.captured and not self.graph.failed
        with self.graph.warmup_stream() if warming else contextlib.nullcontext():
            if self.on_compile_error is not None:
                self._compiled(inputs, targets, inspect)
            else:
                self._device_work(inputs, targets, inspect)
        self.optimizer.zero_grad(set_to_none=True)
        if self.graph is not None:
            self.graph.warmed_up()

    def _compiled(self, inputs, targets, inspect) -> None:
        """A step of the compiled model; one whose compilation fails trains eagerly, as does
        every step after it.

        The first step compiles, and so does one whose batch has a shape not seen before (a
        last, smaller batch): the model's buffers are saved before those, so that a failed one
        leaves no trace. A failure in any step that started a compilation (one that a change in
        the model's Python state recompiles) is taken for the compiler's too, but BatchNorm
        statistics that its forward pass updated before the failure stay as they are."""
        first = self.steps_taken == 0
        saved = None
        if inputs.shape not in self._shapes:
            self._shapes.add(inputs.shape)
            saved = BufferRollback(list(self.model.buffers()))
            saved.save()
        started = self.compiles.count if self.compiles is not None else 0
        try:
            self._device_work(inputs, targets, inspect)
        except UserError:  # a mistake in the user's code (mpexp.log's): eager would make it too
            raise
        except Exception as err:
            compiling = self.compiles is not None and self.compiles.count > started
            # the first step's failure is the compiler's, whatever it raised (torch.compile's
            # wrapper defers all of its work to that call); a later one only if it compiled
            if not (first or compiling):
                raise
            if saved is not None:
                saved.restore_if(torch.ones((), device=inputs.device))
            self._forget_step()
            fall_back, self.on_compile_error = self.on_compile_error, None
            self.model = fall_back(err)
            self._device_work(inputs, targets, inspect)

    def _device_work(self, inputs, targets, inspect, captured: bool = False) -> None:
        """Everything the step does on the device: the same kernels eager or replayed."""
        self.buffers.save()
        lr = self.schedule.lr() if self.schedule is not None else None  # the rate it steps with
        terms = train_step(
            self.model,
            inputs,
            targets,
            self.optimizer,
            self.scaler,
            self.precision,
            self.accumulate,
            self.clip_grad_norm,
            inspect=inspect,
            loss_fn=self.loss_fn,
            schedule=self.schedule,
        )
        skipped = self.scaler.found_inf()
        self.buffers.restore_if(skipped)
        # between step() and update(): the scale this step used and whether it was skipped
        before_update = torch.stack((terms[0], self.scaler.scale_tensor(), skipped))
        self.scaler.update()
        record = self.history.record_captured if captured else self.history.record
        record(before_update, self.scaler.floor_hit(), lr, terms[1:])

    def _captured_work(self, inputs, targets) -> None:
        self._device_work(inputs, targets, None, captured=True)

    def _forget_step(self) -> None:
        """Undo the host side of a step that did not finish (its device work never ran)."""
        self.scaler.reset_step()
        # what GradScaler.step hands a fused optimizer and removes after its step: left over, a
        # never-computed scale would multiply into the next step's
        for name in ("grad_scale", "found_inf"):
            if hasattr(self.optimizer, name):
                delattr(self.optimizer, name)
        self.optimizer.zero_grad(set_to_none=True)

    @property
    def timed_steps(self) -> int:
        """Set-up steps taken so far."""
        return min(self.steps_taken, self.setup_steps)

    def describe(self) -> dict:
        """What the steps ran as, for the run record (after training)."""
        graph = self.graph
        ran = {
            "cuda_graph": bool(graph is not None and graph.captured and not graph.failed),
            "graph_replays": graph.replays if graph is not None else 0,
        }
        if graph is not None and graph.failed:
            ran["cuda_graph_off"] = graph.failure
        return ran
