"""The float32 workspace of pure bf16's step, and each batch's views into it.

mpexp/precision/pure_layout.py cuts the parameters into batches of pieces; here a batch gets its
places in one `Workspace` that every batch of every step reuses, and `BatchViews` holds what a
batch works on: its pieces of the weights, gradients and states, their places in the workspace,
and each kind of state as one stretch of memory where the states' buffers allow it.
"""

from __future__ import annotations

import torch

from mpexp.precision.pure_layout import ALIGN, Batch, aligned, stretch
from mpexp.precision.pure_updates import COMPENSATION, StochasticScratch
from mpexp.shards import local_shard


class Workspace:
    """Buffers of `extent` elements: float32 for the weight (`w`), its gradient (`g`, which the
    arithmetic leaves free for a mask, a rounding's integers or Kahan's carried buffer), each
    16-bit state (`m`) and the stored weight before the step (`old`, for Kahan's rounding and the
    count of lost updates); bfloat16 for the rounded weight (`new`); 64-bit random draws for
    stochastic rounding. Kept from step to step: `precision.update_chunk` elements at most (a
    few MiB), which a CPU's allocator would otherwise hand back to the system and fault in again
    every step, and which a CUDA graph needs at fixed addresses."""

    def __init__(
        self, extent: int, device: torch.device, moments: int, old: bool, new: bool, draws: bool
    ) -> None:
        def zeros(dtype=torch.float32, size=extent):
            # zeros: a batch's padding between pieces stays finite and equal in every buffer
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

    def nbytes(self) -> int:
        buffers = [self.w, self.g, *self.m, self.old, self.new, self.draws]
        return sum(b.numel() * b.element_size() for b in buffers if b is not None)

    def scratch(self) -> StochasticScratch:
        """Stochastic rounding's integers: the draws, and `g` as 32-bit integers (free once the
        arithmetic has read the gradient)."""
        return StochasticScratch.over(self.draws, self.g.view(torch.int32))


class BatchViews:
    """One batch's tensors (see the module's docstring). `keys` are the optimizer's state keys
    shaped like their parameter; with `sixteen` they are 16-bit and stepped in the workspace,
    else float32 and stepped in place."""

    def __init__(
        self,
        batch: Batch,
        ws: Workspace,
        params: list[torch.Tensor],
        states: list[dict],
        keys: tuple[str, ...],
        sixteen: bool,
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
            else:
                self.m[key] = self.stored[key]
        self.carried = None
        if COMPENSATION in mine[0][1]:
            self.carried = [p.take(local_shard(s[COMPENSATION])) for p, s in mine]
            self.stretches[COMPENSATION] = stretch(self.carried, self.g)
        self.steps = [s["step"] for _, s in mine] if "step" in mine[0][1] else []
        device = ws.w.device
        self.rows = torch.tensor([aligned(p.size) // ALIGN for p in pieces], device=device)
        self.owner_index = torch.tensor(self.owners, device=device)
        pads = [i for p in pieces for i in range(p.offset + p.size, p.offset + aligned(p.size))]
        self.pads = torch.tensor(pads, dtype=torch.long, device=device) if pads else None
        buffers = [ws.w, ws.g, *ws.m, ws.old, ws.new]
        self._flat = {id(b): b[: self.extent] for b in buffers if b is not None}

    def grads(self) -> list[torch.Tensor]:
        """This step's gradient pieces (a backward pass makes new gradient tensors)."""
        return [p.take(local_shard(self.params[p.param].grad)) for p in self.batch.pieces]

    def flat(self, buffer: torch.Tensor) -> torch.Tensor:
        """The batch's stretch of a workspace buffer, padding included."""
        return self._flat[id(buffer)]

    def zero_padding(self, buffer: torch.Tensor) -> None:
        """Zeros between the pieces (left there by other batches): rounded and compared, they
        stay zero, and Kahan's buffer keeps zeros between its states."""
        if self.pads is not None:
            buffer.index_fill_(0, self.pads, 0)

    def summed(self, mask: torch.Tensor) -> torch.Tensor:
        """Per piece, the sum of a float mask over the batch's stretch (a CPU sums floats
        several times faster than it counts nonzeros): by rows of ALIGN, then over each
        piece's rows (exact: counts below 2^24)."""
        rows = mask.view(-1, ALIGN).sum(1)
        return torch.segment_reduce(rows, "sum", lengths=self.rows)
