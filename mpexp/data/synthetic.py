"""A learnable synthetic image set: class templates plus per-sample noise, made from a seed."""

from __future__ import annotations

import math

import torch

from mpexp.data.base import Batch, InMemoryData
from mpexp.errors import DataError
from mpexp.system import available_memory_bytes
from mpexp.tasks.classification import Classification

# float32 bytes held per image value while a set is made: the noise, the templates gathered per
# label and the blend, each of the set's whole size (see make_images)
GENERATION_BYTES = 3 * 4


def make_images(n: int, templates: torch.Tensor, noise: float, generator) -> Batch:
    """n images: a random class's template blended with uniform noise, and the class labels."""
    labels = torch.randint(len(templates), (n,), generator=generator)
    jitter = torch.rand((n, *templates.shape[1:]), generator=generator)
    images = (1 - noise) * templates[labels] + noise * jitter
    return images, labels


class SyntheticData(InMemoryData):
    """Class-dependent images of any shape; identical for identical seeds, no files needed."""

    def __init__(
        self,
        train_size: int = 8192,
        val_size: int = 1024,
        channels: int = 1,
        height: int = 28,
        width: int = 28,
        num_classes: int = 10,
        noise: float = 0.5,
        seed: int = 0,
        **loader,
    ):
        super().__init__(**loader)
        self.sizes = (train_size, val_size)
        self.shape = (channels, height, width)
        self.num_classes = num_classes
        self.noise = noise
        self.seed = seed

    def planned_task(self) -> Classification:
        c, h, w = self.shape
        return Classification(channels=c, height=h, width=w, num_classes=self.num_classes)

    def planned_sizes(self) -> tuple[int, int]:
        return self.sizes

    def load(self) -> tuple[Batch, Batch, int]:
        self._check_memory()
        generator = torch.Generator().manual_seed(self.seed)
        # Each class is a fixed random pattern; noise hides part of it, so the task is learnable
        # but a model must see many samples to separate classes reliably.
        templates = torch.rand((self.num_classes, *self.shape), generator=generator)
        train = make_images(self.sizes[0], templates, self.noise, generator)
        val = make_images(self.sizes[1], templates, self.noise, generator)
        return train, val, self.num_classes

    def _check_memory(self) -> None:
        """Refuse, with one line, sizes whose images cannot be made in the memory there is, rather
        than fail in the allocator (or be killed by the OS) partway."""
        available = available_memory_bytes()
        per_sample = GENERATION_BYTES * math.prod(self.shape) + 8  # and an int64 label
        needed = max(self.sizes) * per_sample
        if available is not None and needed > available:
            fits = available // per_sample
            raise DataError(
                f"dataset.train_size={self.sizes[0]:,} and dataset.val_size={self.sizes[1]:,} "
                f"synthetic images of {'x'.join(map(str, self.shape))} need about "
                f"{needed / 2**30:,.1f} GiB of memory to make, and {available / 2**30:,.1f} GiB "
                f"is available: use sizes below {fits:,} samples."
            )
