"""Each parameter group's batches (mpexp/precision/pure_layout.py), their views and the one
workspace they share (mpexp/precision/pure_workspace.py).

How the batches are laid out, and where their pieces start on the device, is kept from step to
step, made again only when which parameters step, or how the large ones are laid out, changes.
On a CPU the workspace and the views into it are kept too: its allocator would hand the
workspace back to the system and fault it in again every step, and making a batch's views costs
microseconds a piece, which a step of small tensors would pay again every time. On a GPU the
workspace is let go after each step, so that it is not held through the next forward and
backward passes beside their activations (a caching allocator hands its memory to them; a step
captured in a CUDA graph keeps it in the graph's own memory)."""

from __future__ import annotations

import torch

from mpexp.precision.pure_compiled import CompiledUpdate
from mpexp.precision.pure_layout import Batch, cuttable, most_pieces, plan_batches, step_order
from mpexp.precision.pure_updates import COMPENSATION
from mpexp.precision.pure_workspace import BatchViews, PieceBounds, Workspace, aligned
from mpexp.shards import local_shard


class Batches:
    """The batches of a PureOptimizer (mpexp/precision/pure_step.py)."""

    def __init__(self, optimizer) -> None:
        self.optimizer = optimizer
        self.workspace: Workspace | None = None
        # whether the workspace and views are kept between steps (see the module's docstring)
        self.kept = optimizer.device_type == "cpu"
        # per group: what its batches were made for, and the batches with their PieceBounds
        self._layouts: dict[int, tuple] = {}
        self._views: dict[int, tuple] = {}  # per group: what they were made for, its views

    def clear(self) -> None:
        """Forget every group's views (the states were made or loaded anew)."""
        self._views.clear()

    def after_step(self) -> None:
        """Let the workspace go where it is not kept from step to step."""
        if not self.kept:
            self.workspace = None
            self._views.clear()

    def of(self, index: int, stepped: list[int], group: dict) -> list[BatchViews]:
        """Group `index`'s batches for the parameters `stepped` (those with gradients)."""
        o = self.optimizer
        big = [i for i in stepped if local_shard(o.params[i]).numel() > o.chunk]
        key = (tuple(stepped), tuple(self._cuttable(i, group) for i in big))
        cached = self._views.get(index)
        if cached is not None and cached[0] == key:
            return cached[1]
        layout = self._layouts.get(index)
        if layout is None or layout[0] != key:
            flat = dict(zip(big, key[1], strict=True))
            weights = [local_shard(o.params[i].detach()) for i in stepped]
            order = step_order([w.numel() for w in weights], o.chunk)
            entries = [(stepped[j], weights[j], flat.get(stepped[j], False)) for j in order]
            batches = plan_batches(index, entries, o.chunk)
            device = local_shard(o.params[0].detach()).device
            layout = (key, batches, [PieceBounds(b, device) for b in batches])
            self._layouts[index] = layout
        _, batches, bounds = layout
        self._fit(batches)
        states = [o.state[p] for p in o.params]
        sixteen = o.states_dtype != torch.float32
        keys, ws = o.keys(group), self.workspace
        views = [
            BatchViews(b, ws, o.params, states, keys, sixteen, s)
            for b, s in zip(batches, bounds, strict=True)
        ]
        self._views[index] = (key, views)
        return views

    def _cuttable(self, index: int, group: dict) -> bool:
        """Whether parameter `index` is cut along its memory (its gradient and states laid out
        as it is) rather than along its first dimension."""
        o = self.optimizer
        p = o.params[index]
        state = o.state[p]
        others = [p.grad, *(state[k] for k in (*o.keys(group), COMPENSATION) if k in state)]
        return cuttable(local_shard(p.detach()), [local_shard(t) for t in others])

    def _fit(self, batches: list[Batch]) -> None:
        """A workspace as large as the largest batch so far (a new one drops every group's
        views into the old)."""
        extent = max(b.extent for b in batches)
        if self.workspace is not None and self.workspace.extent >= extent:
            return
        if self.workspace is not None:
            extent = max(extent, self.workspace.extent)
            self._views.clear()
        o = self.optimizer
        self.workspace = Workspace(extent, o.params[0].device, **self.buffers())

    def buffers(self) -> dict:
        """Which workspace buffers the optimizer's steps use."""
        o = self.optimizer
        sixteen = o.states_dtype != torch.float32
        moments = max(len(o.keys(g)) for g in o.param_groups) if sixteen else 0
        counting = o.lost is not None
        return {
            "moments": moments,
            "old": o.rounding == "kahan" or counting,
            "new": o.rounding != "nearest" or counting,
            "draws": o.rounding == "stochastic",
        }

    def bound(self) -> int:
        """The most a step holds besides the weights, gradients and states, whichever
        parameters step and however the large ones are cut: the workspace (a chunk, or the
        largest group's parameters if fewer, or a first-dimension row larger than a chunk),
        every batch's PieceBounds, and the count's sums during a batch (a fifth of a byte a
        workspace element, 300 bytes a piece; a batch holds at most one piece of each
        parameter)."""
        o = self.optimizer
        groups = [[local_shard(p) for p in g["params"]] for g in o.param_groups]
        cuts = [most_pieces(p, o.chunk) for g in groups for p in g]
        largest = max(min(o.chunk, sum(p.numel() for p in g)) for g in groups)
        extent = aligned(max(largest, *(size for _, size in cuts)))
        pieces = sum(count for count, _ in cuts)  # a batch holds one piece at least
        in_batch = max(len(g) for g in groups)
        workspace = Workspace.element_bytes(**self.buffers()) * extent
        if o.compiles:  # the compiled update's gathered weights and gradients, in bf16
            workspace += CompiledUpdate.gather_bytes(extent, o.device_type)
        sums = extent // 5 + 300 * (in_batch + 1)
        return workspace + sums + PieceBounds.nbytes(pieces, pieces) + 4096
