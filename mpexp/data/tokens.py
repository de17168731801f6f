"""Pre-tokenized corpora in nanoGPT's layout: a folder with `train.bin` and `val.bin`, each a flat
array of token ids with no header, read through `numpy.memmap` (a corpus of any size trains, and
only the windows a batch needs come off the disk). Files written by nanoGPT's prepare.py scripts
(GPT-2's tokens as uint16) train unchanged.

The ids are uint16 where the vocabulary fits in 16 bits (`dataset.vocab_size` <= 65,536) and uint32
above it, unless `dataset.dtype` says otherwise: the files carry no header to tell. Windows,
validation and resume follow mpexp/data/windows.py. A folder with `train.bin` alone validates on
its tail (`dataset.val_fraction`), as dataset=text does, and says so.

`val/bpb` needs the bytes of text per token, which token files do not record: give
`dataset.bytes_per_token` (the text's bytes over its token count) to have it; without it the run
reports no val/bpb rather than a figure in other units.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from mpexp.data.windows import TokenWindows, sample_stretches
from mpexp.errors import ConfigError, DataError
from mpexp.tasks.language_model import LanguageModelling

log = logging.getLogger(__name__)

DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


class TokenFiles(TokenWindows):
    """Random windows of the token ids in `<path>/train.bin` (and `<path>/val.bin`)."""

    def __init__(
        self,
        path: str | None = None,
        vocab_size: int = 50257,
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
        self.vocab_size = vocab_size
        self.dtype = dtype
        self.bytes_per_token = bytes_per_token
        self.folder: Path | None = None
        self.split_from_train = False  # no val.bin: the training file's tail validates

    def setup(
        self, device: torch.device, memory_format: torch.memory_format = torch.contiguous_format
    ) -> LanguageModelling:
        self.require_block_size("dataset=tokens")
        if self.path is None:
            raise ConfigError(
                "dataset=tokens needs the folder of its token files: dataset.path=<folder with "
                "train.bin and val.bin> (nanoGPT's data/<name>/ after its prepare.py)."
            )
        if self.vocab_size < 1:
            raise ConfigError(f"dataset.vocab_size={self.vocab_size} must be at least 1.")
        dtype = np.dtype(self._dtype())
        self.folder = Path(self.path).expanduser().resolve()
        train_path, val_path = self.folder / "train.bin", self.folder / "val.bin"
        if not train_path.is_file():
            raise DataError(
                f"dataset.path={self.path} holds no train.bin. Give the folder with nanoGPT's "
                "train.bin and val.bin (token ids, no header)."
            )
        train = _open(train_path, dtype)
        if val_path.is_file():
            self.train_tokens, self.val_tokens = train, _open(val_path, dtype)
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
        self._check_ids(dtype)
        self.task = LanguageModelling(
            vocab_size=self.vocab_size,
            block_size=self.block_size,
            bytes_per_token=self.bytes_per_token,
        )
        if self.bytes_per_token is None:
            log.info(
                "No val/bpb: the token files do not say how many bytes of text a token stands "
                "for; give dataset.bytes_per_token=<bytes / tokens of the text> to have it."
            )
        return self.task

    def _dtype(self) -> type:
        if self.dtype is None:
            return np.uint16 if self.vocab_size <= 1 << 16 else np.uint32
        if self.dtype not in DTYPES:
            raise ConfigError(
                f"dataset.dtype={self.dtype} is not a token type: give uint16 or uint32, or null "
                "for uint16 up to a vocabulary of 65,536 and uint32 above it."
            )
        if self.dtype == "uint16" and self.vocab_size > 1 << 16:
            raise ConfigError(
                f"dataset.vocab_size={self.vocab_size:,} does not fit in uint16 token ids "
                "(65,536 at most): the files must be uint32, dataset.dtype=uint32."
            )
        return DTYPES[self.dtype]

    def _check_ids(self, dtype: np.dtype) -> None:
        """Refuse ids at or above the vocabulary, looked for in evenly spread samples of both
        files (a whole pass over a corpus of billions of tokens would cost minutes at setup)."""
        names = ("train.bin", "train.bin" if self.split_from_train else "val.bin")
        offset = (0, len(self.train_tokens) if self.split_from_train else 0)
        for name, first_id, tokens in zip(
            names, offset, (self.train_tokens, self.val_tokens), strict=True
        ):
            for first, stretch in sample_stretches(tokens):
                bad = np.flatnonzero(stretch >= self.vocab_size)
                if len(bad):
                    at = first_id + first + int(bad[0])
                    raise DataError(
                        f"{self.folder / name} holds token id {int(stretch[bad[0]]):,} at "
                        f"position {at:,}, at or above dataset.vocab_size={self.vocab_size:,}. "
                        "Set dataset.vocab_size to the tokenizer's vocabulary (50257 for GPT-2's), "
                        f"or dataset.dtype if the files are not {dtype.name}."
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
        return {"tokenizer": None}  # the files do not say which made them

    def describe(self) -> str:
        val = "the tail of train.bin" if self.split_from_train else "val.bin"
        return (
            f"{self.train_size:,} windows of {self.block_size} tokens per epoch from "
            f"{len(self.train_tokens):,} training tokens ({self.folder}/train.bin, "
            f"{np.dtype(self.train_tokens.dtype).name}), validated on {len(self.val_tokens):,} of "
            f"{val}"
        )


def _open(path: Path, dtype: np.dtype) -> np.ndarray:
    """A token file through a memory map; its size must be a whole number of tokens."""
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
