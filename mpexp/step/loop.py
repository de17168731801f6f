"""The training loop: `Fit` drives a run's epochs and calls its parts, each in a file of its own:

- the step: `train_step` (train_step.py), which the `Stepper` (stepper.py) runs eagerly,
  compiled or captured as a CUDA graph, with its bookkeeping on the device;
- what the steps measured, read back at each flush (readback.py) and written as rows
  (step_log.py);
- the epoch's bookkeeping: where training stands (loop_state.py), the interval between two
  validations (interval_clock.py), its row (epoch_row.py), the progress bar (progress.py);
- validation (validation.py), checkpoints and stops (checkpointing.py), and what the speed
  switches came to (speed_record.py).

Nothing here reads a device value on the host per step: values are gathered on the device and read
back every `trainer.log_every` steps (see mpexp/step/history.py).
"""

from __future__ import annotations

import contextlib
import time

from omegaconf import DictConfig

from mpexp.batches import BatchSplit
from mpexp.checkpoints.checkpoint import Checkpointer, Position
from mpexp.checkpoints.resume import Resume
from mpexp.config import run_length
from mpexp.data.mixing import batch_mixing
from mpexp.distributed import World
from mpexp.step.checkpointing import LoopCheckpoints
from mpexp.step.data_wait import wait_clock
from mpexp.step.diagnostics import Diagnostics
from mpexp.step.epoch_row import EpochRows
from mpexp.step.history import StepHistory
from mpexp.step.interval_clock import IntervalClock
from mpexp.step.loop_state import LoopState
from mpexp.step.parts import Parts
from mpexp.step.progress import Progress
from mpexp.step.readback import Readback
from mpexp.step.speed_record import SpeedRecord
from mpexp.step.step_log import StepLog
from mpexp.step.stepper import Stepper
from mpexp.step.validation import Validation
from mpexp.step.weight_average import weight_average
from mpexp.stopping import StopSignals
from mpexp.system import PeakMemory
from mpexp.tracking.tracker import Tracker


class Fit:
    """One run's epochs: steps, metric flushes, validation, checkpoints and stop signals."""

    def __init__(
        self,
        cfg: DictConfig,
        parts: Parts,
        tracker: Tracker,
        saver: Checkpointer,
        world: World,
        stop: StopSignals,
    ):
        trainer = self.trainer = cfg.trainer
        self.parts, self.tracker, self.saver = parts, tracker, saver
        self.world, self.stop, self.device = world, stop, world.device
        # in a distributed run each flush averages the losses over ranks (one collective per flush)
        history = StepHistory(
            capacity=trainer.log_every,
            device=self.device,
            reduce_loss=world.mean if world.distributed else None,
            terms=parts.data.task.term_names,
        )
        memory = PeakMemory(self.device)
        steps = self.steps = StepLog(tracker, trainer.on_nonfinite_loss, parts.scaler)
        diagnostics = Diagnostics(
            cfg.diagnostics, parts.model, parts.scaler, tracker, parts.precision, parts.optimizer
        )
        # this process's micro-batches; validation and diagnostics run the same ones: a whole
        # batch at once could need many times the step's memory
        split = BatchSplit(cfg.dataset.batch_size, trainer.accumulate, world.size)
        self.stepper = Stepper.for_parts(
            parts, history, diagnostics, split.accumulate_per_process, trainer.clip_grad_norm
        )
        record = self.speed_record = SpeedRecord(
            parts, self.stepper, history, tracker, world, trainer
        )
        progress = trainer.progress
        hide = (None if progress is None else not progress) if world.is_main else True
        self.progress = Progress(steps, parts.data.batch_size, hide)
        state = self.state = LoopState()
        # how long the run trains and when it validates: every epoch, or every N steps
        self.last_epoch, self.total_steps = run_length(trainer, parts.data.steps_per_epoch())
        self.eval_every = trainer.eval_every_steps
        # how long the step waited for data: the GPU's idle time, or a CPU's wait for batches
        self.waiting = wait_clock(self.device)
        self.readback = Readback(tracker, history, steps, diagnostics, self.waiting)
        # a classifier's recipe: mixed training batches, an fp32 average of the weights
        self.mixing = batch_mixing(trainer, parts.data.task, trainer.seed)
        average = self.average = weight_average(trainer, parts.model)
        validation = self.validation = Validation(
            parts, record, self.device, split.micro_batch, tracker, average
        )
        self.checkpoints = LoopCheckpoints(
            parts, saver, stop, world, steps, average, state, self.last_epoch, self.total_steps
        )
        self.clock = IntervalClock(
            state, self.stepper, steps, memory, self.waiting, parts.data.batch_size, self.device
        )
        self.epoch_rows = EpochRows(
            parts, validation, tracker, world, steps, memory, state, self.total_steps
        )

    def restore(self, resume: Resume) -> None:
        """Continue from a checkpoint: weights, optimizer, scaler, schedule, RNGs and the log."""
        self.checkpoints.restore(resume)

    def run(self) -> dict:
        """Train the remaining epochs; return the final metrics."""
        self.parts.model.train()
        record = self.speed_record
        try:
            with record.compiles if record.compiled else contextlib.nullcontext():
                for epoch in range(self.state.position.epoch, self.last_epoch + 1):
                    self._epoch(epoch)
                    if self.state.position.step >= self.total_steps:
                        break
            tested = self.validation.test(self.state.position.step)
            tested.update(record.compute_only(self.state.position.step))
        except Exception:
            self.readback.write_own_values()
            raise
        steps = self.steps
        return {
            **self.state.row,
            **tested,
            "amp/skipped_steps": steps.skipped,
            # after the last update: the scale the next step would use (one read, at the end)
            "amp/final_scale": float(self.parts.scaler.scale_tensor()),
            **steps.outcome(),
            **record.setup_time(),
        }

    def check_it_trained(self) -> None:
        """A run whose every step was skipped trained nothing: it ends failed, saying why."""
        self.steps.check_any_taken(self.state.position.step)

    def _epoch(self, epoch: int) -> None:
        """Train epoch `epoch` (the rest of it after a resume), validating, logging a row and
        checkpointing at its end, or every `trainer.eval_every_steps` steps and at the run's
        last step."""
        data, position = self.parts.data, self.state.position
        step = position.step
        done = position.batch if epoch == position.epoch else 0  # trained before a resume
        steps_per_epoch = data.steps_per_epoch()
        if self.state.interval is None:  # this process's first: a resume may carry one on
            self.clock.open(done=done)
        bar = self.progress.bar(epoch, self.last_epoch, steps_per_epoch, done)
        static = self.stepper.graph is not None  # a captured step reads its batch in place
        batches = data.train_batches(epoch, self.trainer.seed, self.device, static, start=done)
        if self.mixing is not None:
            batches = self.mixing.batches(batches, epoch, done, data.rank)
        waiting = self.waiting
        interval = self.state.interval
        for batch, (inputs, targets) in enumerate(waiting.batches(batches), start=done + 1):
            step += 1
            self.tracker.step = step  # where the user's own mpexp.log() calls log
            waiting.step_began()
            self.stepper.step(step, inputs, targets)
            if self.average is not None:
                self.average.after_step(step)
            waiting.step_ended()
            if self.stepper.steps_taken <= self.stepper.setup_steps:
                waiting.forget()  # a set-up step synchronises: the gap after it is the host's
            if self.trainer.compute_only_steps:
                self.speed_record.last_batch = inputs, targets
            interval.samples += len(targets)  # on the host: a shape, no device read
            bar.update()
            flush = step % self.trainer.log_every == 0
            if flush:
                self.readback.flush()
                self.progress.show(bar, interval.start)
            last = step >= self.total_steps
            if last or (self.eval_every and step % self.eval_every == 0):
                interval.waited += waiting.take()
                at = Position(epoch + 1, 0, step) if batch == steps_per_epoch else None
                self._close_interval(epoch, at or Position(epoch, batch, step))
                interval = self.state.interval
                if last:
                    break
                continue
            # ranks must stop at the same step: they agree where they meet anyway, at a flush
            stopping = self._stop_agreed() if flush or not self.world.distributed else False
            if self.saver.due(step) or stopping:
                # a stop's own flush leaves the lost updates' window open: the checkpoint keeps
                # its counts, so that the resumed run logs the rows the whole run would have
                self.readback.flush(wait=True, close_windows=self.saver.due(step))
                began = time.perf_counter()
                self.checkpoints.save(
                    Position(epoch, batch, step), began - interval.start, stopping
                )
                interval.start += time.perf_counter() - began  # checkpoints are not training time
                waiting.forget()  # nor is the device's wait through one
        else:
            if self.eval_every is None:
                interval.waited += waiting.take()
                self._close_interval(epoch, Position(epoch + 1, 0, step))
            else:  # the interval goes on into the next epoch, and so does the clock's count
                self.state.position = Position(epoch + 1, 0, step)
        bar.close()

    def _close_interval(self, epoch: int, position: Position) -> None:
        """Validate, log the interval's row, checkpoint at `position`, and open the next."""
        interval = self.state.interval
        seconds, setup = self.clock.read()
        self.readback.flush(wait=True)
        self.state.samples_seen += (interval.samples - interval.counted) * self.world.size
        interval.counted = interval.samples
        self.state.row = self.epoch_rows.write(epoch, position.step, seconds, setup, interval)
        self.state.position = position
        self.checkpoints.save(position, 0.0, self._stop_agreed())
        self.state.interval = None
        if position.step < self.total_steps:
            self.clock.open()

    def speed_ran(self) -> dict:
        """The speed switches as they took effect (mpexp/step/speed_record.py)."""
        return self.speed_record.ran()

    def _stop_agreed(self) -> bool:
        """Whether a signal asks to stop; all ranks of a distributed run decide alike."""
        return self.world.any(bool(self.stop.received))
