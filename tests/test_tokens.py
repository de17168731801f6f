"""Real tokens for language models: nanoGPT's train.bin / val.bin (dataset=tokens), a BPE learned
from a text corpus or a user's tokenizer.json (dataset=text dataset.tokenizer=...), the model's
vocabulary padded to the data's, and each bad input refused with one message."""

from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from mpexp.data.text import TextData
from mpexp.data.tokens import TokenFiles
from mpexp.errors import ConfigError, DataError
from mpexp.run.runner import train
from mpexp.sample import Draw, sample
from mpexp.sample import main as sample_main
from mpexp.tasks.language_model import LanguageModelling
from mpexp.tracking.run_context import RunContext
from tests.conftest import CPU, TINY, make_cfg, run_cli
from tests.test_language_model import TINY_LM, corpus, text_data, tiny_lm
from tests.test_resume import assert_same_final_state, comparable, crashed_and_resumed
from tests.test_training import read_metrics

VOCAB = 300  # above a byte's 256: uint16 ids, and a model vocabulary padded to 320
CYCLE = 61  # the token stream repeats a random sequence of this many distinct ids


def token_stream(length: int, seed: int = 0) -> np.ndarray:
    """A stream that repeats one random sequence of `CYCLE` distinct ids below VOCAB: each id is
    about equally frequent (unigram entropy ln 61 = 4.1 nats), yet the next id follows from the
    one before."""
    cycle = np.random.default_rng(seed).permutation(VOCAB)[:CYCLE]
    return np.resize(cycle, length).astype(np.uint16)


def bin_pair(folder: Path, train: int = 20_000, val: int = 2_000, val_bin: bool = True) -> Path:
    """train.bin and val.bin as nanoGPT's prepare.py writes them: raw uint16 ids, no header."""
    folder.mkdir(parents=True, exist_ok=True)
    stream = token_stream(train + val)
    stream[:train].tofile(folder / "train.bin")
    if val_bin:
        stream[train:].tofile(folder / "val.bin")
    return folder


def tokens_args(folder: Path, *more: str) -> list[str]:
    lm = [o for o in TINY_LM if not o.startswith("dataset=")]
    return [*lm, "dataset=tokens", f"dataset.path={folder}", f"dataset.vocab_size={VOCAB}", *more]


def tokens_data(folder: Path, **kwargs) -> TokenFiles:
    settings = {"vocab_size": VOCAB, "block_size": 16, "train_size": 64, "val_size": 8,
                "batch_size": 8, **kwargs}  # fmt: skip
    return TokenFiles(str(folder), **settings)


# --- dataset=tokens ------------------------------------------------------------------------------


def test_a_uint16_bin_pair_trains_well_below_the_unigram_entropy(tmp_path):
    folder = bin_pair(tmp_path / "data")
    summary = train(make_cfg(*tokens_args(folder)), RunContext(tmp_path / "run"))
    val = np.fromfile(folder / "val.bin", dtype=np.uint16)
    p = np.bincount(val) / len(val)
    entropy = -(p[p > 0] * np.log(p[p > 0])).sum()  # ln 61 = 4.1 nats
    assert summary["val/loss"] < entropy - 1  # it learned which id follows which
    ran = summary["ran"]
    assert ran["task"]["vocab_size"] == VOCAB
    assert ran["parameters"] == _gpt_parameters(320)  # the embedding padded to 5 x 64
    assert "val/bpb" not in summary  # token files do not say how many bytes a token is
    (text,), _ = sample(tmp_path / "run", Draw(tokens=12), "5 7")  # no tokenizer: ids in and out
    ids = [int(i) for i in text.split()]
    assert len(ids) == 2 + 12 and all(0 <= i < VOCAB for i in ids)  # never a padding id


def _gpt_parameters(vocab: int) -> int:
    from mpexp.models.gpt import GPT

    return sum(p.numel() for p in GPT(vocab_size=vocab, block_size=32, n_embd=32).parameters())


def test_windows_come_from_train_bin_and_validation_from_val_bin(tmp_path):
    folder = bin_pair(tmp_path / "data", train=1000, val=200)
    data = tokens_data(folder)
    task = data.setup(CPU)
    assert (task.vocab_size, task.model_kwargs()["vocab_size"]) == (VOCAB, 320)
    assert isinstance(data.train_tokens, np.memmap) and data.train_tokens.dtype == np.uint16
    train_ids = torch.from_numpy(
        np.fromfile(folder / "train.bin", dtype=np.uint16).astype(np.int64)
    )
    windows = train_ids.unfold(0, 17, 1)
    batches = list(data.train_batches(epoch=1, seed=0, device=CPU))
    assert len(batches) == 8
    for inputs, targets in batches:
        assert inputs.dtype == torch.int64 and inputs.shape == (8, 16)
        assert torch.equal(inputs[:, 1:], targets[:, :-1])
        whole = torch.cat([inputs, targets[:, -1:]], dim=1)
        for window in whole:
            assert (windows == window).all(dim=1).any()
    val = np.fromfile(folder / "val.bin", dtype=np.uint16)
    (inputs, targets), *_ = data.val_batches(CPU)
    assert inputs[0].tolist() == val[:16].tolist() and targets[0].tolist() == val[1:17].tolist()
    again = [x for x, _ in data.train_batches(epoch=1, seed=0, device=CPU, start=5)]
    assert all(torch.equal(a, b[0]) for a, b in zip(again, batches[5:], strict=True))


def test_uint32_ids_are_read_where_the_vocabulary_needs_them(tmp_path):
    folder = tmp_path / "big"
    folder.mkdir()
    ids = (np.arange(3000) % 7 + 70_000).astype(np.uint32)
    ids.tofile(folder / "train.bin")
    ids.tofile(folder / "val.bin")
    data = tokens_data(folder, vocab_size=70_007)
    data.setup(CPU)
    inputs, _ = next(data.train_batches(1, 0, CPU))
    assert data.train_tokens.dtype == np.uint32 and int(inputs.min()) >= 70_000
    with pytest.raises(ConfigError, match="does not fit in uint16"):
        tokens_data(folder, vocab_size=70_007, dtype="uint16").setup(CPU)


def test_train_bin_without_val_bin_validates_on_its_tail_and_says_so(tmp_path, caplog):
    folder = bin_pair(tmp_path / "data", train=1000, val=0, val_bin=False)
    data = tokens_data(folder, val_fraction=0.2)
    with caplog.at_level(logging.WARNING):
        data.setup(CPU)
    assert "has no val.bin: the last 0.2 of train.bin validates" in caplog.text
    assert (len(data.train_tokens), len(data.val_tokens)) == (800, 200)
    assert "the tail of train.bin" in data.describe()  # the run's first line says it too


def test_bits_per_byte_follow_the_given_bytes_per_token(tmp_path):
    data = tokens_data(bin_pair(tmp_path / "data", 1000, 200), bytes_per_token=4.0)
    task = data.setup(CPU)
    metrics = task.val_metrics([2.0 * 100, 50.0], 100)
    assert metrics["val/bpb"] == pytest.approx(2.0 / math.log(2) / 4.0)


def test_the_models_vocabulary_is_the_datas_padded_to_a_multiple_of_64():
    def padded(vocab):
        return LanguageModelling(vocab_size=vocab, block_size=8).model_kwargs()["vocab_size"]

    assert (padded(256), padded(300), padded(50257), padded(64)) == (256, 320, 50304, 64)


def test_a_crashed_run_on_token_files_resumes_with_the_same_windows(tmp_path, monkeypatch, caplog):
    folder = bin_pair(tmp_path / "data")
    args = tokens_args(folder, "dataset.train_size=128", "trainer.deterministic=true",
                       "trainer.checkpoint_every_steps=5")  # fmt: skip
    whole, killed = crashed_and_resumed(args, tmp_path, monkeypatch, caplog)
    assert comparable(killed) == comparable(whole)  # every step's loss, bit for bit
    assert_same_final_state(whole, killed, ("model", "optimizer", "position"))


def _odd_size(folder: Path) -> None:
    (folder / "train.bin").write_bytes(b"\0" * 4001)


def _id_too_large(folder: Path) -> None:
    ids = np.fromfile(folder / "val.bin", dtype=np.uint16)
    ids[1234] = VOCAB + 5
    ids.tofile(folder / "val.bin")


def _no_train_bin(folder: Path) -> None:
    (folder / "train.bin").unlink()


@pytest.mark.parametrize(
    ("spoil", "message"),
    [
        (_odd_size, "holds 4,001 bytes, not a whole number of uint16 tokens"),
        (_id_too_large, "val.bin holds token id 305 at position 1,234, at or above"),
        (_no_train_bin, "holds no train.bin"),
    ],
)
def test_bad_token_files_are_refused_before_anything_is_written(tmp_path, spoil, message):
    folder = bin_pair(tmp_path / "data", train=4000, val=2000)
    spoil(folder)
    run = tmp_path / "run"
    with pytest.raises(DataError, match=message):
        train(make_cfg(*tokens_args(folder)), RunContext(run))
    assert not (run / "metrics.jsonl").exists() and not (run / "summary.json").exists()


# --- tokenizers on dataset=text ------------------------------------------------------------------


def learn_tokenizer(path: Path, text: str, vocab: int) -> Path:
    """A byte-level BPE tokenizer.json learned from `text`, as a user might bring one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=vocab, initial_alphabet=alphabet, show_progress=False)
    tokenizer.train_from_iterator([text], trainer)
    tokenizer.save(str(path))
    return path


def test_a_bpe_is_learned_from_the_training_part_cached_and_reused(tmp_path):
    book = corpus(tmp_path)
    data = text_data(book, tmp_path, tokenizer="bpe", vocab_size=320)
    task = data.setup(CPU)
    (tokenizer_file,) = (tmp_path / "cache").glob("*-bpe320.tokenizer.json")
    learned = tokenizer_file.stat().st_mtime_ns
    assert task.vocab_size == 320 and task.bytes_per_token > 2  # merges: fewer tokens than bytes
    val_bytes = len(book.read_bytes()) - round(len(book.read_bytes()) * 0.9)
    assert task.bytes_per_token == pytest.approx(val_bytes / len(data.val_tokens), rel=1e-3)
    from tokenizers import Tokenizer

    decoded = Tokenizer.from_file(str(tokenizer_file)).decode(data.val_tokens.tolist())
    assert book.read_text().endswith(decoded)  # the validation tokens are the corpus's tail

    again = text_data(book, tmp_path, tokenizer="bpe", vocab_size=320)
    again.setup(CPU)
    assert tokenizer_file.stat().st_mtime_ns == learned  # reused, not learned again
    assert again.resume_key() == data.resume_key()
    book.write_text("Another text altogether, of other words. " * 400)
    text_data(book, tmp_path, tokenizer="bpe", vocab_size=320).setup(CPU)
    assert tokenizer_file.stat().st_mtime_ns != learned  # a changed corpus: learned again


def test_bpe_bits_per_byte_are_of_the_original_text(tmp_path):
    args = [*TINY_LM, f"dataset.path={corpus(tmp_path)}", f"dataset.cache_dir={tmp_path / 'c'}",
            "dataset.tokenizer=bpe", "dataset.vocab_size=320", "trainer.epochs=1"]  # fmt: skip
    summary = train(make_cfg(*args), RunContext(tmp_path / "run"))
    per_token = summary["ran"]["task"]["bytes_per_token"]
    assert per_token > 2
    # counted from the bytes of the very targets scored (exact_bpb), near the split's average
    assert summary["ran"]["task"]["exact_bpb"]
    average = summary["val/loss"] / math.log(2) / per_token
    assert summary["val/bpb"] == pytest.approx(average, rel=0.02)
    assert summary["val/bpb"] != pytest.approx(average, rel=1e-6)
    assert summary["ran"]["data"]["tokenizer"] == "bpe"
    (text,), _ = sample(tmp_path / "run", Draw(tokens=20), "It is a")  # its own tokenizer
    assert text.startswith("It is a") and len(text) > len("It is a") + 20


def test_a_changed_tokenizer_refuses_the_resume_with_one_message(tmp_path):
    book = corpus(tmp_path)
    tokenizer = learn_tokenizer(tmp_path / "tok.json", book.read_text(), 300)
    args = [*TINY_LM, f"dataset.path={book}", f"dataset.cache_dir={tmp_path / 'c'}",
            f"dataset.tokenizer={tokenizer}", "dataset.vocab_size=320"]  # fmt: skip
    run = tmp_path / "run"
    train(make_cfg(*args, "trainer.epochs=1"), RunContext(run))
    before = (run / "metrics.jsonl").read_bytes()
    learn_tokenizer(tokenizer, "Some quite different words, to merge otherwise. " * 300, 300)
    resume = make_cfg(*args, "trainer.epochs=2", f"trainer.resume={run}")
    with pytest.raises(ConfigError, match=r"other data \(tokenizer \w+ then, \w+ now\)"):
        train(resume, RunContext(run))
    assert (run / "metrics.jsonl").read_bytes() == before
    assert [r["epoch"] for r in read_metrics(run)[1]] == [1]


def test_a_tokenizer_file_that_does_not_load_is_refused(tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text(json.dumps({"model": "not one"}))
    with pytest.raises(DataError, match="does not load as a Hugging Face tokenizer"):
        text_data(corpus(tmp_path), tmp_path, tokenizer=str(bad)).setup(CPU)
    with pytest.raises(DataError, match="is no file"):
        text_data(corpus(tmp_path), tmp_path, tokenizer=str(tmp_path / "none.json")).setup(CPU)


def test_a_vocabulary_smaller_than_the_tokenizers_is_refused(tmp_path):
    book = corpus(tmp_path)
    tokenizer = learn_tokenizer(tmp_path / "tok.json", book.read_text(), 300)
    with pytest.raises(ConfigError, match=r"vocab_size=280 is smaller than the vocabulary of"):
        text_data(book, tmp_path, tokenizer=str(tokenizer), vocab_size=280).setup(CPU)
    with pytest.raises(ConfigError, match="smaller than a byte-level BPE's 256"):
        text_data(book, tmp_path, tokenizer="bpe", vocab_size=200).setup(CPU)
    with pytest.raises(ConfigError, match="smaller than the byte tokenizer's 256"):
        text_data(book, tmp_path, vocab_size=100).setup(CPU)


def test_the_byte_tokenizer_keeps_the_resume_key_and_bits_per_byte_of_before(tmp_path):
    data = text_data(corpus(tmp_path), tmp_path)
    task = data.setup(CPU)
    assert isinstance(data, TextData) and data.resume_key().keys() == {"tokens", "digest"}
    assert (task.vocab_size, task.bytes_per_token, data.record()) == (
        256,
        1.0,
        {"tokenizer": "byte"},
    )


# --- mpexp-sample --------------------------------------------------------------------------------


def test_mpexp_sample_prints_text_from_a_finished_run(tmp_path):
    run = tmp_path / "run"
    train(make_cfg(*tiny_lm(tmp_path, "trainer.epochs=1", "precision=bf16")), RunContext(run))
    args = [str(run), "--tokens", "40", "--prompt", "It is a", "--seed", "3"]
    printed = run_cli("mpexp.sample", *args, cwd=tmp_path)
    assert printed.returncode == 0, printed.stderr
    text = printed.stdout.removesuffix("\n")
    assert text.startswith("It is a") and len(text.encode()) >= len("It is a") + 30
    assert "step-00000016.pt, the best kept by val/loss" in printed.stderr
    assert "bf16 (autocast bfloat16)" in printed.stderr  # in the run's precision
    assert sample(run, Draw(tokens=40, seed=3), "It is a")[0] == [text]  # the seed decides


def test_mpexp_sample_refuses_a_run_it_cannot_sample_with_one_line(tmp_path, capsys):
    image_run = tmp_path / "image"
    train(make_cfg(*TINY, "trainer.epochs=1"), RunContext(image_run))
    assert sample_main([str(image_run)]) == 2
    assert "is not a language-model run" in capsys.readouterr().err
    text_run = tmp_path / "text"
    train(make_cfg(*tiny_lm(tmp_path, "trainer.epochs=1")), RunContext(text_run))
    shutil.rmtree(text_run / "checkpoints")  # as a run killed before its first checkpoint
    assert sample_main([str(text_run)]) == 2
    err = capsys.readouterr().err
    assert "has no checkpoint to sample from" in err and len(err.strip().splitlines()) == 1


def llmc_shard(path: Path, tokens: np.ndarray, version: int = 1) -> None:
    """A token shard as llm.c's data scripts write it: 256 int32 of header, then the ids."""
    header = np.zeros(256, dtype="<i4")
    header[:3] = (20240520, version, len(tokens))
    path.write_bytes(header.tobytes() + tokens.astype(np.uint16 if version == 1 else np.uint32)
                     .tobytes())  # fmt: skip


def test_llm_c_shards_train_unchanged_read_as_one_stream(tmp_path):
    stream = token_stream(9_000)
    folder = tmp_path / "fineweb"
    folder.mkdir()
    for k, (a, b) in enumerate(((0, 4_000), (4_000, 8_000))):  # two training shards
        llmc_shard(folder / f"fineweb_train_{k + 1:06d}.bin", stream[a:b])
    llmc_shard(folder / "fineweb_val_000000.bin", stream[8_000:], version=2)  # uint32 ids
    data = tokens_data(folder)
    data.setup(CPU)
    assert len(data.train_tokens) == 8_000 and len(data.val_tokens) == 1_000
    # a window across the shards' seam reads on from one into the next
    assert data.train_tokens[3_990:4_010].tolist() == stream[3_990:4_010].tolist()
    pieces = torch.from_numpy(stream[:8_000].astype(np.int64)).unfold(0, 17, 1)
    for inputs, targets in data.train_batches(epoch=1, seed=0, device=CPU):
        assert torch.equal(inputs[:, 1:], targets[:, :-1])
        for window in torch.cat((inputs, targets[:, -1:]), dim=1):  # a piece of the stream
            assert (pieces == window).all(dim=1).any()
    assert next(iter(data.val_batches(CPU)))[0][0].tolist() == stream[8_000:8_016].tolist()
    train(make_cfg(*tokens_args(folder, "trainer.epochs=1")), RunContext(tmp_path / "run"))


def test_a_truncated_llm_c_shard_is_refused_naming_its_count(tmp_path):
    folder = tmp_path / "shards"
    folder.mkdir()
    llmc_shard(folder / "x_train_000001.bin", token_stream(2_000))
    llmc_shard(folder / "x_val_000000.bin", token_stream(500))
    with (folder / "x_train_000001.bin").open("r+b") as f:
        f.truncate(1024 + 2 * 1_500)
    with pytest.raises(DataError, match=r"promises 2,000 uint16 tokens .* truncated"):
        tokens_data(folder).setup(CPU)
