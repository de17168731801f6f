"""One optimizer step, `train_step`: the same code for every precision, loss-scaling strategy
and task. The Stepper (mpexp/step/stepper.py) runs it with its bookkeeping on the device."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F

from mpexp.precision.loss_scaler import LossScaler
from mpexp.precision.modes import Precision
from mpexp.step.schedules import Schedule


def train_step(
    model,
    inputs,
    targets,
    optimizer,
    scaler: LossScaler,
    precision: Precision,
    accumulate: int = 1,
    clip_grad_norm: float | None = None,
    inspect=None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = F.cross_entropy,
    schedule: Schedule | None = None,
):
    """One optimizer step; the same code for every precision, loss-scaling strategy and task.

    `loss_fn(output, targets)` is the task's loss (mpexp/tasks/), a batch mean; with None,
    `model(inputs, targets)` gives that loss itself, as the terms that add up to it (an
    Objective, mpexp/step/objective.py: the model and its loss compiled together, as the loop
    runs them). Returns the batch's loss terms, detached (one where the loss has no others). The
    batch is
    split into `accumulate` micro-batches, each scaled and back-propagated on its own; their
    losses are weighted by size so the gradients add up to the whole batch's. `inspect`, if given,
    sees the gradients in true units before clipping (diagnostics). A `schedule` on the device
    counts the step unless it was skipped and sets the next step's rate.

    Gradients are unscaled before the step only when something reads them there (`inspect`,
    clipping, a calibrating scaler). Otherwise `scaler.step` unscales them: a fused optimizer
    does it inside its update kernel, sparing a separate multiply over every gradient.
    """
    if accumulate == 1:  # the common case, straight: no chunks, no weights, no accumulator
        with precision.autocast(cache=False):  # forward only: backward runs outside autocast
            terms = _loss_terms(model, loss_fn, inputs, targets)
        scaler.scale(terms.sum()).backward()
        total = terms.detach()
    else:
        total = 0.0
        chunks = list(zip(inputs.chunk(accumulate), targets.chunk(accumulate), strict=True))
        for i, (x, y) in enumerate(chunks):
            # under DDP, all-reduce the gradients once, with the last micro-batch's backward
            last = i == len(chunks) - 1
            with _no_grad_sync(model, last):
                with precision.autocast(cache=False):
                    terms = _loss_terms(model, loss_fn, x, y) * (len(y) / len(targets))
                scaler.scale(terms.sum()).backward()
            total = total + terms.detach()
    if inspect is not None or clip_grad_norm is not None or scaler.needs_true_units():
        scaler.unscale_(optimizer)  # once, after the last micro-batch: true units from here on
    if inspect is not None:
        inspect()
    if clip_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)
    scaler.step(optimizer)  # skipped when the gradients (or the loss) are not finite
    if schedule is not None:
        schedule.after_step(scaler.found_inf())
    return total


def _loss_terms(model, loss_fn, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    if loss_fn is None:
        return model(inputs, targets)
    return loss_fn(model(inputs), targets).reshape(1)


def _no_grad_sync(model, last: bool) -> contextlib.AbstractContextManager:
    if last or not hasattr(model, "no_sync"):  # DDP has no_sync; a plain module needs none
        return contextlib.nullcontext()
    return model.no_sync()
