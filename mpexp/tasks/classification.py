"""Image classification: images in, one logit per class out, judged by validation accuracy.

Validation measures the loss, top-1 accuracy and, with 5 classes or more, top-5 accuracy
(`val/acc5`). Training may smooth the labels (`trainer.label_smoothing`) and take soft targets,
one probability per class, where batches are mixed (mixup, CutMix: mpexp/data/mixing.py).
Validation's loss is always the plain cross-entropy of the true labels: a smoothed one would
rise with the smoothing, not with the model's error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from mpexp.tasks.base import ACCURACY, IGNORE_INDEX, Task

# top-5 accuracy is measured where there are at least this many classes (with fewer it is 1)
TOP_K = 5


@dataclass(frozen=True)
class Classification(Task):
    channels: int
    height: int
    width: int
    num_classes: int
    # trainer.label_smoothing: the share of each target spread evenly over all classes
    label_smoothing: float = 0.0

    name = "classification"
    result = ACCURACY
    summaries: ClassVar[dict[str, str]] = {
        "val/acc": "max,last",
        "val/acc5": "max,last",
        "val/loss": "min,last",
    }

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
        """Cross-entropy of class indices, or of one probability per class (mixed batches)."""
        return F.cross_entropy(output, targets, label_smoothing=self.label_smoothing)

    @property
    def top5(self) -> bool:
        return self.num_classes >= TOP_K

    def val_sums(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(output.float(), targets, reduction="sum", ignore_index=IGNORE_INDEX)
        # a padded item's target is no class: it is in no top-k
        hits = output.topk(TOP_K if self.top5 else 1, dim=1).indices == targets[:, None]
        sums = [loss, hits[:, 0].sum().float()]
        if self.top5:
            sums.append(hits.any(dim=1).sum().float())
        return torch.stack(sums)

    def val_count(self, targets: torch.Tensor) -> int:
        return len(targets)

    def val_metrics(self, sums: list[float], count: int) -> dict[str, float]:
        metrics = {"val/loss": sums[0] / count, "val/acc": sums[1] / count}
        if self.top5:
            metrics["val/acc5"] = sums[2] / count
        return metrics

    def epoch_text(self, row: dict[str, Any]) -> str:
        return f"Val Loss: {row['val/loss']:.4f}, Val Acc: {100 * row['val/acc']:.2f}%"
