"""`dataset.cache=resized`: each split of an image folder stored once as raw pixels, every image
resized so that its shorter side is validation's resize (`dataset.resize_size`: 256 for 224), and
read back without decoding. An epoch then costs a copy and a crop per image, not a JPEG decode.

The store is three files under `dataset.cache_dir` (by default `$MPEXP_DATA_DIR/images`, beside the
text corpus's tokens), named after the folder, the split and the size:

    <name>.bin         uint8 pixels, image after image, each 3 x H x W; read through a memory map,
                       so that a folder larger than memory trains (only the images asked for are
                       read, by whichever worker asks)
    <name>.index.npy   int64 (offset, H, W) of each image; H = 0: it could not be decoded
    <name>.json        the key: the folder's digest (every file's path, size and modification
                       time), the size, the image count, the undecodable files

A store whose key does not match the folder as it is now (a file added, removed or rewritten; a
store cut short) is not trusted: it is built again, and a log line says why. A folder that changes
while its store is built is found by taking its digest again afterwards: the store is built once
more, and refused (DataError) if the folder changed again. A cache folder that cannot be written
(read-only, full) costs the cache, not the run: CacheUnavailable, which the image folder turns into
a loud warning and a run that decodes as usual (`ran.data.cache` says which ran).

Training's random resized crop is taken from the stored image: a small crop is enlarged from fewer
pixels than the decoded original would give it (the trade FFCV makes too); validation's resize and
centre crop give exactly the worker path's images.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset
from torchvision.transforms import v2
from tqdm import tqdm

from mpexp.data.workers import WorkerLoader
from mpexp.errors import DataError

log = logging.getLogger(__name__)

CACHE_VERSION = 1
KINDS = ("none", "resized")


class CacheUnavailable(Exception):
    """The store cannot be written (a read-only or full cache folder); the message says why."""


Decoder = Callable[[str, int], torch.Tensor]  # (path, the shorter side needed) -> 3 x H x W uint8


class _Resizing(Dataset):
    """The build's items: each file decoded and resized, as validation resizes it, in a
    DataLoader worker; (3, 0, 0) where the file cannot be decoded."""

    def __init__(self, paths: list[str], side: int, decode: Decoder):
        self.paths, self.side, self.decode = paths, side, decode

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> torch.Tensor:
        try:
            return v2.functional.resize(self.decode(self.paths[index], self.side), self.side)
        except Exception:  # Pillow raises many kinds; the image folder names the file when read
            return torch.zeros(3, 0, 0, dtype=torch.uint8)


class ResizedImages:
    """One split's store: built or checked by `open`, then read by index in any process."""

    def __init__(self, paths: list[str], side: int, folder: Path, name: str, decode: Decoder):
        """`paths`: the split's files in label order; `name`: the store's file names' stem;
        `decode`: the image folder's own (mpexp/data/image_folder.py)."""
        self.paths, self.side, self.decode = paths, side, decode
        self.pixels_path = folder / f"{name}.bin"
        self.index_path = folder / f"{name}.index.npy"
        self.key_path = folder / f"{name}.json"
        self._pixels: np.memmap | None = None
        self._index: np.ndarray | None = None

    def __getstate__(self) -> dict:
        # a worker maps the files itself: a pickled memory map would copy every pixel
        return {**self.__dict__, "_pixels": None, "_index": None}

    def key(self) -> dict:
        """What the store must have been built from: each file's path, size and mtime."""
        digest = hashlib.sha256()
        for path in self.paths:
            stat = os.stat(path)
            digest.update(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
        return {"version": CACHE_VERSION, "side": self.side, "count": len(self.paths),
                "digest": digest.hexdigest()}  # fmt: skip

    def open(self, workers: int = 0) -> ResizedImages:
        """Check the store against the folder, building it where it is missing or does not
        match; raises CacheUnavailable when it cannot be written, DataError when the folder
        keeps changing while it is built."""
        key = self.key()
        problem = self._problem(key)
        if problem is None:
            log.info("Reading %d images resized to %d px from %s.", len(self.paths), self.side,
                     self.pixels_path)  # fmt: skip
            return self
        if problem != "missing":
            log.warning("Image cache %s %s: not trusted, built again.", self.pixels_path, problem)
        for attempt in range(2):
            self._build(key, workers)
            now = self.key()
            if now == key:
                return self
            self._remove()
            if attempt == 0:
                log.warning(
                    "The images changed while %s was built (a file was added, removed or "
                    "rewritten): it is built again from the folder as it is now.",
                    self.pixels_path,
                )
            key = now
        raise DataError(
            f"The image folder changed again while {self.pixels_path} was built a second time: "
            "something is writing to it. Let it finish (or stop it) before training, or train "
            "without the cache (dataset.cache=none)."
        )

    def _problem(self, key: dict) -> str | None:
        """Why the store cannot be used as it is, or None when it can."""
        if not all(p.is_file() for p in (self.key_path, self.index_path, self.pixels_path)):
            return "missing"
        try:
            saved = json.loads(self.key_path.read_text())
        except (OSError, ValueError):
            return "has an unreadable key"
        if not isinstance(saved, dict) or saved.get("key") != key:
            side = saved.get("key", {}).get("side") if isinstance(saved, dict) else None
            if side is not None and side != self.side:
                return f"was built at {side} px, not {self.side}"
            return "was built from other files (the folder changed since)"
        size = self.pixels_path.stat().st_size
        if size != saved.get("bytes"):
            return f"holds {size:,} of its {saved.get('bytes')} bytes (cut short)"
        return None

    def _build(self, key: dict, workers: int) -> None:
        """Resize every image (in `workers` DataLoader workers) into the store's files, each
        written under a temporary name and renamed when whole: a failed build leaves no part."""
        folder = self.pixels_path.parent
        partial = [p.with_name(f"{p.name}.{os.getpid()}.partial")
                   for p in (self.pixels_path, self.index_path, self.key_path)]  # fmt: skip
        try:
            folder.mkdir(parents=True, exist_ok=True)
            index = np.zeros((len(self.paths), 3), dtype=np.int64)
            undecodable = []
            # a generator of its own: the loader's start draws a seed, which must not shift the
            # run's (a run that builds the store trains as one that reads it)
            loader = WorkerLoader(
                _Resizing(self.paths, self.side, self.decode),
                batch_size=None,
                num_workers=workers,
                generator=torch.Generator(),
            )
            bar = tqdm(loader, total=len(self.paths), unit="img", leave=False,
                       desc=f"Caching images at {self.side} px")  # fmt: skip
            with partial[0].open("wb") as out:
                for i, image in enumerate(bar):
                    if image.numel() == 0:
                        undecodable.append(self.paths[i])
                    index[i] = out.tell(), image.shape[1], image.shape[2]
                    out.write(image.numpy().tobytes())
                written = out.tell()
            with partial[1].open("wb") as out:
                np.save(out, index)
            record = {"key": key, "bytes": written, "undecodable": undecodable}
            partial[2].write_text(json.dumps(record))
            for done, final in zip(partial, (self.pixels_path, self.index_path, self.key_path),
                                   strict=True):  # fmt: skip
                os.replace(done, final)
        except OSError as err:
            _discard(partial)
            raise CacheUnavailable(
                f"{folder} cannot hold the image cache ({err.strerror or err})"
            ) from None
        except BaseException:
            _discard(partial)
            raise
        self._pixels = self._index = None
        log.info("Cached %d images at %d px in %s (%.1f MB).", len(self.paths), self.side,
                 self.pixels_path, written / 1e6)  # fmt: skip

    def _remove(self) -> None:
        _discard([self.key_path, self.index_path, self.pixels_path])  # the key first

    def image(self, index: int) -> torch.Tensor:
        """Image `index` as a 3 x H x W uint8 tensor (a copy of its pixels, nothing else read);
        raises ValueError for one that could not be decoded when the store was built."""
        if self._index is None:
            self._index = np.load(self.index_path)
            size = self.pixels_path.stat().st_size
            # numpy cannot map an empty file (a split of undecodable images only)
            self._pixels = np.memmap(self.pixels_path, dtype=np.uint8, mode="r") if size else None
        offset, h, w = (int(v) for v in self._index[index])
        if h == 0:
            raise ValueError(f"{self.paths[index]} could not be decoded when it was cached")
        pixels = np.array(self._pixels[offset : offset + 3 * h * w])
        return torch.from_numpy(pixels).view(3, h, w)


def _discard(paths: list[Path]) -> None:
    """Remove what there is of `paths`; a folder that cannot be written keeps what it has."""
    for path in paths:
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)


def store_name(root: Path, split: str, side: int) -> str:
    """The stem of a split's store: the folder's name, the split, the size and a hash of the
    folder's full path (two folders of the same name keep stores of their own)."""
    where = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:12]
    return f"{root.name or 'images'}-{split}-{side}px-{where}"
