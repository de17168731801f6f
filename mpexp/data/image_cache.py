"""`dataset.cache=resized`: each split of an image folder stored once as raw pixels, and read back
without decoding. An epoch then costs a copy and a crop per image, not a JPEG decode.

Training's images are stored with their shorter side at most `dataset.cache_side` (by default what
the random resized crop needs for its smallest crop to keep its pixels: 792 for 224 px at
`crop_scale` 0.08, the size the decoding workers decode at too) and never enlarged; validation's
and test's are stored as validation resizes them (`dataset.resize_size`, 256 for 224), so that
its centre crop gives exactly the decoding workers' images.

A store is a folder under `dataset.cache_dir` (by default `$MPEXP_DATA_DIR/images`) named after
the image folder, the split, the size and its content key (a digest of every file's path, size,
modification time and bytes, mpexp/data/file_digest.py):

    <name>-<key>/pixels.bin   uint8 pixels, image after image, each 3 x H x W; read through a
                              memory map (only the images asked for are read, by whichever
                              worker asks), so that a folder larger than memory trains
    <name>-<key>/index.npy    int64 (offset, H, W) of each image; H = 0: it could not be decoded
    <name>-<key>/key.json     the key, the pixels' length, the undecodable files
    <name>-<key>.lock         taken by the one process that builds the store; the others wait,
                              naming it from the note it wrote there as it took the lock
                              (`<name>-<key>.lock.guard` makes the two one step)

Many processes share it. A store is built once: a process that finds it missing takes its lock
(an flock) and builds it while every other (a sweep's jobs, started together) waits on the lock
and then reads what was built; under torchrun rank 0 builds while the other ranks wait for it
(`mpexp.distributed.rank_zero_first`). A store is written into a partial folder, synced, and
renamed into place whole: the index and the pixels appear together, and a name once in place is
never written again. A folder of images that changes gets a store of another name (the old one
stays for the runs that still read it, said in a log line); a folder that changes while its store
is built is found by taking its key again before the store is put in place: it is built once more
from the folder as it is then, and refused (DataError) if it changed again. A builder that is
killed leaves its partial folder; the next build of that store removes it (mpexp/atomic.py).

A cache folder that cannot be written (read-only, full) costs the cache, not the run:
CacheUnavailable, which the image folder turns into a loud warning and a run that decodes as
usual (`ran.data.cache` says which ran). `python -m mpexp.cache <dataset overrides>` builds
the stores outside a training job (mpexp/cache.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset
from torchvision.transforms import v2
from tqdm import tqdm

from mpexp import atomic
from mpexp.data.file_digest import file_digests
from mpexp.data.workers import WorkerLoader
from mpexp.errors import DataError

log = logging.getLogger(__name__)

CACHE_VERSION = 2  # 2: a folder per store, named by its key; training's images never enlarged
KINDS = ("none", "resized")
FILES = ("pixels.bin", "index.npy", "key.json")


class CacheUnavailable(Exception):
    """The store cannot be written (a read-only or full cache folder); the message says why."""


class _Changed(Exception):
    """The folder's files changed while their store was built."""


Decoder = Callable[[str, int], torch.Tensor]  # (path, the shorter side needed) -> 3 x H x W uint8


def fitted(image: torch.Tensor, side: int, enlarge: bool) -> torch.Tensor:
    """`image` resized so that its shorter side is `side` (as validation's resize does), or, with
    `enlarge` false, only where it is longer than that: a store keeps no more pixels than it needs
    and invents none."""
    if not enlarge and min(image.shape[1:]) <= side:
        return image
    return v2.functional.resize(image, side)


class _Resizing(Dataset):
    """The build's items: each file decoded and fitted in a DataLoader worker; (3, 0, 0) where it
    cannot be decoded."""

    def __init__(self, paths: list[str], side: int, enlarge: bool, decode: Decoder):
        self.paths, self.side, self.enlarge, self.decode = paths, side, enlarge, decode

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> torch.Tensor:
        try:
            return fitted(self.decode(self.paths[index], self.side), self.side, self.enlarge)
        except Exception:  # Pillow raises many kinds; the image folder names the file when read
            return torch.zeros(3, 0, 0, dtype=torch.uint8)


def file_stats(paths: list[str]) -> np.ndarray:
    """(size, mtime in ns) of each file, as a (n, 2) int64 array; (-1, -1) for one that is gone."""
    stats = np.full((len(paths), 2), -1, dtype=np.int64)
    for i, path in enumerate(paths):
        with contextlib.suppress(OSError):
            stat = os.stat(path)
            stats[i] = stat.st_size, stat.st_mtime_ns
    return stats


class ResizedImages:
    """One split's store: opened (built where missing) by `open`, then read by index in any
    process."""

    def __init__(
        self,
        paths: list[str],
        stats: np.ndarray,
        side: int,
        enlarge: bool,
        folder: Path,
        name: str,
        decode: Decoder,
        contents: np.ndarray | None = None,
    ):
        """`paths`: the split's files in label order, `stats` their (size, mtime) as the folder's
        scan found them (no second walk), `contents` their content digests
        (mpexp/data/file_digest.py; taken here where not given); `side`, `enlarge`: see
        `fitted`; `name`: the stores' names' stem, the key follows; `decode`: the image
        folder's own."""
        self.paths, self.stats = paths, stats
        self.contents = file_digests(paths, stats[:, 0]) if contents is None else contents
        self.side, self.enlarge, self.decode = side, enlarge, decode
        self.folder, self.name = folder, name
        self.store = folder / name  # set by open(): the store's folder, named by its key
        self._pixels: np.memmap | None = None
        self._index: np.ndarray | None = None

    def __getstate__(self) -> dict:
        # a worker maps the files itself: a pickled memory map would copy every pixel; the
        # stats and digests are the scan's business, not a reader's
        return {**self.__dict__, "_pixels": None, "_index": None, "stats": None, "contents": None}

    @property
    def pixels_path(self) -> Path:
        return self.store / FILES[0]

    def key(self) -> dict:
        """What the store is built from: each file's path, size, mtime and content digest (a
        file rewritten at the same size with its mtime put back gets a store of its own), and
        the size."""
        digest = hashlib.sha256()
        files = zip(self.paths, self.stats.tolist(), self.contents.tolist(), strict=True)
        for path, (size, mtime), content in files:
            digest.update(f"{path}\0{size}\0{mtime}\0{content}\n".encode())
        return {"version": CACHE_VERSION, "side": self.side, "enlarge": self.enlarge,
                "count": len(self.paths), "digest": digest.hexdigest()}  # fmt: skip

    def open(self, workers: int = 0) -> ResizedImages:
        """The store for the files as scanned, built where there is none (once, whichever of the
        processes asking at the same time takes its lock); raises CacheUnavailable when it
        cannot be written, DataError when the folder keeps changing while it is built."""
        for attempt in range(2):
            key = self.key()
            self.store = self.folder / f"{self.name}-{key_name(key)}"
            if self._problem(key) is None:
                break
            lock = self.store.with_name(self.store.name + ".lock")
            try:
                waiting = f"Waiting for another process building {self.store}"
                doing = f"to build {len(self.paths)} images ({self._fit()}) if none has"
                with atomic.exclusive(lock, waiting, doing):
                    if self._problem(key) is None:  # built while this process waited
                        break
                    self._build(key, workers)
                    break
            except _Changed:
                if attempt == 0:
                    log.warning(
                        "The images changed while %s was built (a file was added, removed or "
                        "rewritten): it is built again from the folder as it is now.",
                        self.store,
                    )
            except OSError as err:
                raise CacheUnavailable(
                    f"{self.folder} cannot hold the image cache ({err.strerror or err})"
                ) from None
        else:
            raise DataError(
                f"The image folder changed again while {self.store} was built a second time: "
                "something is writing to it. Let it finish (or stop it) before training, or train "
                "without the cache (dataset.cache=none)."
            )
        log.info("Reading %d images (%s) from %s.", len(self.paths), self._fit(), self.store)
        return self

    def _fit(self) -> str:
        return f"{'resized to' if self.enlarge else 'at most'} {self.side} px"

    def _problem(self, key: dict) -> str | None:
        """Why the store cannot be read as it is, or None when it can."""
        if not self.store.exists():
            return "missing"
        if not (self.store / FILES[2]).is_file():
            return "has no key"
        try:
            saved = json.loads((self.store / FILES[2]).read_text())
        except (OSError, ValueError):
            return "has an unreadable key"
        if not isinstance(saved, dict) or saved.get("key") != key:
            return "was built from other files"
        size = self.pixels_path.stat().st_size if self.pixels_path.is_file() else 0
        if size != saved.get("bytes"):
            return f"holds {size:,} of its {saved.get('bytes')} bytes (cut short)"
        return None

    def _build(self, key: dict, workers: int) -> None:
        """Build the store (under its lock): decode and fit every image (in `workers`
        DataLoader workers) into a partial folder, check that the files did not change
        meanwhile (_Changed), and put it in place whole."""
        problem = self._problem(key)
        if problem != "missing":  # damaged in place (a file cut short by hand, a disk error)
            log.warning("Image cache %s %s: not trusted, built again.", self.store, problem)
            if self.store.is_dir():
                shutil.rmtree(self.store)
            else:
                self.store.unlink()
        else:
            self._said_older()
        with atomic.whole_folder(self.store) as partial:
            written, undecodable = self._write(partial, workers)
            now = file_stats(self.paths)
            if not np.array_equal(now, self.stats):
                self.stats, self.contents = now, file_digests(self.paths, now[:, 0])
                raise _Changed
            record = {"key": key, "bytes": written, "undecodable": undecodable}
            (partial / FILES[2]).write_text(json.dumps(record))
            for name in FILES:
                atomic.sync_file(partial / name)
        self._pixels = self._index = None
        log.info("Cached %d images (%s) in %s (%.1f MB).", len(self.paths), self._fit(),
                 self.store, written / 1e6)  # fmt: skip

    def _write(self, partial: Path, workers: int) -> tuple[int, list[str]]:
        """The pixels and the index into `partial`; the pixels' length, the undecodable files."""
        index = np.zeros((len(self.paths), 3), dtype=np.int64)
        undecodable = []
        # a generator of its own: the loader's start draws a seed, which must not shift the run's
        # (a run that builds the store trains as one that reads it)
        loader = WorkerLoader(
            _Resizing(self.paths, self.side, self.enlarge, self.decode),
            batch_size=None,
            num_workers=workers,
            generator=torch.Generator(),
        )
        bar = tqdm(loader, total=len(self.paths), unit="img", leave=False,
                   desc=f"Caching images ({self._fit()})")  # fmt: skip
        with (partial / FILES[0]).open("wb") as out:
            for i, image in enumerate(bar):
                if image.numel() == 0:
                    undecodable.append(self.paths[i])
                index[i] = out.tell(), image.shape[1], image.shape[2]
                out.write(image.numpy().tobytes())
            written = out.tell()
        with (partial / FILES[1]).open("wb") as out:
            np.save(out, index)
        return written, undecodable

    def _said_older(self) -> None:
        """Name the stores of earlier versions of the same files, which this run will not read:
        they stay for the runs that may still read them."""
        older = [p for p in self.folder.glob(f"{self.name}-*") if p.is_dir() and
                 not p.name.endswith(atomic.SUFFIX)]  # fmt: skip
        if older:
            size = sum(f.stat().st_size for p in older for f in p.iterdir() if f.is_file())
            log.warning(
                "The images differ from those of the earlier image cache %s (a file added, "
                "removed or rewritten since): a new store is built. The earlier one (%.1f MB in "
                "all) stays for any run still reading it: remove it when none is.",
                ", ".join(str(p) for p in older),
                size / 1e6,
            )

    def image(self, index: int) -> torch.Tensor:
        """Image `index` as a 3 x H x W uint8 tensor (a copy of its pixels, nothing else read);
        raises ValueError for one that could not be decoded when the store was built."""
        if self._index is None:
            self._index = np.load(self.store / FILES[1])
            size = self.pixels_path.stat().st_size
            # numpy cannot map an empty file (a split of undecodable images only)
            self._pixels = np.memmap(self.pixels_path, dtype=np.uint8, mode="r") if size else None
        offset, h, w = (int(v) for v in self._index[index])
        if h == 0:
            raise ValueError(f"{self.paths[index]} could not be decoded when it was cached")
        pixels = np.array(self._pixels[offset : offset + 3 * h * w])
        return torch.from_numpy(pixels).view(3, h, w)


def key_name(key: dict) -> str:
    """A store's name from its key: the same key, the same name, in every process."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def store_name(root: Path, split: str, side: int) -> str:
    """The stem of a split's stores: the folder's name, the split, the size and a hash of the
    folder's full path (two folders of the same name keep stores of their own)."""
    where = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:12]
    return f"{root.name or 'images'}-{split}-{side}px-{where}"
