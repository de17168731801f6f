"""`ImageFolderData`: an image folder as the dataset the loop asks for (a `TrainingData`), made of
the package's other modules (mpexp/data/image_folder/__init__.py says which does what), and what
a run records of it."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from mpexp.data import gpu_decode
from mpexp.data.augment import CropFlip
from mpexp.data.base import Batch, TrainingData
from mpexp.data.image_cache import KINDS
from mpexp.data.image_folder import reading
from mpexp.data.image_folder.device_batches import DeviceBatches
from mpexp.data.image_folder.layout import find_root, scan
from mpexp.data.image_folder.loaders import GpuDecoding, Loaders
from mpexp.data.image_folder.normalisation import measured
from mpexp.data.image_folder.reading import Split, Undecodable
from mpexp.data.image_folder.stores import Stores, stored_side
from mpexp.data.image_folder.val_split import val_files
from mpexp.errors import ConfigError
from mpexp.tasks.classification import Classification


class ImageFolderData(TrainingData):
    """Image classification on a folder of image files (see the package's docstring, in
    mpexp/data/image_folder/__init__.py)."""

    task_type = Classification

    def __init__(
        self,
        path: str | None = None,
        val_fraction: float = 0.1,
        split_seed: int = 0,
        image_size: int = 224,
        resize_size: int | None = None,
        mean: list[float] | None = None,
        std: list[float] | None = None,
        stats_images: int = 1000,
        augment: dict | None = None,
        batch_size: int = 256,
        drop_last: bool = True,
        num_workers: int = 4,
        cache: str = "none",
        cache_dir: str = "~/.cache/mpexp/data/images",
        cache_side: int | None = None,
        decode: str = "cpu",
    ):
        super().__init__(batch_size, drop_last)
        if cache not in KINDS:
            raise ConfigError(f"dataset.cache={cache} is none of {', '.join(KINDS)}.")
        gpu_decode.check_decode(decode)
        if cache == "resized" and decode == "gpu":
            raise ConfigError(
                "dataset.cache=resized reads images without decoding them, so dataset.decode=gpu "
                "would have nothing to do: choose one of the two."
            )
        self.path = path
        self.val_fraction, self.split_seed = val_fraction, split_seed
        self.image_size = image_size
        # validation's resize before its centre crop: ImageNet's 256 for 224
        self.resize_size = resize_size or round(image_size / 0.875)
        self.mean, self.std = mean, std
        self.stats_images = stats_images
        augment = dict(augment or {})
        self.crop_scale = augment.pop("crop_scale", (0.08, 1.0))
        self.augment = CropFlip(**augment)  # on the device, as for the in-memory sets
        self.num_workers = num_workers
        self.cache, self.cache_dir = cache, Path(cache_dir).expanduser()
        self.cache_side = cache_side  # training's stored size; None: what its crop needs
        self.cache_ran: dict = {"kind": "none"}  # what was read: ran.data.cache
        self.decode, self.decode_on = decode, "cpu"  # asked, and what ran: ran.data.decode
        self._gpu_decodable = False  # whether dataset.decode=gpu could run here (see setup)
        self.classes: list[str] = []
        self.layout = ""
        self.splits: dict[str, Split] = {}
        self.undecodable: dict[str, str] = {}  # path: reason, as this process met them

    # --- the files ---------------------------------------------------------------------------

    def planned_task(self) -> Classification:
        """The classes from the class folders' names alone: no image is opened."""
        root = find_root(self.path)
        whole = root / "train" if (root / "train").is_dir() else root
        classes = [d for d in whole.iterdir() if d.is_dir() and not d.name.startswith(".")]
        s = self.image_size
        return Classification(channels=3, height=s, width=s, num_classes=len(classes))

    def device_bytes(self, device_type: str, batch: int) -> dict[str, int]:
        """On CUDA, the next batch (uint8 images, labels and indices), copied while the step
        runs; with its JPEGs decoded on the GPU (decode=gpu, or auto, which does so for a
        folder of JPEGs), what decoding it holds (an estimate: gpu_decode.working_bytes)."""
        if device_type != "cuda":
            return {}
        held = {"next_batch": batch * (3 * self.image_size**2 + 16)}
        if self.cache != "resized" and self.decode in ("gpu", "auto"):
            held["gpu_decoder"] = gpu_decode.working_bytes(batch, self.image_size)
        return held

    # --- setup --------------------------------------------------------------------------------

    def setup(
        self, device: torch.device, memory_format: torch.memory_format = torch.contiguous_format
    ) -> Classification:
        """Find the images and their classes, compute the normalisation where it is not given,
        and make the DataLoaders (their workers start with the first epoch)."""
        root = self._find_splits()
        self._undecodable = Undecodable(self.splits, self.classes, self.undecodable)
        if self.cache == "resized":
            self.cache_ran = self._stores(root).attach()
        else:
            every = [os.fsdecode(f) for split in self.splits.values() for f in split.files]
            self.decode_on = gpu_decode.choose(self.decode, device, every)
            # what the slow-data advice may suggest: the GPU's decoder on a CUDA run of JPEGs
            self._gpu_decodable = gpu_decode.choose("auto", device, every) == "gpu"
            for split in self.splits.values():
                split.on_gpu, split.crop_scale = self.decode_on == "gpu", self.crop_scale
        self._gpu = (
            GpuDecoding(device, self.image_size, self.resize_size)
            if self.decode_on == "gpu"
            else None
        )
        self._loaders = Loaders(
            self.splits, self.batch_size, self.drop_last, self.num_workers, device, self.decode_on
        )
        if self.mean is None or self.std is None:
            self.mean, self.std = measured(
                self.splits["train"],
                lambda keys: self._host("train", self._loaders.once("train", keys)),
                self.split_seed,
                self.stats_images,
            )
        self._to_device = DeviceBatches(
            device, memory_format, self.batch_size, self.augment, self.mean, self.std
        )
        s = self.image_size
        self.task = Classification(channels=3, height=s, width=s, num_classes=len(self.classes))
        return self.task

    def _find_splits(self) -> Path:
        """Walk the folder (once) into its splits; the folder's root."""
        root = find_root(self.path)
        scanned, self.layout = scan(root, self.path, self.val_fraction, self.split_seed)
        self.classes = sorted(scanned["train"])
        views = reading.views(self.image_size, self.resize_size, self.crop_scale)
        for name, split in scanned.items():
            files = [f for c in self.classes for f in split[c]]
            labels = [i for i, c in enumerate(self.classes) for _ in split[c]]
            self.splits[name] = Split(root, files, labels, views, self.image_size)
            # the bytes as well: the cache's key and the resume key (each rank reads its share)
            self.splits[name].read_contents(self.rank, self.world_size)
        return root

    def build_cache(self) -> list[Path]:
        """Each split's store of resized images, built where missing, as a run with
        dataset.cache=resized would (`python -m mpexp.cache`); the stores. Raises DataError
        where the cache folder cannot hold them."""
        return self._stores(self._find_splits()).build()

    def _stores(self, root: Path) -> Stores:
        sides = {
            name: stored_side(
                name, self.image_size, self.resize_size, self.crop_scale, self.cache_side
            )
            for name in self.splits
        }
        return Stores(root, self.splits, sides, self.cache_dir, self.num_workers)

    # --- batches -------------------------------------------------------------------------------

    @property
    def train_size(self) -> int:
        """Training images, over all ranks."""
        return len(self.splits["train"])

    def train_batches(
        self, epoch: int, seed: int, device: torch.device, static: bool = False, start: int = 0
    ) -> Iterator[Batch]:
        """The epoch's batches from batch `start` on; the images before it are not decoded."""
        order = self.epoch_order(seed, epoch, start)
        loader = self._loaders.read("train", [(i, seed, epoch) for i in order.tolist()])
        n = self.train_size
        draws = self.augment.draws(n, seed, epoch, device) if self.augment.active else None
        batches = self._host("train", loader, self._to_device.copy_stream)
        yield from self._to_device.batches(batches, device, static, draws)

    def val_batches(self, device: torch.device) -> Iterator[Batch]:
        """The validation images in a fixed order, each once (this rank's share of them),
        resized and centre-cropped."""
        return self._evaluated("val", device)

    def test_batches(self, device: torch.device) -> Iterator[Batch] | None:
        """The test/ folder's images as validation's are, where there is one."""
        return self._evaluated("test", device) if "test" in self.splits else None

    def _evaluated(self, split: str, device: torch.device) -> Iterator[Batch]:
        share = range(len(self.splits[split]))[self.eval_share(len(self.splits[split]))]
        loader = self._loaders.read(split, [(i, None, 0) for i in share])
        batches = self._host(split, loader, self._to_device.copy_stream)
        return self._to_device.batches(batches, device)

    def _host(self, split: str, loader: DataLoader, reader=None) -> Iterable:
        """The loader's batches, the images replaced in them noted (reading.Undecodable) and,
        with dataset.decode=gpu, their JPEGs decoded on the device for the stream `reader`."""
        batches = self._undecodable.checked(split, loader)
        if self._gpu is None:
            return batches
        return self._gpu.batches(self.splits[split], batches, reader)

    def faster_data_keys(self) -> list[str]:
        """More decoding workers; images stored resized (no decoding at all), or JPEGs decoded
        on the GPU where this run could (a CUDA device, a folder of JPEGs alone): the two are
        alternatives, and neither is suggested once one is taken. Never what the run refuses."""
        keys = ["dataset.num_workers"]
        if self.cache == "none" and "gpu" not in (self.decode, self.decode_on):
            keys.append("dataset.cache=resized")
            if self._gpu_decodable:  # decode=auto takes it itself: only decode=cpu lands here
                keys.append("dataset.decode=gpu")
        return keys

    # --- what the run records ------------------------------------------------------------------

    def resume_key(self) -> dict:
        """Each class's training and validation files (names, sizes, modification times and
        content digests, as the start found them) and the normalisation: a file added, removed
        or rewritten since a checkpoint, a class added or removed, moves images between the
        splits or the labels, and a resume would validate on images it trained on.
        (The test split is evaluated once, at the end: what it holds then is what it reports.)"""
        key: dict = {"classes": len(self.classes)}
        for split in ("train", "val"):
            for label, name in enumerate(self.classes):
                key[f"{split}/{name}"] = self.splits[split].digest(label)
        return {**key, "mean": list(self.mean), "std": list(self.std)}

    def run_files(self) -> dict[str, bytes]:
        """val_files.txt: the validation images, one path (relative to dataset.path) a line, in
        label order: which images a run's val/acc measured."""
        return {"val_files.txt": val_files(self.splits["val"].files)}

    def describe(self) -> str:
        shown = ", ".join(self.classes[:8]) + (", ..." if len(self.classes) > 8 else "")
        return f"{self.train_size:,} training images, {len(self.classes)} classes: {shown}"

    def record(self) -> dict:
        """The classes (in label order), the split, the normalisation, the undecodable images."""
        return {
            "path": str(Path(self.path).expanduser().resolve()),
            "layout": self.layout,
            "classes": self.classes,
            "train_images": self.train_size,
            "val_images": len(self.splits["val"]),
            **({"test_images": len(self.splits["test"])} if "test" in self.splits else {}),
            "mean": self.mean,
            "std": self.std,
            "undecodable": sorted(self.undecodable),
            "cache": self.cache_ran,
            "decode": self.decode_on if self.cache_ran["kind"] == "none" else "none (cached)",
        }
