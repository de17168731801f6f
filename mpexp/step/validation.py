"""Validation: the metrics of the validation set, of the weights' moving average, and once,
after training, of the test set; a compiled model is validated compiled, and trains eagerly from
the validation whose compilation fails."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from mpexp.data.base import Batch, TrainingData
from mpexp.distributed import World
from mpexp.errors import UserError
from mpexp.precision.modes import Precision
from mpexp.step.objective import objective_of
from mpexp.step.parts import Parts
from mpexp.step.speed_record import SpeedRecord
from mpexp.step.weight_average import WeightAverage
from mpexp.tracking.tracker import Tracker

log = logging.getLogger("mpexp")


@torch.no_grad()
def evaluate(
    model,
    data: TrainingData,
    device,
    precision: Precision,
    pad: bool = False,
    batches=None,
    micro_batch: int | None = None,
    world: World | None = None,
) -> dict[str, float]:
    """The validation metrics of the data's task, summed on the device and read once; of
    `batches` (the test set's, say) where given, else of the validation set. `model` is the
    model, or its Objective (mpexp/step/objective.py), compiled or not. With a distributed
    `world`, each rank sums its share of the batches (the data gives it that share) and the
    ranks' sums are added up, so that every rank finds the metrics of the whole set.

    Each batch runs in micro-batches of `micro_batch` items (default: whole batches), the
    training step's: a pass over a whole optimizer batch of a large model would hold its
    activations and output for all of it at once (GPT-2 small's logits for 480 windows are 49 GB
    in bf16). With `pad` (a compiled model), a last, smaller micro-batch is padded to the full
    size, so that it runs through the graph compiled for full ones rather than compiling one of
    its own; its padding counts nowhere (`Task.padded_targets`)."""
    task = data.task
    objective = objective_of(model, task)
    size = micro_batch or data.batch_size
    objective.eval()
    total = None
    count = 0  # on the host: a batch's size is known there, and a tensor of it would be a copy
    try:
        for inputs, targets in batches if batches is not None else data.val_batches(device):
            count += task.val_count(targets)
            for x, y in zip(inputs.split(size), targets.split(size), strict=True):
                if pad and len(y) < size:
                    x, y = _padded(x, y, size, task)
                with precision.autocast():
                    sums = objective(x, y)
                total = sums if total is None else total + sums
    finally:  # a compiler's failure, which the loop survives, leaves the model training
        objective.train()
    mine = (total.tolist() if total is not None else None, count)
    every = world.gather(mine) if world is not None else [mine]
    # a rank whose share is empty (fewer batches than ranks) has no sums to add
    sums = [s for s, _ in every if s is not None]
    totals = [sum(column) for column in zip(*sums, strict=True)]
    return task.val_metrics(totals, sum(c for _, c in every))


def _padded(inputs: torch.Tensor, targets: torch.Tensor, size: int, task) -> Batch:
    """A batch lengthened to `size` items by repeating its last. The inputs keep their strides
    (a full batch's: a slice of the same data), which the compiled graph's guards check as they
    check the shape: a text window cut from a longer one, an image stored channels-last."""
    padded = inputs.new_empty_strided((size, *inputs.shape[1:]), inputs.stride())
    padded[: len(inputs)] = inputs
    padded[len(inputs) :] = inputs[-1:]
    return padded, task.padded_targets(targets, size)


@dataclass
class Validation:
    """What each validation measures, on the path the model trains on, in the step's
    micro-batches."""

    parts: Parts
    record: SpeedRecord  # the eager model, the compilations and a compiled model's fallback
    device: torch.device
    micro_batch: int  # this process's micro-batch: a whole batch could need many times the memory
    tracker: Tracker
    average: WeightAverage | None = None  # the weights' moving average, validated alongside

    def metrics(self) -> tuple[dict[str, float], float]:
        """The validation metrics (of the moving average too), and the time spent compiling."""
        # every rank validates its share with rank 0's BatchNorm statistics, as one process would
        self.record.world.sync_buffers(self.parts.model)
        metrics, val_compile_s = self._validate()
        if self.average is not None:
            metrics.update(self._average())
        return metrics, val_compile_s

    def _measured(self, model, pad: bool = False, batches=None) -> dict[str, float]:
        """`evaluate` of `model` in the step's micro-batches, summed over the ranks."""
        p = self.parts
        return evaluate(model, p.data, self.device, p.precision, pad, batches,
                        self.micro_batch, self.record.world)  # fmt: skip

    def _validate(self) -> tuple[dict[str, float], float]:
        """The validation metrics, and the time spent compiling for them (the first validation
        compiles the model's graph in eval mode). A compiled model pads a last, smaller batch, so
        that no batch compiles a graph of its own; one whose compilation fails here is evaluated
        eagerly, and trains eagerly from here on, as when its first step fails to compile."""
        if not self.record.compiled:  # eager (or compiled no longer): the plain evaluation
            return self._measured(self.record.objective), 0.0
        compiles = self.record.compiles
        started, seconds = compiles.count, compiles.seconds
        try:
            metrics = self._measured(self.parts.forward, pad=True)
        except UserError:
            raise
        except Exception as err:
            if compiles.count == started:  # it compiled nothing: no compiler failure
                raise
            self.record.stop_compiling(err)
            metrics = self._measured(self.record.objective)
        compiling = compiles.seconds - seconds
        self.record.val_compile_s += compiling
        return metrics, compiling

    def _average(self) -> dict[str, float]:
        """The validation metrics of the weights' moving average (`val_ema/...`), on the path
        that validated the weights themselves (compiled, once `_validate` has compiled it)."""
        with self.average.swapped_in():  # in the step's micro-batches, as _validate runs them
            self.record.world.sync_buffers(self.parts.model)  # rank 0's averaged statistics
            metrics = self._measured(self.parts.forward, pad=self.record.compiled)
        return {f"val_ema/{key.split('/', 1)[1]}": value for key, value in metrics.items()}

    def test(self, step: int) -> dict[str, float]:
        """The test set's metrics (`test/...`), evaluated once, after the last epoch, eagerly,
        and written as a row of their own; none where the data has no test set."""
        batches = self.parts.data.test_batches(self.device)
        if batches is None:
            return {}
        self.record.world.sync_buffers(self.parts.model)
        metrics = self._measured(self.record.objective, batches=batches)
        tested = {f"test/{key.split('/', 1)[1]}": value for key, value in metrics.items()}
        # a row of the step it followed, without `epoch`: readers take rows with one as epochs'
        self.tracker.log({"step": step, **tested})
        log.info(
            "Test set (held out, evaluated once): %s",
            ", ".join(f"{key} {value:.4f}" for key, value in tested.items()),
        )
        return tested
