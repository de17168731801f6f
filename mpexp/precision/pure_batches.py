"""Each parameter group's batches (mpexp/precision/pure_layout.py), their views and the one
workspace they share (mpexp/precision/pure_workspace.py), kept from step to step: made again
only when which parameters step, or how the large ones are laid out, changes."""

from __future__ import annotations

import torch

from mpexp.precision.pure_layout import Batch, aligned, cuttable, plan_batches
from mpexp.precision.pure_updates import COMPENSATION
from mpexp.precision.pure_workspace import BatchViews, Workspace
from mpexp.shards import local_shard


class Batches:
    """The batches of a PureOptimizer (mpexp/precision/pure_step.py)."""

    def __init__(self, optimizer) -> None:
        self.optimizer = optimizer
        self.workspace: Workspace | None = None
        self._views: dict[int, tuple] = {}  # per group: its views and what they were made for

    def clear(self) -> None:
        """Forget every group's views (the states were made or loaded anew)."""
        self._views.clear()

    def of(self, index: int, stepped: list[int], group: dict) -> list[BatchViews]:
        """Group `index`'s batches for the parameters `stepped` (those with gradients)."""
        o = self.optimizer
        big = [i for i in stepped if local_shard(o.params[i]).numel() > o.chunk]
        key = (tuple(stepped), tuple(self._cuttable(i, group) for i in big))
        cached = self._views.get(index)
        if cached is not None and cached[0] == key:
            return cached[1]
        flat = dict(zip(big, key[1], strict=True))
        entries = [(i, local_shard(o.params[i].detach()), flat.get(i, False)) for i in stepped]
        batches = plan_batches(index, entries, o.chunk)
        self._fit(batches)
        states = [o.state[p] for p in o.params]
        sixteen = o.states_dtype != torch.float32
        keys = o.keys(group)
        views = [BatchViews(b, self.workspace, o.params, states, keys, sixteen) for b in batches]
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
        """The most a step holds besides the weights, gradients and states: the workspace
        (as large as the largest group's parameters, or a chunk, before there is one) and the
        count's per-row sums (an eighth of a byte an element)."""
        o = self.optimizer
        if self.workspace is not None:
            extent = self.workspace.extent
        else:
            groups = [[p for p in g["params"]] for g in o.param_groups]
            largest = max(sum(aligned(local_shard(p).numel()) for p in g) for g in groups)
            extent = min(aligned(o.chunk), largest)
        return Workspace.element_bytes(**self.buffers()) * extent + extent // 8 + 4096
