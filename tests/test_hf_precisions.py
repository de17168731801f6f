"""Every precision mode on transformers models (model=hf), as on mpexp's own: a Llama and a ViT of
their own configs train a step in fp32, tf32, fp16 (under each loss scaler), bf16, fp8 (emulated
on a CPU) and pure bf16 with each rounding; fp8 converts the models' projections by their own
names and leaves the head in bf16; the diagnostics name transformers' modules; and a run killed
mid-way resumes exactly. (In a file of its own: the two halves of model=hf's tests run side by
side under `pytest -n 2`.)"""

from __future__ import annotations

import json
import math

import pytest

from mpexp.run.runner import train
from mpexp.tracking.run_context import RunContext
from tests.conftest import make_cfg, run_cli
from tests.test_distributed import TORCHRUN
from tests.test_hf import LLAMA, SHORT, VIT, text
from tests.test_resume import assert_same_final_state, comparable, crashed_and_resumed
from tests.test_training import read_metrics

pytest.importorskip("transformers")

MODES = ["fp32", "tf32", "fp16", "bf16", "fp8", "bf16_pure", "bf16_pure_kahan",
         "bf16_pure_stochastic"]  # fmt: skip
# fp16 under each loss scaler besides the dynamic one that `auto` gives it
SCALERS = ["loss_scaling=static", "loss_scaling=hysteresis", "loss_scaling=none"]
CASES = [("llama", m, None) for m in MODES] + [("vit", m, None) for m in MODES]
CASES += [("llama", "fp16", s) for s in SCALERS]


@pytest.mark.parametrize(("model", "precision", "scaler"), CASES)
def test_every_precision_mode_trains_an_hf_llama_and_vit(tmp_path, model, precision, scaler):
    data = LLAMA + text(tmp_path) if model == "llama" else VIT
    args = [*data, *SHORT, f"precision={precision}"]
    if precision == "bf16":  # and the per-layer diagnostics, under transformers' own names
        args.append("diagnostics.grad_stats_every=1")
    summary = train(make_cfg(*args, *([scaler] if scaler else [])), RunContext(tmp_path / "run"))
    ran = summary["ran"]
    assert ran["precision"] == precision.removesuffix("_kahan").removesuffix("_stochastic")
    assert math.isfinite(summary["val/loss"]) and math.isfinite(summary["train/epoch_loss"])
    layer = "model.layers.0.self_attn" if model == "llama" else "vit.layers.0.attention"
    if precision == "fp8":  # the attention and MLP projections; the head stays in bf16
        assert f"{layer}.q_proj" in ran["fp8_converted"]
        head = "lm_head" if model == "llama" else "classifier"
        assert head not in ran["fp8_converted"]
    if precision == "bf16":
        steps, _ = read_metrics(tmp_path / "run")
        assert any(f"diag/{layer}.q_proj/underflow" in row for row in steps)


def test_a_run_killed_mid_way_resumes_exactly(tmp_path, monkeypatch, caplog):
    args = [*LLAMA, *text(tmp_path), *SHORT, "dataset.train_size=64", "precision=fp16",
            "trainer.checkpoint_every_steps=2"]  # fmt: skip
    whole, crashed = crashed_and_resumed(args, tmp_path, monkeypatch, caplog)
    assert comparable(crashed) == comparable(whole)
    assert_same_final_state(whole, crashed, ("model", "optimizer", "scaler", "position"))


@pytest.mark.slow  # torchrun and two processes that import transformers: about 30 s on 2 cores
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_llama_with_tied_embeddings_trains_under_ddp_and_fsdp(tmp_path, strategy):
    """FSDP2 shards it by its decoder layers (its _no_split_modules), the tied embedding and
    head with the root; both strategies train it to the loss one process reaches."""
    args = [*LLAMA, *text(tmp_path), *SHORT, "dataset.train_size=32", "precision=bf16",
            "model.tie_word_embeddings=true"]  # fmt: skip
    alone = train(make_cfg(*args), RunContext(tmp_path / "alone"))
    result = run_cli(*TORCHRUN, "-m", "mpexp.train", *args, f"trainer.strategy={strategy}",
                     cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (run_dir,) = (tmp_path / "outputs").glob("*/*")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["ran"]["strategy"] == strategy and summary["ran"]["world_size"] == 2
    assert summary["val/loss"] == pytest.approx(alone["val/loss"], abs=1e-2)
