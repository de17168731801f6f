"""MNIST and Fashion-MNIST (28x28 greyscale, 10 classes) through torchvision."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
from torchvision import datasets

from mpexp.data.base import Batch, InMemoryData
from mpexp.data.checks import check_labels, check_mnist_raw
from mpexp.data.torchvision_sets import open_torchvision
from mpexp.tasks.classification import Classification


class MNISTData(InMemoryData):
    """MNIST digits; the test split is the validation set."""

    torchvision_class = datasets.MNIST
    files = "MNIST/raw/ (train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-*, .gz or not)"

    def __init__(self, root: str = "data", download: bool = True, **loader):
        super().__init__(**loader)
        self.root = root
        self.download = download

    def planned_task(self) -> Classification:
        return Classification(channels=1, height=28, width=28, num_classes=10)

    def planned_sizes(self) -> tuple[int, int]:
        return 60_000, 10_000  # Fashion-MNIST's too

    def load(self) -> tuple[Batch, Batch, int]:
        cls = self.torchvision_class
        raw = Path(self.root).expanduser() / cls.__name__ / "raw"  # where torchvision looks
        train, test = open_torchvision(
            cls, self.root, self.download, self.files, check=lambda: check_mnist_raw(raw)
        )
        classes = len(train.classes)
        for split, prefix in ((train, "train"), (test, "t10k")):
            check_labels(split.targets, classes, str(raw / f"{prefix}-labels-idx1-ubyte"))
        # .data is the whole split as a uint8 N x 28 x 28 tensor: no per-sample PIL decode
        return (
            (train.data.unsqueeze(1), train.targets.long()),
            (test.data.unsqueeze(1), test.targets.long()),
            classes,
        )


class FashionMNISTData(MNISTData):
    """Fashion-MNIST: MNIST's format and shape, clothing instead of digits."""

    torchvision_class = datasets.FashionMNIST
    files = "FashionMNIST/raw/ (train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-*)"


def write_idx(path: Path, array: np.ndarray) -> None:
    """Save a uint8 array in the IDX format MNIST ships in (what torchvision's MNIST reads):
    two zero bytes, the type code 0x08 (uint8), the number of dimensions, big-endian sizes, data."""
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    Path(path).write_bytes(header + np.ascontiguousarray(array, dtype=np.uint8).tobytes())


def write_mnist_files(root: Path, splits: dict[str, tuple[np.ndarray, np.ndarray]], folder="MNIST"):
    """Write {"train": (images, labels), "t10k": (...)} as `root/<folder>/raw/*-ubyte` files."""
    raw = Path(root) / folder / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for prefix, (images, labels) in splits.items():
        write_idx(raw / f"{prefix}-images-idx3-ubyte", images)
        write_idx(raw / f"{prefix}-labels-idx1-ubyte", labels)
