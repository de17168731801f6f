"""Subword tokens for dataset=text: a byte-level BPE learned from the corpus's training part, or a
tokenizer.json the user has (GPT-2's, Llama's), through Hugging Face `tokenizers`.

The corpus's bytes (mpexp/data/text.py's token cache) are split first, the training part from the
validation part at a character boundary, and each part is encoded on its own, so no token spans
the split and the validation text's bytes per token are known exactly: `val/bpb` stays bits per
byte of the original text, comparable between tokenizers. Where the corpus is several files and
the tokenizer has an end-of-text token (GPT-2's `<|endoftext|>`, LLaMA-3's `<|end_of_text|>`,
`</s>`), one stands between each file and the next, as nanoGPT's prepare.py scripts end each
document; no token spans two files either. A learned BPE has none. The learned tokenizer
(`<stem>-bpe<N>.tokenizer.json`) and the encoded tokens (`<stem>-<tokenizer>.bin`, uint16 or uint32,
training tokens then validation tokens) are cached beside the byte tokens, with a key
(`<stem>-<tokenizer>.json`) that records the source, the split and the tokenizer's digest: a
changed corpus, vocabulary or tokenizer file rebuilds them. Nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mpexp import atomic
from mpexp.errors import ConfigError, DataError

log = logging.getLogger(__name__)

CACHE_VERSION = 2  # bump when the encoded file's layout changes: older caches are rebuilt
# (2: an end-of-text token between files)
PIECE = 1 << 16  # bytes of text encoded at a time, cut at a line's end
BATCH = 64  # pieces handed to the (multi-threaded) encoder at once
BYTE_ALPHABET = 256  # a byte-level BPE starts from every byte: its vocabulary is never smaller
# the end-of-text tokens of the tokenizers people have: GPT-2's, LLaMA-3's, sentencepiece models'
END_OF_TEXT = ("<|endoftext|>", "<|end_of_text|>", "</s>")


@dataclass(frozen=True)
class Encoded:
    """A corpus encoded by a tokenizer: its two parts' tokens and what they came from."""

    train: np.ndarray
    val: np.ndarray
    tokenizer_path: Path
    digest: str  # of the tokenizer file's bytes
    tokenizer_vocab: int
    bytes_per_token: float  # of the validation text


def _tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise ConfigError(
            "dataset.tokenizer other than byte needs Hugging Face tokenizers: "
            "pip install 'mpexp[bpe]' (or pip install tokenizers)."
        ) from None
    return tokenizers


def byte_lengths(path: Path, vocab: int) -> list[int] | None:
    """Each token id's length in bytes of the original text, for an exact val/bpb: a byte-level
    tokenizer (GPT-2's, and every BPE mpexp learns) writes each byte as one character, so a
    token's string is as long as its bytes; special tokens (end-of-text) stand for no text, and
    ids past the tokenizer's (padding) for none either. None for other tokenizers, whose strings
    are not bytes (SentencePiece's, say): the split's average bytes per token serves them."""
    tokenizer = load(path)
    if "ByteLevel" not in str(tokenizer.pre_tokenizer):
        return None
    special = {t.content for t in getattr(tokenizer, "get_added_tokens_decoder", dict)().values()}
    lengths = [0] * vocab
    for token, i in tokenizer.get_vocab().items():
        if i < vocab and token not in special:
            lengths[i] = len(token)
    return lengths


def tokenizer_spec(spec: str | None) -> str:
    """dataset.tokenizer as `encode` takes it: null is bytes, a folder (a pretrained model's,
    written by save_pretrained) is its tokenizer.json."""
    if spec is None:
        return "byte"
    if spec in ("byte", "bpe") or not Path(spec).expanduser().is_dir():
        return spec
    path = Path(spec).expanduser() / "tokenizer.json"
    if not path.is_file():
        raise ConfigError(
            f"dataset.tokenizer={spec} is a folder without a tokenizer.json (a pretrained "
            "model's folder is the text's tokenizer unless dataset.tokenizer says otherwise). "
            "Save the model's fast tokenizer there (tokenizer.save_pretrained), or give "
            "dataset.tokenizer=<a tokenizer.json>, bpe or byte."
        )
    return str(path)


def load(path: Path):
    """A tokenizer.json, or one message saying why it does not load."""
    tokenizers = _tokenizers()
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception for every kind of bad file
        raise DataError(
            f"dataset.tokenizer={path} does not load as a Hugging Face tokenizer.json ({err}). "
            "Give the tokenizer.json file itself, dataset.tokenizer=bpe to learn one from the "
            "corpus, or dataset.tokenizer=byte."
        ) from None


def end_of_text(tokenizer) -> int | None:
    """The id of the tokenizer's end-of-text token, or None where it has none."""
    for token in END_OF_TEXT:
        if (found := tokenizer.token_to_id(token)) is not None:
            return found
    return None


def char_boundary(data: np.ndarray, at: int) -> int:
    """The first position from `at` on that starts a UTF-8 character (or the end)."""
    while at < len(data) and data[at] & 0xC0 == 0x80:
        at += 1
    return at


def pieces(data: np.ndarray, start: int, stop: int) -> Iterator[str]:
    """The text of data[start:stop] in pieces of about `PIECE` bytes, each cut after a newline
    where there is one (else at a character boundary)."""
    while start < stop:
        end = min(stop, start + PIECE)
        if end < stop:
            chunk = np.asarray(data[start:end])
            newline = np.flatnonzero(chunk == ord("\n"))
            end = start + int(newline[-1]) + 1 if len(newline) else char_boundary(data, end)
        yield bytes(np.asarray(data[start:end])).decode("utf-8")
        start = end


def learn_bpe(data: np.ndarray, split: int, vocab_size: int, path: Path):
    """A byte-level BPE of `vocab_size` tokens learned from data[:split], written to `path`."""
    tokenizers = _tokenizers()
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    log.info("Learning a byte-level BPE of %d tokens from %s bytes", vocab_size, f"{split:,}")
    tokenizer.train_from_iterator(pieces(data, 0, split), trainer)
    _write_atomically(path, tokenizer.to_str().encode())
    return tokenizer


def encode(
    data: np.ndarray,
    split: int,
    cache: Path,
    stem: str,
    source_key: dict,
    spec: str,
    vocab: int,
    ends: list[int] = (),
) -> Encoded:
    """The corpus's bytes (`data`, the training part before `split`) as the tokens of `spec`
    (`bpe` with `vocab` tokens, or a tokenizer.json's path), from the cache or built into it.
    `ends` are where the corpus's files end in `data`: the end-of-text token goes after each
    but the last, where the tokenizer has one."""
    split = char_boundary(data, split)
    if spec == "bpe":
        if vocab < BYTE_ALPHABET:
            raise ConfigError(
                f"dataset.vocab_size={vocab} is smaller than a byte-level BPE's {BYTE_ALPHABET} "
                "byte tokens: give dataset.vocab_size >= 256 (e.g. 4096)."
            )
        name = f"bpe{vocab}"
        tokenizer_path = cache / f"{stem}-{name}.tokenizer.json"
    else:
        tokenizer_path = Path(spec).expanduser().resolve()
        if not tokenizer_path.is_file():
            raise DataError(
                f"dataset.tokenizer={spec} is no file. Give a Hugging Face tokenizer.json, "
                "dataset.tokenizer=bpe to learn one from the corpus, or dataset.tokenizer=byte."
            )
        name = "tok-" + hashlib.sha256(str(tokenizer_path).encode()).hexdigest()[:8]
    tokens_path, key_path = cache / f"{stem}-{name}.bin", cache / f"{stem}-{name}.json"
    key = {"version": CACHE_VERSION, "source": source_key, "split": split, "tokenizer": spec}
    if spec == "bpe":
        key["vocab_size"] = vocab
    saved = _read_key(key_path)
    fresh = saved is not None and saved["key"] == key and tokenizer_path.is_file()
    if spec == "bpe" and not fresh:
        learn_bpe(data, split, vocab, tokenizer_path)
    digest = file_digest(tokenizer_path)
    tokenizer = load(tokenizer_path)
    size = tokenizer.get_vocab_size()
    eot = end_of_text(tokenizer)
    cuts = [e for e in ends if e < len(data)] if eot is not None else []
    dtype = np.uint16 if size <= 1 << 16 else np.uint32
    expected = None if saved is None else saved["train"] + saved["val"]
    if not (
        fresh
        and saved["digest"] == digest
        and tokens_path.is_file()
        and tokens_path.stat().st_size == (expected or 0) * np.dtype(dtype).itemsize
    ):
        saved = _encode_into(tokenizer, data, (split, cuts, eot), tokens_path, dtype)
        saved.update(key=key, digest=digest)
        _write_atomically(key_path, json.dumps(saved).encode())
    tokens = np.memmap(tokens_path, dtype=dtype, mode="r")
    train, val = tokens[: saved["train"]], tokens[saved["train"] :]
    val_bytes = len(data) - split
    return Encoded(train, val, tokenizer_path, digest, size, val_bytes / max(1, len(val)))


def _encode_into(tokenizer, data: np.ndarray, cuts: tuple, path: Path, dtype) -> dict:
    """Write the training part's tokens, then the validation part's, to `path`; their counts.
    `cuts` is (the split, where files end, the end-of-text id written after each)."""
    split, ends, eot = cuts
    log.info("Encoding %s bytes with %s", f"{len(data):,}", path.name)
    counts = {}
    try:
        # written whole or not at all; a killed encoding's partial file is removed by the next
        with atomic.whole_file(path) as out:
            for part, (start, stop) in (("train", (0, split)), ("val", (split, len(data)))):
                before = out.tell()
                batch = []
                for piece in [*_texts(data, start, stop, ends), None]:
                    if isinstance(piece, str):
                        batch.append(piece)
                    if batch and (not isinstance(piece, str) or len(batch) == BATCH):
                        for encoding in tokenizer.encode_batch(batch, add_special_tokens=False):
                            out.write(np.asarray(encoding.ids, dtype=dtype).tobytes())
                        batch = []
                    if piece is FILE_END:
                        out.write(np.asarray([eot], dtype=dtype).tobytes())
                counts[part] = (out.tell() - before) // np.dtype(dtype).itemsize
    except OSError as err:
        raise DataError(
            f"The encoded corpus cannot be written in {path.parent} ({err.strerror or err}). "
            "Point dataset.cache_dir at a writable folder with room for it."
        ) from None
    return counts


FILE_END = object()  # where _texts puts the end of one file and the start of the next


def _texts(data: np.ndarray, start: int, stop: int, ends: list[int]) -> Iterator[str | object]:
    """The text of data[start:stop] in pieces, and FILE_END at each of `ends` in (start, stop]:
    no piece spans two files."""
    for end in [*(e for e in ends if start < e <= stop), None]:
        yield from pieces(data, start, stop if end is None else end)
        if end is not None:
            yield FILE_END
            start = end


def _read_key(path: Path) -> dict | None:
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    whole = isinstance(saved, dict) and {"key", "train", "val", "digest"} <= saved.keys()
    return saved if whole else None


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def _write_atomically(path: Path, data: bytes) -> None:
    try:
        atomic.write_whole(path, data)
    except OSError as err:
        raise DataError(
            f"{path.name} cannot be written in {path.parent} ({err.strerror or err}). Point "
            "dataset.cache_dir at a writable folder."
        ) from None
