"""Augmentation of the in-memory sets on the device: random crops from zero-padded images and
horizontal flips, reproducible under the seed, the same for a resumed epoch, for either loader,
for the static batch of a captured step and in channels_last, with no host read."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mpexp.data.base import InMemoryData
from mpexp.errors import ConfigError
from mpexp.run.runner import train
from mpexp.tracking.run_context import RunContext
from mpexp.validate import validate
from tests.conftest import TINY, make_cfg
from tests.test_host_reads import HostReads
from tests.test_training import read_metrics

CPU = torch.device("cpu")
AUGMENT = {"crop_padding": 2, "flip": True}


class Indexed(InMemoryData):
    """Random 3x6x6 images labelled by their index, so that a batch tells which samples it holds."""

    def load(self):
        images = torch.rand(40, 3, 6, 6, generator=torch.Generator().manual_seed(0))
        return (images, torch.arange(40)), (images[:8], torch.arange(8)), 40


def batches(epoch=1, seed=0, start=0, static=False, augment=AUGMENT, **kwargs):
    data = Indexed(batch_size=8, augment=augment, **kwargs)
    data.setup(CPU)
    # clone: a static batch is the same two tensors every time
    return data, [
        (x.clone(), y.clone()) for x, y in data.train_batches(epoch, seed, CPU, static, start)
    ]


def by_sample(epoch_batches) -> dict[int, torch.Tensor]:
    return {int(y): x for xs, ys in epoch_batches for x, y in zip(xs, ys, strict=True)}


def candidates(image: torch.Tensor, padding: int) -> list[torch.Tensor]:
    """Every crop of the zero-padded image at the image's size, flipped or not."""
    _, h, w = image.shape
    padded = F.pad(image, (padding,) * 4)
    crops = [
        padded[:, i : i + h, j : j + w]
        for i in range(2 * padding + 1)
        for j in range(2 * padding + 1)
    ]
    return crops + [c.flip(-1) for c in crops]


def test_augmentation_crops_and_flips_what_the_model_sees():
    data, augmented = batches()
    originals = data.train[0]
    for images, labels in batches(augment=None)[1]:
        assert torch.equal(images, originals[labels])  # off: the images as stored
    changed = flipped = 0
    for images, labels in augmented:
        for image, label in zip(images, labels, strict=True):
            original = originals[label]
            options = candidates(original, 2)
            assert any(torch.equal(image, c) for c in options), "not a padded crop or its flip"
            changed += not torch.equal(image, original)
            flipped += any(torch.equal(image, c) for c in options[25:]) and not any(
                torch.equal(image, c) for c in options[:25]
            )
    assert changed > 30 and 8 < flipped < 32  # about half are flipped, nearly all moved


def test_augmentation_repeats_under_the_seed_and_changes_with_it_and_the_epoch():
    first, again = batches(seed=3)[1], batches(seed=3)[1]
    assert all(torch.equal(a[0], b[0]) for a, b in zip(first, again, strict=True))
    mine = by_sample(first)
    for other in (batches(seed=4)[1], batches(epoch=2, seed=3)[1]):
        same = sum(torch.equal(x, mine[i]) for i, x in by_sample(other).items())
        assert same < 8  # the same sample, other draws: almost never the same window


def test_a_resumed_epoch_gets_the_uninterrupted_epochs_augmented_batches():
    whole, resumed = batches(epoch=2)[1], batches(epoch=2, start=3)[1]
    assert len(resumed) == len(whole) - 3
    for (x, y), (rx, ry) in zip(whole[3:], resumed, strict=True):
        assert torch.equal(x, rx) and torch.equal(y, ry)


def test_both_loaders_and_the_static_batch_augment_each_sample_alike():
    device = by_sample(batches(epoch=4)[1])
    assert by_sample(batches(epoch=4, loader="dataloader")[1]).keys() == device.keys()
    for other in (batches(epoch=4, loader="dataloader")[1], batches(epoch=4, static=True)[1]):
        found = by_sample(other)
        assert all(torch.equal(found[i], device[i]) for i in device)


def test_channels_last_batches_stay_channels_last_and_static_ones_stay_put():
    data = Indexed(batch_size=8, augment=AUGMENT)
    data.setup(CPU, torch.channels_last)
    seen = list(data.train_batches(1, 0, CPU, static=True))
    assert all(x.is_contiguous(memory_format=torch.channels_last) for x, _ in seen)
    assert len({x.data_ptr() for x, _ in seen}) == 1  # a captured graph's input, written in place
    plain = batches(epoch=1)[1]
    assert torch.equal(seen[-1][0], plain[-1][0])  # the last one, still in the static tensor


def test_augmenting_reads_no_device_value_on_the_host():
    data = Indexed(batch_size=8, augment=AUGMENT)
    data.setup(CPU)
    with HostReads() as reads:
        for _ in data.train_batches(1, 0, CPU, static=True):
            pass
    assert reads.count == 0


def test_a_run_trains_on_augmented_batches_with_either_loader(tmp_path):
    def losses(name: str, *overrides: str) -> list[float]:
        cfg = make_cfg(*TINY, "trainer.epochs=1", "dataset.train_size=256", "trainer.log_every=1",
                       *overrides)  # fmt: skip
        train(cfg, RunContext(tmp_path / name))
        return [r["train/loss"] for r in read_metrics(tmp_path / name)[0]]

    plain = losses("plain")
    augment = ["dataset.augment.crop_padding=2", "dataset.augment.flip=true"]
    for loader in ("device", "dataloader"):
        seen = losses(loader, *augment, f"dataset.loader={loader}")
        assert len(seen) == len(plain) and all(math.isfinite(x) for x in seen)
        assert seen[0] != plain[0]  # the first step already saw other pixels


def test_augmentation_is_off_for_digits_and_on_in_the_cifar10_resnet_preset():
    for option in ("mnist", "fashion_mnist", "synthetic", "cifar10"):
        augment = make_cfg(f"dataset={option}").dataset.augment
        assert (augment.crop_padding, augment.flip) == (0, False)
    cfg = make_cfg("experiment=cifar10_resnet")
    assert (cfg.dataset.augment.crop_padding, cfg.dataset.augment.flip) == (4, True)
    assert cfg.dataset._target_.endswith("CIFAR10Data") and cfg.model._target_.endswith(
        "resnet18_cifar"
    )
    opt = cfg.optimizer
    assert (opt._target_, opt.lr, opt.momentum, opt.weight_decay) == ("torch.optim.SGD", 0.1,
                                                                      0.9, 5e-4)  # fmt: skip
    assert cfg.scheduler._target_.endswith("cosine") and cfg.dataset.batch_size == 128
    assert make_cfg("experiment=cifar10_resnet", "precision=bf16").precision.autocast == "bfloat16"
    with pytest.raises(ConfigError, match=r"dataset\.augment\.crop_padding=-1 must be an integer"):
        validate(make_cfg("dataset.augment.crop_padding=-1"))
