"""dataset.cache=resized for an image folder: each split's store of resized images
(mpexp/data/image_cache.py), opened, or built where missing, and handed to the split to read
from, at the side each split is stored at."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from mpexp.data.image_cache import CacheUnavailable, ResizedImages, store_name
from mpexp.data.image_folder import reading
from mpexp.data.image_folder.reading import Split, least_side
from mpexp.distributed import rank_zero_first
from mpexp.errors import DataError

log = logging.getLogger(__name__)


def stored_side(
    split: str,
    image_size: int,
    resize_size: int,
    crop_scale: tuple[float, float] | None,
    cache_side: int | None,
) -> tuple[int, bool]:
    """A split's stored shorter side, and whether smaller images are enlarged to it.
    Validation's and test's images are stored as validation resizes them. Training's are
    stored at most at `cache_side`, by default the side its random resized crop needs for
    its smallest crop to keep every pixel (what the decoding workers decode at), and never
    enlarged; without a random crop, as validation's."""
    if split != "train" or (crop_scale is None and cache_side is None):
        return resize_size, True
    return cache_side or least_side(image_size, crop_scale), False


class Stores:
    """The stores of a folder's splits, in `folder`: split `name`'s at `sides[name]` (its
    shorter side, and whether smaller images are enlarged to it, as `stored_side` gives)."""

    def __init__(
        self,
        root: Path,
        splits: dict[str, Split],
        sides: dict[str, tuple[int, bool]],
        folder: Path,
        num_workers: int,
    ):
        self.root, self.splits, self.sides = root, splits, sides
        self.folder, self.num_workers = folder, num_workers

    def build(self) -> list[Path]:
        """Each split's store, built where missing, as a run with dataset.cache=resized would;
        the stores. Raises DataError where the cache folder cannot hold them."""
        try:
            stores = self.open()
        except CacheUnavailable as why:
            raise DataError(
                f"{why}. Point dataset.cache_dir (or MPEXP_DATA_DIR) at a writable folder with "
                "room for the images."
            ) from None
        return [store.store for store in stores.values()]

    def attach(self) -> dict:
        """Read every split from its store of resized images, built where missing; a cache
        folder that cannot be written costs the cache, not the run. What ran: ran.data.cache."""
        try:
            stores = self.open()
        except CacheUnavailable as why:
            log.warning(
                "dataset.cache=resized is NOT used: %s. This run decodes every image in its "
                "workers instead (ran.data.cache records it). Point dataset.cache_dir (or "
                "MPEXP_DATA_DIR) at a writable folder with room for the images to use it.",
                why,
            )
            return {"kind": "none", "asked": "resized", "why": str(why)}
        for name, store in stores.items():
            self.splits[name].cache = store
        return {"kind": "resized", "side": self.sides["train"][0],
                "val_side": self.sides["val"][0],
                "stores": [str(s.store) for s in stores.values()]}  # fmt: skip

    def open(self) -> dict[str, ResizedImages]:
        """Each split's store (mpexp/data/image_cache.py), built where it is missing: by one
        process of those asking together, by rank 0 under torchrun. Raises CacheUnavailable."""
        stores = {}
        # the files by their full paths: the same key whichever folder a run starts from
        real = self.root.resolve()
        with rank_zero_first():  # one build for all ranks: rank 0's, which the others then read
            for name, split in self.splits.items():
                paths = [os.path.join(real, os.fsdecode(f)) for f in split.files]
                side, enlarge = self.sides[name]
                stem = store_name(self.root, name, side)
                # reading.decode as it is at the call, as Split.read looks it up (a test swaps it)
                stores[name] = ResizedImages(
                    paths, split.stats, side, enlarge, self.folder, stem, reading.decode,
                    split.contents,
                ).open(self.num_workers)  # fmt: skip
                # as the store found them, if they changed
                split.stats, split.contents = stores[name].stats, stores[name].contents
        return stores
