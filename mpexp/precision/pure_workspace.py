"""The float32 workspace of pure bf16's step, and each batch's views into it.

mpexp/precision/pure_layout.py cuts the parameters into batches of pieces; here a batch gets its
places in one `Workspace` that every batch of a step reuses, and `BatchViews` holds what a batch
works on: its pieces of the weights, gradients and states, their places in the workspace, each
kind of state as one stretch of memory where the states' buffers allow it, and the count's sums
of a mask over the batch by piece (`PieceBounds`).
"""

from __future__ import annotations

import torch

from mpexp.precision.pure_layout import Batch, stretch
from mpexp.precision.pure_updates import COMPENSATION, StochasticScratch
from mpexp.shards import local_shard

ROW = 64  # elements: the rows a batch's counts are summed by (`BatchViews.summed`)


def aligned(count: int) -> int:
    """`count` rounded up to whole rows."""
    return -(-count // ROW) * ROW


class Workspace:
    """Buffers of `extent` elements: float32 for the weight (`w`), its gradient (`g`, which the
    arithmetic leaves free for a mask, a rounding's integers or Kahan's carried buffer), each
    16-bit state (`m`) and the stored weight before the step (`old`, for Kahan's rounding and the
    count of lost updates); bfloat16 for the rounded weight (`new`); 64-bit random draws for
    stochastic rounding. `precision.update_chunk` elements at most (a few MiB), in whole rows
    of ROW."""

    def __init__(
        self, extent: int, device: torch.device, moments: int, old: bool, new: bool, draws: bool
    ) -> None:
        extent = aligned(extent)  # whole rows, which the counts are summed by

        def zeros(dtype=torch.float32, size=extent):
            return torch.zeros(size, dtype=dtype, device=device)

        self.extent = extent
        self.w, self.g = zeros(), zeros()
        self.m = [zeros() for _ in range(moments)]
        self.old = zeros() if old else None
        self.new = zeros(torch.bfloat16) if new else None
        self.draws = zeros(torch.int64, extent // 4 + 1) if draws else None

    @staticmethod
    def element_bytes(moments: int, old: bool, new: bool, draws: bool) -> int:
        """Bytes per element of a workspace with these buffers."""
        return 4 * (2 + moments + int(old)) + 2 * int(new) + 2 * int(draws)

    def scratch(self) -> StochasticScratch:
        """Stochastic rounding's integers: the draws, and `g` as 32-bit integers (free once the
        arithmetic has read the gradient)."""
        return StochasticScratch.over(self.draws, self.g.view(torch.int32))


class PieceBounds:
    """Whose each of a batch's pieces is, and where the pieces start and the batch ends, on the
    device: what the count's sums need. Made once for each layout of the batches, as a copy from
    the host, which a step must not wait on (nor a CUDA graph's capture make)."""

    def __init__(self, batch: Batch, device: torch.device) -> None:
        pieces = batch.pieces
        self.owners = torch.tensor([p.param for p in pieces], device=device)
        bounds = torch.tensor([p.offset for p in pieces] + [batch.extent], device=device)
        self.before = bounds // ROW  # the whole rows before each bound
        # the row each bound falls in (the batch's end may be the end of its last row)
        self.row = self.before.clamp(max=aligned(batch.extent) // ROW - 1)
        self.past = torch.arange(ROW, device=device) >= (bounds % ROW)[:, None]

    @staticmethod
    def nbytes(pieces: int, batches: int) -> int:
        """The bytes of `batches` batches' of `pieces` pieces in all."""
        return 8 * pieces + (16 + ROW) * (pieces + batches)


class BatchViews:
    """One batch's tensors (see the module's docstring). `keys` are the optimizer's state keys
    shaped like their parameter; with `sixteen` they are 16-bit and stepped in the workspace,
    else float32 and stepped in place. `bounds` are the batch's `PieceBounds`."""

    def __init__(
        self,
        batch: Batch,
        ws: Workspace,
        params: list[torch.Tensor],
        states: list[dict],
        keys: tuple[str, ...],
        sixteen: bool,
        bounds: PieceBounds,
    ) -> None:
        pieces = batch.pieces
        self.batch, self.extent = batch, batch.extent
        self.params = params
        self.owners = [p.param for p in pieces]
        self.weights = [p.take(local_shard(params[p.param].detach())) for p in pieces]
        self.w = [p.place(ws.w) for p in pieces]
        self.g = [p.place(ws.g) for p in pieces]
        self.new = [p.place(ws.new) for p in pieces] if ws.new is not None else None
        mine = list(zip(pieces, [states[p.param] for p in pieces], strict=True))
        self.stored = {k: [p.take(local_shard(s[k])) for p, s in mine] for k in keys}
        self.m, self.stretches = {}, {}
        for i, key in enumerate(keys):
            if sixteen:
                self.m[key] = [p.place(ws.m[i]) for p in pieces]
                self.stretches[key] = stretch(self.stored[key], self.m[key])
            else:  # stepped in place; their stretch is for the compiled update
                self.m[key] = self.stored[key]
                self.stretches[key] = stretch(self.stored[key], self.w)
        self.carried = None
        if COMPENSATION in mine[0][1]:
            self.carried = [p.take(local_shard(s[COMPENSATION])) for p, s in mine]
            self.stretches[COMPENSATION] = stretch(self.carried, self.g)
        self.steps = [s["step"] for _, s in mine] if "step" in mine[0][1] else []
        self.owner_index = bounds.owners
        self._bounds = bounds
        buffers = [ws.w, ws.g, *ws.m, ws.old, ws.new]
        self._flat = {id(b): b[: self.extent] for b in buffers if b is not None}
        self.ws = ws  # the workspace the views are into

    def grads(self) -> list[torch.Tensor]:
        """This step's gradient pieces (a backward pass makes new gradient tensors)."""
        return [p.take(local_shard(self.params[p.param].grad)) for p in self.batch.pieces]

    def flat(self, buffer: torch.Tensor) -> torch.Tensor:
        """The batch's stretch of a workspace buffer."""
        return self._flat[id(buffer)]

    def summed(self, buffer: torch.Tensor | None = None) -> torch.Tensor:
        """Per piece, the sum of the float mask in `ws.g` (or `buffer`, another of the
        workspace's float32 buffers, or one viewed as bf16) over the batch (a CPU sums floats
        several times faster than it counts nonzeros): the running sum of the rows before each
        bound, plus the part of the bound's own row before it, differenced from bound to bound.
        Exact (whole numbers up to 2^24, `precision.update_chunk`'s limit), and device work
        only (segment_reduce, which could sum by piece, checks its lengths on the host)."""
        # the mask in rows (the last one runs past the batch into elements not counted)
        buffer = self.ws.g if buffer is None else buffer
        rows, b = buffer[: aligned(self.extent)].view(-1, ROW), self._bounds
        summed = rows.sum(1, dtype=torch.float32)
        running = torch.cat((summed.new_zeros(1), summed.cumsum(0)))
        part = rows.index_select(0, b.row).masked_fill_(b.past, 0).sum(1, dtype=torch.float32)
        return torch.diff(running.index_select(0, b.before) + part)
