"""The model and its task's loss as one module, so that `torch.compile` sees both.

Compiled alone, a model hands its output to a loss that runs eagerly after the compiled graph:
a language model's logits then leave the graph whole, and the loss reads them again (on GPT-2
small, about a quarter of a step's memory traffic). nanoGPT computes its loss in the model's own
forward pass, so the compiler fuses the two; `Objective` does the same for any model and task
without the model knowing its task: called with a batch, it gives the task's training loss in
training mode (as its terms, `Task.loss_terms`) and validation's sums (`Task.val_sums`) in eval
mode, and the loop compiles it
whole (mpexp/build.py).

It holds no weights of its own: checkpoints, diagnostics and optimizers keep using the model.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from mpexp.tasks.base import Task


class Objective(nn.Module):
    """`objective(inputs, targets)`: the terms of the task's loss of the model's output when
    training (a 1-D tensor, summing to the loss), its validation sums in eval mode."""

    def __init__(self, model: nn.Module, task: Task):
        super().__init__()
        self.model = model
        self.task = task

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        output = self.model(inputs)
        if self.training:
            return self.task.loss_terms(output, targets)
        return self.task.val_sums(output, targets)

    def no_sync(self) -> contextlib.AbstractContextManager:
        """DDP's: no gradient all-reduce in this backward pass (micro-batches but the last)."""
        no_sync = getattr(self.model, "no_sync", None)
        return no_sync() if no_sync is not None else contextlib.nullcontext()


def eager(forward: nn.Module) -> nn.Module:
    """The module under a torch.compile wrapper (`forward` itself where there is none)."""
    return getattr(forward, "_orig_mod", forward)


def objective_of(model: nn.Module, task: Task) -> nn.Module:
    """`model` where it already is an Objective (compiled or not), else the model with the task's
    loss."""
    return model if isinstance(eager(model), Objective) else Objective(model, task)
