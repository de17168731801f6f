"""MNIST and CIFAR-10 load through torchvision's own classes from files in their real formats."""

from __future__ import annotations

import hashlib
import pickle

import numpy as np
import pytest
import torch
from torchvision import datasets

from mpexp.data.cifar10 import CIFAR10Data
from mpexp.data.mnist import FashionMNISTData, MNISTData, write_mnist_files
from mpexp.data.synthetic import SyntheticData
from mpexp.errors import DataError

CPU = torch.device("cpu")


def make_mnist(root, folder: str, n_train: int, n_test: int, rng):
    splits = {
        prefix: (
            rng.integers(0, 256, (n, 28, 28), dtype=np.uint8),
            rng.integers(0, 10, n, dtype=np.uint8),
        )
        for prefix, n in (("train", n_train), ("t10k", n_test))
    }
    write_mnist_files(root, splits, folder)
    return splits


@pytest.mark.parametrize(
    ("cls", "folder"), [(MNISTData, "MNIST"), (FashionMNISTData, "FashionMNIST")]
)
def test_mnist_family_loads_idx_files(tmp_path, cls, folder):
    splits = make_mnist(tmp_path, folder, 96, 32, np.random.default_rng(0))
    data = cls(root=str(tmp_path), download=False, batch_size=32)
    info = data.setup(CPU)
    assert (info.channels, info.height, info.width, info.num_classes) == (1, 28, 28, 10)

    images, labels = data.train
    assert torch.equal(images[:, 0], torch.from_numpy(splits["train"][0]))
    assert torch.equal(labels, torch.from_numpy(splits["train"][1]).long())
    batch, _ = next(iter(data.val_batches(CPU)))
    assert batch.dtype == torch.float32 and batch.min() >= 0 and batch.max() <= 1
    assert torch.allclose(batch[:, 0] * 255, torch.from_numpy(splits["t10k"][0][:32]).float())


def test_cifar10_loads_python_pickle_batches(tmp_path, monkeypatch):
    rng = np.random.default_rng(1)
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    batches = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        entry = {
            "data": rng.integers(0, 256, (8, 3072), dtype=np.uint8),
            "labels": list(rng.integers(0, 10, 8)),
        }
        (folder / name).write_bytes(pickle.dumps(entry))
        batches[name] = entry
    (folder / "batches.meta").write_bytes(
        pickle.dumps({"label_names": [f"c{i}" for i in range(10)]})
    )

    # torchvision verifies the real archive's checksums; point them at the files written here
    def md5(name):
        return hashlib.md5((folder / name).read_bytes()).hexdigest()

    monkeypatch.setattr(
        datasets.CIFAR10,
        "train_list",
        [[f"data_batch_{i}", md5(f"data_batch_{i}")] for i in range(1, 6)],
    )
    monkeypatch.setattr(datasets.CIFAR10, "test_list", [["test_batch", md5("test_batch")]])
    monkeypatch.setattr(
        datasets.CIFAR10,
        "meta",
        {"filename": "batches.meta", "key": "label_names", "md5": md5("batches.meta")},
    )

    data = CIFAR10Data(root=str(tmp_path), download=False, batch_size=8)
    info = data.setup(CPU)
    assert (info.channels, info.height, info.width, info.num_classes) == (3, 32, 32, 10)
    images, labels = data.train
    assert images.shape == (40, 3, 32, 32)
    first = torch.from_numpy(batches["data_batch_1"]["data"][0].reshape(3, 32, 32))
    assert torch.equal(images[0], first)
    assert labels[:8].tolist() == [int(x) for x in batches["data_batch_1"]["labels"]]


def test_missing_mnist_names_the_place_and_the_offline_option(tmp_path):
    data = MNISTData(root=str(tmp_path / "nowhere"), download=False, batch_size=32)
    with pytest.raises(DataError) as err:
        data.setup(CPU)
    message = str(err.value)
    assert "nowhere" in message and "MNIST/raw" in message and "dataset=synthetic" in message


def test_synthetic_data_is_deterministic_by_seed_and_shaped_as_asked():
    def load(seed):
        return SyntheticData(
            train_size=64, val_size=16, channels=3, height=8, width=12, seed=seed, batch_size=8
        ).load()

    (x1, y1), _, classes = load(5)
    (x2, y2), _, _ = load(5)
    (x3, _), _, _ = load(6)
    assert x1.shape == (64, 3, 8, 12) and classes == 10
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert not torch.equal(x1, x3)


def test_synthetic_images_depend_on_their_class():
    (x, y), (vx, vy), _ = SyntheticData(
        train_size=2000, val_size=500, noise=0.8, seed=0, batch_size=8
    ).load()
    # learnable, not noise: a nearest-class-mean rule fitted on train beats chance (10%) on val
    means = torch.stack([x[y == c].mean(0) for c in range(10)]).flatten(1)
    predicted = torch.cdist(vx.flatten(1), means).argmin(1)
    assert (predicted == vy).float().mean() > 0.5
