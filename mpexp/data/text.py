"""Text as byte-level tokens for language models: a UTF-8 file or a folder of them, of any size.

Tokens are bytes (a vocabulary of 256: no tokenizer to download or train, and bits per token are
bits per byte). The source is written once into one binary file of tokens in a cache folder,
beside a key that records the source (its files, sizes and modification times) and the token
count; a run reads the tokens through `numpy.memmap`, so a corpus larger than memory trains, and
only the windows a batch needs are read from disk. A cache file that does not match its key
(truncated, or made from another source, or from an edited one) is rebuilt, never trusted.

The first (1 - `val_fraction`) of the tokens train and the tail validates. A training sample is
a window of `block_size + 1` tokens at a random offset (the input is its first `block_size`
tokens, the target the same window shifted by one); an epoch is `train_size` windows whose offsets
are drawn from the run's seed and the epoch, so a resumed run continues with the same windows and
the ranks of a distributed run take every world_size-th of them. Validation is `val_size` windows
spread evenly over the tail, the same every epoch.

With no `path`, the corpus is the source code of the running Python's standard library: real
text that every machine has.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import logging
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from mpexp import atomic
from mpexp.data.tokenizer import Encoded, byte_lengths, encode, tokenizer_spec
from mpexp.data.windows import TokenWindows
from mpexp.errors import ConfigError, DataError
from mpexp.tasks.language_model import LanguageModelling

log = logging.getLogger(__name__)

VOCAB_SIZE = 256  # byte-level tokens
CACHE_VERSION = 1  # bump when the token file's layout changes: older caches are rebuilt
CHUNK = 1 << 20  # bytes copied at a time: a corpus is never read into memory whole
# folders a corpus folder's walk does not enter: version control, caches, environments
SKIPPED_FOLDERS = {"__pycache__", "site-packages", "dist-packages", "node_modules"}


@dataclass(frozen=True)
class Source:
    """The files a corpus is made of, in the order their bytes are concatenated."""

    name: str  # for messages and the run's first line
    root: Path
    files: tuple[Path, ...]

    def key(self) -> dict:
        """What the cache must match: each file with its size and modification time."""
        return {
            "version": CACHE_VERSION,
            "root": str(self.root),
            "files": [
                [str(f.relative_to(self.root)) if f != self.root else "", *_stamp(f)]
                for f in self.files
            ],
        }


def _stamp(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns


def stdlib_source() -> Source:
    """The running Python's standard library, its .py files (no installed packages)."""
    root = Path(sysconfig.get_paths()["stdlib"]).resolve()
    files = sorted(
        (f for f in root.rglob("*.py") if not SKIPPED_FOLDERS.intersection(f.parts)),
        key=lambda f: f.relative_to(root).parts,
    )
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    return Source(f"Python {version}'s standard library ({root})", root, tuple(files))


def path_source(path: str) -> Source:
    """A text file, or every file below a folder (hidden ones and caches left out), sorted."""
    root = Path(path).expanduser().resolve()
    if not root.exists():
        raise DataError(
            f"dataset.path={path} does not exist. Give a UTF-8 text file or a folder of them, or "
            "leave dataset.path unset to train on Python's standard library."
        )
    if root.is_file():
        return Source(str(root), root, (root,))
    files = []
    for top, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in SKIPPED_FOLDERS)
        files += [Path(top) / n for n in sorted(names) if not n.startswith(".")]
    return Source(str(root), root, tuple(f for f in files if f.is_file()))


class TokenCache:
    """A source's bytes as one token file (`<name>.bin`) and its key (`<name>.json`)."""

    def __init__(self, source: Source, folder: Path):
        self.source = source
        digest = hashlib.sha256(str(source.root).encode()).hexdigest()[:16]
        self.stem = f"{source.root.name or 'corpus'}-{digest}"
        self.tokens_path = folder / f"{self.stem}.bin"
        self.key_path = folder / f"{self.stem}.json"

    def open(self) -> np.memmap:
        """The tokens, built first when the cache is missing or does not match the source."""
        key = self.source.key()
        problem = self._problem(key)
        if problem is not None:
            if problem != "missing":
                log.warning("Token cache %s %s; rebuilding it.", self.tokens_path, problem)
            self._build(key)
        count = json.loads(self.key_path.read_text())["tokens"]
        if count == 0:
            return np.zeros(0, dtype=np.uint8)  # numpy cannot map an empty file
        return np.memmap(self.tokens_path, dtype=np.uint8, mode="r", shape=(count,))

    def file_ends(self) -> list[int]:
        """Where each file's bytes end in the token file, in order (the cache matches its key,
        which holds their sizes; the files left out as not text take no bytes)."""
        saved = json.loads(self.key_path.read_text())
        skipped = set(saved.get("skipped", []))
        sizes = [size for _, size, _ in saved["source"]["files"]]
        kept = [size for f, size in zip(self.source.files, sizes, strict=True)
                if str(f) not in skipped]  # fmt: skip
        return np.cumsum(kept).tolist()

    def _problem(self, key: dict) -> str | None:
        """Why the cache cannot be used as it is, or None when it can."""
        if not self.key_path.is_file() or not self.tokens_path.is_file():
            return "missing"
        try:
            saved = json.loads(self.key_path.read_text())
        except (OSError, ValueError):
            return "has an unreadable key"
        if not isinstance(saved, dict) or saved.get("source") != key:
            return "was made from another source (or the files changed since)"
        size = self.tokens_path.stat().st_size
        if size != saved.get("tokens"):
            return f"holds {size:,} of its {saved.get('tokens')} tokens (truncated)"
        return None

    def _build(self, key: dict) -> None:
        """Copy the source's text files into the token file; files that are not UTF-8 text, or
        cannot be read, are left out (and counted) when the source is a folder, refused when it
        is one file. A build that fails leaves no partial file behind."""
        folder = self.tokens_path.parent
        try:
            skipped: dict[Path, str] = {}  # file: why it was left out
            # written whole or not at all; a killed build's partial file is removed by the next
            with atomic.whole_file(self.tokens_path) as out:  # the tokens first, then the key
                for path in self.source.files:
                    if (why := _copy_text(path, out)) is not None:
                        skipped[path] = why
                tokens = out.tell()
                if skipped and self.source.files == (self.source.root,):
                    raise DataError(f"{self.source.root} {skipped[self.source.root]}.")
            record = {"source": key, "tokens": tokens, "skipped": [str(p) for p in skipped]}
            atomic.write_whole(self.key_path, json.dumps(record).encode())
        except OSError as err:
            raise DataError(
                f"The token cache cannot be written in {folder} ({err.strerror or err}). Point "
                "dataset.cache_dir at a writable folder with room for the corpus."
            ) from None
        if skipped:
            shown = ", ".join(
                f"{p.relative_to(self.source.root)} ({why.split(' (')[0]})"
                for p, why in list(skipped.items())[:3]
            )
            more = f" and {len(skipped) - 3} more" if len(skipped) > 3 else ""
            log.warning(
                "%d files in %s are not UTF-8 text or cannot be read, and were left out: %s%s.",
                len(skipped),
                self.source.root,
                shown,
                more,
            )


NOT_TEXT = (
    "is not UTF-8 text (it holds bytes that UTF-8 does not allow, or NUL bytes). Convert it to "
    "UTF-8, e.g. `iconv -f latin1 -t utf-8`"
)


def _copy_text(path: Path, out) -> str | None:
    """Append a file's bytes to `out` if it is UTF-8 text (checked as it is copied, in chunks)
    and return None; otherwise leave `out` as it was and say why not. An error in writing `out`
    (a full disk) is raised: it is the cache's, not the file's."""
    try:
        f = path.open("rb")
    except OSError as err:
        return _unreadable(err)
    start = out.tell()
    decoder = codecs.getincrementaldecoder("utf-8")()
    why = None
    with f:
        while True:
            try:
                chunk = f.read(CHUNK)
            except OSError as err:
                why = _unreadable(err)
                break
            if not chunk:
                if not _decodes(decoder, b"", final=True):  # it ends inside a character
                    why = NOT_TEXT
                break
            if b"\0" in chunk or not _decodes(decoder, chunk):  # no text file holds NUL bytes
                why = NOT_TEXT
                break
            out.write(chunk)
    if why is not None:
        out.seek(start)
        out.truncate()
    return why


def _unreadable(err: OSError) -> str:
    return f"cannot be read ({err.strerror or err}); check that it is a readable file"


def _decodes(decoder, chunk: bytes, final: bool = False) -> bool:
    try:
        decoder.decode(chunk, final=final)
    except UnicodeDecodeError:
        return False
    return True


class TextData(TokenWindows):
    """Random windows of tokens of a text corpus (see the module's docstring)."""

    def __init__(
        self,
        path: str | None = None,
        block_size: int | None = None,
        train_size: int = 4096,
        val_size: int = 256,
        val_fraction: float = 0.1,
        cache_dir: str = "~/.cache/mpexp/data/text",
        tokenizer: str | None = "byte",
        vocab_size: int | None = None,
        batch_size: int = 32,
        drop_last: bool = True,
    ):
        super().__init__(block_size, train_size, val_size, val_fraction, batch_size, drop_last)
        self.path = path
        self.cache_dir = Path(cache_dir).expanduser()
        self.tokenizer = tokenizer_spec(tokenizer)
        self.vocab_size = vocab_size
        self.tokens: np.ndarray | None = None  # the corpus's bytes
        self.split = 0  # the first validation byte
        self.source: Source | None = None
        self.encoded: Encoded | None = None  # the corpus in a tokenizer's tokens, if not bytes

    def planned_task(self) -> LanguageModelling | None:
        if self.tokenizer != "byte":  # a learned or given tokenizer's vocabulary: read or learned
            return None if self.vocab_size is None else self._task(self.vocab_size, None)
        return self._task(self.vocab_size or VOCAB_SIZE, 1.0)

    def _task(self, vocab: int, bytes_per_token: float | None) -> LanguageModelling:
        self.require_block_size("dataset=text")
        return LanguageModelling(vocab, self.block_size, bytes_per_token=bytes_per_token)

    def corpus(self) -> Source:
        """Where the text comes from (a subclass may fetch it first)."""
        return stdlib_source() if self.path is None else path_source(self.path)

    def setup(
        self, device: torch.device, memory_format: torch.memory_format = torch.contiguous_format
    ) -> LanguageModelling:
        self.require_block_size("dataset=text")
        if self.tokenizer == "byte" and (self.vocab_size or VOCAB_SIZE) < VOCAB_SIZE:
            raise ConfigError(
                f"dataset.vocab_size={self.vocab_size} is smaller than the byte tokenizer's "
                f"{VOCAB_SIZE} tokens: leave it unset (null) with dataset.tokenizer=byte."
            )
        if self.tokenizer == "bpe" and self.vocab_size is None:
            raise ConfigError(
                "dataset.tokenizer=bpe needs the vocabulary to learn: dataset.vocab_size=<tokens> "
                "(e.g. 4096)."
            )
        self.source = self.corpus()
        if not self.source.files:
            raise DataError(
                f"{self.source.name} holds no files to read. Give a UTF-8 text file or a folder "
                "with text files in it (hidden files and __pycache__ are left out)."
            )
        cache = TokenCache(self.source, self.cache_dir)
        self.tokens = cache.open()
        self.split = round(len(self.tokens) * (1 - self.val_fraction))
        if len(self.tokens) == 0:
            what = "is empty" if self.source.files == (self.source.root,) else "has no text files"
            raise DataError(
                f"{self.source.name} {what}: there is nothing to train on. Give a UTF-8 text "
                "file or a folder of them with dataset.path=<file or folder>."
            )
        if self.tokenizer == "byte":
            self.train_tokens = self.tokens[: self.split]
            self.val_tokens = self.tokens[self.split :]
            vocab, bytes_per_token = self.vocab_size or VOCAB_SIZE, 1.0
        else:
            self.encoded = encode(
                self.tokens, self.split, self.cache_dir, cache.stem, self.source.key(),
                self.tokenizer, self.vocab_size or 0, cache.file_ends(),
            )  # fmt: skip
            self.train_tokens, self.val_tokens = self.encoded.train, self.encoded.val
            vocab = self.vocab_size or self.encoded.tokenizer_vocab
            if vocab < self.encoded.tokenizer_vocab:
                raise ConfigError(
                    f"dataset.vocab_size={vocab} is smaller than the vocabulary of "
                    f"dataset.tokenizer={self.tokenizer} ({self.encoded.tokenizer_vocab:,} "
                    "tokens): raise it, or leave it unset to take the tokenizer's."
                )
            bytes_per_token = self.encoded.bytes_per_token
        self.check_windows(
            f"{self.source.name} has {len(self.tokens):,} bytes",
            f" with dataset.val_fraction={self.val_fraction}",
        )
        self.task = LanguageModelling(
            vocab_size=vocab,
            block_size=self.block_size,
            bytes_per_token=bytes_per_token,
            token_bytes=self._token_bytes(vocab, device),
        )
        return self.task

    def _token_bytes(self, vocab: int, device: torch.device) -> torch.Tensor | None:
        """Each id's bytes (val/bpb counted exactly, on the device): one for a byte, a byte-level
        BPE token's length; None where the tokenizer's strings are not its bytes."""
        if self.encoded is None:
            return torch.ones(vocab, dtype=torch.int64, device=device)
        lengths = byte_lengths(self.encoded.tokenizer_path, vocab)
        return None if lengths is None else torch.tensor(lengths, device=device)

    def resume_key(self) -> dict:
        """The corpus's length and a digest of evenly spread samples of it: text added, cut or
        edited since a checkpoint moves the split and the windows' offsets, and a resume would
        go on with other windows and validate on other text. (Not the cache key: touching a
        file without changing it must not refuse a resume.) With a tokenizer, its digest too:
        another tokenizer makes other tokens of the same text."""
        n, block = len(self.tokens), 4096
        digest = hashlib.sha256()
        for start in np.linspace(0, max(0, n - block), num=64, dtype=np.int64):
            digest.update(np.asarray(self.tokens[start : start + block]).tobytes())
        key = {"tokens": n, "digest": digest.hexdigest()[:16]}
        if self.encoded is not None:
            key["tokenizer"] = self.encoded.digest
        return key

    def record(self) -> dict:
        if self.encoded is None:
            return {"tokenizer": "byte"}
        return {
            "tokenizer": self.tokenizer,
            "tokenizer_file": str(self.encoded.tokenizer_path),
            "tokenizer_digest": self.encoded.digest,
        }

    def describe(self) -> str:
        n = len(self.tokens)
        size = f"{n:,} bytes ({n / 1e6:,.1f} MB) of {self.source.name}"
        if self.encoded is None:
            return f"{self.train_size:,} windows of {self.block_size} tokens per epoch from {size}"
        tokens = len(self.train_tokens) + len(self.val_tokens)
        return (
            f"{self.train_size:,} windows of {self.block_size} tokens per epoch from {tokens:,} "
            f"{self.tokenizer} tokens ({self.encoded.bytes_per_token:.2f} bytes per token) of "
            f"{size}"
        )
