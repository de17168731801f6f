"""What the loop asks of a dataset (`TrainingData`), and the in-memory datasets with their two ways
of batching.

A dataset gives (inputs, targets) batches: shuffled training batches in an order set by the seed
and the epoch (from any batch on, so that a resumed run continues with the same ones), and the
validation set in a fixed order. Its `setup` says which task the batches serve
(mpexp/tasks/): the loop, the report and the tracker ask the task, never the dataset's kind.

MNIST, Fashion-MNIST, CIFAR-10 and the synthetic set fit in memory many times over, so each is
loaded once as a pair of tensors (`InMemoryData`). `loader=device` keeps them on the training
device and shuffles and slices there (no worker processes, no host copies per step);
`loader=dataloader` goes through torch's DataLoader with pinned memory and workers, the
conventional path.

In a distributed run each rank trains on its shard of every epoch: both loaders draw the same
seeded permutation and rank r takes every world_size-th sample of it from position r, as
DistributedSampler does, so together the ranks see each sample once per epoch.

`augment` crops and flips the training batches on the device, both loaders alike
(mpexp/data/augment.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from itertools import islice
from typing import ClassVar

import torch
from torch.utils.data import DistributedSampler, TensorDataset

from mpexp.data.augment import CropFlip
from mpexp.data.checks import warn_nonfinite
from mpexp.data.workers import WorkerLoader
from mpexp.tasks.base import Task
from mpexp.tasks.classification import Classification

Batch = tuple[torch.Tensor, torch.Tensor]


def to_float(images: torch.Tensor, memory_format=torch.contiguous_format) -> torch.Tensor:
    """uint8 images to float in [0, 1], as torchvision's ToTensor gives; float input passes."""
    scaled = images.dtype == torch.uint8
    images = images.to(torch.float32, memory_format=memory_format)  # one copy for both changes
    return images.div_(255) if scaled else images


def epoch_seed(seed: int, epoch: int) -> int:
    """The seed of one epoch's order: the run's seed and the epoch, as every loader takes it."""
    return seed * 100_003 + epoch


class TrainingData(ABC):
    """What the loop asks of a dataset: the task its batches serve, how many there are, and the
    batches themselves, on the training device.

    `batch_size` is per process: the process's share of the optimizer step's batch, which the
    run sets before `setup` (mpexp/batches.py). Subclasses implement `setup`, `train_size`,
    `train_batches` and `val_batches`; the counting of steps and samples, and sharding, live
    here.
    """

    # the kind of task its batches serve, known before any data is read (Optuna's direction)
    task_type: ClassVar[type[Task]]

    def __init__(self, batch_size: int, drop_last: bool = True):
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.rank, self.world_size = 0, 1
        self.task: Task | None = None  # known once set up

    @abstractmethod
    def setup(
        self, device: torch.device, memory_format: torch.memory_format = torch.contiguous_format
    ) -> Task:
        """Load (or open) the data for training on `device`; return the task it serves."""

    def planned_task(self) -> Task | None:
        """The task from the config alone, for `mpexp-plan`: the shapes a run's batches will
        have, known without reading the data; None where only the data can tell (then the plan
        sets the data up as a run would)."""
        return None

    def device_bytes(self, device_type: str, batch: int) -> dict[str, int]:
        """What the data keeps on the training device (`cuda`, `cpu`) beside the batch the step
        reads, by kind, from the config alone, for `mpexp-plan`; `batch` is one process's step
        batch. None here: batches are made one at a time."""
        return {}

    @property
    @abstractmethod
    def train_size(self) -> int:
        """Training samples per epoch, over all ranks."""

    @abstractmethod
    def train_batches(
        self, epoch: int, seed: int, device: torch.device, static: bool = False, start: int = 0
    ) -> Iterator[Batch]:
        """One epoch of training batches on `device`, in an order set by (seed, epoch), from
        batch `start` on (the batches before it are not made: a resumed run skips them).

        With `static=True` a dataset may give every full batch in the same two tensors, which a
        captured CUDA graph then reads in place (the values change, the memory does not); other
        batches the graph copies into its own inputs."""

    @abstractmethod
    def val_batches(self, device: torch.device) -> Iterator[Batch]:
        """The validation set in a fixed order, every sample once: in a distributed run, this
        rank's share of it (`eval_share`), whose sums validation adds up over the ranks. A
        dataset that gives every rank the whole set is measured right too, N times over."""

    def test_batches(self, device: torch.device) -> Iterator[Batch] | None:
        """A held-out test set as `val_batches` gives validation's (this rank's share),
        evaluated once when training ends and reported as `test/...`; None where the data has
        none."""
        return None

    def shard(self, rank: int, world_size: int) -> None:
        """Train on rank `rank`'s share of each epoch; `batch_size` is then per rank."""
        self.rank, self.world_size = rank, world_size

    def rank_share(self, items: torch.Tensor) -> torch.Tensor:
        """This rank's share of an epoch's items: every world_size-th one from position `rank`,
        once the remainder that would leave the ranks unequal shares is dropped."""
        n, world = len(items), self.world_size
        return items[: n - n % world][self.rank :: world]

    def eval_share(self, n: int) -> slice:
        """This rank's share of `n` items evaluated in order (validation's, the test set's): a
        stretch of them, the ranks' stretches in rank order covering all `n` once, their sizes
        at most one apart."""
        world, rank = self.world_size, self.rank
        return slice(rank * n // world, (rank + 1) * n // world)

    def epoch_order(self, seed: int, epoch: int, start: int = 0) -> torch.Tensor:
        """This rank's share of the epoch's seeded order of the training set, from batch
        `start` on (a resumed epoch)."""
        generator = torch.Generator().manual_seed(epoch_seed(seed, epoch))
        order = self.rank_share(torch.randperm(self.train_size, generator=generator))
        return order[start * self.batch_size :]

    def steps_per_epoch(self) -> int:
        # every rank gets the same number of samples (a remainder of < world_size is dropped),
        # hence the same number of steps: a rank with one step more would wait forever on the rest
        n, b = self.train_size // self.world_size, self.batch_size
        return n // b if self.drop_last else -(-n // b)

    def samples_per_epoch(self) -> int:
        """Training samples this rank takes per epoch: with drop_last=false the last, smaller
        batch counts what it holds."""
        n = self.train_size // self.world_size
        return n - n % self.batch_size if self.drop_last else n

    def describe(self) -> str:
        """What an epoch trains on, for the run's first line."""
        return f"{self.train_size:,} samples"

    def check_values(self, name: str) -> None:  # noqa: B027 (optional: most data needs none)
        """Warn about values that will spoil training (non-finite inputs); `name` is the
        dataset's option, for the message. Called once, on the main rank."""

    def faster_data_keys(self) -> list[str]:
        """The dataset keys that feed this data faster, as this run has them set: what the
        data-wait warning and the sweep report suggest (none: nothing in its loading to change)."""
        return []

    def faster_data_hint(self) -> str:
        """What to change when the step waits on this data (said once a run, see
        mpexp.step.data_wait.STARVED_SHARE)."""
        return faster_data_hint(self.faster_data_keys())

    def record(self) -> dict:
        """What the run records about the data beyond its config (`ran.data`), e.g. an image
        folder's classes; asked before training and again at its end."""
        return {}

    def run_files(self) -> dict[str, bytes]:
        """Files the run directory keeps about the data, by name (an image folder's validation
        files): what is too long for `ran.data`."""
        return {}

    def resume_key(self) -> dict | None:
        """What must be as it was for a resume to continue on the same samples, beyond the
        config (a checkpoint keeps it; a resume whose data gives another is refused). None
        where the config alone decides the samples."""
        return None


def faster_data_hint(keys: list[str]) -> str:
    """A dataset's keys that feed it faster, in a sentence."""
    if not keys:
        return (
            "This dataset has no loading setting that feeds it faster; a larger "
            "dataset.batch_size spreads the time between steps over more samples."
        )
    # a key with a value is set to it; one without (a count) is raised
    said = [key if "=" in key else f"a higher {key}" for key in keys]
    return f"Feed it faster: {', or '.join(said)} (docs/speed.md)."


class InMemoryData(TrainingData):
    """An image classification set held as (images, labels) tensors for training and validation.

    Subclasses implement `load()`; everything about batching lives here.
    """

    task_type = Classification

    def __init__(
        self,
        batch_size: int,
        drop_last: bool = True,
        loader: str = "device",
        num_workers: int = 0,
        augment: dict | None = None,
    ):
        super().__init__(batch_size, drop_last)
        self.loader = loader
        self.num_workers = num_workers
        self.augment = CropFlip(**(augment or {}))  # of the training batches, on the device
        self.memory_format = torch.contiguous_format  # setup() takes the step's
        self.train: Batch | None = None
        self.val: Batch | None = None
        self._ready: dict[str, Batch] = {}  # loader=device: what the step reads, made in setup
        self._static: Batch | None = None  # static batches' storage

    def load(self) -> tuple[Batch, Batch, int]:
        """Return (train images, labels), (val images, labels) and the number of classes.

        Images are N x C x H x W, uint8 or float in [0, 1]; labels are int64.
        """
        raise NotImplementedError

    def planned_sizes(self) -> tuple[int, int] | None:
        """(training, validation) samples, known without loading them (None: only loading
        tells)."""
        return None

    def device_bytes(self, device_type: str, batch: int) -> dict[str, int]:
        """With `loader=device`, the whole set as the step reads it (float32 images, int64
        labels) and each epoch's order of it (and its crop and flip draws, where augmented)."""
        task, sizes = self.planned_task(), self.planned_sizes()
        if self.loader != "device" or task is None or sizes is None:
            return {}
        train, val = sizes
        image = 4 * task.channels * task.height * task.width
        order = 8 * train * (1 + 3 * self.augment.active)
        return {"data": (train + val) * (image + 8) + order}

    def setup(
        self, device: torch.device, memory_format: torch.memory_format = torch.contiguous_format
    ) -> Classification:
        """Load the data and make it what the step reads.

        With `loader=device` the images are converted once, here, to float32 in [0, 1] in the
        step's memory format on the device, so that a batch is one gather: no per-batch dtype
        conversion, division or layout copy. `self.train` and `self.val` keep what `load()` gave.
        """
        train, val, num_classes = self.load()
        self.train, self.val = train, val
        self.memory_format = memory_format
        if self.loader == "device":
            self._ready = {
                "train": self._on_device(train, device),
                "val": self._on_device(val, device),
            }
        _, c, h, w = train[0].shape
        self.task = Classification(channels=c, height=h, width=w, num_classes=num_classes)
        return self.task

    def faster_data_keys(self) -> list[str]:
        """Held on the device, the data needs no loading; through a DataLoader, its workers."""
        if self.loader == "device":
            return []
        return ["dataset.loader=device", "dataset.num_workers"]

    def check_values(self, name: str) -> None:
        warn_nonfinite({"training": self.train[0], "validation": self.val[0]}, name)

    def _on_device(self, data: Batch, device: torch.device) -> Batch:
        """Images as float32 on `device`, stored N x H x W x C for channels_last: a gather along
        the first dimension then yields batches that are channels_last already."""
        images, labels = data
        images = to_float(images.to(device))
        if self.memory_format == torch.channels_last:
            images = images.permute(0, 2, 3, 1).contiguous()
        return images, labels.to(device)

    def _batch_view(self, stored: torch.Tensor) -> torch.Tensor:
        """A batch as the model takes it (N x C x H x W), from its stored layout."""
        if self.memory_format == torch.channels_last:
            return stored.permute(0, 3, 1, 2)
        return stored

    @property
    def train_size(self) -> int:
        """The whole training set, over all ranks."""
        return len(self.train[1])

    def train_batches(
        self, epoch: int, seed: int, device: torch.device, static: bool = False, start: int = 0
    ) -> Iterator[Batch]:
        """Shuffled training batches; with `loader=device` and `static`, every full batch is
        gathered into the same two tensors."""
        n = self.train_size
        draws = self.augment.draws(n, seed, epoch, device) if self.augment.active else None
        if self.loader == "device":
            order = self.epoch_order(seed, epoch, start)
            yield from self._gather(self._ready["train"], order.to(device), static, draws)
            return
        # a captured step copies a DataLoader's batches into its own inputs (step_graph.py);
        # batches of in-memory tensors are cheap to skip: slices, no decoding
        yield from islice(self._loader_batches(epoch, seed, device, draws), start, None)

    def _loader_batches(
        self, epoch: int, seed: int, device: torch.device, draws: torch.Tensor | None
    ) -> Iterator[Batch]:
        world = self.world_size
        if world > 1:
            # DistributedSampler seeds its permutation with seed + epoch: the device path's order
            sampler = DistributedSampler(
                TensorDataset(*self.train),
                num_replicas=world,
                rank=self.rank,
                seed=seed * 100_003,
                drop_last=True,
            )
            sampler.set_epoch(epoch)
            yield from self._dataloader(
                self.train, device, shuffle=False, sampler=sampler, draws=draws
            )
        else:
            generator = torch.Generator().manual_seed(epoch_seed(seed, epoch))
            yield from self._dataloader(
                self.train, device, shuffle=True, generator=generator, draws=draws
            )

    def val_batches(self, device: torch.device) -> Iterator[Batch]:
        """This rank's share of the validation set, in order."""
        if self.loader == "device":
            images, labels = self._ready["val"]
            share = self.eval_share(len(labels))
            images, labels = images[share], labels[share]
            for start in range(0, len(labels), self.batch_size):
                stop = start + self.batch_size
                yield self._batch_view(images[start:stop]), labels[start:stop]
        else:
            share = self.eval_share(len(self.val[1]))
            yield from self._dataloader(tuple(t[share] for t in self.val), device, shuffle=False)

    def _gather(
        self, data: Batch, order: torch.Tensor, static: bool, draws: torch.Tensor | None = None
    ) -> Iterator[Batch]:
        images, labels = data
        n, b = len(order), self.batch_size
        stop = n - n % b if self.drop_last else n
        for start in range(0, stop, b):
            idx = order[start : start + b]
            if static and len(idx) == b:
                if self._static is None:
                    self._static = (images.new_empty((b, *images.shape[1:])), labels.new_empty(b))
                torch.index_select(images, 0, idx, out=self._static[0])
                torch.index_select(labels, 0, idx, out=self._static[1])
                batch = self._batch_view(self._static[0]), self._static[1]
            else:
                batch = self._batch_view(images[idx]), labels[idx]
            if draws is not None:
                self.augment.apply_(batch[0], draws[idx])
            yield batch

    def _dataloader(
        self, data: Batch, device, shuffle: bool, generator=None, sampler=None, draws=None
    ) -> Iterator[Batch]:
        pin = device.type == "cuda"
        train = shuffle or sampler is not None
        # with augmentation each batch brings its samples' indices, to take their draws by
        indexed = (*data, torch.arange(len(data[1]))) if draws is not None else data
        loader = WorkerLoader(
            TensorDataset(*indexed),
            batch_size=self.batch_size,
            shuffle=shuffle,
            sampler=sampler,
            drop_last=self.drop_last and train,
            num_workers=self.num_workers,
            pin_memory=pin,
            generator=generator,
            persistent_workers=False,
        )
        for images, labels, *index in loader:
            images = to_float(images.to(device, non_blocking=pin), self.memory_format)
            if draws is not None:
                self.augment.apply_(images, draws[index[0].to(device, non_blocking=pin)])
            yield images, labels.to(device, non_blocking=pin)
