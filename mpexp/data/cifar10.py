"""CIFAR-10 (32x32 colour, 10 classes) through torchvision."""

from __future__ import annotations

import torch
from torchvision import datasets

from mpexp.data.base import Batch, InMemoryData
from mpexp.data.torchvision_sets import open_torchvision


class CIFAR10Data(InMemoryData):
    """CIFAR-10; the test split is the validation set."""

    def __init__(self, root: str = "data", download: bool = True, **loader):
        super().__init__(**loader)
        self.root = root
        self.download = download

    def load(self) -> tuple[Batch, Batch, int]:
        train, test = open_torchvision(
            datasets.CIFAR10,
            self.root,
            self.download,
            "cifar-10-batches-py/ (data_batch_1..5, test_batch, batches.meta)",
        )

        def split(ds) -> Batch:
            # .data is N x 32 x 32 x 3 uint8 (numpy); models want N x 3 x 32 x 32
            images = torch.from_numpy(ds.data).permute(0, 3, 1, 2).contiguous()
            return images, torch.as_tensor(ds.targets, dtype=torch.long)

        return split(train), split(test), len(train.classes)
