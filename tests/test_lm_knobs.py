"""The switches language-model precision studies ablate (model.qk_norm, model.bias,
trainer.z_loss) and the attention-logit growth diagnostic, which measures in a forward pass of
its own so that a compiled model's diagnostics steps compile nothing."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from mpexp.errors import ConfigError
from mpexp.models.gpt import GPT, causal_logit_absmax
from mpexp.run.runner import train
from mpexp.step import performance
from mpexp.tasks.language_model import LanguageModelling
from mpexp.tracking.run_context import RunContext
from tests.conftest import TINY, make_cfg
from tests.test_compile import Backend
from tests.test_language_model import tiny_lm
from tests.test_tokens import VOCAB, bin_pair
from tests.test_training import read_metrics


def _largest_logit(model: GPT, tokens: torch.Tensor) -> float:
    attn = model.blocks[0].attn
    seen = {}

    def keep(_, inputs, out):
        n, length, width = inputs[0].shape
        qkv = out.view(n, length, 3, attn.n_head, width // attn.n_head)
        q, k, _ = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        seen["max"] = float(causal_logit_absmax(attn.q_norm(q), attn.k_norm(k)))

    attn.qkv.register_forward_hook(keep)
    with torch.no_grad():
        model(tokens)
    return seen["max"]


def test_qk_norm_bounds_the_attention_logits_that_grow_with_the_weights():
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    largest = {}
    for qk_norm in (False, True):
        torch.manual_seed(0)
        model = GPT(block_size=16, n_layer=1, n_head=2, n_embd=32, qk_norm=qk_norm)
        with torch.no_grad():
            model.blocks[0].attn.qkv.weight.mul_(50)  # weights grown large in training
        largest[qk_norm] = _largest_logit(model, tokens)
    head = 16
    # a normalised query and key each have norm sqrt(head): their scaled product is at most that
    assert largest[True] <= math.sqrt(head) + 1e-4
    assert largest[False] > 10 * largest[True]


def test_bias_false_leaves_no_bias_anywhere():
    with_bias = GPT(n_embd=32, qk_norm=True)
    without = GPT(n_embd=32, qk_norm=True, bias=False)
    assert any(name.endswith("bias") for name, _ in with_bias.named_parameters())
    assert not any(name.endswith("bias") for name, _ in without.named_parameters())
    # the same weights otherwise: only the biases are gone
    biases = sum(p.numel() for n, p in with_bias.named_parameters() if n.endswith("bias"))
    count = sum(p.numel() for p in without.parameters())
    assert count == sum(p.numel() for p in with_bias.parameters()) - biases


def test_the_z_loss_adds_the_squared_log_normaliser_to_training_only():
    task = LanguageModelling(vocab_size=8, block_size=4, z_loss=0.01)
    logits = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(0)) * 3
    targets = torch.randint(0, 8, (2, 4), generator=torch.Generator().manual_seed(1))
    plain = F.cross_entropy(logits.reshape(-1, 8), targets.reshape(-1))
    z = torch.logsumexp(logits, dim=-1).square().mean()
    assert task.loss(logits, targets) == pytest.approx(float(plain + 0.01 * z), rel=1e-6)
    # validation reports the cross-entropy alone: runs with and without it compare
    sums = task.val_sums(logits, targets)
    assert float(sums[0]) / targets.numel() == pytest.approx(float(plain), rel=1e-6)


def test_z_loss_trains_a_language_model_and_records_its_weight(tmp_path):
    cfg = make_cfg(*tiny_lm(tmp_path, "trainer.z_loss=1e-3", "trainer.epochs=1",
                            "model.qk_norm=true", "model.bias=false"))  # fmt: skip
    summary = train(cfg, RunContext(tmp_path / "run"))
    assert summary["ran"]["task"]["z_loss"] == 1e-3
    assert summary["val/loss"] < math.log(256)  # below a uniform guess: it learned


def test_z_loss_on_an_image_classifier_is_refused_before_it_trains(tmp_path):
    cfg = make_cfg(*TINY, "trainer.z_loss=1e-4")
    with pytest.raises(ConfigError, match=r"trainer.z_loss=0.0001 applies to language models"):
        train(cfg, RunContext(tmp_path / "run"))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_the_logit_growth_diagnostic_compiles_nothing_on_its_steps(monkeypatch, tmp_path):
    """Its steps measure in an eager pass of their own: the compiled training forward keeps its
    one graph (a flag read inside it would compile a second on every switch)."""
    backend = Backend()
    compile_ = torch.compile
    monkeypatch.setattr(
        performance.torch,
        "compile",
        lambda model, mode, dynamic: compile_(model, backend=backend, dynamic=dynamic),
    )
    torch._dynamo.reset()
    cfg = make_cfg(*tiny_lm(tmp_path, "diagnostics.grad_stats_every=4", "trainer.epochs=1",
                            "trainer.compile=true"))  # fmt: skip
    train(cfg, RunContext(tmp_path / "run"))
    monkeypatch.undo()
    assert [grad for grad, _ in backend.graphs] == [True, False]  # training's, validation's
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    growth = [r for r in rows if "diag/total/attn_logit_max" in r]
    assert [r["step"] for r in growth] == [4, 8, 12, 16]
    for row in growth:
        layers = [row[f"diag/blocks.{i}.attn/attn_logit_max"] for i in (0, 1)]
        assert row["diag/total/attn_logit_max"] == max(layers) > 0


def test_the_gpt2_small_recipe_trains_on_token_files_as_its_preset_says(tmp_path):
    """experiment=gpt2_small at a CPU's scale (one small block, short windows): the recipe's
    optimizer, schedule on the device, accumulation, clipping and step budget as composed."""
    folder = bin_pair(tmp_path)
    cfg = make_cfg(
        "experiment=gpt2_small", f"dataset.path={folder}", f"dataset.vocab_size={VOCAB}",
        "model.n_layer=1", "model.n_head=2", "model.n_embd=32", "model.block_size=32",
        "dataset.batch_size=16", "dataset.train_size=64", "dataset.val_size=16",
        "trainer.accumulate=2", "trainer.max_steps=6", "trainer.eval_every_steps=3",
        "scheduler.warmup_steps=2", "trainer.log_every=3", "trainer.progress=false",
        "wandb.mode=disabled",
    )  # fmt: skip
    summary = train(cfg, RunContext(tmp_path / "run"))
    ran = summary["ran"]
    assert (ran["accumulate"], ran["clip_grad_norm"], ran["schedule"]) == (2, 1.0, "device")
    assert summary["ran"]["task"]["vocab_size"] == VOCAB
    steps, rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [3, 6] and rows[-1]["tokens"] == 6 * 16 * 32
    rates = [r["lr"] for r in steps]  # warm-up over 2 steps, then cosine to a tenth of 6e-4
    assert rates[:2] == pytest.approx([3e-4, 6e-4]) and rates[-1] == pytest.approx(
        6e-5 + (6e-4 - 6e-5) * 0.5 * (1 + math.cos(math.pi * 3 / 4)), rel=1e-5
    )


def test_a_language_model_run_logs_samples_as_a_wandb_table(tmp_path):
    cfg = make_cfg(*tiny_lm(tmp_path, "trainer.epochs=1", "wandb.samples=2",
                            "wandb.mode=offline"))  # fmt: skip
    train(cfg, RunContext(tmp_path / "run"))
    text = (tmp_path / "run" / "samples.txt").read_text()
    assert text.count("--- step-") == 2  # from the run's checkpoint, as mpexp-sample says
    (table,) = (tmp_path / "run" / "wandb").glob("*run-*/files/media/table/samples_*.table.json")
    rows = json.loads(table.read_text())
    assert rows["columns"] == ["checkpoint", "text"] and len(rows["data"]) == 2


def test_samples_of_an_image_classifier_are_refused_before_it_trains(tmp_path):
    with pytest.raises(ConfigError, match=r"wandb.samples=2 samples text from a language model"):
        train(make_cfg(*TINY, "wandb.samples=2"), RunContext(tmp_path / "run"))
