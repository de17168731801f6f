"""Per-step training values kept on the device and read back in batches.

Reading a CUDA tensor on the host (`.item()`, `.tolist()`, `GradScaler.get_scale()`) waits for all
queued work, which stalls the pipeline if done every step. Instead, each step stacks its loss, loss
scale and skip flag into one small device tensor; `flush()` copies everything recorded so far to
pinned host memory without waiting, and hands back the rows of the *previous* flush, whose copy has
long finished. The complete scale history (every step's scale and skip flag) survives this way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepRow:
    step: int
    lr: float
    loss: float
    scale: float
    skipped: bool


class StepHistory:
    def __init__(self, reduce_loss: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """`reduce_loss`, if given, maps each flushed block of losses on the device to what is
        logged, e.g. their mean over the ranks of a distributed run."""
        self._reduce_loss = reduce_loss
        self._meta: list[tuple[int, float]] = []
        self._values: list[torch.Tensor] = []
        self._pending: list[tuple[list[tuple[int, float]], torch.Tensor, object]] = []

    def record(
        self, step: int, lr: float, loss: torch.Tensor, scale: torch.Tensor, skipped: torch.Tensor
    ) -> None:
        """Queue one step's values; no host-device synchronisation."""
        self._meta.append((step, lr))
        self._values.append(torch.stack((loss.detach().float(), scale.float(), skipped.float())))

    def flush(self, wait: bool = False) -> list[StepRow]:
        """Start the copy of what was recorded; return the rows whose copy is done.

        With wait=True every recorded row is returned (one synchronisation), as at an epoch's end.
        """
        if self._values:
            values = torch.stack(self._values)
            if self._reduce_loss is not None:
                values[:, 0] = self._reduce_loss(values[:, 0])
            event = None
            if values.is_cuda:
                host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
                host.copy_(values, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
                values = host
            self._pending.append((self._meta, values, event))
            self._meta, self._values = [], []

        rows: list[StepRow] = []
        while len(self._pending) > (0 if wait else 1):
            meta, values, event = self._pending.pop(0)
            if event is not None:
                event.synchronize()
            for (step, lr), (loss, scale, skipped) in zip(meta, values.tolist(), strict=True):
                rows.append(StepRow(step, lr, loss, scale, skipped > 0))
        return rows
