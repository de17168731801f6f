"""An image folder's DataLoaders: each split's worker processes, kept from the set-up on, and the
keys (index, seed, epoch) they are to read next; with dataset.decode=gpu, the JPEGs of their
host batches decoded on the device."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch.utils.data import DataLoader

from mpexp.data import gpu_decode
from mpexp.data.image_folder.reading import Split
from mpexp.data.workers import WorkerLoader


class Keys:
    """A DataLoader's sampler whose keys change from epoch to epoch: persistent workers keep the
    DataLoader, and with it the sampler, across epochs."""

    def __init__(self) -> None:
        self.keys: list[tuple[int, int | None, int]] = []

    def __iter__(self):
        return iter(self.keys)

    def __len__(self) -> int:
        return len(self.keys)


class Loaders:
    """Each split's DataLoader (its workers start with its first batch) and the keys it reads:
    a key is (index, seed, epoch); seed None: validation's view."""

    def __init__(
        self,
        splits: dict[str, Split],
        batch_size: int,
        drop_last: bool,
        num_workers: int,
        device: torch.device,
        decode_on: str,
    ):
        self.splits = splits
        self.batch_size, self.num_workers = batch_size, num_workers
        self.pin = device.type == "cuda"
        self.decode_on = decode_on
        self.keys = {name: Keys() for name in splits}
        self.loaders = {
            # the test split's workers end with its one evaluation
            name: self.loader(name, self.keys[name], name == "train" and drop_last, name != "test")
            for name in splits
        }

    def read(self, split: str, keys: list[tuple[int, int | None, int]]) -> DataLoader:
        """Split `split`'s DataLoader, to read `keys` next."""
        self.keys[split].keys = keys
        return self.loaders[split]

    def once(self, split: str, keys: list[tuple[int, int | None, int]]) -> DataLoader:
        """A DataLoader of its own for `keys` of split `split`, every batch kept, its workers
        ending with it."""
        sampler = Keys()
        sampler.keys = keys
        return self.loader(split, sampler, drop_last=False, persistent=False)

    def loader(
        self, split: str, keys: Keys, drop_last: bool, persistent: bool = True
    ) -> DataLoader:
        workers = self.num_workers
        return WorkerLoader(
            self.splits[split],
            batch_size=self.batch_size,
            sampler=keys,
            drop_last=drop_last,
            num_workers=workers,
            pin_memory=self.pin,
            # kept across epochs: no new processes, and no copy of the file list, each epoch
            persistent_workers=persistent and workers > 0,
            # the workers' seeds come from here, not from torch's global generator, which a
            # checkpoint restores: a DataLoader's start must not shift the training's draws
            generator=torch.Generator(),
            collate_fn=gpu_decode.collate if self.decode_on == "gpu" else None,
        )


class GpuDecoding:
    """dataset.decode=gpu: the host batches' JPEGs decoded, cropped and resized on the device
    (mpexp/data/gpu_decode.py)."""

    def __init__(self, device: torch.device, image_size: int, resize_size: int):
        self.decoder = gpu_decode.Decoder(device)
        self.device, self.image_size, self.resize_size = device, image_size, resize_size

    def batches(self, split: Split, batches: Iterable, reader=None) -> Iterator:
        """`batches` of `split` decoded, for the stream `reader` to read (the copy stream, which
        the step's waits on; None: the current one)."""
        for images, labels, index in batches:
            paths = [split.path(i) for i in index.tolist()]  # a host tensor
            size, resize = self.image_size, self.resize_size
            stream = reader or torch.cuda.current_stream(self.device)
            yield self.decoder.batch(images, paths, size, resize, stream), labels, index
