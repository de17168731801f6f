"""mpexp-sample as nanoGPT samples: the best-validated checkpoint (which the run keeps beside the
newest), top-k, several samples, a prompt from a file, the end-of-text start, meta.pkl's
characters, a KV cache that draws exactly what the whole context draws, and refusals in one
line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mpexp.models.gpt import GPT
from mpexp.run.runner import train
from mpexp.rundir import checkpoint_files
from mpexp.sample import Draw, generate
from mpexp.sample import main as sample_main
from mpexp.tracking.records import record_end
from mpexp.tracking.run_context import RunContext
from tests.conftest import make_cfg
from tests.test_language_model import TINY_LM, tiny_lm
from tests.test_lm_files import char_args, gpt2_like_tokenizer, shakespeare_char
from tests.test_resume import crashed_and_resumed
from tests.test_tokens import VOCAB, bin_pair, tokens_args


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_cached_sampling_draws_the_same_tokens_as_the_whole_context():
    torch.manual_seed(0)
    model = GPT(vocab_size=64, block_size=16, n_layer=2, n_embd=32).eval()
    prompt = [3, 1, 4, 1, 5]
    # 30 tokens: past the context of 16, where the cache gives way to the last 16 tokens
    for draw in (Draw(tokens=30, temperature=1.0, top_k=20, samples=3, seed=7),
                 Draw(tokens=30, temperature=0)):  # fmt: skip
        cached = generate(model, prompt, 60, draw, cached=True)
        whole = generate(model, prompt, 60, draw, cached=False)
        assert cached == whole
        assert len(cached) == draw.samples and all(len(s) == 30 for s in cached)
        assert all(0 <= t < 60 for s in cached for t in s)  # never a padding id


def test_top_k_draws_only_among_the_k_likeliest():
    torch.manual_seed(0)
    model = GPT(vocab_size=64, block_size=16, n_embd=32).eval()
    greedy = generate(model, [1, 2], 64, Draw(tokens=10, temperature=0))
    one = generate(model, [1, 2], 64, Draw(tokens=10, temperature=1.5, top_k=1, seed=3))
    assert one == greedy
    drawn = generate(model, [1, 2], 64, Draw(tokens=10, temperature=1.5, top_k=None, seed=3))
    assert drawn != greedy  # without the cut, a hot softmax draws others


def worsening_run(tmp_path: Path) -> list[str]:
    """A run trained on "a" alone and validated on "b": its validation loss rises from the first
    validation (step 4) to the last (step 12)."""
    corpus = tmp_path / "ab.txt"
    corpus.write_text("a" * 9000 + "b" * 1000)
    return [*TINY_LM, f"dataset.path={corpus}", f"dataset.cache_dir={tmp_path / 'cache'}",
            "trainer.epochs=3", "dataset.train_size=64", "trainer.keep_checkpoints=1"]  # fmt: skip


BEST_AND_NEWEST = ["step-00000004.pt", "step-00000012.pt"]


def test_a_run_keeps_its_best_checkpoint_beside_the_newest_and_samples_from_it(tmp_path, capsys):
    run = tmp_path / "run"
    train(make_cfg(*worsening_run(tmp_path)), RunContext(run))
    assert [p.name for p in checkpoint_files(run)] == BEST_AND_NEWEST
    assert sample_main([str(run), "--tokens", "5"]) == 0
    out = capsys.readouterr()
    assert "step-00000004.pt, the best kept by val/loss" in out.err


def test_a_resumed_run_keeps_the_best_of_before_its_crash(tmp_path, monkeypatch, caplog):
    whole, crashed = crashed_and_resumed(worsening_run(tmp_path), tmp_path, monkeypatch, caplog)
    assert [p.name for p in checkpoint_files(crashed)] == BEST_AND_NEWEST
    assert [p.name for p in checkpoint_files(whole)] == BEST_AND_NEWEST


def test_several_samples_from_a_file_prompt(tmp_path, capsys):
    run = tmp_path / "run"
    train(make_cfg(*tiny_lm(tmp_path, "trainer.epochs=1")), RunContext(run))
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("It was")
    args = [str(run), "--tokens", "12", "--num-samples", "3", "--prompt", f"FILE:{prompt}"]
    assert sample_main(args) == 0
    out = capsys.readouterr()
    samples = out.out.removesuffix("\n").split("\n---------------\n")
    assert len(samples) == 3 and all(s.startswith("It was") for s in samples)
    assert "from the prompt, top-k 200" in out.err
    assert sample_main([str(run), "--prompt", f"FILE:{tmp_path / 'missing.txt'}"]) == 2
    assert "missing.txt cannot be read" in one_line(capsys)


def test_a_character_level_run_is_decoded_with_meta_pkls_characters(tmp_path, capsys):
    folder = shakespeare_char(tmp_path / "shakespeare_char")
    run = tmp_path / "run"
    train(make_cfg(*char_args(folder)), RunContext(run))
    assert sample_main([str(run), "--tokens", "30", "--prompt", "First"]) == 0
    out = capsys.readouterr()
    text = out.out.removesuffix("\n")
    assert text.startswith("First") and len(text) == len("First") + 30  # a character per id
    assert sample_main([str(run), "--prompt", "Zürich"]) == 2  # no id for ü
    assert "has no id for: 'ü'" in one_line(capsys)


@pytest.fixture(scope="module")
def tokens_run(tmp_path_factory):
    """A finished dataset=tokens run of a vocabulary of 300 (the model's 320 rows)."""
    tmp = tmp_path_factory.mktemp("tokens")
    run = tmp / "run"
    train(make_cfg(*tokens_args(bin_pair(tmp / "data"), "trainer.epochs=1")), RunContext(run))
    return run


def test_token_files_decode_with_a_tokenizer_from_its_end_of_text(tokens_run, tmp_path, capsys):
    tokenizer = gpt2_like_tokenizer(tmp_path / "tokenizer.json", "the quick brown fox " * 50)
    assert sample_main([str(tokens_run), "--tokens", "8", "--tokenizer", str(tokenizer)]) == 0
    out = capsys.readouterr()
    assert "from end-of-text" in out.err
    assert not out.out.strip().replace(" ", "").isdigit()  # text, not ids


def test_a_prompt_id_outside_the_vocabulary_is_refused(tokens_run, capsys):
    # 300 to 319 are the model's padding rows (the vocabulary of 300 padded to 320): outside too
    for bad in ("310", "-1", "300"):
        assert sample_main([str(tokens_run), "--prompt", f"5 {bad}"]) == 2
        message = one_line(capsys)
        assert f"token id {bad} (position 1) is outside the run's vocabulary of {VOCAB}" in message


def test_a_run_stopped_before_its_first_step_has_no_checkpoint_yet(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    record_end(run, "interrupted")  # what a stop before the first step leaves
    assert sample_main([str(run)]) == 2
    assert "has no checkpoint yet: the run stopped before its first step" in one_line(capsys)
