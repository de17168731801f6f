"""Pre-tokenized corpora as nanoGPT and llm.c write them, read through `numpy.memmap` (a corpus of
any size trains, and only the windows a batch needs come off the disk):

- nanoGPT's layout: a folder with `train.bin` and `val.bin`, each a flat array of token ids with
  no header (its prepare.py scripts write GPT-2's tokens as uint16);
- llm.c's: shards named `<name>_train_<k>.bin` and `<name>_val_<k>.bin` (or `<name>_train.bin`),
  each behind a header of 256 int32: a magic, a version, the token count. GPT-2's shards are
  magic 20240520 version 1 (uint16 ids), LLaMA-3's magic 20240801 version 7 (uint32 ids). A
  split's shards are read in name order as one stream.

Both train unchanged. nanoGPT's ids are uint16 where the vocabulary fits in 16 bits
(`dataset.vocab_size` <= 65,536) and uint32 above it, unless `dataset.dtype` says otherwise: its
files carry no header to tell; an llm.c header says it itself. The vocabulary is
`dataset.vocab_size`, else the `vocab_size` of nanoGPT's meta.pkl beside the files (its
character-level scripts write one; mpexp/data/meta_pkl.py reads it without running code), else
GPT-2's 50,257. Every id in the files is checked against it once, at setup (a memory-mapped pass:
0.1 s per GB in the page cache, a cold file at the disk's speed). Windows, validation and resume
follow mpexp/data/windows.py. A folder with `train.bin` alone validates on its tail
(`dataset.val_fraction`), as dataset=text does, and says so.

`val/bpb` needs the bytes of text per token, which token files do not record: give
`dataset.bytes_per_token` (the text's bytes over its token count) to have it; without it the run
reports no val/bpb rather than a figure in other units.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from mpexp.data.meta_pkl import MOST_IDS, Meta, read_meta
from mpexp.data.meta_pkl import NAME as META_NAME
from mpexp.data.windows import TokenWindows
from mpexp.distributed import gathered
from mpexp.errors import ConfigError, DataError
from mpexp.tasks.language_model import LanguageModelling

log = logging.getLogger(__name__)

DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
GPT2_VOCAB = 50257  # the vocabulary when neither dataset.vocab_size nor a meta.pkl gives one
LLMC_HEADER = 256 * 4  # an llm.c shard's header's bytes: 256 int32
# the header's first two int32, (magic, version): the ids' type. GPT-2's shards; uint32 ids behind
# GPT-2's magic; LLaMA-3's shards
LLMC_FORMATS = {(20240520, 1): np.uint16, (20240520, 2): np.uint32, (20240801, 7): np.uint32}
LLMC_MAGICS = sorted({magic for magic, _ in LLMC_FORMATS})
SCAN = 1 << 24  # ids read at a time by the check of every id: 32 MB of uint16


class TokenFiles(TokenWindows):
    """Random windows of the token ids in `<path>/train.bin` (and `<path>/val.bin`)."""

    def __init__(
        self,
        path: str | None = None,
        vocab_size: int | None = None,
        dtype: str | None = None,
        bytes_per_token: float | None = None,
        block_size: int | None = None,
        train_size: int = 4096,
        val_size: int = 256,
        val_fraction: float = 0.1,
        batch_size: int = 32,
        drop_last: bool = True,
    ):
        super().__init__(block_size, train_size, val_size, val_fraction, batch_size, drop_last)
        self.path = path
        self.vocab_size = vocab_size  # as given; `vocab` is what the run uses
        self.vocab = vocab_size or GPT2_VOCAB
        self.dtype = dtype
        self.bytes_per_token = bytes_per_token
        self.folder: Path | None = None
        self.meta: Meta | None = None  # nanoGPT's meta.pkl, where the folder has one
        self.split_from_train = False  # no val.bin: the training file's tail validates
        self.names: tuple[str, str | None] = ("train.bin", "val.bin")  # the first files' names

    def planned_task(self) -> LanguageModelling:
        """The vocabulary as a run finds it (meta.pkl beside the files, where the folder is
        there), without opening the token files."""
        self.require_block_size("dataset=tokens")
        if self.path is not None:
            self.folder = Path(self.path).expanduser().resolve()
            self.vocab = self._vocabulary()
        return LanguageModelling(self.vocab, self.block_size, self.bytes_per_token)

    def setup(
        self, device: torch.device, memory_format: torch.memory_format = torch.contiguous_format
    ) -> LanguageModelling:
        self.require_block_size("dataset=tokens")
        if self.path is None:
            raise ConfigError(
                "dataset=tokens needs the folder of its token files: dataset.path=<folder with "
                "train.bin and val.bin> (nanoGPT's data/<name>/ after its prepare.py)."
            )
        if self.vocab_size is not None and not 1 <= self.vocab_size <= MOST_IDS:
            raise ConfigError(
                f"dataset.vocab_size={self.vocab_size} must lie in [1, {MOST_IDS:,}]: token "
                "files hold uint16 or uint32 ids."
            )
        self.folder = Path(self.path).expanduser().resolve()
        train_files, val_files = split_files(self.folder)
        if not train_files:
            raise DataError(
                f"dataset.path={self.path} holds no train.bin (nanoGPT's train.bin and val.bin) "
                "and no llm.c shards (<name>_train_<k>.bin, <name>_val_<k>.bin). Give the folder "
                "that holds them."
            )
        self.vocab = self._vocabulary()
        dtype = np.dtype(self._dtype())
        self.names = (train_files[0].name, val_files[0].name if val_files else None)
        shards = train_files[0].name != "train.bin"  # llm.c's: each file behind its header
        opened = {f: _open(f, dtype, shards) for f in [*train_files, *val_files]}
        train = _stream([opened[f] for f in train_files])
        if val_files:
            self.train_tokens = train
            self.val_tokens = _stream([opened[f] for f in val_files])
        elif isinstance(train, Shards):
            raise DataError(
                f"{self.folder} holds {len(train_files)} training shards and no validation "
                "shard (<name>_val_<k>.bin): give llm.c's validation shard beside them."
            )
        else:
            self.split_from_train = True
            split = round(len(train) * (1 - self.val_fraction))
            self.train_tokens, self.val_tokens = train[:split], train[split:]
            log.warning(
                "%s has no val.bin: the last %g of train.bin validates (dataset.val_fraction).",
                self.folder,
                self.val_fraction,
            )
        what = f" with dataset.val_fraction={self.val_fraction}" if self.split_from_train else ""
        self.check_windows(f"The token files in {self.folder}", what)
        self._check_ids(opened)
        self.task = LanguageModelling(
            vocab_size=self.vocab,
            block_size=self.block_size,
            bytes_per_token=self.bytes_per_token,
        )
        if self.bytes_per_token is None:
            log.info(
                "No val/bpb: the token files do not say how many bytes of text a token stands "
                "for; give dataset.bytes_per_token=<bytes / tokens of the text> to have it."
            )
        return self.task

    def _vocabulary(self) -> int:
        """dataset.vocab_size, else meta.pkl's, else GPT-2's; the two given must agree."""
        if (self.folder / META_NAME).is_file():
            self.meta = read_meta(self.folder / META_NAME)
        if self.meta is None:
            return self.vocab_size or GPT2_VOCAB
        if self.vocab_size is not None and self.vocab_size != self.meta.vocab_size:
            raise ConfigError(
                f"dataset.vocab_size={self.vocab_size:,} disagrees with the vocab_size "
                f"{self.meta.vocab_size:,} of {self.meta.path}: leave dataset.vocab_size unset "
                "(null) to take meta.pkl's, or fix the one that is wrong."
            )
        return self.meta.vocab_size

    def _dtype(self) -> type:
        if self.dtype is None:
            return np.uint16 if self.vocab <= 1 << 16 else np.uint32
        if self.dtype not in DTYPES:
            raise ConfigError(
                f"dataset.dtype={self.dtype} is not a token type: give uint16 or uint32, or null "
                "for uint16 up to a vocabulary of 65,536 and uint32 above it."
            )
        if self.dtype == "uint16" and self.vocab > 1 << 16:
            raise ConfigError(
                f"The vocabulary of {self.vocab:,} tokens does not fit in uint16 token ids "
                "(65,536 at most): the files must be uint32, dataset.dtype=uint32."
            )
        return DTYPES[self.dtype]

    def _check_ids(self, files: dict[Path, np.ndarray]) -> None:
        """Refuse a file holding an id at or above the vocabulary, wherever it is: the embedding
        would fail on it mid-run. One pass over the files, `SCAN` ids at a time; in a
        distributed run each rank scans every world_size-th stretch, and every rank refuses
        the first id out of range that any of them found."""
        arrays = list(files.values())
        found = None  # (file's number, position, id) of the first id out of range found here
        for k, first in scan_share(arrays, self.rank, self.world_size):
            chunk = np.asarray(arrays[k][first : first + SCAN])
            if chunk.max() >= self.vocab:
                at = int(np.flatnonzero(chunk >= self.vocab)[0])
                found = (k, first + at, int(chunk[at]))
                break
        every = gathered(found) if self.world_size > 1 else [found]
        found = min((f for f in every if f is not None), default=None)
        if found is None:
            return
        k, position, token = found
        if self.meta is not None:
            where = f"meta.pkl's vocab_size {self.vocab:,}"
        elif self.vocab_size is None:
            where = f"GPT-2's {self.vocab:,}, as dataset.vocab_size is unset"
        else:
            where = f"dataset.vocab_size={self.vocab:,}"
        path, tokens = list(files)[k], arrays[k]
        raise DataError(
            f"{path} holds token id {token:,} at position {position:,}, at or above the "
            f"vocabulary ({where}). Set dataset.vocab_size to the tokenizer's vocabulary (50257 "
            f"for GPT-2's, 128256 for LLaMA-3's), or dataset.dtype if the file is not "
            f"{tokens.dtype.name}."
        )

    def resume_key(self) -> dict:
        """Both parts' lengths and a digest of samples of them: files replaced or re-tokenized
        since a checkpoint would give a resume other windows."""
        return {
            "train_tokens": len(self.train_tokens),
            "val_tokens": len(self.val_tokens),
            "digest": self.sample_digest(),
        }

    def record(self) -> dict:
        """No tokenizer (the files do not say which made them); nanoGPT's meta.pkl, which maps
        a character-level run's ids to characters, where there is one."""
        if self.meta is None:
            return {"tokenizer": None}
        return {"tokenizer": None, "meta": str(self.meta.path)}

    def describe(self) -> str:
        train, val = self.names
        val = f"the tail of {train}" if self.split_from_train else val
        return (
            f"{self.train_size:,} windows of {self.block_size} tokens per epoch from "
            f"{len(self.train_tokens):,} training tokens ({self.folder}/{train}, "
            f"{np.dtype(self.train_tokens.dtype).name}), validated on {len(self.val_tokens):,} of "
            f"{val}"
        )


def scan_share(arrays: list, rank: int, world_size: int) -> list[tuple[int, int]]:
    """The stretches of `SCAN` ids that rank `rank` of `world_size` checks, as (array's number,
    first position): every world_size-th of all the arrays' stretches, in order."""
    stretches = [(k, at) for k, ids in enumerate(arrays) for at in range(0, len(ids), SCAN)]
    return stretches[rank::world_size]


def split_files(folder: Path) -> tuple[list[Path], list[Path]]:
    """The training and validation files of a folder: nanoGPT's train.bin and val.bin, or else
    llm.c's shards, in name order."""
    if (folder / "train.bin").is_file():
        val = folder / "val.bin"
        return [folder / "train.bin"], [val] if val.is_file() else []
    shards = sorted(folder.glob("*.bin"))
    return (
        [f for f in shards if "_train" in f.stem],
        [f for f in shards if "_val" in f.stem],
    )


class Shards:
    """Token files read as one stream, in order: what the windows index (`len`, slices and
    arrays of positions), without copying the files into one."""

    def __init__(self, parts: list[np.ndarray]):
        self.parts = parts
        self.starts = np.cumsum([0, *(len(p) for p in parts)])
        self.dtype = parts[0].dtype

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, index) -> np.ndarray:
        if isinstance(index, slice):
            index = np.arange(*index.indices(len(self)))
        index = np.asarray(index)
        shard = np.searchsorted(self.starts, index, side="right") - 1
        out = np.empty(index.shape, dtype=self.dtype)
        for k in np.unique(shard):
            here = shard == k
            out[here] = self.parts[k][index[here] - self.starts[k]]
        return out


def _stream(parts: list[np.ndarray]) -> np.ndarray | Shards:
    """One file's tokens as they are, several files' as one stream of one type."""
    if len(parts) == 1:
        return parts[0]
    if len({p.dtype for p in parts}) > 1:
        raise DataError("The shards hold token ids of different types (their headers' versions).")
    return Shards(parts)


def _llmc_header(path: Path, required: bool) -> tuple[np.dtype, int] | None:
    """An llm.c shard's id type and token count, from its header; None for a headerless file (a
    nanoGPT .bin, which has no header to require)."""
    with path.open("rb") as f:
        head = f.read(LLMC_HEADER)
    # a headerless file shorter than a header need not be a whole number of int32 (301 uint16
    # ids): only its whole int32 are read as one
    head = np.frombuffer(head[: len(head) - len(head) % 4], dtype="<i4")
    magic, version = (int(head[0]), int(head[1])) if len(head) >= 3 else (None, None)
    if magic not in LLMC_MAGICS:
        if not required:
            return None
        raise DataError(
            f"{path} has no llm.c token header: its first int32 is {magic}, where llm.c's shards "
            f"begin with one of the magics {', '.join(map(str, LLMC_MAGICS))} (GPT-2's, "
            "LLaMA-3's). Write it with llm.c's data scripts, or name headerless nanoGPT files "
            "train.bin and val.bin."
        )
    if (magic, version) not in LLMC_FORMATS:
        known = ", ".join(
            f"{v} (magic {m}, {np.dtype(t).name})" for (m, v), t in LLMC_FORMATS.items()
        )
        raise DataError(
            f"{path} is an llm.c token shard of version {version} (magic {magic}); mpexp reads "
            f"versions {known}."
        )
    return np.dtype(LLMC_FORMATS[magic, version]), int(head[2])


def _open(path: Path, dtype: np.dtype, shard: bool) -> np.ndarray:
    """A token file through a memory map; its size must be a whole number of tokens (an llm.c
    shard's, whose header `shard` requires: its header's count, whose type the header gives)."""
    header = _llmc_header(path, required=shard)
    if header is not None:
        dtype, count = header
        expected = LLMC_HEADER + count * dtype.itemsize
        if path.stat().st_size != expected:
            raise DataError(
                f"{path} holds {path.stat().st_size:,} bytes where its llm.c header promises "
                f"{count:,} {dtype.name} tokens ({expected:,} bytes): it is truncated."
            )
        return np.memmap(path, dtype=dtype, mode="r", offset=LLMC_HEADER, shape=(count,))
    size = path.stat().st_size
    if size % dtype.itemsize:
        raise DataError(
            f"{path} holds {size:,} bytes, not a whole number of {dtype.name} tokens "
            f"({dtype.itemsize} bytes each): it is truncated, or its ids are of another type "
            "(set dataset.dtype=uint16 or uint32 as the file was written)."
        )
    if size == 0:
        return np.zeros(0, dtype=dtype)  # numpy cannot map an empty file
    return np.memmap(path, dtype=dtype, mode="r")
