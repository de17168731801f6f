"""Image classification: images in, one logit per class out, judged by validation accuracy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from mpexp.tasks.base import ACCURACY, IGNORE_INDEX, Task


@dataclass(frozen=True)
class Classification(Task):
    channels: int
    height: int
    width: int
    num_classes: int

    name = "classification"
    result = ACCURACY
    summaries: ClassVar[dict[str, str]] = {"val/acc": "max,last", "val/loss": "min,last"}

    def model_kwargs(self) -> dict[str, Any]:
        return {
            "in_channels": self.channels,
            "num_classes": self.num_classes,
            "image_size": (self.height, self.width),
        }

    def describe_inputs(self) -> str:
        return f"{self.channels}x{self.height}x{self.width} images"

    def example(self, batch: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        images = torch.zeros(batch, self.channels, self.height, self.width, device=device)
        return images, torch.zeros(batch, dtype=torch.long, device=device)

    def check_output(self, shape: tuple[int, ...]) -> str | None:
        if shape == (1, self.num_classes):
            return None
        return (
            f"gives outputs of shape {shape} for one image; the loss needs "
            f"(1, {self.num_classes}), one logit per class"
        )

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output, targets)

    def val_sums(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(output.float(), targets, reduction="sum", ignore_index=IGNORE_INDEX)
        correct = (output.argmax(1) == targets).sum()  # a padded item's target is no class
        return torch.stack((loss, correct.float()))

    def val_count(self, targets: torch.Tensor) -> int:
        return len(targets)

    def val_metrics(self, sums: list[float], count: int) -> dict[str, float]:
        loss_sum, correct = sums
        return {"val/loss": loss_sum / count, "val/acc": correct / count}

    def epoch_text(self, row: dict[str, Any]) -> str:
        return f"Val Loss: {row['val/loss']:.4f}, Val Acc: {100 * row['val/acc']:.2f}%"
