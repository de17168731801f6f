"""CIFAR-10 (32x32 colour, 10 classes) through torchvision."""

from __future__ import annotations

from pathlib import Path

import torch
from torchvision import datasets

from mpexp.data.base import Batch, InMemoryData
from mpexp.data.checks import check_cifar_batches, check_labels
from mpexp.data.torchvision_sets import open_torchvision
from mpexp.tasks.classification import Classification


class CIFAR10Data(InMemoryData):
    """CIFAR-10; the test split is the validation set."""

    def __init__(self, root: str = "data", download: bool = True, **loader):
        super().__init__(**loader)
        self.root = root
        self.download = download

    def planned_task(self) -> Classification:
        return Classification(channels=3, height=32, width=32, num_classes=10)

    def planned_sizes(self) -> tuple[int, int]:
        return 50_000, 10_000

    def load(self) -> tuple[Batch, Batch, int]:
        cls = datasets.CIFAR10
        folder = Path(self.root).expanduser() / cls.base_folder
        train, test = open_torchvision(
            cls,
            self.root,
            self.download,
            "cifar-10-batches-py/ (data_batch_1..5, test_batch, batches.meta)",
            check=lambda: check_cifar_batches(cls, folder),
        )

        def split(ds, files: str) -> Batch:
            # .data is N x 32 x 32 x 3 uint8 (numpy); models want N x 3 x 32 x 32
            images = torch.from_numpy(ds.data).permute(0, 3, 1, 2).contiguous()
            labels = torch.as_tensor(ds.targets, dtype=torch.long)
            check_labels(labels, len(train.classes), f"{folder / files}")
            return images, labels

        return split(train, "data_batch_*"), split(test, "test_batch"), len(train.classes)
