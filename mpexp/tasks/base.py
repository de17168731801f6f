"""The task seam: what a workload's batches mean, asked by everyone who needs to know.

A dataset gives batches of (inputs, targets) and says which task they serve (`TrainingData.setup`
returns the task). The task alone knows:

- what a model is built with for these inputs (`model_kwargs`) and what it must give back
  (`check_output`), and an example batch of the run's shapes (the model's trial and FLOP count);
- how a batch's model output becomes the training loss (`loss`);
- what validation measures: per-batch sums kept on the device (`val_sums`), turned into metrics
  once per validation (`val_metrics`), and how the epoch's log line shows them (`epoch_text`);
  and targets for padding that those sums leave out (`padded_targets`: a compiled model's last,
  smaller validation batch is padded to the full size);
- which metric is the run's result and whether higher or lower is better (`result`): the W&B
  summaries, the `best` checkpoint, the sweep report's parity verdicts and Optuna's objective
  follow it. The run records it as `ran.task`, so that the report reads it from the run's files.

So the loop, the report and the tracker never ask what kind of workload they run.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:  # torch is imported once a run starts: the tracker imports this module early
    import torch


@dataclass(frozen=True)
class Result:
    """The metric a run is judged by, and how to compare two values of it."""

    metric: str  # a key of the epoch rows, e.g. "val/acc"
    higher_is_better: bool
    # the sweep report's parity tolerance: how far a configuration may fall behind its reference
    # and still count as within noise, in `unit` (the metric times `scale`)
    tolerance: float
    unit: str  # what a difference is shown in, e.g. "points" (of accuracy) or "nats"
    scale: float = 1.0  # the metric times this is in `unit` (100 for a fraction in points)
    value_unit: str | None = None  # what a value is shown in ("%" for accuracy); None: `unit`
    title: str = "Result"  # what the sweep report's section calls it
    decimals: int = 4  # how many the report shows of a value or difference (in `unit`)

    @property
    def direction(self) -> str:
        """Optuna's word for it: "maximize" or "minimize"."""
        return "maximize" if self.higher_is_better else "minimize"

    @property
    def name(self) -> str:
        """The metric in words: "val acc", "val loss"."""
        return self.metric.replace("/", " ").replace("_", " ")

    @property
    def shown_in(self) -> str:
        return self.value_unit or self.unit

    def better(self, value: float, than: float | None) -> bool:
        """Whether `value` beats `than` (None: nothing yet); a NaN never does."""
        if math.isnan(value):
            return False
        if than is None:
            return True
        return value > than if self.higher_is_better else value < than

    def reached(self, value: float, target: float) -> bool:
        """Whether `value` is as good as `target` or better."""
        return value >= target if self.higher_is_better else value <= target

    def record(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_record(cls, task: dict[str, Any] | None) -> Result:
        """The Result a run recorded under `ran.task`; runs recorded before mpexp had tasks were
        all image classifiers, judged by val accuracy."""
        if not task:
            return ACCURACY
        return cls(**{f.name: task[f.name] for f in fields(cls) if f.name in task})


# the target of an item that validation leaves out (padding): cross-entropy's default ignore_index
IGNORE_INDEX = -100

# an image classifier's result: final val accuracy, compared in points; half a point is about the
# seed-to-seed spread of the tutorial's MNIST runs
ACCURACY = Result(
    "val/acc",
    True,
    tolerance=0.5,
    unit="points",
    scale=100.0,
    value_unit="%",
    title="Accuracy",
    decimals=2,
)


class Task(ABC):
    """What a batch means (see the module's docstring). Subclasses are frozen dataclasses of the
    facts the data gives (image shape and classes; vocabulary and context length)."""

    name: ClassVar[str]
    result: ClassVar[Result]
    # the W&B summaries of the validation metrics: "max,last", "min,last", ...
    summaries: ClassVar[dict[str, str]]

    @abstractmethod
    def model_kwargs(self) -> dict[str, Any]:
        """What a model for these inputs is built with (besides its own config keys)."""

    @abstractmethod
    def describe_inputs(self) -> str:
        """The inputs in words, for messages: "1x28x28 images", "windows of 128 byte tokens"."""

    @abstractmethod
    def example(self, batch: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch of zeros with the run's shapes and dtypes: (inputs, targets)."""

    @abstractmethod
    def check_output(self, shape: tuple[int, ...]) -> str | None:
        """What is wrong with a model's output shape for one example, or None when it fits."""

    @abstractmethod
    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The training loss of a batch: a scalar, the mean over the batch's items."""

    # the keys under which `loss_terms` logs the terms after the first (none: the loss is one)
    term_names: ClassVar[tuple[str, ...]] = ()
    # whether its loss and validation sums take a 16-bit output and compute in float32 themselves
    # (a language model's, a chunk at a time): pure bf16 then hands the output on as it is,
    # rather than a float32 copy of all of it (GPT-2 small's logits: 2.3 GiB a micro-batch)
    takes_16_bit_output: ClassVar[bool] = False

    def loss_terms(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The training loss as a 1-D tensor of the terms that add up to it: the first is
        logged as `train/loss`, the others under `term_names` (an auxiliary loss, say)."""
        return self.loss(output, targets).reshape(1)

    @abstractmethod
    def val_sums(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One validation batch's sums as a 1-D float tensor, left on the device: the batches'
        sums are added up there and read once. Items whose target is IGNORE_INDEX (padding, see
        `padded_targets`) count in none of them."""

    def padded_targets(self, targets: torch.Tensor, size: int) -> torch.Tensor:
        """`targets` lengthened to `size` items with targets that `val_sums` leaves out, made on
        the device (no host read): the padding of a last, smaller validation batch."""
        padded = targets.new_full((size, *targets.shape[1:]), IGNORE_INDEX)
        padded[: len(targets)] = targets
        return padded

    @abstractmethod
    def val_count(self, targets: torch.Tensor) -> int:
        """How many items a validation batch's sums are over (from its shape: no device read)."""

    @abstractmethod
    def val_metrics(self, sums: list[float], count: int) -> dict[str, float]:
        """The validation metrics (`val/...`) from the summed sums over `count` items."""

    @abstractmethod
    def epoch_text(self, row: dict[str, Any]) -> str:
        """The validation part of the epoch's log line, e.g. "Val Loss: 0.31, Val Acc: 91.2%"."""

    def throughput(self, samples_per_s: float) -> dict[str, float]:
        """Rates beyond samples per second that the task's unit of work gives (tokens/s)."""
        return {}

    def progress(self, samples: int) -> dict[str, int]:
        """How far training has come in the task's unit of work beyond samples (tokens)."""
        return {}

    def record(self) -> dict[str, Any]:
        """`ran.task`: the task's name, its result metric and how the report compares it."""
        return {"name": self.name, **self.result.record(), **asdict(self)}
