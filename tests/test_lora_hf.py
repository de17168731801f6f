"""LoRA on a transformers model, built here directly (tests/lora_models.py) as model=hf's adapter
will build it: its attention projections found by their names, its adapters merged or saved
apart as an export writes them and as transformers and peft load them back, and an
8B-shaped LoRA row of the plan at its real size on fake tensors."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from mpexp import config
from mpexp.finetune.export import merged, save_adapters
from mpexp.finetune.prepare import fine_tune
from mpexp.plan.rehearsal import rehearse
from tests.conftest import make_cfg
from tests.lora_models import CausalLM

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

TINY_LLAMA = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 64}  # fmt: skip


def lora(r: int = 4, **more) -> OmegaConf:
    node = OmegaConf.structured(config.ModelConfig(_target_="tests.lora_models.CausalLM"))
    node.lora = OmegaConf.merge(node.lora, {"r": r, **more})
    return node


@pytest.fixture(scope="module")
def adapted():
    """A tiny Llama with LoRA on its attention projections, its adapters moved off their start
    (B is zero there, which would hide a merge that drops them)."""
    torch.manual_seed(0)
    model = CausalLM(vocab_size=96, **TINY_LLAMA)
    base = {k: v.clone() for k, v in model.model.state_dict().items()}
    tuning = fine_tune(model, lora())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(std=0.1)
    tokens = torch.randint(0, 96, (2, 12))
    return model, tuning, base, tokens


def test_lora_finds_a_llamas_attention_projections(adapted):
    _, tuning, _, _ = adapted
    assert tuning.lora["target_modules"] == [
        f"model.model.layers.*.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")
    ]
    assert tuning.lora["layers"] == 8
    # per layer: A (4 x 32) beside each projection, B (32 x 4) for q and o, (16 x 4) for k and v
    assert tuning.trainable == 2 * (4 * 4 * 32 + 2 * 32 * 4 + 2 * 16 * 4)


def test_adapters_saved_apart_load_over_the_base_with_peft(adapted, tmp_path):
    model, tuning, base, tokens = adapted
    save_adapters(tuning.adapters, tmp_path / "adapter", within="model", base="my-llama")
    fresh = transformers.LlamaForCausalLM(model.model.config)
    fresh.load_state_dict(base)
    loaded = peft.PeftModel.from_pretrained(fresh, str(tmp_path / "adapter"))
    assert loaded.peft_config["default"].base_model_name_or_path == "my-llama"
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=tokens).logits, model(tokens))


def test_merged_adapters_save_as_a_plain_model_that_transformers_loads(adapted, tmp_path):
    model, tuning, _, tokens = adapted
    with torch.no_grad():
        expected = model(tokens)
        plain = merged(tuning.adapters)
        assert not any("lora" in name for name, _ in plain.named_parameters())
        plain.model.save_pretrained(tmp_path / "merged")
        again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
        # the same function, up to the rounding of W + alpha / r B A once per weight
        torch.testing.assert_close(again(input_ids=tokens).logits, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "layers",
    [2, pytest.param(32, marks=pytest.mark.slow)],  # 32: about 30 s on fake tensors
)
def test_an_8b_shaped_lora_row_holds_the_bytes_the_arithmetic_says(layers):
    """Llama-3-8B's widths under LoRA r=16 on q, k, v and o, bf16 and AdamW: the adapters hold
    4 + 4 + 8 bytes a weight, the frozen Linear layers 2 (held in bf16), the embedding and the
    norms 4. At 32 layers: 8.04 B parameters, 13.6 M trainable, 17.2 GB of weights."""
    cfg = make_cfg("dataset=tokens", "dataset.vocab_size=128256", "dataset.block_size=64",
                   "dataset.batch_size=2", "precision=bf16", "optimizer=adamw")  # fmt: skip
    cfg.model = lora(16)
    cfg.model._target_ = "tests.lora_models." + ("llama_8b" if layers == 32 else
                                                 "llama_8b_widths_2_layers")  # fmt: skip
    row = rehearse(cfg, "cuda", micro_batches=1)
    hidden, kv, mlp, vocab, r = 4096, 1024, 14336, 128256, 16
    linear = layers * (2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * mlp) + vocab * hidden
    rest = vocab * hidden + (2 * layers + 1) * hidden  # the embedding, the norms
    adapters = layers * r * (4 * hidden + 2 * hidden + 2 * kv)
    assert row.parameters == linear + rest + adapters
    assert row.trainable_parameters == adapters
    assert row.bytes["weights"] == 2 * linear + 4 * rest + 4 * adapters
    assert row.bytes["gradients"] == 4 * adapters
    assert row.bytes["optimizer"] == 8 * adapters
    assert not row.missing
    if layers == 32:
        assert row.parameters == 8_043_892_736 and adapters == 13_631_488
        assert row.bytes["weights"] == 17_166_254_080


def test_the_finetune_lora_preset_composes_lora_over_a_pretrained_causal_lm():
    cfg = make_cfg("experiment=finetune_lora", "model.pretrained=/models/my-llama")
    assert cfg.model.lora.r == 16 and cfg.model.lora.target_modules is None
    assert cfg.model.pretrained == "/models/my-llama"
