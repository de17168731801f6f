"""The progress bar: one per epoch on the main process, with the loss and speed at each flush
(trainer.progress: on, off, or by default on a terminal only)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from tqdm import tqdm

from mpexp.step.step_log import StepLog


@dataclass
class Progress:
    """The epochs' progress bars."""

    steps: StepLog  # the epoch's losses so far
    batch_size: int
    hide: bool | None  # tqdm's `disable`: None hides the bar where the output is no terminal

    def bar(self, epoch: int, last_epoch: int, total: int, done: int) -> tqdm:
        """Epoch `epoch`'s bar, of `total` steps, `done` of them before a resume."""
        return tqdm(
            total=total, initial=done, desc=f"epoch {epoch}/{last_epoch}", disable=self.hide
        )

    def show(self, bar: tqdm, start: float) -> None:
        """The last loss, and the speed since `start`, shown at a flush."""
        if self.steps.losses:
            rate = len(self.steps.losses) * self.batch_size / (time.perf_counter() - start)
            bar.set_postfix(loss=f"{self.steps.losses[-1]:.4f}", samples_s=f"{rate:.0f}")
