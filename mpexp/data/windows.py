"""Random windows of a token array for language models: what dataset=text and dataset=tokens
share (mpexp/data/text.py, mpexp/data/tokens.py).

A dataset of this kind holds its training tokens and its validation tokens as two arrays (memory
maps, usually, of uint8, uint16 or uint32 ids). A training sample is a window of `block_size + 1`
tokens at a random offset of the training tokens (the input is its first `block_size` tokens, the
target the same window shifted by one); an epoch is `train_size` windows whose offsets are drawn
from the run's seed and the epoch, so a resumed run continues with the same windows and the ranks
of a distributed run take every world_size-th of them. Validation is `val_size` windows spread
evenly over the validation tokens, the same every epoch.

Batches are gathered one ahead on a background thread: only the windows' tokens come off the
disk, in the file's narrow dtype (pinned on CUDA, so that the copy does not block), and are
widened to int64 on the training device, while the step before runs.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from mpexp.data.base import Batch, TrainingData, epoch_seed
from mpexp.errors import DataError
from mpexp.tasks.language_model import LanguageModelling

SAMPLES = 64  # evenly spread stretches of the tokens that a digest reads
SAMPLE_TOKENS = 4096  # tokens per stretch


class TokenWindows(TrainingData):
    """Windows of `train_tokens` and `val_tokens` (set by a subclass's `setup`)."""

    task_type = LanguageModelling

    def __init__(
        self,
        block_size: int | None,
        train_size: int,
        val_size: int,
        val_fraction: float,
        batch_size: int,
        drop_last: bool,
    ):
        super().__init__(batch_size, drop_last)
        self.block_size = block_size
        self.sizes = (train_size, val_size)
        self.val_fraction = val_fraction
        self.train_tokens: np.ndarray | None = None
        self.val_tokens: np.ndarray | None = None

    @property
    def train_size(self) -> int:
        return self.sizes[0]

    def require_block_size(self, name: str) -> None:
        """Refuse to set up without a window length; `name` is the dataset's option."""
        if self.block_size is None:
            raise DataError(
                f"{name} needs the window length: a model with a context length "
                "(model=gpt sets model.block_size) or dataset.block_size=<tokens>."
            )

    def check_windows(self, name: str, what: str) -> None:
        """Refuse a training or validation part shorter than one window; `name` is the data's,
        `what` how it was split, for the message."""
        window = self.block_size + 1
        for part, tokens in (("training", self.train_tokens), ("validation", self.val_tokens)):
            if len(tokens) < window:
                raise DataError(
                    f"{name}: its {part} part ({len(tokens):,} tokens{what}) is shorter than one "
                    f"window of model.block_size + 1 = {window} tokens. Use more data, a smaller "
                    "block_size or another dataset.val_fraction."
                )

    def train_batches(
        self, epoch: int, seed: int, device: torch.device, static: bool = False, start: int = 0
    ) -> Iterator[Batch]:
        """Windows at offsets drawn from (seed, epoch); this rank's every world_size-th one."""
        generator = torch.Generator().manual_seed(epoch_seed(seed, epoch))
        last = len(self.train_tokens) - self.block_size  # offsets below it keep a whole window
        offsets = torch.randint(last, (self.train_size,), generator=generator)
        offsets = self.rank_share(offsets).numpy()
        b = self.batch_size
        stop = len(offsets) - len(offsets) % b if self.drop_last else len(offsets)
        chunks = [offsets[first : first + b] for first in range(start * b, stop, b)]
        yield from self._prefetched(self.train_tokens, chunks, device)

    def val_batches(self, device: torch.device) -> Iterator[Batch]:
        """`val_size` windows spread evenly over the validation tokens, in order (this rank's
        share of them)."""
        last = len(self.val_tokens) - self.block_size - 1  # the last offset with a whole window
        offsets = np.linspace(0, last, self.sizes[1]).round().astype(np.int64)
        offsets = offsets[self.eval_share(len(offsets))]
        b = self.batch_size
        chunks = [offsets[first : first + b] for first in range(0, len(offsets), b)]
        yield from self._prefetched(self.val_tokens, chunks, device)

    def _prefetched(
        self, tokens: np.ndarray, chunks: list[np.ndarray], device: torch.device
    ) -> Iterator[Batch]:
        """The batches of windows at each chunk of offsets, in order, each gathered on a thread
        while the one before is trained on. A generator closed early (a stop) waits for the one
        gather in flight and leaves no thread behind."""
        pin = device.type == "cuda"
        gather = functools.partial(_gather, tokens, window=self.block_size + 1, pin=pin)
        if not chunks:
            return
        with ThreadPoolExecutor(1, thread_name_prefix="mpexp-windows") as pool:
            ahead = pool.submit(gather, chunks[0])
            for following in [*chunks[1:], None]:
                windows = ahead.result()
                if following is not None:
                    ahead = pool.submit(gather, following)
                # widened on the device: a quarter (uint16) of the bytes cross the bus
                windows = windows.to(device, non_blocking=pin).long()
                yield windows[:, :-1], windows[:, 1:]

    def sample_digest(self) -> str:
        """A digest of evenly spread stretches of both parts: what a resume compares, cheaply."""
        digest = hashlib.sha256()
        for tokens in (self.train_tokens, self.val_tokens):
            for first, stretch in sample_stretches(tokens):
                digest.update(np.int64(first).tobytes())
                digest.update(np.ascontiguousarray(stretch).tobytes())
        return digest.hexdigest()[:16]


def sample_stretches(tokens: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    """(offset, tokens) of `SAMPLES` evenly spread stretches of `SAMPLE_TOKENS` tokens."""
    n = len(tokens)
    for first in np.unique(np.linspace(0, max(0, n - SAMPLE_TOKENS), SAMPLES, dtype=np.int64)):
        yield int(first), np.asarray(tokens[first : first + SAMPLE_TOKENS])


def _gather(tokens: np.ndarray, offsets: np.ndarray, window: int, pin: bool) -> torch.Tensor:
    """The windows of `window` tokens at `offsets`, one per row, in the tokens' own dtype."""
    windows = torch.from_numpy(np.asarray(tokens[offsets[:, None] + np.arange(window)]))
    return windows.pin_memory() if pin else windows
