"""Per-step training values kept on the device and read back in batches.

Reading a CUDA tensor on the host (`.item()`, `.tolist()`, `GradScaler.get_scale()`) waits for all
queued work, which stalls the pipeline if done every step. Instead, each step stacks its values into
one small device tensor; `flush()` copies everything recorded so far to pinned host memory without
waiting, and hands back the rows of the *previous* flush, whose copy has long finished. The complete
scale history (every step's scale and skip flag) survives this way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


class DeviceRows:
    """Fixed-width rows of device values, each with host-side metadata, read back in batches."""

    def __init__(self, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """`reduce`, if given, maps each flushed block of rows (on the device) to what is read
        back, e.g. values averaged over the ranks of a distributed run."""
        self._reduce = reduce
        self._meta: list[Any] = []
        self._values: list[torch.Tensor] = []
        self._pending: list[tuple[list[Any], torch.Tensor, object]] = []

    def append(self, meta: Any, values: torch.Tensor) -> None:
        """Queue one row (a 1-D tensor, the same width and dtype every time); no synchronisation."""
        self._meta.append(meta)
        self._values.append(values)

    def flush(self, wait: bool = False) -> list[tuple[Any, list[float]]]:
        """Start the copy of what was appended; return the (meta, values) rows whose copy is done.

        With wait=True every appended row is returned (one synchronisation), as at an epoch's end.
        """
        if self._values:
            values = torch.stack(self._values)
            if self._reduce is not None:
                values = self._reduce(values)
            event = None
            if values.is_cuda:
                host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
                host.copy_(values, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
                values = host
            self._pending.append((self._meta, values, event))
            self._meta, self._values = [], []

        rows: list[tuple[Any, list[float]]] = []
        while len(self._pending) > (0 if wait else 1):
            meta, values, event = self._pending.pop(0)
            if event is not None:
                event.synchronize()
            rows.extend(zip(meta, values.tolist(), strict=True))
        return rows


def _in_column(column: int, reduce: Callable[[torch.Tensor], torch.Tensor]):
    def apply(values: torch.Tensor) -> torch.Tensor:
        values[:, column] = reduce(values[:, column])
        return values

    return apply


@dataclass(frozen=True)
class StepRow:
    step: int
    lr: float
    loss: float
    scale: float
    skipped: bool


class StepHistory:
    """Every step's loss, loss scale and skip flag."""

    def __init__(self, reduce_loss: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """`reduce_loss`, if given, maps each flushed block of losses on the device to what is
        logged, e.g. their mean over the ranks of a distributed run."""
        self._rows = DeviceRows(_in_column(0, reduce_loss) if reduce_loss else None)

    def record(
        self, step: int, lr: float, loss: torch.Tensor, scale: torch.Tensor, skipped: torch.Tensor
    ) -> None:
        """Queue one step's values; no host-device synchronisation."""
        # all float32 already (the loss leaves autocast in float32, the scaler keeps float32):
        # one small stack is the whole per-step cost
        values = torch.stack((loss.detach(), scale, skipped))
        self._rows.append((step, lr), values)

    def flush(self, wait: bool = False) -> list[StepRow]:
        """Rows whose copy to the host is done (all of them with wait=True); see DeviceRows."""
        return [
            StepRow(step, lr, loss, scale, skipped > 0)
            for (step, lr), (loss, scale, skipped) in self._rows.flush(wait)
        ]
