"""`mpexp.log`: the run it logs into, and that run's rows of the user's own values, held with
their tensors on the device until the loop reads them with its own."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

from mpexp.tracking.user_values import is_tensor, taken_values

log = logging.getLogger(__name__)


class RunSink(Protocol):
    """Where `mpexp.log` puts values: a Tracker, or a NullTracker on ranks > 0."""

    def log_own(self, values: Mapping[str, Any], step: int | None = None) -> None: ...


# The run that `mpexp.log` logs into, and the process it belongs to: a process forked from it (a
# DataLoader worker) holds a copy whose files and W&B pipe are not its own.
_user_logs: tuple[RunSink, int] | None = None
_passes = threading.local()  # `off`: this thread runs a pass of the model that is no step


@contextlib.contextmanager
def user_logs_off() -> Iterator[None]:
    """`mpexp.log` does nothing in this thread meanwhile: for passes of the model that are no
    training step, as the FLOP count's on the meta device (mpexp/step/flops.py), whose values
    would land at whatever step trains meanwhile."""
    was, _passes.off = getattr(_passes, "off", False), True
    try:
        yield
    finally:
        _passes.off = was


def take_user_logs(tracker: RunSink | None, closing: Any = None) -> None:
    """Make `tracker` the one `mpexp.log` logs into; None (from `closing`): no run any more."""
    global _user_logs
    if tracker is not None:
        _user_logs = (tracker, os.getpid())
    elif _user_logs is not None and _user_logs[0] is closing:
        _user_logs = None


def log_values(values: Mapping[str, Any], step: int | None = None) -> None:
    """`mpexp.log`: values of your own into the run that is training, `mpexp.log({"my/v": 0.5})`.

    For code of yours that mpexp runs (a model, dataset, loss scaler or schedule): the values go
    into the run's metrics.jsonl as a row `{"step": ..., **values}` and into its W&B run, plotted
    against `step`. `step` defaults to the training step in progress (0 before the first). Values
    are real numbers (Python's, NumPy's scalars and one-element arrays, one-element tensors),
    booleans, strings or `mpexp.tracking.Histogram`s; nested dicts are flattened (`{"a": {"b": 1}}`
    logs `a/b`). A tensor is copied on its device as float32 and read with the loop's own values,
    once per `trainer.log_every` steps, so logging it never waits for the device. A value it cannot
    take is dropped with a warning naming the call, once per call site and key: training goes on.
    Keys under mpexp's own names (`train/`, `val/`, `amp/`, `perf/`, `mem/`, `diag/`, `lr`,
    `step`, `epoch`) are refused (LogError). Does nothing
    outside a run, in processes other than the run's (DataLoader workers), on ranks other than 0
    of a distributed run, which write no metrics, and in the FLOP count's pass (user_logs_off).
    See docs/wandb.md, "Your own values".
    """
    if _user_logs is None or _user_logs[1] != os.getpid() or getattr(_passes, "off", False):
        return
    _user_logs[0].log_own(values, step)


class UserRows:
    """One run's rows of `mpexp.log`: from the first one holding a tensor on, they wait in call
    order until the loop reads them with its own values (`take_waiting`), or a checkpoint or the
    end writes them (`read_waiting`)."""

    def __init__(self) -> None:
        self._keys: set[str] = set()  # the earlier rows' keys: the tracker defines new ones in W&B
        self._waiting: list[dict[str, Any]] = []
        self._warned_capture = False
        self._warned: set[tuple[str | None, str]] = set()  # mpexp.log's dropped values, said

    def row(self, values: Mapping[str, Any], step: int) -> dict[str, Any] | None:
        """`values` as a row at `step`, their tensors copied on the device; None when no value
        is left to log."""
        values = taken_values(values, self._warned)
        if not values:
            return None
        tensors = [value for value in values.values() if is_tensor(value)]
        if tensors and not self._values_to_keep(tensors):
            return None
        row = {"step": step}
        row.update((k, _copied(v) if is_tensor(v) else v) for k, v in values.items())
        return row

    def new_keys(self, row: dict[str, Any]) -> list[str]:
        """The row's keys that no earlier row had (its step aside)."""
        new = [key for key in row if key != "step" and key not in self._keys]
        self._keys.update(new)
        return new

    def hold(self, row: dict[str, Any]) -> bool:
        """Keep `row` to be read later when it holds a tensor or rows wait before it (so that
        rows stay in call order); False: it can be logged now."""
        if any(is_tensor(v) for v in row.values()) or self._waiting:
            self._waiting.append(row)
            return True
        return False

    def take_waiting(self) -> list[dict[str, Any]]:
        """The user's rows held since the last call, in call order, their tensors still on the
        device: the loop reads them with its own values and logs them (mpexp/step/readback.py)."""
        rows, self._waiting = self._waiting, []
        return rows

    def _values_to_keep(self, tensors: list[Any]) -> bool:
        """Whether a call's tensors hold values: not on the meta device (a pass that only works
        out shapes), nor in a CUDA graph's capture, whose replays run no Python (said once)."""
        if any(t.is_meta for t in tensors):
            return False
        if not (any(t.is_cuda for t in tensors) and _capturing()):
            return True
        if not self._warned_capture:
            log.warning(
                "mpexp.log was called inside the training step as it was captured as a CUDA "
                "graph: a replayed step runs no Python, so values logged from inside the step "
                "(the model's forward, say) are logged only from the steps that run eagerly (the "
                "warm-up steps before the capture, and steps that cannot be replayed). "
                "trainer.cuda_graph=false logs them at every step."
            )
            self._warned_capture = True
        return False

    def read_waiting(self) -> list[dict[str, Any]]:
        """The rows still held, their tensors read one by one: at a checkpoint and at the end,
        which wait for the device anyway."""
        rows, self._waiting = self._waiting, []
        try:
            return [{k: float(v) if is_tensor(v) else v for k, v in row.items()} for row in rows]
        except RuntimeError as err:  # a device that failed: the error that ends the run says so
            log.warning("%d rows of mpexp.log could not be read (%s).", len(rows), err)
            return []


def _copied(value: Any) -> Any:
    """A 0-d tensor's value as it is now, as float32 on its device: one small copy, no wait. A
    copy, not the tensor itself: it may change in place before it is read (a buffer, a
    parameter), or be overwritten (an output of CUDA graphs); detached, it keeps no autograd
    graph alive."""
    import torch

    return value.detach().to(torch.float32, copy=True)


def _capturing() -> bool:
    import torch

    return torch.cuda.is_current_stream_capturing()
