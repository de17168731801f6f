"""The files nanoGPT and llm.c users have: llm.c's GPT-2 and LLaMA-3 token shards, nanoGPT's
meta.pkl (read without running code), every id checked against the vocabulary, and dataset=text's
files joined by the tokenizer's end-of-text token."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest

from mpexp.data.tokens import SCAN
from mpexp.errors import DataError
from mpexp.run.runner import train
from mpexp.tracking.run_context import RunContext
from tests.conftest import CPU, make_cfg, one_line_failure
from tests.test_language_model import TINY_LM
from tests.test_tokens import VOCAB, bin_pair, llmc_shard, token_stream, tokens_args, tokens_data

SHAKESPEARE_CHARS = "\n !$&',-.3:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"  # 65


def llama3_shard(path: Path, tokens: np.ndarray) -> None:
    """A shard as llm.c writes LLaMA-3's tokens: magic 20240801, version 7, uint32 ids."""
    header = np.zeros(256, dtype="<i4")
    header[:3] = (20240801, 7, len(tokens))
    path.write_bytes(header.tobytes() + tokens.astype(np.uint32).tobytes())


def test_llama3_shards_of_llm_c_train_through_the_command(tmp_path, in_process):
    stream = token_stream(6_000).astype(np.uint32)
    folder = tmp_path / "fineweb"
    folder.mkdir()
    llama3_shard(folder / "fineweb_train_000001.bin", stream[:5_000])
    llama3_shard(folder / "fineweb_val_000000.bin", stream[5_000:])
    run = tmp_path / "run"
    args = tokens_args(folder, "trainer.epochs=1", f"hydra.run.dir={run}")
    result = in_process(*args, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["ran"]["task"]["vocab_size"] == VOCAB
    assert (
        "5,000 training tokens" in result.stdout + result.stderr + (run / "train.log").read_text()
    )


def test_a_shard_with_an_unknown_magic_is_refused_naming_the_magics_known(tmp_path, in_process):
    folder = tmp_path / "shards"
    folder.mkdir()
    llmc_shard(folder / "x_train_000001.bin", token_stream(2_000))
    llmc_shard(folder / "x_val_000000.bin", token_stream(500))
    with (folder / "x_val_000000.bin").open("r+b") as f:
        f.write(np.int32(20991231).tobytes())
    output = one_line_failure(in_process(*tokens_args(folder), cwd=tmp_path))
    assert "x_val_000000.bin has no llm.c token header: its first int32 is 20991231" in output
    assert "20240520, 20240801" in output


def shakespeare_char(folder: Path, meta: dict | bytes | None = None) -> Path:
    """A folder as nanoGPT's data/shakespeare_char/prepare.py leaves it: uint16 ids of 65
    characters in train.bin and val.bin, and meta.pkl with vocab_size, itos and stoi."""
    folder.mkdir(parents=True)
    text = ("First Citizen:\nBefore we proceed any further, hear me speak.\n" * 150).encode()
    stoi = {c: i for i, c in enumerate(SHAKESPEARE_CHARS)}
    ids = np.array([stoi[chr(b)] for b in text], dtype=np.uint16)
    ids[: len(ids) * 9 // 10].tofile(folder / "train.bin")
    ids[len(ids) * 9 // 10 :].tofile(folder / "val.bin")
    if meta is None:
        meta = {"vocab_size": 65, "itos": dict(enumerate(SHAKESPEARE_CHARS)), "stoi": stoi}
    data = meta if isinstance(meta, bytes) else pickle.dumps(meta)
    (folder / "meta.pkl").write_bytes(data)
    return folder


def char_args(folder: Path, *more: str) -> list[str]:
    lm = [o for o in TINY_LM if not o.startswith("dataset=")]
    return [*lm, "dataset=tokens", f"dataset.path={folder}", "trainer.epochs=1", *more]


def test_a_shakespeare_char_folder_trains_with_meta_pkls_vocabulary(tmp_path):
    folder = shakespeare_char(tmp_path / "shakespeare_char")
    summary = train(make_cfg(*char_args(folder)), RunContext(tmp_path / "run"))
    ran = summary["ran"]
    assert ran["task"]["vocab_size"] == 65
    # the head's rows are the vocabulary padded to a multiple of 64: 128, not GPT-2's 50,304
    from mpexp.models.gpt import GPT

    model = GPT(vocab_size=128, block_size=32, n_embd=32)
    assert ran["parameters"] == sum(p.numel() for p in model.parameters())
    assert ran["data"]["meta"] == str(folder / "meta.pkl")


class _Payload:
    """What a hostile meta.pkl holds: unpickling it would call os.system."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_meta_pkl_that_would_run_code_never_runs_it(tmp_path, in_process):
    marker = tmp_path / "ran"
    payload = pickle.dumps({"vocab_size": 65, "itos": _Payload(marker)})
    folder = shakespeare_char(tmp_path / "data", meta=payload)
    output = one_line_failure(in_process(*char_args(folder), cwd=tmp_path))
    assert not marker.exists()
    message = [line for line in output.splitlines() if "meta.pkl" in line]
    assert len(message) == 1 and "it names posix.system" in message[0], output
    assert "loads only plain data" in message[0]


def test_a_vocab_size_that_disagrees_with_meta_pkl_is_refused_naming_both(tmp_path, in_process):
    folder = shakespeare_char(tmp_path / "data")
    output = one_line_failure(in_process(*char_args(folder, "dataset.vocab_size=50257"),
                                         cwd=tmp_path))  # fmt: skip
    assert "dataset.vocab_size=50,257 disagrees with the vocab_size 65 of" in output


def test_an_id_outside_the_sampled_stretches_is_found(tmp_path):
    folder = bin_pair(tmp_path / "data", train=SCAN + 50_000, val=2_000)
    ids = np.memmap(folder / "train.bin", dtype=np.uint16, mode="r+")
    # past the first pass's chunk, and between the 64 stretches of 4,096 ids the digest reads
    at = SCAN + 3 * 4096 + 100
    ids[at] = VOCAB
    ids.flush()
    del ids
    with pytest.raises(DataError, match=rf"train.bin holds token id 300 at position {at:,}"):
        tokens_data(folder).setup(CPU)


def gpt2_like_tokenizer(path: Path, text: str) -> Path:
    """A byte-level BPE with GPT-2's end-of-text token, as a user's tokenizer.json has it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    tokenizer.train_from_iterator([text], trainer)
    tokenizer.save(str(path))
    return path


def test_dataset_text_puts_the_end_of_text_token_between_its_files(tmp_path):
    from tokenizers import Tokenizer

    from tests.test_language_model import text_data

    folder = tmp_path / "docs"
    folder.mkdir()
    texts = [f"Document {k}: " + "the quick brown fox jumps over the lazy dog. " * 40
             for k in range(3)]  # fmt: skip
    for k, text in enumerate(texts):
        (folder / f"{k}.txt").write_text(text)
    tokenizer_file = gpt2_like_tokenizer(tmp_path / "tokenizer.json", "".join(texts))
    data = text_data(folder, tmp_path, tokenizer=str(tokenizer_file), val_fraction=0.2)
    data.setup(CPU)
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    eot = tokenizer.token_to_id("<|endoftext|>")
    ids = [*data.train_tokens.tolist(), *data.val_tokens.tolist()]
    assert ids.count(eot) == 2  # between the files, not after the last
    documents, start = [], 0
    for at in [i for i, t in enumerate(ids) if t == eot] + [len(ids)]:
        documents.append(tokenizer.decode(ids[start:at]))
        start = at + 1
    assert documents == texts  # each file whole (the one the split cuts decodes back to itself)


def test_without_vocab_size_or_meta_pkl_the_vocabulary_is_gpt2s(tmp_path):
    data = tokens_data(bin_pair(tmp_path / "data", train=1000, val=200), vocab_size=None)
    assert data.setup(CPU).vocab_size == 50257 and data.train_tokens.dtype == np.uint16
