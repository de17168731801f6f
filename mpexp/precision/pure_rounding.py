"""How pure bf16's step stores its float32 results: the 16-bit states and the weights, rounded
as `precision.update_rounding` says, and the count of the updates that rounding lost.

Each function works on one batch (mpexp/precision/pure_workspace.py): on its flat stretch of the
workspace where the arithmetic is elementwise (Kahan's sums, the rounding, the masks), so that
a batch of many small tensors pays one operation, not one per tensor; on its pieces only where
the weights' and gradients' own tensors are read or written.
"""

from __future__ import annotations

import torch

from mpexp.precision.pure_updates import COMPENSATION, UpdatesLost, round_stochastic
from mpexp.precision.pure_workspace import BatchViews, Workspace


def load_states(views: BatchViews, ws: Workspace, keys: tuple[str, ...]) -> None:
    """The batch's 16-bit states upcast into the workspace."""
    for i, key in enumerate(keys):
        stretch = views.stretches[key]
        if stretch is not None:
            views.flat(ws.m[i]).copy_(stretch)
        else:
            torch._foreach_copy_(views.m[key], views.stored[key])


def store_states(
    views: BatchViews, ws: Workspace, keys: tuple[str, ...], generator: torch.Generator | None
) -> None:
    """The stepped states rounded back into their 16-bit tensors: to nearest, or, with a
    `generator`, stochastically (so that a state whose steps are below its resolution still
    moves in expectation)."""
    for i, key in enumerate(keys):
        stretch, value = views.stretches[key], views.flat(ws.m[i])
        if generator is None:
            if stretch is not None:
                stretch.copy_(value)
            else:
                torch._foreach_copy_(views.stored[key], views.m[key])
            continue
        rounded = stretch if stretch is not None else views.flat(ws.new)
        round_stochastic(value, generator, rounded, ws.scratch())
        if stretch is None:
            torch._foreach_copy_(views.stored[key], views.new)


def store_weights(
    rounding: str,
    views: BatchViews,
    ws: Workspace,
    generator: torch.Generator | None,
    lost: UpdatesLost | None,
    found_inf: torch.Tensor | None,
) -> None:
    """The float32 weights (`ws.w`) stored in the bf16 weights as `rounding` says; with `lost`,
    the count of the elements whose update was nonzero and of those the stored weight kept
    (`ws.old` holds the weights before the step). `ws.g` is free: the arithmetic has read the
    gradient, so it takes the masks, the rounding's integers and Kahan's buffer in turn."""
    w, g = views.flat(ws.w), views.flat(ws.g)
    old = views.flat(ws.old) if ws.old is not None else None
    counting = lost is not None
    if counting:
        torch.ne(w, old, out=g)
        moved = views.summed()
    if rounding == "nearest" and not counting:
        torch._foreach_copy_(views.weights, views.w)  # rounded to nearest by the copy
        return
    new = views.flat(ws.new)
    if rounding == "kahan":
        changed = _kahan(views, ws, found_inf, counting)
    else:
        if rounding == "nearest":
            new.copy_(w)
        else:
            round_stochastic(w, generator, new, ws.scratch())
        changed = None
        if counting:
            torch.ne(g.copy_(new), old, out=g)
            changed = views.summed()
    if counting:
        lost.add_pieces(views.owner_index, moved, changed)
    torch._foreach_copy_(views.weights, views.new)


def _load_carried(views: BatchViews, ws: Workspace) -> torch.Tensor:
    """Kahan's buffer upcast into `ws.g`."""
    carried, stretch = views.flat(ws.g), views.stretches[COMPENSATION]
    if stretch is not None:
        carried.copy_(stretch)
    else:
        torch._foreach_copy_(views.g, views.carried)
    return carried


def _kahan(
    views: BatchViews, ws: Workspace, found_inf: torch.Tensor | None, counting: bool
) -> torch.Tensor | None:
    """optimi's order: the update wanted plus what earlier roundings lost, added to the stored
    weight and rounded to nearest (into `ws.new`); what this rounding left out is kept in Kahan's
    buffer for the next step. A skipped step (the kernel left `ws.w` at `ws.old`) adds nothing,
    not even the buffer, and leaves the buffer as it was. Returns, when `counting`, how many
    weights of each piece the step changed."""
    w, old, g, new = (views.flat(b) for b in (ws.w, ws.old, ws.g, ws.new))
    wanted = w.sub_(old)
    carried = _load_carried(views, ws)
    if found_inf is None:
        wanted.add_(carried)
    else:
        wanted.addcmul_(carried, 1 - found_inf)
    new.copy_(torch.add(old, wanted, out=g))
    # old - new: exactly the negative of new - old, what the rounding applied
    unapplied = old.sub_(g.copy_(new))
    wanted.add_(unapplied)  # what the rounding left out of the sum
    changed = None
    if counting:
        torch.ne(unapplied, 0, out=g)
        changed = views.summed()
    if found_inf is not None:
        wanted.addcmul_(_load_carried(views, ws), found_inf)
    stretch = views.stretches[COMPENSATION]
    if stretch is not None:
        stretch.copy_(wanted)
    else:
        torch._foreach_copy_(views.carried, views.w)
    return changed
