"""The model and its task's loss as one module, so that `torch.compile` sees both.

Compiled alone, a model hands its output to a loss that runs eagerly after the compiled graph:
a language model's logits then leave the graph whole, and the loss reads them again (on GPT-2
small, about a quarter of a step's memory traffic). nanoGPT computes its loss in the model's own
forward pass, so the compiler fuses the two; `Objective` does the same for any model and task
without the model knowing its task: called with a batch, it gives the task's training loss in
training mode (as its terms, `Task.loss_terms`) and validation's sums (`Task.val_sums`) in eval
mode, and the loop compiles it whole (mpexp/build.py). Under DDP the compiled Objective is what
DDP wraps (nanoGPT's order: compile, then wrap); under FSDP2 the model's units are compiled one
by one and the loss apart (torchtitan's), as FSDP's hooks between the units break any graph
that spans them.

It holds no weights of its own: checkpoints, diagnostics and optimizers keep using the model.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from mpexp.step.performance import Speed, UnitCompilation
from mpexp.tasks.base import Task


class Objective(nn.Module):
    """`objective(inputs, targets)`: the terms of the task's loss of the model's output when
    training (a 1-D tensor, summing to the loss), its validation sums in eval mode."""

    def __init__(self, model: nn.Module, task: Task):
        super().__init__()
        self.model = model
        self.task = task
        self.loss_terms = task.loss_terms  # the training loss: compiled apart under FSDP2
        self.units: UnitCompilation | None = None  # the model's units, compiled one by one

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        output = self.model(inputs)
        if self.training:
            return self.loss_terms(output, targets)
        return self.task.val_sums(output, targets)

    def compile_apart(self, units: UnitCompilation, speed: Speed) -> Objective:
        """The Objective of a model whose units are compiled one by one (`units`, FSDP2's), with
        the training loss compiled on its own, as torchtitan compiles its loss."""
        self.units = units
        self.loss_terms = torch.compile(
            self.task.loss_terms, mode=speed.compile_mode, dynamic=False
        )
        return self

    def eagerly(self) -> None:
        """Undo `compile_apart`: the units' and the loss's eager code from here on."""
        if self.units is not None:
            self.units.undo()
        self.units = None
        self.loss_terms = self.task.loss_terms


def eager(forward: nn.Module) -> nn.Module:
    """The module under the wrappers of the loop's forward pass, DDP's and torch.compile's
    (`forward` itself where it has none)."""
    if isinstance(forward, DistributedDataParallel):
        forward = forward.module
    return getattr(forward, "_orig_mod", forward)


def uncompiled(forward: nn.Module) -> nn.Module:
    """`forward` eager from here on, as the loop trains it: DDP still around it (its gradients
    are still all-reduced), nothing compiled inside."""
    if isinstance(forward, DistributedDataParallel):
        forward.module = uncompiled(forward.module)  # the same parameters: DDP is none the wiser
        return forward
    forward = getattr(forward, "_orig_mod", forward)
    if isinstance(forward, Objective):
        forward.eagerly()
    return forward


def objective_of(model: nn.Module, task: Task) -> nn.Module:
    """What evaluation calls: `model` where it already is an Objective (compiled or not), else
    the model with the task's loss; never through DDP, which has no gradients to all-reduce
    there and would broadcast the buffers at every forward pass of each rank's own batches."""
    if isinstance(model, DistributedDataParallel):
        model = model.module
    return model if isinstance(eager(model), Objective) else Objective(model, task)
