"""MNIST and Fashion-MNIST (28x28 greyscale, 10 classes) through torchvision."""

from __future__ import annotations

from torchvision import datasets

from mpexp.data.base import Batch, InMemoryData
from mpexp.data.torchvision_sets import open_torchvision


class MNISTData(InMemoryData):
    """MNIST digits; the test split is the validation set."""

    torchvision_class = datasets.MNIST
    files = "MNIST/raw/ (train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-*, .gz or not)"

    def __init__(self, root: str = "data", download: bool = True, **loader):
        super().__init__(**loader)
        self.root = root
        self.download = download

    def load(self) -> tuple[Batch, Batch, int]:
        train, test = open_torchvision(self.torchvision_class, self.root, self.download, self.files)
        # .data is the whole split as a uint8 N x 28 x 28 tensor: no per-sample PIL decode
        return (
            (train.data.unsqueeze(1), train.targets.long()),
            (test.data.unsqueeze(1), test.targets.long()),
            len(train.classes),
        )


class FashionMNISTData(MNISTData):
    """Fashion-MNIST: MNIST's format and shape, clothing instead of digits."""

    torchvision_class = datasets.FashionMNIST
    files = "FashionMNIST/raw/ (train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-*)"
