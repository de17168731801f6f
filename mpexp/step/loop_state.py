"""Where training stands between steps: the position, the last validation's row, the samples
seen and the interval in progress; what a checkpoint keeps of the loop and a resume brings back."""

from __future__ import annotations

from dataclasses import dataclass, field

from mpexp.checkpoints.checkpoint import Position


@dataclass
class Interval:
    """The steps since the last validation (an epoch's, by default): what its row reports."""

    start: float  # perf_counter() at its start, less what it had taken before a resume
    setup_s: float  # the stepper's set-up time at its start
    timed_steps: int  # and its set-up steps
    samples: int = 0  # samples trained on (this rank's)
    counted: int = 0  # of those, already in the run's samples_seen
    waited: float = 0.0  # seconds waited for batches


@dataclass
class LoopState:
    """Where training stands: the loop moves it on, its parts read it."""

    position: Position = field(default_factory=Position)  # the next epoch, batches done in it
    row: dict | None = None  # the last validation's metrics (an epoch's, by default)
    samples_seen: int = 0  # training samples so far, over all ranks
    interval: Interval | None = None  # the steps since the last validation
    resumed_time: float = 0.0  # time the interval in progress had taken before a checkpoint
    resumed_samples: int | None = 0  # and the samples it had trained on
