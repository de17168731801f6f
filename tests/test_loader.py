"""Both batching paths give every sample once per epoch, in a seeded order."""

from __future__ import annotations

import torch

from mpexp.data.base import InMemoryData

CPU = torch.device("cpu")


class Numbered(InMemoryData):
    """Image i is filled with the value i, so a batch tells which samples it holds."""

    def load(self):
        n = 100
        images = torch.arange(n, dtype=torch.float32).view(n, 1, 1, 1).expand(n, 3, 2, 2).clone()
        return (images, torch.arange(n) % 10), (images[:20], torch.arange(20) % 10), 10


def epoch_ids(loader: str, epoch: int, seed: int, drop_last: bool = False) -> list[int]:
    data = Numbered(batch_size=16, drop_last=drop_last, loader=loader)
    data.setup(CPU)
    ids = []
    for images, labels in data.train_batches(epoch, seed, CPU):
        assert torch.equal(labels, images[:, 0, 0, 0].long() % 10)  # images and labels stay paired
        ids += images[:, 0, 0, 0].long().tolist()
    return ids


def test_device_loader_yields_each_sample_once_per_epoch():
    ids = epoch_ids("device", epoch=1, seed=0)
    assert sorted(ids) == list(range(100))
    dropped = epoch_ids("device", epoch=1, seed=0, drop_last=True)
    assert len(dropped) == 96 and len(set(dropped)) == 96


def test_order_depends_on_seed_and_epoch_and_repeats_for_the_same_pair():
    assert epoch_ids("device", 1, 0) == epoch_ids("device", 1, 0)
    assert epoch_ids("device", 1, 0) != epoch_ids("device", 1, 1)
    assert epoch_ids("device", 1, 0) != epoch_ids("device", 2, 0)


def test_device_and_dataloader_paths_cover_the_same_samples():
    assert sorted(epoch_ids("dataloader", 3, 7)) == sorted(epoch_ids("device", 3, 7))


def test_validation_batches_cover_the_validation_set_in_order():
    data = Numbered(batch_size=16, drop_last=True, loader="device")
    data.setup(CPU)
    ids = [int(x) for images, _ in data.val_batches(CPU) for x in images[:, 0, 0, 0]]
    assert ids == list(range(20))  # drop_last applies to training only


def test_channels_last_batches_come_in_nhwc_layout():
    data = Numbered(batch_size=16, loader="device")
    data.setup(CPU, torch.channels_last)
    images, _ = next(iter(data.train_batches(1, 0, CPU)))
    assert images.dtype == torch.float32
    assert images.is_contiguous(memory_format=torch.channels_last)
    assert not images.is_contiguous()  # 3 channels: NHWC and NCHW really differ
