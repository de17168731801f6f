"""Which files validate, where the folder has no validation folder of its own: a file validates
where a hash of (`split_seed`, its path below the folder split) falls below `val_fraction`. The
same split in every run, whatever its seed, and a file added or removed moves no other; the run
directory lists what validated (val_files.txt)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from mpexp.errors import DataError


def split_by_fraction(
    classes: dict[str, list[tuple]], whole: Path, root: Path, val_fraction: float, split_seed: int
) -> tuple[dict, dict]:
    """Each file of `whole`'s classes to validation where its place (`split_place`) is below
    `val_fraction`, to training otherwise; a class whose every file would validate keeps
    its last-placed one to train on."""
    under = 0 if whole == root else len(whole.name) + 1  # the paths below train/
    train, val = {}, {}
    for name, files in classes.items():
        places = [split_place(split_seed, f[0][under:]) for f in files]
        held = [p < val_fraction for p in places]
        if all(held):
            held[places.index(max(places))] = False
        val[name] = [f for f, h in zip(files, held, strict=True) if h]
        train[name] = [f for f, h in zip(files, held, strict=True) if not h]
    if not any(val.values()):
        total = sum(map(len, classes.values()))
        raise DataError(
            f"dataset.val_fraction={val_fraction} of {total} images in "
            f"{len(classes)} classes leaves no image to validate on. Raise dataset."
            "val_fraction, add images, or give the validation images a val/ folder."
        )
    return train, val


def split_place(split_seed: int, path: str) -> float:
    """A file's place in [0, 1) for the split by val_fraction, from `split_seed` and its path
    within the folder split (its class folder and name) alone: the same in every run and every
    Python (hashlib, not hash()), and unmoved by any other file added or removed."""
    digest = hashlib.sha256(f"{split_seed}/".encode() + os.fsencode(path)).digest()
    return int.from_bytes(digest[:8], "little") / 2**64


def val_files(files: np.ndarray) -> bytes:
    """val_files.txt: the validation split's `files` (paths relative to dataset.path, as bytes),
    one a line, in label order: which images a run's val/acc measured."""
    return b"".join(bytes(f) + b"\n" for f in files)
