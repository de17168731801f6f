"""The interval clock: it opens the steps up to the next validation and times them at their
close, leaving out the set-up steps (compilation, the CUDA graph's warm-up and capture); an
interval that a checkpoint interrupted carries on after the resume, with its time and samples."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from mpexp.step.data_wait import DeviceIdleClock, HostWaitClock
from mpexp.step.loop_state import Interval, LoopState
from mpexp.step.step_log import StepLog
from mpexp.step.stepper import Stepper
from mpexp.system import PeakMemory, synchronize


@dataclass
class IntervalClock:
    """Opens and times the intervals between validations (`state.interval`)."""

    state: LoopState
    stepper: Stepper  # its set-up steps and their time
    steps: StepLog  # an interval that starts an epoch starts its losses
    memory: PeakMemory  # the interval's peak
    waiting: HostWaitClock | DeviceIdleClock  # the data wait, from the interval's first step
    batch_size: int
    device: torch.device

    def open(self, done: int = 0) -> None:
        """Start timing the steps up to the next validation. After a resume they may continue
        an interval that a checkpoint interrupted (`done` batches into its epoch): its time and
        samples carry over."""
        samples = self.state.resumed_samples
        if samples is None:  # a checkpoint from before intervals: its epoch's batches so far
            samples = done * self.batch_size
        if not (samples or self.state.resumed_time):
            self.steps.new_epoch()
        self.memory.reset()
        self.waiting.forget()  # validation and checkpoints since the last step are no data wait
        self.state.interval = Interval(
            start=time.perf_counter() - self.state.resumed_time,
            setup_s=self.stepper.setup_s,
            timed_steps=self.stepper.timed_steps,
            samples=samples,
            counted=samples,  # in samples_seen already, as the checkpoint kept it
        )
        self.state.resumed_time, self.state.resumed_samples = 0.0, 0

    def read(self) -> tuple[float, tuple[int, float]]:
        """The interval's training time in seconds, read at its end (one synchronisation), and
        the set-up steps and set-up time that it leaves out."""
        interval = self.state.interval
        synchronize(self.device)
        # compilation and the CUDA graph's warm-up and capture are set-up, not training time:
        # perf/compile_s has them
        setup = self.stepper.setup_s - interval.setup_s
        seconds = time.perf_counter() - interval.start - setup
        timed = self.stepper.timed_steps - interval.timed_steps
        return seconds, (timed, setup)
