"""Per-step training values kept on the device and read back in batches.

Reading a CUDA tensor on the host (`.item()`, `.tolist()`, `GradScaler.get_scale()`) waits for all
queued work, which stalls the pipeline if done every step. Instead, each step writes its values into
a row of a small device tensor; `flush()` copies everything recorded so far to pinned host memory
without waiting, and hands back the rows of the *previous* flush, whose copy has long finished. The
complete scale history (every step's scale and skip flag) survives this way, also from steps
replayed as a CUDA graph (mpexp/step/step_graph.py). The user's own tensors (`mpexp.log`) are read
back the same way (`OwnRows`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


class DeviceRows:
    """Fixed-width rows of device values, each with host-side metadata, read back in batches."""

    def __init__(self, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """`reduce`, if given, maps each flushed block of rows (on the device) to what is read
        back, e.g. values averaged over the ranks of a distributed run."""
        self._reduce = reduce
        self._meta: list[Any] = []
        self._values: list[torch.Tensor] = []  # blocks of rows
        self._pending: list[tuple[list[Any], torch.Tensor, object]] = []

    def append(self, meta: Any, values: torch.Tensor) -> None:
        """Queue one row (a 1-D tensor, the same width and dtype every time); no synchronisation."""
        self._meta.append(meta)
        self._values.append(values.unsqueeze(0))

    def append_block(self, metas: list[Any], values: torch.Tensor) -> None:
        """Queue several rows at once: `values` holds one row per entry of `metas`."""
        self._meta.extend(metas)
        self._values.append(values)

    def flush(self, wait: bool = False) -> list[tuple[Any, list[float]]]:
        """Start the copy of what was appended; return the (meta, values) rows whose copy is done.

        With wait=True every appended row is returned (one synchronisation), as at an epoch's end.
        """
        if self._values:
            values = torch.cat(self._values)
            if self._reduce is not None:
                values = self._reduce(values)
            self._pending.append((self._meta, *_copy_to_host(values)))
            self._meta, self._values = [], []

        rows: list[tuple[Any, list[float]]] = []
        while len(self._pending) > (0 if wait else 1):
            meta, values, event = self._pending.pop(0)
            if event is not None:
                event.synchronize()
            rows.extend(zip(meta, values.tolist(), strict=True))
        return rows


def _copy_to_host(values: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """Start copying `values` to pinned host memory without waiting; return the copy and the event
    that marks it done (none for values not on a GPU, which `tolist` reads as they are)."""
    if not values.is_cuda:
        return values, None
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(values.device))
    return host, event


class OwnRows:
    """The user's rows from `mpexp.log` whose values include tensors, read back in batches.

    `start` stacks the tensors of the rows handed to it (one block per device they are on) and
    starts copying them to the host without waiting; `done` returns the rows whose copy has
    finished, their tensors replaced by numbers: those of earlier starts, or all with wait=True.
    """

    def __init__(self) -> None:
        # rows whose tensors are replaced by their device, and each device's block on its way
        self._pending: list[tuple[list[dict], dict[torch.device, tuple]]] = []

    def start(self, rows: list[dict[str, Any]]) -> None:
        """Start reading the tensors of `rows` (mpexp.log's, in call order); no synchronisation."""
        if not rows:
            return
        blocks: dict[torch.device, list[torch.Tensor]] = {}
        for row in rows:
            for value in row.values():
                if isinstance(value, torch.Tensor):
                    blocks.setdefault(value.device, []).append(value)
                    if value.is_cuda:
                        # it may come from another stream (a CUDA graph's warm-up steps run on
                        # one): its memory must not be handed out there before the stack reads it
                        value.record_stream(torch.cuda.current_stream(value.device))
        copies = {device: _copy_to_host(torch.stack(values)) for device, values in blocks.items()}
        placed = [
            {k: v.device if isinstance(v, torch.Tensor) else v for k, v in row.items()}
            for row in rows
        ]  # the device tensors can go once stacked
        self._pending.append((placed, copies))

    def done(self, wait: bool = False) -> list[dict[str, Any]]:
        """The rows whose copy has finished, as numbers (every row with wait=True: one wait)."""
        rows: list[dict[str, Any]] = []
        while len(self._pending) > (0 if wait else 1):
            placed, copies = self._pending.pop(0)
            numbers = {}
            for device, (values, event) in copies.items():
                if event is not None:
                    event.synchronize()
                numbers[device] = iter(values.tolist())
            rows += [
                {k: next(numbers[v]) if isinstance(v, torch.device) else v for k, v in row.items()}
                for row in placed
            ]
        return rows


def _in_columns(columns: list[int], reduce: Callable[[torch.Tensor], torch.Tensor]):
    def apply(values: torch.Tensor) -> torch.Tensor:
        values[:, columns] = reduce(values[:, columns])
        return values

    return apply


@dataclass(frozen=True)
class StepRow:
    step: int
    lr: float
    loss: float
    scale: float
    skipped: bool
    floor_hit: bool = False  # the scale wanted to back off below loss_scaling.min_scale
    terms: dict[str, float] = field(default_factory=dict)  # the loss's other terms, by key


class StepHistory:
    """Every step's loss, loss scale, skip flag and floor flag, in a ring of rows on the device.

    The host notes each step's number and learning rate (`note`); the step itself writes its row
    into the ring (`record`), at the host's count when it runs eagerly, or at a position the
    device keeps when it is replayed from a CUDA graph, where no host value can reach it.
    `flush` copies the rows written since the last one to the host without waiting.
    """

    WIDTH = 5  # loss, scale, skipped, floor hit, learning rate (a device schedule's)

    def __init__(
        self,
        capacity: int = 64,
        device: torch.device | str = "cpu",
        reduce_loss: Callable[[torch.Tensor], torch.Tensor] | None = None,
        terms: tuple[str, ...] = (),
    ) -> None:
        """`capacity`: the most steps between two flushes that a captured step may write
        (eager steps grow the ring as needed). `reduce_loss`, if given, maps each flushed block
        of losses on the device to what is logged, e.g. their mean over the ranks of a
        distributed run. `terms` names the loss's terms beyond the first (`Task.term_names`),
        each a column after the others, reduced as the loss is."""
        self.terms = terms
        self.width = self.WIDTH + len(terms)
        self._ring = torch.zeros((capacity, self.width), device=device)
        self._position = torch.zeros((), dtype=torch.long, device=device)
        self._row_numbers = torch.arange(capacity, device=device)
        self._device_at: int | None = 0  # what `_position` holds, as far as the host knows
        self._captured = False  # whether a captured step writes into the ring
        self._meta: list[tuple[int, float | None]] = []
        self._no_lr = torch.zeros(1, device=device)  # the column's value where the host knows it
        losses = [0, *range(self.WIDTH, self.width)]
        self._rows = DeviceRows(_in_columns(losses, reduce_loss) if reduce_loss else None)

    def note(self, step: int, lr: float | None) -> None:
        """The host's part of a step's row, before the step runs: its number, and its learning
        rate where the host knows it (None: a device schedule's, which the row records)."""
        self._meta.append((step, lr))

    def _parts(self, before_update, floor_hit, lr, terms) -> tuple[torch.Tensor, ...]:
        lr = self._no_lr if lr is None else lr.reshape(1)
        parts = (before_update, floor_hit.reshape(1), lr)
        return parts if terms is None or not len(terms) else (*parts, terms)

    def record(
        self,
        before_update: torch.Tensor,
        floor_hit: torch.Tensor,
        lr: torch.Tensor | None = None,
        terms: torch.Tensor | None = None,
    ) -> None:
        """Write the step's row: `before_update` is (loss, scale, skipped) stacked before the
        scaler's update, `floor_hit` what the update decided, `lr` the step's learning rate on
        the device (None where the host noted it), `terms` the loss's other terms (1-D, as
        `terms` named them). Eager: at the host's count."""
        row = len(self._meta) - 1
        if row >= len(self._ring):
            if self._captured:  # a captured step writes into this ring: it must stay
                raise RuntimeError(
                    f"{row + 1} steps since the last flush, but the history ring holds "
                    f"{len(self._ring)}: flush at least every {len(self._ring)} steps."
                )
            grown = self._ring.new_zeros((2 * len(self._ring), self.width))
            grown[: len(self._ring)] = self._ring
            self._ring = grown
        torch.cat(self._parts(before_update, floor_hit, lr, terms), out=self._ring[row])

    def record_captured(
        self,
        before_update: torch.Tensor,
        floor_hit: torch.Tensor,
        lr: torch.Tensor | None = None,
        terms: torch.Tensor | None = None,
    ) -> None:
        """`record` for a step captured in a CUDA graph: at the position the device keeps."""
        self._captured = True
        row = torch.cat(self._parts(before_update, floor_hit, lr, terms)).unsqueeze(0)
        # a select, not index_copy_: under deterministic algorithms indexing may take a path
        # that checks its index on the host, which a capture cannot hold
        here = (self._row_numbers == self._position).unsqueeze(1)
        torch.where(here, row, self._ring, out=self._ring)
        self._position.add_(1)

    def before_replay(self) -> None:
        """Point the device's position at this step's row, if the host's count has moved on
        without it (eager steps, a flush); then account for the replay's own increment."""
        row = len(self._meta) - 1
        if row >= len(self._ring):
            raise RuntimeError(
                f"{row + 1} steps since the last flush, but the history ring holds "
                f"{len(self._ring)}: flush at least every {len(self._ring)} steps."
            )
        if self._device_at != row:
            self._position.fill_(row)
        self._device_at = row + 1

    def flush(self, wait: bool = False) -> list[StepRow]:
        """Rows whose copy to the host is done (all of them with wait=True); see DeviceRows."""
        if self._meta:
            # a copy: the ring's rows are written again from the next step on
            self._rows.append_block(self._meta, self._ring[: len(self._meta)].clone())
            self._meta = []
        return [
            StepRow(
                step,
                _float32(device_lr) if lr is None else lr,
                loss,
                scale,
                skipped > 0,
                floor > 0,
                dict(zip(self.terms, terms, strict=True)),
            )
            for (step, lr), (loss, scale, skipped, floor, device_lr, *terms) in self._rows.flush(
                wait
            )
        ]


def _float32(value: float) -> float:
    """A float32 read back, as the shortest decimal that is that float32: a device schedule's
    rate of 3e-3 logs as 0.003, not as 0.003000000026077032."""
    return float(str(np.float32(value)))
