"""Checks of dataset files in their published formats, so that a damaged file is named with what is
wrong with it instead of surfacing as a shape error, or an index error an epoch later."""

from __future__ import annotations

import hashlib
import logging
import math
import struct
from pathlib import Path

import torch

from mpexp.errors import DataError

log = logging.getLogger(__name__)

REPLACE = (
    "Replace it with an intact copy, or delete it and let the dataset download it again "
    "(dataset.download=true)."
)


def check_idx(path: Path, dims: tuple[int | None, ...]) -> int:
    """Check an IDX file of unsigned bytes (MNIST's format: a zero word, type 0x08, the number of
    dimensions, big-endian sizes, then the bytes) against the shape it should hold (None: any
    size). Return its first size, the number of samples."""
    size = path.stat().st_size
    header = 4 + 4 * len(dims)
    with path.open("rb") as f:
        head = f.read(header)
    if len(head) < header:
        raise DataError(
            f"{path} is truncated: {size:,} bytes, less than its {header}-byte header. {REPLACE}"
        )
    zero, kind, ndim = struct.unpack(">HBB", head[:4])
    if (zero, kind, ndim) != (0, 0x08, len(dims)):
        raise DataError(
            f"{path} is not an MNIST-format file of {len(dims)}-d unsigned bytes: it starts with "
            f"0x{head[:4].hex()}, not 0x000008{len(dims):02x}. {REPLACE}"
        )
    shape = struct.unpack(f">{ndim}I", head[4:])
    if any(want is not None and want != got for want, got in zip(dims, shape, strict=True)):
        wanted = " x ".join("n" if d is None else str(d) for d in dims)
        raise DataError(
            f"{path} holds an array of {' x '.join(map(str, shape))}, not {wanted}. {REPLACE}"
        )
    expected = header + math.prod(shape)
    if size < expected:
        raise DataError(f"{path} is truncated: {size:,} of {expected:,} bytes. {REPLACE}")
    if size > expected:
        raise DataError(
            f"{path} has {size - expected:,} bytes more than its header accounts for "
            f"({expected:,}): it is not an intact MNIST-format file. {REPLACE}"
        )
    return shape[0]


def check_mnist_raw(raw: Path, height: int = 28, width: int = 28) -> None:
    """MNIST's (or Fashion-MNIST's) four files in `raw`, where they are all present unpacked."""
    for split in ("train", "t10k"):
        images, labels = raw / f"{split}-images-idx3-ubyte", raw / f"{split}-labels-idx1-ubyte"
        if not (images.is_file() and labels.is_file()):
            continue  # not there yet: torchvision downloads them or says they are missing
        n_images = check_idx(images, (None, height, width))
        n_labels = check_idx(labels, (None,))
        if n_images != n_labels:
            raise DataError(
                f"{images.name} holds {n_images:,} images but {labels.name} {n_labels:,} labels: "
                f"the two files in {raw} do not belong together. {REPLACE}"
            )
        if n_images == 0:  # torchvision cannot read an empty file, and there is nothing to train
            raise DataError(f"{images} holds no images (and {labels.name} no labels). {REPLACE}")


def check_labels(labels: torch.Tensor, num_classes: int, source: str) -> None:
    """Every label a class index; else name the first one that is not, and where it is."""
    bad = ((labels < 0) | (labels >= num_classes)).nonzero()
    if len(bad):
        i = int(bad[0])
        raise DataError(
            f"{source} holds the label {int(labels[i])} at position {i:,}, but the dataset has "
            f"{num_classes} classes (0 to {num_classes - 1}). {REPLACE}"
        )


def warn_nonfinite(splits: dict[str, torch.Tensor], source: str) -> None:
    """Warn once per split whose float images hold NaN or inf: a validation set with them ends
    with a NaN val/loss (the report marks such a run diverged), a training set with them makes
    NaN losses. One check at setup (a device sync per split), none per step."""
    for split, images in splits.items():
        if not images.is_floating_point():
            continue  # uint8 images are finite by their type
        bad = (~torch.isfinite(images)).flatten(1).any(dim=1).nonzero().flatten()
        if len(bad):
            log.warning(
                "The %s set of %s holds %d images with non-finite values (NaN or inf), the "
                "first at position %d: %s. Fix or drop those images.",
                split,
                source,
                len(bad),
                int(bad[0]),
                "the run's val/loss will be NaN"
                if split == "validation"
                else "steps that take them will have NaN losses (trainer.on_nonfinite_loss)",
            )


def check_cifar_batches(cls, folder: Path) -> None:
    """CIFAR's pickled batches that are present in `folder`, against the MD5s torchvision knows.

    A batch is a pickle, and unpickling runs whatever code the file names: a file whose checksum
    differs is never opened, only named, with how to fetch it again.
    """
    entries = [*cls.train_list, *cls.test_list, [cls.meta["filename"], cls.meta["md5"]]]
    for name, md5 in entries:
        path = folder / name
        if not path.is_file():
            continue  # not there yet: torchvision downloads it or says it is missing
        found = _md5(path)
        if found != md5:
            raise DataError(
                f"{path} is not the file CIFAR-10 publishes: its MD5 is {found}, not {md5} "
                f"({path.stat().st_size:,} bytes; damaged, truncated or another file), so it is "
                f"not read. Delete it and run with dataset.download=true, or unpack {cls.url} "
                f"into {folder.parent}."
            )


def _md5(path: Path) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
