"""The data-wait clock: how long the training step waited for its batches (perf/data_wait_s).

Two clocks, one per kind of step, chosen once (`wait_clock`):

- **On a CPU** the step is synchronous: the host waits for each batch and then runs the step, so
  the host's time inside `next()` is the time the step could not run (`HostWaitClock`).
- **On a GPU** the step is asynchronous: the host queues steps ahead of the device (a captured
  step up to many steps ahead) and DataLoader workers prefetch, so the host's wait in `next()`
  overlaps the device's work on steps already queued, and counts as waiting time the GPU spent
  busy. What starves a GPU is the time *it* idles between steps: `DeviceIdleClock` records an
  event on the step's stream where each step's device work begins and where it ends, and adds up
  the gaps from one step's end to the next one's beginning. The events are read at each metric
  flush, never per step (no host read in the hot path), and only once the device has passed them.

A gap holds what the device did between steps besides waiting: the batch's copy from pinned
memory and its conversion and augmentation on the device (the data path's own work), so the
clock measures the time the step did not run, as the host clock does on a CPU.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from typing import Any, Protocol

import torch

from mpexp.data.base import Batch

# the share of an epoch spent waiting for batches past which a run is warned (perf/data_wait_share)
STARVED_SHARE = 0.1


class HostWaitClock:
    """The host time spent waiting for each batch, added up: on a synchronous step (a CPU's),
    time the step could not run for lack of data."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def batches(self, batches: Iterator[Batch]) -> Iterator[Batch]:
        """`batches`, each one's wait timed."""
        batches = iter(batches)
        while True:
            began = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:
                return
            finally:
                self.seconds += time.perf_counter() - began
            yield batch

    def step_began(self) -> None:
        """The step's device work is about to be queued (nothing to mark on the host)."""

    def step_ended(self) -> None:
        """The step's device work is queued."""

    def forget(self) -> None:
        """The time until the next step is no training time (a checkpoint, validation)."""

    def read(self) -> None:
        """Take in what the device has finished (nothing to read on the host)."""

    def take(self) -> float:
        """The seconds waited since the last take."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds


class Events(Protocol):
    """Timestamps on the step's stream: recorded without waiting, read once the device has
    passed them. `CudaEvents` on a GPU; a test gives one of known times."""

    def record(self) -> Any:
        """A marker of the point the stream has reached in the queued work."""

    def done(self, marker: Any) -> bool:
        """Whether the device has passed `marker` (no waiting)."""

    def wait(self, marker: Any) -> None:
        """Wait until the device has passed `marker`."""

    def seconds_between(self, earlier: Any, later: Any) -> float:
        """Device seconds from `earlier` to `later`, both passed."""


class CudaEvents:
    """Timing events on the current CUDA stream: the step's (a captured step replays on it)."""

    def __init__(self, device: torch.device):
        self.device = device

    def record(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def done(self, marker: torch.cuda.Event) -> bool:
        return marker.query()  # cudaEventQuery: answers at once, never waits

    def wait(self, marker: torch.cuda.Event) -> None:
        marker.synchronize()

    def seconds_between(self, earlier: torch.cuda.Event, later: torch.cuda.Event) -> float:
        return earlier.elapsed_time(later) / 1000.0  # milliseconds


class DeviceIdleClock:
    """The device's time between steps, from events on the step's stream (see the module's
    docstring): the gap from each step's end to the next step's beginning, where positive."""

    def __init__(self, events: Events):
        self.events = events
        self.seconds = 0.0
        self._ended: Any = None  # the last step's end, while the next step may follow it
        self._gaps: deque[tuple[Any, Any]] = deque()  # (end, next beginning), not yet read

    def batches(self, batches: Iterator[Batch]) -> Iterator[Batch]:
        return iter(batches)  # the host's wait is no measure here: the events are

    def step_began(self) -> None:
        began = self.events.record()
        if self._ended is not None:
            self._gaps.append((self._ended, began))
        self._ended = None

    def step_ended(self) -> None:
        self._ended = self.events.record()

    def forget(self) -> None:
        self._ended = None

    def read(self) -> None:
        """Add up the gaps the device has passed; the others wait for a later read."""
        while self._gaps and self.events.done(self._gaps[0][1]):
            self._add(self._gaps.popleft())

    def take(self) -> float:
        """The seconds the device waited since the last take, all of them: waits for the last
        gap's end (the interval's end synchronises the device anyway)."""
        if self._gaps:
            self.events.wait(self._gaps[-1][1])
        while self._gaps:
            self._add(self._gaps.popleft())
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    def _add(self, gap: tuple[Any, Any]) -> None:
        self.seconds += max(0.0, self.events.seconds_between(*gap))


def wait_clock(device: torch.device) -> HostWaitClock | DeviceIdleClock:
    """The clock for steps on `device`: the device's idle time on CUDA, the host's wait
    elsewhere."""
    if device.type == "cuda":
        return DeviceIdleClock(CudaEvents(device))
    return HostWaitClock()
