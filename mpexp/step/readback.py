"""What the device has gathered, read back on the host every `trainer.log_every` steps and at
each validation and checkpoint: the step rows, the user's values from mpexp.log, the data-wait
clock's marks and the diagnostics' counts."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from mpexp.step.data_wait import DeviceIdleClock, HostWaitClock
from mpexp.step.diagnostics import Diagnostics
from mpexp.step.history import OwnRows, StepHistory
from mpexp.step.step_log import StepLog
from mpexp.tracking.tracker import Tracker

log = logging.getLogger("mpexp")


@dataclass
class Readback:
    """The host's reads of the device's values: one per flush, none per step."""

    tracker: Tracker
    history: StepHistory
    steps: StepLog
    diagnostics: Diagnostics
    waiting: HostWaitClock | DeviceIdleClock
    own: OwnRows = field(default_factory=OwnRows)  # the user's tensors from mpexp.log

    def flush(self, wait: bool = False, close_windows: bool = True) -> None:
        """Read back what the device has gathered (all of it with wait=True: one sync);
        `close_windows=False` leaves the diagnostics' counting windows open."""
        # the user's tensors are queued for the host before the history's copy, whose wait then
        # covers them too
        self.own.start(self.tracker.take_waiting())
        rows = self.history.flush(wait)
        self.waiting.read()  # the device's idle gaps that it has passed
        # before the step rows, which may stop the run: values logged up to a non-finite loss are
        # what explains it
        for row in self.own.done(wait):
            self.tracker.log(row)
        self.steps.write(rows)
        self.diagnostics.flush(wait, close_windows)

    def write_own_values(self) -> None:
        """The user's values on their way to the host, written as the run fails: the values that
        lead up to a failure explain it (the tracker writes those logged since, at its end)."""
        try:
            rows = self.own.done(wait=True)
        except RuntimeError as err:  # a device that failed: the error that ends the run says so
            log.warning("mpexp.log's values of the last steps could not be read (%s).", err)
            return
        for row in rows:
            self.tracker.log(row)
