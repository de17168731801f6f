"""The data-wait clock: how long the training step waited for its batches (perf/data_wait_s)."""

from __future__ import annotations

import time
from collections.abc import Iterator

from mpexp.data.base import Batch

# the share of an epoch spent waiting for batches past which a run is warned (perf/data_wait_share)
STARVED_SHARE = 0.1


class WaitClock:
    """The batches of an epoch, with the host time spent waiting for each one added up: time
    the step could not run for lack of data (on a GPU the device may still be busy with queued
    steps meanwhile, so this bounds its own wait from above)."""

    def __init__(self, batches: Iterator[Batch]):
        self._batches = iter(batches)
        self.seconds = 0.0

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        began = time.perf_counter()
        try:
            return next(self._batches)
        finally:
            self.seconds += time.perf_counter() - began

    def take(self) -> float:
        """The seconds waited since the last take."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds
