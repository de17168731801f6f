"""Mixup and CutMix of a classifier's training batches, on the device (`trainer.mixup_alpha`,
`trainer.cutmix_alpha`), as torchvision's reference recipe mixes them.

Each batch is mixed with itself rolled by one item: mixup blends whole images, `lam x + (1 - lam)
x_rolled`; CutMix pastes a box of the rolled images, whose area sets `lam`. The targets become one
probability per class, `lam onehot(y) + (1 - lam) onehot(y_rolled)`, which the cross-entropy takes
as they are (label smoothing applies on top). With both alphas above 0 each batch takes one of
the two, at even odds.

The draws (`lam`, which technique, the box) are Python numbers from a generator seeded by the
run's seed, the epoch, the batch and the rank: no tensor is read on the host, so the step keeps
its lead on the GPU, and a resumed run draws what the uninterrupted one drew. That is why this is
not torchvision.transforms.v2's MixUp and CutMix, whose draws come from torch's global generator
as tensors read back one by one; the arithmetic is theirs.

Images are mixed in place: the batch a dataset gives is the step's to change (the device's crop
and flip change it too), and a static batch stays where a captured step reads it.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator

import torch

from mpexp.data.base import Batch
from mpexp.errors import ConfigError


class BatchMixing:
    """Mixes training batches of `num_classes` classes (see the module's docstring)."""

    def __init__(self, num_classes: int, mixup_alpha: float, cutmix_alpha: float, seed: int):
        self.num_classes = num_classes
        self.mixup_alpha, self.cutmix_alpha = mixup_alpha, cutmix_alpha
        self.seed = seed

    def batches(
        self, batches: Iterator[Batch], epoch: int, start: int, rank: int = 0
    ) -> Iterator[Batch]:
        """`batches` (an epoch's, from batch `start` on), each mixed by its own draws."""
        for index, (images, labels) in enumerate(batches, start=start):
            draws = random.Random(f"{self.seed}/{epoch}/{index}/{rank}")
            yield self.mix(images, labels, draws)

    def mix(self, images: torch.Tensor, labels: torch.Tensor, draws: random.Random) -> Batch:
        """The batch mixed by mixup or CutMix as `draws` decide: images in place, targets as
        one probability per class."""
        use_mixup = self.mixup_alpha > 0 and (self.cutmix_alpha == 0 or draws.random() < 0.5)
        if use_mixup:
            lam = draws.betavariate(self.mixup_alpha, self.mixup_alpha)
            rolled = images.roll(1, 0)
            images.mul_(lam).add_(rolled, alpha=1.0 - lam)
        else:
            lam = self._cutmix(images, draws)
        return images, self.targets(labels, lam)

    def _cutmix(self, images: torch.Tensor, draws: random.Random) -> float:
        """Paste a box of the rolled batch into each image; the share of the image left is the
        targets' weight. The box is centred on a uniform pixel, its sides sqrt(1 - lam) of the
        image's, clipped at the borders (which is why lam is taken from the box's area)."""
        lam = draws.betavariate(self.cutmix_alpha, self.cutmix_alpha)
        height, width = images.shape[-2:]
        centre_y, centre_x = draws.randrange(height), draws.randrange(width)
        half = 0.5 * math.sqrt(1.0 - lam)
        half_h, half_w = int(half * height), int(half * width)
        top, bottom = max(centre_y - half_h, 0), min(centre_y + half_h, height)
        left, right = max(centre_x - half_w, 0), min(centre_x + half_w, width)
        box = images[..., top:bottom, left:right]
        box.copy_(box.roll(1, 0))  # roll makes a copy first: no item reads a pasted box
        return 1.0 - (bottom - top) * (right - left) / (height * width)

    def targets(self, labels: torch.Tensor, lam: float) -> torch.Tensor:
        """`lam` of each item's class and `1 - lam` of its rolled partner's, as float32."""
        # scattered, not F.one_hot: that reads the labels' min and max on the host (on a CPU)
        onehot = torch.zeros(len(labels), self.num_classes, device=labels.device)
        onehot.scatter_(1, labels[:, None], 1.0)
        partners = onehot.roll(1, 0)
        return onehot.mul_(lam).add_(partners, alpha=1.0 - lam)


def batch_mixing(trainer, task, seed: int) -> BatchMixing | None:
    """The run's mixing of training batches, or None without it; refused for a task whose
    targets are no classes."""
    mixup, cutmix = trainer.get("mixup_alpha", 0.0), trainer.get("cutmix_alpha", 0.0)
    if not (mixup or cutmix):
        return None
    num_classes = getattr(task, "num_classes", None)
    if num_classes is None:
        raise ConfigError(
            f"trainer.mixup_alpha={mixup} / trainer.cutmix_alpha={cutmix} mix images and their "
            f"class labels; this run's task is {task.name}. Set both to 0 or train a classifier."
        )
    return BatchMixing(num_classes, float(mixup), float(cutmix), seed)
