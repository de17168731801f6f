"""The epoch's row: validation's metrics beside the interval's loss, speed, memory and data wait,
logged at each validation (every epoch, or every `trainer.eval_every_steps` steps), and the
warnings a row gives: an epoch that took no optimizer step, a step that waited on its data."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from mpexp.distributed import World
from mpexp.step.data_wait import STARVED_SHARE
from mpexp.step.loop_state import Interval, LoopState
from mpexp.step.parts import Parts
from mpexp.step.step_log import StepLog
from mpexp.step.validation import Validation
from mpexp.system import PeakMemory
from mpexp.tracking.tracker import Tracker

log = logging.getLogger("mpexp")


@dataclass
class EpochRows:
    """Writes the row of each validation, summed or averaged over ranks."""

    parts: Parts
    validation: Validation
    tracker: Tracker
    world: World
    steps: StepLog  # the epoch's step losses and skips
    memory: PeakMemory
    state: LoopState  # the samples seen so far
    total_steps: int
    rows: int = 0  # validation rows this process has logged
    warned_starved: bool = False  # the data-wait warning is given once a run

    def write(
        self,
        epoch: int,
        step: int,
        epoch_time: float,
        setup: tuple[int, float],
        interval: Interval,
    ) -> dict:
        """The row of an epoch (or of the steps since the last validation, with
        `trainer.eval_every_steps`): `setup` is its set-up steps and their time, both left out
        of its speed; `interval` its samples and the seconds it waited for them."""
        data_wait = interval.waited
        p = self.parts
        task = p.data.task
        metrics, val_compile_s = self.validation.metrics()
        row = {
            "epoch": epoch,
            "step": step,
            "train/epoch_loss": self.steps.epoch_loss(),
            **metrics,
            "perf/epoch_time_s": epoch_time,
            "samples": self.state.samples_seen,
            # the set-up steps' samples are left out with their time
            "perf/samples_per_s": (interval.samples - setup[0] * p.data.batch_size) / epoch_time,
            **self.memory.read(),
            "perf/data_wait_s": data_wait,
            "perf/data_wait_share": min(1.0, data_wait / epoch_time) if epoch_time > 0 else 0.0,
        }
        if setup[0] or setup[1] or val_compile_s:
            row["perf/compile_s"] = setup[1] + val_compile_s
        row = self.world.reduce_epoch(row)
        # from the samples/s already computed (summed over ranks): no device read of its own
        row.update(task.throughput(row["perf/samples_per_s"]))
        row.update(task.progress(self.state.samples_seen))
        row.update(p.throughput.result().metrics(row["perf/samples_per_s"]))
        self.tracker.log(row)
        self.rows += 1
        self._warn_if_starved(row)
        steps = len(self.steps.losses)
        if steps and self.steps.epoch_skipped == steps:
            log.warning(
                "Epoch %d took no optimizer step: all %d of its steps were skipped (non-finite "
                "gradients or losses), so the weights did not change in it.%s",
                epoch,
                steps,
                " Under loss scaling, a scale still coming down from a high "
                "loss_scaling.init_scale does this."
                if p.scaler.scales_loss
                else "",
            )
        log.info(
            "Epoch: %d, Loss: %.4f, Elapsed Time: %.2fsec, %s, Peak Mem: %.0f MiB, "
            "Skipped Steps: %d",
            epoch,
            row["train/epoch_loss"],
            row["perf/epoch_time_s"],
            task.epoch_text(row),
            row[self.memory.key],
            self.steps.skipped,
        )
        return row

    def _warn_if_starved(self, row: dict) -> None:
        """Once a run, when the step waited on its data for more than a tenth of an epoch's
        time: a precision comparison would then time the data path. The first epoch is left
        out unless it is the last (workers starting, files first read)."""
        share = row["perf/data_wait_share"]
        first = self.rows == 1 and row["step"] < self.total_steps
        if self.warned_starved or first or share <= STARVED_SHARE or not self.world.is_main:
            return
        self.warned_starved = True
        log.warning(
            "Epoch %d waited %.2f s of its %.2f s (%.0f %%) for data: the step outruns its "
            "data, so its speed is the data path's, not the precision's. %s",
            row["epoch"],
            row["perf/data_wait_s"],
            row["perf/epoch_time_s"],
            100 * share,
            self.parts.data.faster_data_hint(),
        )
