"""One split's image files as the DataLoader's workers read them (`Split`): each decoded upright
(Pillow; a large JPEG at a reduced scale), a transient read error tried again, and turned into the
view training or validation takes of it. An image that cannot be decoded is replaced by the next
one of its split that can; `Undecodable` notes each such image, names the first few in a warning,
and stops a run where a whole class is lost."""

from __future__ import annotations

import errno
import hashlib
import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch
from PIL import ExifTags, Image, ImageOps
from torch.utils.data import Dataset
from torchvision.transforms import v2

from mpexp.data import gpu_decode
from mpexp.data.augment import mixed_seed
from mpexp.data.file_digest import file_digests
from mpexp.data.image_cache import ResizedImages
from mpexp.errors import DataError

log = logging.getLogger(__name__)

# images tried in a row in place of one that cannot be decoded before the set is called unreadable
MAX_TRIES = 64
NAMED_UNDECODABLE = 5  # named in a warning each; the rest only counted
# read errors that a network or overloaded file system gives and takes back: a read that fails so
# is tried again (READ_TRIES in all, RETRY_WAIT_S doubling in between), not taken as a damaged file
TRANSIENT_ERRNOS = frozenset({errno.EIO, errno.EAGAIN, errno.EINTR, errno.ETIMEDOUT, errno.ESTALE})
READ_TRIES = 4
RETRY_WAIT_S = 0.05

T = TypeVar("T")


def retrying(read: Callable[[], T]) -> T:
    """`read()`, tried again after a transient read error (TRANSIENT_ERRNOS) up to READ_TRIES
    times in all; any other error, or the last one, is raised."""
    tried = 1
    while True:
        try:
            return read()
        except OSError as err:
            if err.errno not in TRANSIENT_ERRNOS or tried == READ_TRIES:
                raise
        time.sleep(RETRY_WAIT_S * 2 ** (tried - 1))
        tried += 1


def decode(path: str, least: int | None = None) -> torch.Tensor:
    """An image file as a 3 x H x W uint8 RGB tensor, upright (its EXIF orientation applied,
    greyscale repeated, alpha dropped, the first frame of an animation), by Pillow; raises on a
    file it cannot decode, with Pillow's reason. A transient read error is retried (`retrying`).

    `least`: the shorter side the image is needed at. A larger JPEG is then decoded at 1/2, 1/4
    or 1/8 of its size, the smallest that keeps that side (libjpeg's DCT scaling): a 12-megapixel
    photo needed at 256 pixels decodes in a fraction of the time of its full size."""
    return retrying(lambda: _decode(path, least))


def _decode(path: str, least: int | None) -> torch.Tensor:
    with Image.open(path) as image:
        if least is not None:  # a square: the same scale whichever way the photo is turned
            image.draft("RGB", (least, least))
        # a camera stores a photo as its sensor read it and says in EXIF which way is up
        if image.getexif().get(ExifTags.Base.Orientation, 1) != 1:
            image = ImageOps.exif_transpose(image)
        if image.mode in ("I", "I;16", "I;16B", "I;16L"):  # 16-bit greyscale: its high byte
            image = Image.fromarray((np.asarray(image) >> 8).astype(np.uint8))
        return v2.functional.pil_to_tensor(image.convert("RGB"))


def undecodable_reason(path: str) -> str | None:
    """Why `path` cannot be decoded, or None when it can."""
    try:
        decode(path)
    except Exception as err:  # Pillow raises many kinds (OSError, SyntaxError, ValueError, ...)
        return str(err) or type(err).__name__
    return None


class Split(Dataset):
    """One split as the DataLoader's workers read it: files relative to `root`, their labels, and
    what each image becomes. A key is (index, seed, epoch); seed None: validation's view."""

    def __init__(self, root: Path, files: list[tuple], labels: list[int], views: dict, size: int):
        """`files`: (path relative to `root`, size, mtime in ns) of each, as the scan found them."""
        self.root = str(root)
        # bytes in NumPy arrays, not a list of str: a forked worker that reads a Python object
        # touches its reference count and so copies its memory page, list by list. os.fsencode:
        # a name that is not UTF-8 (an old archive's Latin-1) comes back as the same bytes
        self.files = np.array([os.fsencode(f[0]) for f in files], dtype=np.bytes_)
        # (size, mtime) of each file when the run started: its cache's and its resume's key
        self.stats = np.array([f[1:] for f in files], dtype=np.int64).reshape(-1, 2)
        # a digest of each file's bytes (mpexp/data/file_digest.py), in those keys too: set by
        # `read_contents`, as the dataset's setup asks
        self.contents = np.zeros(len(files), dtype=np.uint64)
        self.labels = np.array(labels, dtype=np.int64)
        self.views = views  # "train" and "val": (transform, the shorter side it needs)
        self.size = size  # of the square a transform gives
        self.cache: ResizedImages | None = None  # dataset.cache=resized: read, not decoded
        self.on_gpu = False  # dataset.decode=gpu: the files' bytes, decoded on the device
        self.crop_scale: tuple[float, float] | None = None  # training's crop, drawn for the GPU

    def __len__(self) -> int:
        return len(self.labels)

    def path(self, index: int) -> str:
        return os.path.join(self.root, os.fsdecode(self.files[index]))

    def of_class(self, label: int) -> range:
        """The indices of a class's images: a class's files are consecutive."""
        where = np.flatnonzero(self.labels == label)
        return range(int(where[0]), int(where[-1]) + 1) if len(where) else range(0)

    def paths(self) -> list[str]:
        """Every file's path, in label order."""
        return [self.path(i) for i in range(len(self))]

    def read_contents(self, rank: int = 0, world_size: int = 1) -> None:
        """Take each file's content digest (`contents`), the ranks sharing the reading."""
        self.contents = file_digests(self.paths(), self.stats[:, 0], rank, world_size)

    def digest(self, label: int) -> str:
        """A class's files as the run started: their number, total size, the newest one's time
        and a digest of their names, sizes, modification times (-1: a link to nothing) and
        contents (a file rewritten at the same size with its time put back changes it)."""
        members = self.of_class(label)
        digest = hashlib.sha256()
        stats = self.stats[members.start : members.stop]
        contents = self.contents[members.start : members.stop].tolist()
        names = self.files[members.start : members.stop]
        for name, (size, mtime), content in zip(names, stats.tolist(), contents, strict=True):
            digest.update(name + f"\0{size}\0{mtime}\0{content}\0".encode())
        total, newest = int(stats[:, 0].clip(min=0).sum()), int(stats[:, 1].max(initial=0))
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(newest // 10**9))
        files = f"{len(members)} files, {total:,} bytes"
        return f"{files}, newest {when} UTC, {digest.hexdigest()[:12]}"

    def read(self, index: int, least: int | None) -> torch.Tensor:
        """Image `index`, from the cache where there is one, else decoded from its file."""
        if self.cache is not None:
            return self.cache.image(index)
        if self.on_gpu:
            return gpu_decode.encoded(self.path(index))
        return decode(self.path(index), least)

    def __getitem__(self, key: tuple[int, int | None, int]):
        """(image, label, index, source): `source` is the index of the file decoded, the next
        decodable one where `index`'s cannot be, -1 where none of MAX_TRIES could."""
        index, seed, epoch = key
        transform, least = self.views["val" if seed is None else "train"]
        for tried in range(min(MAX_TRIES, len(self))):
            source = (index + tried) % len(self)
            try:
                image = self.read(source, least)
            except Exception:  # Pillow raises many kinds; Undecodable.checked names them
                continue
            if self.on_gpu:
                image = gpu_decode.item(image, self.crop_scale, (index, seed, epoch))
                return image, int(self.labels[source]), index, source
            if seed is None:
                return transform(image), int(self.labels[source]), index, source
            # torchvision's random transforms draw from torch's global generator: set it from
            # the image's own seed, and leave the process's (the main one, without workers) as
            # it was
            with torch.random.fork_rng(devices=[]):
                torch.default_generator.manual_seed(mixed_seed(seed, epoch, index))
                return transform(image), int(self.labels[source]), index, source
        return torch.zeros(3, self.size, self.size, dtype=torch.uint8), 0, index, -1


def views(
    image_size: int, resize_size: int, crop_scale: tuple[float, float] | None
) -> dict[str, tuple]:
    """Training's and validation's transform of a decoded image, each with the shorter side
    it needs the image at. Without a random resized crop, training sees validation's view
    (and is cropped and flipped on the device)."""
    size = (image_size, image_size)
    val = v2.Compose([v2.Resize(resize_size), v2.CenterCrop(size)]), resize_size
    if crop_scale is None:
        return {"train": val, "val": val}
    return {
        "train": (
            v2.RandomResizedCrop(size, scale=tuple(crop_scale)),
            least_side(image_size, crop_scale),
        ),
        "val": val,
    }


def least_side(image_size: int, crop_scale: tuple[float, float]) -> int:
    """The shorter side a training image is needed at for its random resized crop: the
    smallest crop is the share crop_scale[0] of the area, still image_size pixels across
    (792 for 224 at 0.08)."""
    return math.ceil(image_size / math.sqrt(crop_scale[0]))


class Undecodable:
    """The images that could not be decoded, as this process met them in the loaders' batches:
    each named in a warning (the first NAMED_UNDECODABLE) and kept with its reason; a class
    none of whose images decodes stops the run, named."""

    def __init__(self, splits: dict[str, Split], classes: list[str], found: dict[str, str]):
        self.splits, self.classes = splits, classes
        self.found = found  # path: reason; the dataset's, which ran.data.undecodable records

    def checked(self, split: str, loader: Iterable) -> Iterator[tuple[torch.Tensor, ...]]:
        """The loader's host batches as (images, labels, indices), after noting the images that
        had to be replaced (a comparison of two host tensors per batch: no device involved)."""
        for images, labels, index, source in loader:
            if not torch.equal(index, source):
                self._replaced(split, index.tolist(), source.tolist())
            yield images, labels, index

    def _replaced(self, name: str, indices: list[int], sources: list[int]) -> None:
        split = self.splits[name]
        for index, source in zip(indices, sources, strict=True):
            if source == index:
                continue
            if source < 0:
                tried = {int(split.labels[(index + i) % len(split)]) for i in range(MAX_TRIES)}
                if len(tried) == 1:  # all within one class: perhaps that class alone
                    self._check_class(name, tried.pop(), decode_all=True)
                raise DataError(
                    f"None of {min(MAX_TRIES, len(split))} images in a row from "
                    f"{split.path(index)} on can be decoded "
                    f"({undecodable_reason(split.path(index)) or 'unreadable at the time'}). Are "
                    f"the files in "
                    f"{split.root} images? Replace the damaged ones, or remove them."
                )
            for skipped in range(index, source if source > index else source + len(split)):
                self._note(name, skipped % len(split))

    def _note(self, name: str, index: int) -> None:
        path = self.splits[name].path(index)
        if path in self.found:
            return
        self.found[path] = reason = undecodable_reason(path) or "unreadable at the time"
        if len(self.found) <= NAMED_UNDECODABLE:
            log.warning(
                "%s cannot be decoded (%s): the next image of its split stands in for it%s. "
                "Replace it with an intact copy, or remove it.",
                path,
                reason,
                "; further ones are counted, not named (ran.data.undecodable)"
                if len(self.found) == NAMED_UNDECODABLE
                else "",
            )
        self._check_class(name, int(self.splits[name].labels[index]))

    def _check_class(self, name: str, label: int, decode_all: bool = False) -> None:
        """Stop where none of a class's images in split `name` can be decoded (as noted so far,
        or with `decode_all` as found by decoding them now): other classes' images would stand
        in for all of them, and the class would be silently dropped."""
        split = self.splits[name]
        paths = [split.path(i) for i in split.of_class(label)]
        if decode_all:
            if any(undecodable_reason(p) is None for p in paths):
                return
        elif not all(p in self.found for p in paths):
            return
        raise DataError(
            f"None of the {len(paths)} {name} images of class {self.classes[label]} can be "
            f"decoded (e.g. {paths[0]}: {undecodable_reason(paths[0])}), so the class would "
            "never be seen. Replace them with intact copies, or remove the class's folder from "
            "every split."
        )
