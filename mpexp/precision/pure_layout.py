"""Where a pure bf16 step puts each parameter's elements while it computes in float32.

The step walks the parameters in batches of at most `precision.update_chunk` elements: a
parameter that fits is one piece, whole; a larger one is cut into pieces of the chunk's size,
along its memory (or, where its gradient or states are laid out otherwise, along its first
dimension). Each batch's pieces sit one after another in the workspace (mpexp/precision/
pure_workspace.py). The optimizer's 16-bit states are made in the same order, in one buffer per
kind (`zeroed_like`), so that a batch reads and writes each kind of state as one stretch of
memory rather than a piece at a time: on a CPU a copy costs about a microsecond per tensor,
which a model of many small tensors would otherwise pay several times a step. Both follow
`step_order`: the parameters that fit in a chunk first, largest first, so that the small tensors
a model keeps between its large ones (a normalisation's weight and bias between two
convolutions) fill whole batches rather than each making a batch of a few hundred elements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from mpexp.shards import local_shard


def is_dense(t: torch.Tensor) -> bool:
    """Whether `t`'s elements fill one stretch of memory, without gaps or overlaps, in some
    order of its dimensions (contiguous, channels-last, a transpose of either)."""
    expected = 1
    for stride, size in sorted((s, n) for s, n in zip(t.stride(), t.shape, strict=True) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def memory_order(t: torch.Tensor) -> torch.Tensor:
    """A dense tensor's elements as one flat view, in the order memory holds them."""
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


def _contiguous_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


@dataclass(frozen=True)
class Piece:
    """Part of one parameter: `how` is "whole", "flat" (elements start:stop in memory order,
    where the weight, its gradient and its states share one dense layout) or "rows" (rows
    start:stop of the first dimension); `offset` is where it starts in the workspace."""

    param: int
    how: str
    start: int
    stop: int
    offset: int
    shape: tuple[int, ...]  # of its place in the workspace
    stride: tuple[int, ...]

    @property
    def size(self) -> int:
        """Its elements."""
        if self.how == "rows":
            return math.prod(self.shape)
        return self.stop - self.start

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """This piece of `t` (the weight, its gradient or one of its states)."""
        if self.how == "whole":
            return t
        if self.how == "flat":
            return memory_order(t)[self.start : self.stop]
        return t[self.start : self.stop]

    def place(self, buffer: torch.Tensor) -> torch.Tensor:
        """This piece's place in a workspace buffer: laid out as the parameter where it is
        whole and dense, so that its states' stretch and the buffer's match element for
        element."""
        return buffer.as_strided(self.shape, self.stride, self.offset)


@dataclass
class Batch:
    """Pieces of one parameter group's parameters stepped together."""

    group: int
    pieces: list[Piece] = field(default_factory=list)
    # where the batch is a lone piece cut along its memory: its parameter's elements, from its
    # start, whose pieces are each alone in a batch (`_mark_spans`); 0 otherwise
    span: int = 0

    @property
    def extent(self) -> int:
        """The workspace's elements it spans."""
        last = self.pieces[-1]
        return last.offset + last.size


def cuttable(weight: torch.Tensor, others: list[torch.Tensor]) -> bool:
    """Whether a parameter can be cut along its memory: dense, with its gradient and states
    laid out as it is."""
    return is_dense(weight) and all(t.stride() == weight.stride() for t in others)


def step_order(sizes: list[int], chunk: int) -> list[int]:
    """The order (positions in `sizes`, parameters' elements) in which a group's parameters
    are batched and their states laid out: those of at most `chunk` elements first, largest
    first (the smallest then fill the last batches together), then the larger ones, in their
    own order."""
    return sorted(range(len(sizes)), key=lambda i: (sizes[i] > chunk, -min(sizes[i], chunk)))


def plan_batches(group: int, entries: list[tuple[int, torch.Tensor, bool]], chunk: int):
    """The batches of one group: `entries` are (parameter index, its local weight, whether it
    can be cut along its memory), in order. A piece that would overflow a batch starts the
    next one; a first-dimension row larger than `chunk` is a piece of its own."""
    batches, current = [], Batch(group)
    used = 0
    for index, weight, flat in entries:
        for piece in _pieces(index, weight, flat, chunk):
            if current.pieces and used + piece.size > chunk:
                batches.append(current)
                current, used = Batch(group), 0
            current.pieces.append(_at(piece, used))
            used += piece.size
    if current.pieces:
        batches.append(current)
    _mark_spans(batches)
    return batches


def _mark_spans(batches: list[Batch]) -> None:
    """Each batch of a lone piece cut along its memory gets its parameter's `span`: the
    elements from its start whose pieces are each alone in a batch (a compiled step takes
    them in one call)."""
    lone = [b for b in batches if len(b.pieces) == 1 and b.pieces[0].how == "flat"]
    spans: dict[int, int] = {}
    for batch in lone:
        piece = batch.pieces[0]
        if spans.get(piece.param, 0) == piece.start:
            spans[piece.param] = piece.stop
    for batch in lone:
        batch.span = spans.get(batch.pieces[0].param, 0)


def most_pieces(weight: torch.Tensor, chunk: int) -> tuple[int, int]:
    """The most pieces `weight` may be cut into, and the largest of them, whichever way it is
    cut (which the gradient's and states' layouts decide)."""
    ways = [_pieces(0, weight, flat, chunk) for flat in (True, False)]
    return max(len(w) for w in ways), max((p.size for w in ways for p in w), default=0)


def _pieces(index: int, weight: torch.Tensor, flat: bool, chunk: int) -> list[Piece]:
    count = weight.numel()
    if count == 0:
        return []
    if count <= chunk:
        stride = weight.stride() if is_dense(weight) else _contiguous_strides(weight.shape)
        return [Piece(index, "whole", 0, count, 0, tuple(weight.shape), tuple(stride))]
    if flat:
        return [
            Piece(index, "flat", start, min(count, start + chunk), 0, (), (1,))
            for start in range(0, count, chunk)
        ]
    rows, row = weight.shape[0], count // weight.shape[0]
    step = max(1, chunk // row)
    pieces = []
    for start in range(0, rows, step):
        shape = (min(rows, start + step) - start, *weight.shape[1:])
        pieces.append(Piece(index, "rows", start, start + shape[0], 0, shape, ()))
    return pieces


def _at(piece: Piece, offset: int) -> Piece:
    """`piece` placed at `offset`, its workspace shape settled (rows and flat pieces are
    contiguous there)."""
    shape, stride = piece.shape, piece.stride
    if piece.how == "flat":
        shape, stride = (piece.size,), (1,)
    elif piece.how == "rows":
        stride = _contiguous_strides(shape)
    return Piece(piece.param, piece.how, piece.start, piece.stop, offset, shape, stride)


def zeroed_like(params: list[torch.Tensor], dtype: torch.dtype, chunk: int) -> list[torch.Tensor]:
    """A zeroed state for each of `params`, shaped and laid out as it. Those of dense tensors
    that are not sharded share one buffer, one after another in `step_order`, as `plan_batches`
    places their pieces; a sharded (FSDP) parameter's state is sharded as it is, each its own
    tensor."""
    shared = [local_shard(p) is p and is_dense(p) for p in params]
    states: list = [None] * len(params)
    buffer = None
    if any(shared):
        total = sum(p.numel() for p, s in zip(params, shared, strict=True) if s)
        buffer = torch.zeros(total, dtype=dtype, device=params[shared.index(True)].device)
    offset = 0
    for i in step_order([p.numel() for p in params], chunk):
        p = params[i]
        if shared[i]:
            states[i] = buffer.as_strided(p.shape, p.stride(), offset)
            offset += p.numel()
        else:
            states[i] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
    return states


def stretch(pieces: list[torch.Tensor], places: list[torch.Tensor]) -> torch.Tensor | None:
    """The one flat stretch of memory that holds `pieces` (a batch's pieces of one kind of
    state) spaced as `places` (theirs in the workspace) are, from the batch's start: what
    `zeroed_like` makes. None where they are not so laid out."""
    first = pieces[0]
    base = first.storage_offset() - places[0].storage_offset()
    storage = first.untyped_storage()
    for piece, place in zip(pieces, places, strict=True):
        # the storages' own identity: a fake tensor's data pointer is 0 for all of them
        same = piece.untyped_storage()._cdata == storage._cdata
        if not same or piece.stride() != place.stride() or piece.dtype != first.dtype:
            return None
        if piece.storage_offset() - place.storage_offset() != base:
            return None
    extent = places[-1].storage_offset() + places[-1].numel()
    if base < 0 or (base + extent) * first.element_size() > storage.nbytes():
        return None
    return first.as_strided((extent,), (1,), base)


def zeroed_counts(count: int, device: torch.device) -> list[torch.Tensor]:
    """`count` zeroed step counts (0-dim float32, as torch's fused kernels take them), side by
    side in one tensor: a step adds one to all of them in one operation (`side_by_side`), where
    a foreach add over a CPU's separate counts costs about 1.6 µs each, as much as a small
    tensor's whole update."""
    counts = torch.zeros(count, dtype=torch.float32, device=device)
    return [counts[i] for i in range(count)]


def side_by_side(counts: list[torch.Tensor]) -> torch.Tensor | None:
    """The one flat tensor whose elements are `counts` (0-dim tensors) in order, where they lie
    so (`zeroed_counts`); None otherwise."""
    first = counts[0]
    storage, start = first.untyped_storage()._cdata, first.storage_offset()
    for i, count in enumerate(counts):
        if count.dim() != 0 or count.dtype != first.dtype:
            return None
        if count.untyped_storage()._cdata != storage or count.storage_offset() != start + i:
            return None
    if (start + len(counts)) * first.element_size() > first.untyped_storage().nbytes():
        return None
    return first.as_strided((len(counts),), (1,), start)
