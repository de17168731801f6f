"""The loop's checkpoints: what they keep of the loop besides the weights (the step log, the
epoch's row, the interval in progress, the weights' average), a stop at one, and the resume from
one. mpexp/checkpoints/ writes and reads the files."""

from __future__ import annotations

import logging
import signal
from dataclasses import dataclass

from mpexp.checkpoints.checkpoint import Checkpointer, Position
from mpexp.checkpoints.resume import Resume
from mpexp.distributed import World
from mpexp.step.loop_state import LoopState
from mpexp.step.parts import Parts
from mpexp.step.step_log import StepLog
from mpexp.step.weight_average import WeightAverage
from mpexp.stopping import StopSignals

log = logging.getLogger("mpexp")


@dataclass
class LoopCheckpoints:
    """Saves the loop's state with the weights, and restores it."""

    parts: Parts
    saver: Checkpointer
    stop: StopSignals
    world: World
    steps: StepLog
    average: WeightAverage | None
    state: LoopState
    # the run's length: a stop at its very end lets it finish
    last_epoch: int
    total_steps: int

    def restore(self, resume: Resume) -> None:
        """Continue from a checkpoint: weights, optimizer, scaler, schedule, RNGs and the log."""
        p = self.parts
        schedule = self.saver.schedule
        self.state.position = resume.restore(p.model, p.optimizer, p.scaler, self.world, schedule)
        carried = resume.log_state
        self.steps.load_state(carried)
        self.state.row = carried["epoch_row"]
        self.state.resumed_time = carried["elapsed"]
        self.state.resumed_samples = carried.get("interval_samples")
        if self.average is not None:
            self.average.load_state(carried["weight_average"])
        data = self.parts.data
        self.state.samples_seen = carried.get(
            "samples_seen", self.state.position.step * data.batch_size * self.world.size
        )

    def save(self, position: Position, elapsed: float, stopping: bool) -> None:
        """A checkpoint at `position`, `elapsed` seconds into the interval in progress (0.0 at a
        validation); with `stopping`, the run stops once it is written."""
        interval = self.state.interval
        at_interval_end = interval is None or elapsed == 0.0
        log_state = {
            **self.steps.state(),
            "elapsed": elapsed,
            "epoch_row": self.state.row,
            **({"weight_average": self.average.state()} if self.average is not None else {}),
            # the interval in progress (none at a validation): its samples, and all of them
            "interval_samples": 0 if at_interval_end else interval.samples,
            "samples_seen": self.state.samples_seen
            + (0 if at_interval_end else interval.samples - interval.counted) * self.world.size,
        }
        # one at the end lets it finish
        stops = stopping and position.step < self.total_steps and position.epoch <= self.last_epoch
        signum = self.stop.received or signal.SIGTERM  # another rank may have got it
        if stops and self.world.is_main:  # said at once: a big checkpoint takes a while to write
            log.info(
                "%s received: writing a checkpoint at step %d, then stopping.%s",
                signal.Signals(signum).name,
                position.step,
                " Ctrl-C again quits at once, without it." if signum == signal.SIGINT else "",
            )
        path = self.saver.save(position, log_state)  # every rank: FSDP's all write their shards
        if stops:
            raise self.saver.stopped(signum, path, position, self.parts.data.steps_per_epoch())
