"""model=hf as a user runs it, offline: transformers models from a config or a save_pretrained
folder (tiny ones, written here), the validation a loaded model starts from against
transformers' own loss, sampling with transformers' KV cache, the export back to a folder that
from_pretrained loads, the plan at Llama-3.2-1B's widths, and bad input refused in one message
with nothing written. Every precision mode and the resume: tests/test_hf_precisions.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from mpexp.build import build_parts
from mpexp.distributed import World
from mpexp.errors import ConfigError
from mpexp.export import export
from mpexp.models import hf_config
from mpexp.models.hf import hf_model
from mpexp.plan.rows import Target, plan_rows
from mpexp.run.runner import train
from mpexp.sample import Draw, generate, sample
from mpexp.step.objective import Objective
from mpexp.step.validation import evaluate
from mpexp.tracking.run_context import RunContext
from mpexp.validate import check_schema
from tests.conftest import CPU, make_cfg, one_line_failure
from tests.test_host_reads import HostReads
from tests.test_language_model import corpus

transformers = pytest.importorskip("transformers")

# a Llama of its own config: 2 layers of width 32, grouped-query attention (2 heads, 1 kv head)
LLAMA = [
    "model=hf",
    "model.config=llama",
    "model.hidden_size=32",
    "model.num_hidden_layers=2",
    "model.num_attention_heads=2",
    "model.num_key_value_heads=1",
    "model.intermediate_size=64",
]
# a ViT of its own config on 3x32x32 images in patches of 8 (16 patches and the class token)
VIT = [
    "model=hf",
    "model.config=vit",
    "model.hidden_size=32",
    "model.num_hidden_layers=2",
    "model.num_attention_heads=2",
    "model.intermediate_size=64",
    "model.patch_size=8",
    "dataset=synthetic",
    "dataset.channels=3",
    "dataset.height=32",
    "dataset.width=32",
    "dataset.num_classes=5",
]
# one optimizer step an epoch, one validation batch
SHORT = [
    "model.block_size=16",
    "dataset.train_size=16",
    "dataset.val_size=16",
    "dataset.batch_size=16",
    "trainer.epochs=1",
    "trainer.log_every=1",
    "trainer.progress=false",
    "wandb.mode=disabled",
]


def text(folder: Path) -> list[str]:
    return ["dataset=text", f"dataset.path={corpus(folder)}", f"dataset.cache_dir={folder}/cache"]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    """save_pretrained folders, as a user has them: `llama` (tied embeddings, its own BPE
    tokenizer of 300 tokens with an end-of-text token) and `vit` (3x32x32 images, 5 classes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("pretrained")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    learn = trainers.BpeTrainer(
        vocab_size=300,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    tokenizer.train_from_iterator([corpus(root).read_text()], learn)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|endoftext|>"
    )
    torch.manual_seed(0)
    llama = transformers.AutoConfig.for_model(
        "llama", vocab_size=len(fast), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=64, max_position_embeddings=64,
        tie_word_embeddings=True,
    )  # fmt: skip
    transformers.AutoModelForCausalLM.from_config(llama).save_pretrained(root / "llama")
    fast.save_pretrained(root / "llama")
    vit = transformers.AutoConfig.for_model(
        "vit", hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        image_size=32, patch_size=8, num_channels=3, num_labels=5,
    )  # fmt: skip
    transformers.AutoModelForImageClassification.from_config(vit).save_pretrained(root / "vit")
    return root


@pytest.fixture(scope="module")
def fine_tuned(pretrained, tmp_path_factory) -> Path:
    """The pretrained Llama trained two steps in bf16 on text, which its own tokenizer reads."""
    folder = tmp_path_factory.mktemp("fine_tuned")
    args = ["model=hf", f"model.pretrained={pretrained / 'llama'}", *text(folder), *SHORT,
            "dataset.train_size=32", "precision=bf16"]  # fmt: skip
    train(make_cfg(*args), RunContext(folder / "run"))
    return folder / "run"


def test_a_configs_own_keys_are_taken_without_plus_and_a_misspelt_one_is_refused():
    cfg = make_cfg(*LLAMA, "model.rms_norm_eps=1e-5")  # no `+`: the node takes transformers' keys
    check_schema(cfg)
    assert cfg.model.hidden_size == 32 and cfg.model.rms_norm_eps == 1e-5
    with pytest.raises(ConfigError, match=r"closest first: hidden_size, ") as refused:
        check_schema(make_cfg(*LLAMA, "model.hiden_size=8"))
    assert "num_key_value_heads" in str(refused.value)  # the config's keys, listed
    with pytest.raises(ConfigError, match=r"model.config=lama .* The closest: llama"):
        check_schema(make_cfg("model=hf", "model.config=lama"))
    with pytest.raises(ConfigError, match=r"model.vocab_size .* the data's"):
        check_schema(make_cfg(*LLAMA, "model.vocab_size=512"))


def test_a_pretrained_llamas_validation_is_transformers_own_loss_on_the_same_windows(pretrained):
    """Loaded (its weights in float32), sized by nothing but its folder, its text read with its
    own tokenizer: mpexp's validation of it equals transformers' loss with labels."""
    folder = pretrained / "llama"
    cfg = make_cfg("model=hf", f"model.pretrained={folder}", *text(pretrained), *SHORT)
    built = build_parts(cfg, World(CPU), {"model": "hf", "dataset": "text"})
    assert built.data.record()["tokenizer_file"] == str((folder / "tokenizer.json").resolve())
    assert built.task.vocab_size == 300 and next(built.model.parameters()).dtype == torch.float32
    ours = evaluate(Objective(built.model, built.task), built.data, CPU, built.precision)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    total = count = 0
    with torch.no_grad():
        for inputs, targets in built.data.val_batches(CPU):
            # the whole window: each position predicts the next, as mpexp's targets say
            window = torch.cat([inputs, targets[:, -1:]], dim=1)
            total += theirs(input_ids=window, labels=window).loss.item() * targets.numel()
            count += targets.numel()
    assert ours["val/loss"] == pytest.approx(total / count, rel=1e-5)


def test_the_adapter_reads_nothing_on_the_host_and_shards_by_the_models_own_blocks():
    """transformers' default attention reads a value on the host each forward (its check for
    packed sequences); the mask-free one mpexp picks gives the same logits and reads none."""
    sizes = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
             "intermediate_size": 64}  # fmt: skip
    torch.manual_seed(0)
    ours = hf_model("llama", None, 16, vocab_size=64, **sizes)
    torch.manual_seed(0)
    default = hf_model("llama", None, 16, attn_implementation="sdpa", vocab_size=64, **sizes)
    tokens = torch.randint(64, (2, 16))
    for model, reads in ((ours, 0), (default, 1)):
        with HostReads() as counted:
            logits = model(tokens)
            logits.sum().backward()
        assert counted.count == reads
    assert torch.equal(logits, ours(tokens))
    assert [type(unit).__name__ for unit in ours.fsdp_units()] == ["LlamaDecoderLayer"] * 2


def test_sampling_uses_transformers_kv_cache_and_the_runs_tokenizer(pretrained, fine_tuned):
    model = hf_model(pretrained=str(pretrained / "llama"), block_size=16, vocab_size=320).eval()
    window = torch.randint(0, 300, (2, 16))
    with torch.no_grad():  # past the context: the output layer on the last position alone
        torch.testing.assert_close(model.last_logits(window), model(window)[:, -1])
    # 30 tokens: past the context of 16, where the cache gives way to the last 16 tokens
    for draw in (Draw(tokens=30, temperature=1.0, top_k=20, samples=2, seed=7),
                 Draw(tokens=30, temperature=0)):  # fmt: skip
        assert generate(model, [5, 6, 7], 300, draw) == generate(
            model, [5, 6, 7], 300, draw, cached=False
        )
    (written,), how = sample(fine_tuned, Draw(tokens=12, temperature=0), "It is a truth")
    assert written.startswith("It is a truth") and len(written) > len("It is a truth")
    assert "bf16 (autocast bfloat16)" in how


def test_the_best_checkpoint_exports_to_a_folder_transformers_loads(
    pretrained, fine_tuned, tmp_path
):
    from tokenizers import Tokenizer

    from mpexp.checkpoints.files import load
    from mpexp.sample import best_checkpoint

    out = tmp_path / "exported"
    said = export(fine_tuned, out)
    assert "LlamaForCausalLM" in said[0] and "its tokenizer" in said[1]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).state_dict()
    trained = load(best_checkpoint(fine_tuned)[0])["model"]
    assert trained.keys() == loaded.keys()
    assert all(torch.equal(loaded[k], v) for k, v in trained.items())
    words = "It is a truth universally acknowledged"
    run_tokenizer = Tokenizer.from_file(str(pretrained / "llama" / "tokenizer.json"))
    exported = transformers.AutoTokenizer.from_pretrained(out)
    assert exported.encode(words, add_special_tokens=False) == run_tokenizer.encode(words).ids
    with pytest.raises(Exception, match="not empty"):
        export(fine_tuned, out)


def test_plan_at_llama_3_2_1b_widths_holds_the_bytes_the_arithmetic_says():
    """Its embedding of 128,256 x 2048 (tied to the output layer), its layers' widths (32 query
    heads over 8 kv heads, an MLP of 8192), at 1 of its 16 layers (a layer's fake-tensor pass
    costs seconds here; the slow test below plans all 16): 16 bytes a parameter under mixed
    precision (fp32 weights and gradients, Adam's two fp32 moments), 8 under pure bf16."""
    rows = plan_rows(
        ["model=hf_llama_1b", "model.num_hidden_layers=1", "model.block_size=64",
         "dataset=tokens", "dataset.vocab_size=128256", "dataset.batch_size=2",
         "precision=bf16,fp16,bf16_pure"], Target("cuda"),
    )  # fmt: skip
    hidden, kv, mlp, vocab = 2048, 512, 8192, 128256
    layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * mlp + 2 * hidden
    assert all(row["parameters"] == vocab * hidden + layer + hidden for row in rows)
    for row, per in zip(rows, (16, 16, 8), strict=True):
        b = row["bytes"]
        assert (b["weights"] + b["gradients"] + b["optimizer"]) == per * row["parameters"]
        assert not row["missing"] and row["host_reads_per_step"] == 0, row["missing"]


@pytest.mark.slow  # 16 layers at 1.2 B parameters on fake tensors: about 20 s a row on 2 cores
def test_plan_at_llama_3_2_1b_size():
    rows = plan_rows(
        ["model=hf_llama_1b", "model.block_size=64", "dataset=tokens",
         "dataset.vocab_size=128256", "dataset.batch_size=2", "precision=bf16,fp16,bf16_pure"],
        Target("cuda"),
    )  # fmt: skip
    assert [row["parameters"] for row in rows] == [1_235_814_400] * 3  # Llama-3.2-1B's count
    for row, per in zip(rows, (16, 16, 8), strict=True):
        assert row["bytes_per_parameter"] == per and not row["missing"]


def bad_inputs(pretrained: Path, folder: Path) -> dict[str, tuple[list[str], str]]:
    """A mistake each: the command's arguments and what its one message says."""
    no_weights = folder / "no_weights"
    no_weights.mkdir(exist_ok=True)
    (no_weights / "config.json").write_text('{"model_type": "llama"}')
    llama, vit = pretrained / "llama", pretrained / "vit"
    no_tokenizer = folder / "no_tokenizer"  # the Llama's weights without its tokenizer.json
    no_tokenizer.mkdir(exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        (no_tokenizer / name).write_bytes((llama / name).read_bytes())
    gpt2 = ["model=hf", "model.config=gpt2", "model.n_layer=1", "model.n_embd=32", "model.n_head=2"]
    return {
        "unknown type": (["model=hf", "model.config=lama"], "The closest: llama"),
        "misspelt key": ([*LLAMA, "model.hiden_size=8"], "closest first: hidden_size"),
        "no weights": (["model=hf", f"model.pretrained={no_weights}"], "holds no weights"),
        "other type": (["model=hf", "model.config=gpt2", f"model.pretrained={llama}"],
                       "is a llama model"),
        "no class for the task": (["model=hf", "model.config=vit", *text(folder), *SHORT],
                                  "no causal language model class for a vit model"),
        "small vocabulary": (
            ["model=hf", f"model.pretrained={llama}", *text(folder), *SHORT,
             "dataset.tokenizer=bpe", "dataset.vocab_size=512"],
            "token id 300 and those above have no row in its embedding",
        ),
        "image size": (["model=hf", f"model.pretrained={vit}", "dataset=synthetic",
                        "dataset.channels=3", *SHORT], "doesn't match model (32*32).\nChange"),
        # rotary positions: past its 64 the Llama would train on, without a word
        "window past a folder's context": (
            ["model=hf", f"model.pretrained={llama}", *text(folder), *SHORT,
             "dataset.block_size=128"],
            "windows of 128 tokens, longer than its context of 64 positions",
        ),
        # GPT-2's position table of model.block_size=16 rows: an IndexError mid-build
        "window past a new model's context": (
            [*gpt2, *text(folder), *SHORT, "dataset.block_size=32"],
            "Use dataset.block_size=16 (or fewer), or model.block_size=32",
        ),
        "no tokenizer.json": (["model=hf", f"model.pretrained={no_tokenizer}", *text(folder),
                               *SHORT], "is a folder without a tokenizer.json"),
        "timm on text": (["model=timm", "model.name=resnet18", *text(folder)],
                         "model=timm classifies images; this dataset cuts text"),
    }  # fmt: skip


MISTAKES = ["unknown type", "misspelt key", "no weights", "other type", "no class for the task",
            "small vocabulary", "image size", "window past a folder's context",
            "window past a new model's context", "no tokenizer.json", "timm on text"]  # fmt: skip


@pytest.mark.parametrize("mistake", MISTAKES)
def test_bad_input_is_one_message_and_nothing_is_written(pretrained, tmp_path, in_process, mistake):
    args, said = bad_inputs(pretrained, tmp_path)[mistake]
    output = one_line_failure(in_process(*args, "wandb.mode=disabled", cwd=tmp_path))
    assert said in output
    assert not (tmp_path / "outputs").exists()


def test_a_pretrained_encoder_is_loaded_as_a_decoder_blind_to_later_tokens(tmp_path):
    """A folder saved from BertForMaskedLM says is_decoder=false: trained on text as it is, each
    position would see the token it is to predict. Changing the last token changes no earlier
    position's logits."""
    config = transformers.AutoConfig.for_model(
        "bert", vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=16,
    )  # fmt: skip
    transformers.AutoModelForMaskedLM.from_config(config).save_pretrained(tmp_path / "bert")
    model = hf_model(pretrained=str(tmp_path / "bert"), block_size=16, vocab_size=64).eval()
    tokens = torch.randint(0, 64, (2, 16))
    changed = tokens.clone()
    changed[:, -1] = (tokens[:, -1] + 1) % 64
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    assert model.config.is_decoder
    assert torch.equal(before[:, :-1], after[:, :-1]) and not torch.equal(before, after)


def test_without_transformers_a_run_names_the_install_that_brings_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers fails
    with pytest.raises(ConfigError, match=r"pip install 'mpexp\[hf\]'"):
        hf_config.transformers()


def test_a_lora_run_exports_adapters_peft_loads_over_its_base_or_merged(pretrained, tmp_path):
    """experiment=finetune_lora on the pretrained Llama, two steps; its export: the base as it
    was, with the trained adapters apart (peft's PeftModel over it), or merged into a plain
    model. Both compute what the run's checkpoint computes."""
    from mpexp.build import rebuilt
    from mpexp.checkpoints.files import load
    from mpexp.export import model_kwargs
    from mpexp.sample import best_checkpoint

    peft = pytest.importorskip("peft")
    args = ["experiment=finetune_lora", f"model.pretrained={pretrained / 'llama'}",
            *text(tmp_path), *SHORT, "dataset.train_size=32", "model.lora.dropout=0",
            "optimizer.lr=0.05", "scheduler.warmup_steps=0", "precision=fp32"]  # fmt: skip
    train(make_cfg(*args), RunContext(tmp_path / "run"))
    state = load(best_checkpoint(tmp_path / "run")[0])
    ran = __import__("json").loads((tmp_path / "run" / "summary.json").read_text())["ran"]
    trained, _ = rebuilt(state, **model_kwargs(ran["task"]))
    tokens = torch.randint(0, 300, (2, 16))
    with torch.no_grad():
        expected = trained.eval()(tokens)

    said = export(tmp_path / "run", tmp_path / "apart")
    assert "adapters apart" in said[1] and "its tokenizer" in said[2]
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "apart")
    untouched = transformers.AutoModelForCausalLM.from_pretrained(pretrained / "llama")
    assert all(torch.equal(v, untouched.state_dict()[k]) for k, v in base.state_dict().items())
    with torch.no_grad():
        before = base(input_ids=tokens).logits
        loaded = peft.PeftModel.from_pretrained(base, str(tmp_path / "apart" / "adapter"))
        got = loaded(input_ids=tokens).logits
    assert not torch.allclose(before, expected, atol=1e-3)  # the adapters moved off zero
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)

    said = export(tmp_path / "run", tmp_path / "merged", merge=True)
    assert "merged" in said[0] and not (tmp_path / "merged" / "adapter").exists()
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=tokens).logits, expected, rtol=0, atol=1e-5)
