"""An image folder's normalisation where dataset.mean and dataset.std are not given: each
channel's mean and standard deviation over a sample of the training images, logged so that the
next run can be given them and skip this."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

import torch

from mpexp.data.image_folder.reading import Split

log = logging.getLogger(__name__)


def measured(
    train: Split, read: Callable[[list[tuple]], Iterable], split_seed: int, images: int
) -> tuple[list[float], list[float]]:
    """Each channel's mean and standard deviation over `images` training images (drawn by
    split_seed), as validation sees them: `read(keys)` gives their host batches. Logged, to be
    given next time."""
    began = time.perf_counter()
    generator = torch.Generator().manual_seed(split_seed)
    sample = torch.randperm(len(train), generator=generator)[:images].tolist()
    sums = torch.zeros(2, 3, dtype=torch.float64)
    for batch, _, _ in read([(i, None, 0) for i in sorted(sample)]):
        pixels = batch.double().div_(255).transpose(0, 1).flatten(1)
        sums += torch.stack((pixels.sum(1), pixels.square().sum(1))).cpu()  # set-up: no step
    count = len(sample) * train.size**2
    mean = sums[0] / count
    std = (sums[1] / count - mean.square()).clamp_(min=0).sqrt()
    mean, std = [round(float(x), 4) for x in mean], [round(max(float(x), 1e-3), 4) for x in std]
    log.info(
        "Normalising by dataset.mean=[%s] dataset.std=[%s], computed from %d training images "
        "in %.1f s; give both to skip this.",
        ",".join(map(str, mean)),
        ",".join(map(str, std)),
        len(sample),
        time.perf_counter() - began,
    )
    return mean, std
