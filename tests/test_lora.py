"""Fine-tuning any model: LoRA through peft and frozen weights, on mpexp's GPT in every precision
mode, compiled, under DDP and FSDP2; what the run records, what its checkpoints hold and how a
resume puts it back bit for bit; what the plan counts; and what a mistake is told."""

from __future__ import annotations

import re
import sys

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from mpexp import config
from mpexp.build import build_parts, build_training, rebuilt
from mpexp.checkpoints import sharded
from mpexp.checkpoints.files import load
from mpexp.checkpoints.resume import Resume
from mpexp.distributed import World
from mpexp.errors import ConfigError, ResumeRefused
from mpexp.finetune.prepare import fine_tune
from mpexp.models.gpt import GPT
from mpexp.plan.rehearsal import rehearse
from mpexp.run.runner import train
from mpexp.rundir import checkpoint_files
from mpexp.sample import Draw, sample
from mpexp.step.train_step import train_step
from mpexp.tracking.run_context import RunContext
from mpexp.validate import validate
from tests.conftest import CPU, make_cfg, one_line_failure
from tests.test_language_model import corpus
from tests.test_training import read_metrics

pytest.importorskip("peft")

# a GPT of two blocks of width 32, with rank-4 adapters on its attention projections
LORA = ["model.lora.r=4", "optimizer.lr=1e-2"]
# per block: A (4 x 32) and B (96 x 4) beside qkv, A (4 x 32) and B (32 x 4) beside proj
ADAPTERS = 2 * (4 * 32 + 96 * 4 + 4 * 32 + 32 * 4)


def tiny_gpt(tmp_path, *more: str) -> list[str]:
    return [
        "model=gpt",
        "model.n_embd=32",
        "model.block_size=16",
        "dataset=text",
        f"dataset.path={corpus(tmp_path)}",
        f"dataset.cache_dir={tmp_path / 'cache'}",
        "dataset.train_size=64",
        "dataset.val_size=16",
        "dataset.batch_size=16",
        "trainer.device=cpu",
        "trainer.progress=false",
        "wandb.mode=disabled",
        *more,
    ]


def built_and_stepped(cfg, steps: int = 2, world: World | None = None):
    """The run's parts as mpexp-train builds them, after `steps` optimizer steps; the weights
    before those steps, by name."""
    validate(cfg)
    torch.manual_seed(cfg.trainer.seed)
    built = build_parts(cfg, world or World(CPU), {})
    optimizer, _, forward = build_training(cfg, built, CPU)
    before = {n: p.detach().clone() for n, p in built.model.named_parameters()}
    batches = built.data.train_batches(1, 0, CPU)
    for _ in range(steps):
        inputs, targets = next(batches)[:2]
        train_step(forward, inputs, targets, optimizer, built.scaler, built.precision, loss_fn=None)
        built.scaler.update()
    return built, optimizer, before


def adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def check_only_adapters_trained(model, optimizer, before) -> None:
    after = dict(model.named_parameters())
    assert any(adapter(n) for n in after)
    for name, weight in after.items():
        moved = not torch.equal(weight, before[name])
        assert moved == adapter(name), name  # the base bit for bit as it was; adapters trained
        assert weight.requires_grad == adapter(name)
    trained = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert trained == {id(p) for n, p in after.items() if adapter(n)}


# --- every precision mode ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("precision", "adapters", "frozen"),
    [
        ("fp32", torch.float32, torch.float32),
        ("bf16", torch.float32, torch.bfloat16),  # float32 adapters over a bf16 base
        ("fp16", torch.float32, torch.float16),  # and the loss scaler unscales their gradients
        ("fp8", torch.float32, torch.float32),  # the base's Linear layers in fp8, from float32
        ("bf16_pure", torch.bfloat16, torch.bfloat16),  # every weight in bf16
    ],
)
def test_lora_trains_only_the_adapters_in_every_precision(tmp_path, precision, adapters, frozen):
    cfg = make_cfg(*tiny_gpt(tmp_path, *LORA, f"precision={precision}"))
    built, optimizer, before = built_and_stepped(cfg)
    check_only_adapters_trained(built.model, optimizer, before)
    model = built.model
    assert {p.dtype for n, p in model.named_parameters() if adapter(n)} == {adapters}
    assert model.get_submodule("blocks.0.attn.qkv.base_layer").weight.dtype == frozen
    assert model.get_submodule("blocks.0.mlp.0").weight.dtype == frozen  # frozen: held alike
    assert model.wte.weight.dtype == (frozen if precision == "bf16_pure" else torch.float32)
    if precision == "fp8":  # the frozen base converts, the adapters stay as they are
        fp8 = built.precision.fp8
        assert "blocks.0.attn.qkv.base_layer" in fp8.converted
        assert "LoRA adapter" in fp8.unconverted["blocks.0.attn.qkv.lora_A.default"]
    record = built.tuning.record()
    assert record["trainable_parameters"] == ADAPTERS
    assert record["lora"]["target_modules"] == ["blocks.*.attn.qkv", "blocks.*.attn.proj"]


def test_frozen_layers_held_in_bf16_compute_what_float32_ones_compute():
    """Autocast casts a frozen Linear's float32 weight to bf16 at every use: holding it in bf16
    gives the same logits and the same adapter gradients, bit for bit, in less memory."""
    results = []
    for held in ("autocast", "float32"):
        torch.manual_seed(0)
        model = GPT(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
        tuning = fine_tune(model, settings(r=4, frozen_dtype=held))
        tuning.hold_frozen(model, torch.bfloat16, fp32_modules=[])
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
            logits = model(torch.arange(32).view(2, 16))
        logits.float().square().mean().backward()
        grads = [p.grad for n, p in model.named_parameters() if adapter(n)]
        bytes_held = sum(p.numel() * p.element_size() for p in model.parameters())
        results.append((logits, grads, tuning.frozen_dtype, bytes_held))
    (logits, grads, dtype, held), (logits_32, grads_32, dtype_32, held_32) = results
    assert torch.equal(logits, logits_32) and all(map(torch.equal, grads, grads_32))
    assert dtype.startswith("bfloat16") and dtype_32 == "float32"
    linear = 2 * (32 * 96 + 96 + 32 * 32 + 32 + 32 * 128 + 128 + 128 * 32 + 32)
    assert held_32 - held == 2 * linear  # 2 bytes a frozen Linear weight fewer


def test_a_lora_model_compiles_whole_and_trains_its_adapters(tmp_path):
    """torch.compile traces peft's layers in one graph (fullgraph: a break would raise)."""
    cfg = make_cfg(*tiny_gpt(tmp_path, *LORA, "precision=bf16", "model.n_layer=1"))
    torch.manual_seed(0)
    built = build_parts(cfg, World(CPU), {})
    optimizer, _, forward = build_training(cfg, built, CPU)
    compiled = torch.compile(forward, backend="eager", fullgraph=True, dynamic=False)
    before = {n: p.detach().clone() for n, p in built.model.named_parameters()}
    batches = built.data.train_batches(1, 0, CPU)
    for _ in range(2):  # B starts at zero: A's first gradient is zero, its second is not
        inputs, targets = next(batches)[:2]
        train_step(
            compiled, inputs, targets, optimizer, built.scaler, built.precision, loss_fn=None
        )
        built.scaler.update()
    check_only_adapters_trained(built.model, optimizer, before)


@pytest.fixture
def one_process_group(tmp_path):
    """A gloo process group of this process alone: DDP and FSDP2 wrap and train as on many."""
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


def test_lora_trains_under_ddp_and_fsdp_and_fsdp_checkpoints_leave_the_base_out(
    tmp_path, one_process_group
):
    for strategy in ("ddp", "fsdp"):
        cfg = make_cfg(*tiny_gpt(tmp_path, *LORA, "precision=bf16", f"trainer.strategy={strategy}"))
        world = World(CPU, strategy, 0, 1, "gloo")
        built, optimizer, before = built_and_stepped(cfg, world=world)
        check_only_adapters_trained(built.model, optimizer, before)
    # FSDP2 keeps the base float32 in its shards and gathers it in bf16 itself
    assert built.tuning.frozen_dtype == "float32"
    folder = tmp_path / "step-2"
    sharded.save(folder, {"format": 1}, {}, built.model, optimizer, rank=0)
    again, optimizer_again, _ = built_and_stepped(cfg, steps=0, world=world)  # as built
    sharded.load_into(folder, again.model, optimizer_again)
    for saved, loaded in zip(built.model.parameters(), again.model.parameters(), strict=True):
        assert torch.equal(saved.full_tensor(), loaded.full_tensor())  # adapters read back
    from torch.distributed.checkpoint import FileSystemReader

    stored = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    assert any(".lora_A." in key for key in stored)
    assert not any("base_layer" in key or "wte" in key for key in stored)


# --- freezing ------------------------------------------------------------------------------------


def test_freeze_patterns_freeze_what_they_name_and_the_optimizer_gets_the_rest(tmp_path):
    cfg = make_cfg(*tiny_gpt(tmp_path, "model.freeze=[wte,wpe,blocks.0,blocks.*.ln_?]"))
    built, optimizer, before = built_and_stepped(cfg)
    trained = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for name, weight in built.model.named_parameters():
        frozen = (
            name.startswith(("wte.", "wpe.", "blocks.0.")) or ".ln_1." in name or (".ln_2." in name)
        )
        assert weight.requires_grad != frozen and (id(weight) in trained) != frozen, name
        assert torch.equal(weight, before[name]) == frozen, name
    assert built.tuning.frozen_dtype == "float32"  # nothing is autocast: all held as built
    assert built.tuning.record()["trainable_parameters"] == sum(
        p.numel() for p in built.model.parameters() if p.requires_grad
    )


# --- mistakes ------------------------------------------------------------------------------------


def settings(freeze=(), frozen_dtype="autocast", **lora):
    """The model group's fine-tuning keys, as the config gives them."""
    node = OmegaConf.structured(config.ModelConfig(_target_="mpexp.models.gpt.GPT"))
    node.freeze, node.frozen_dtype = list(freeze), frozen_dtype
    node.lora = OmegaConf.merge(node.lora, lora)
    return node


@pytest.mark.parametrize(
    ("asked", "said"),
    [
        ({"freeze": ["blocks.9"]}, "model.freeze: 'blocks.9' matches no parameter of GPT. Its "
         "layers: wte, wpe, blocks.*.ln_1, blocks.*.attn.qkv, blocks.*.attn.proj"),
        ({"r": 4, "target_modules": ["qkv", "q_proj"]},
         "model.lora.target_modules: 'q_proj' names no module of GPT. Its layers: wte, wpe, "
         "blocks.*.ln_1, blocks.*.attn.qkv"),
        ({"r": 4, "target_modules": ["blocks"]}, "model.lora: peft cannot adapt GPT's layers "
         "blocks: Target module ModuleList"),
        ({"freeze": ["*"]}, "model.freeze=['*'] freezes every parameter of GPT: nothing "
         "would train"),
    ],
)  # fmt: skip
def test_a_fine_tuning_mistake_is_told_in_one_message(asked, said):
    model = GPT(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    with pytest.raises(ConfigError) as raised:
        fine_tune(model, settings(**asked))
    assert said in str(raised.value) and "\n" not in str(raised.value)


def test_lora_settings_out_of_range_are_refused_before_anything_is_built():
    for key, value, said in [
        ("r", -1, "model.lora.r=-1 must be an integer >= 0"),
        ("alpha", 0, "model.lora.alpha=0.0 must be positive"),
        ("dropout", 1.0, "model.lora.dropout=1.0 must lie in [0, 1)"),
        # before a model is built: one of model=hf's without size keys has 7 B parameters
        ("dtype", "float32", "model.lora.dtype=float32 under precision=bf16_pure"),
    ]:
        cfg = make_cfg("model=gpt", "dataset=text", "model.lora.r=4", "precision=bf16_pure")
        cfg.model.lora[key] = value
        with pytest.raises(ConfigError, match=re.escape(said)):
            validate(cfg)


def test_lora_on_a_model_without_attention_asks_for_its_layers():
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.Flatten(), torch.nn.Linear(4, 2))
    with pytest.raises(ConfigError, match=r"has none\. Name the layers .* its layers: 0, 2\."):
        fine_tune(model, settings(r=4))


def test_lora_without_peft_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft raises ImportError
    model = GPT(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    with pytest.raises(ConfigError, match=r'not installed here: pip install -e "\.\[hf\]"'):
        fine_tune(model, settings(r=4))


def test_the_command_refuses_a_missing_target_in_one_line_and_writes_nothing(tmp_path, in_process):
    args = tiny_gpt(tmp_path, *LORA, "model.lora.target_modules=[c_attn]")
    output = one_line_failure(in_process(*args, cwd=tmp_path))
    assert "'c_attn' names no module of GPT" in output
    assert not (tmp_path / "outputs").exists()


# --- a run: its record, its checkpoints, resume, sampling ---------------------------------------


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A LoRA run of 8 steps, checkpointed at steps 4 and 8 (both kept)."""
    tmp = tmp_path_factory.mktemp("lora_run")
    args = tiny_gpt(tmp, *LORA, "precision=bf16", "trainer.epochs=null", "trainer.max_steps=8",
                    "trainer.checkpoint_every_steps=4", "trainer.keep_checkpoints=2",
                    "trainer.log_every=1")  # fmt: skip
    summary = train(make_cfg(*args), RunContext(tmp / "run"))
    return tmp / "run", args, summary


def test_a_lora_run_records_what_trains_and_checkpoints_only_that(lora_run):
    run_dir, _, summary = lora_run
    ran = summary["ran"]
    assert ran["trainable_parameters"] == ADAPTERS == 1536 < ran["parameters"]
    assert ran["lora"]["r"] == 4 and ran["lora"]["alpha"] == 8 and ran["lora"]["layers"] == 4
    assert ran["frozen_dtype"].startswith("bfloat16")
    assert (
        ran["bytes_grads"] == ADAPTERS * 4 and ran["bytes_states"] == 2 * ADAPTERS * 4
    )  # Adam's two
    state = load(checkpoint_files(run_dir)[-1])
    assert all(adapter(k) for k in state["model"]), "no frozen weight is saved"
    assert sum(v.numel() for v in state["model"].values()) == ADAPTERS
    assert "blocks.0.attn.qkv.base_layer.weight" in state["frozen"]


def test_resuming_a_lora_run_repeats_it_bit_for_bit(lora_run, tmp_path):
    run_dir, args, _ = lora_run
    first, last = checkpoint_files(run_dir)
    whole = load(last)["model"]
    steps, _ = read_metrics(run_dir)
    losses = [r["train/loss"] for r in steps if "train/loss" in r]
    train(make_cfg(*args, f"trainer.resume={first}"), RunContext(run_dir))
    again = load(checkpoint_files(run_dir)[-1])["model"]
    assert whole.keys() == again.keys() and all(torch.equal(whole[k], again[k]) for k in whole)
    steps, _ = read_metrics(run_dir)
    assert [r["train/loss"] for r in steps if "train/loss" in r] == losses


def test_a_resume_over_other_frozen_weights_is_refused(lora_run):
    run_dir, _, _ = lora_run
    path = checkpoint_files(run_dir)[0]
    state = load(path)
    other = dict(state["frozen"])
    name = "blocks.1.mlp.0.weight"
    other[name] = [*other[name][:2], other[name][2] + 1]
    with pytest.raises(ResumeRefused, match=f"other frozen weights: {name} holds other values"):
        Resume(path, state).check_frozen(other)


def test_a_lora_run_samples_from_its_rebuilt_base(lora_run):
    run_dir, _, _ = lora_run
    (text,), note = sample(run_dir, Draw(tokens=8, temperature=0.0), "def ")
    assert text.startswith("def ") and "bf16" in note
    _, tuning = rebuilt(load(checkpoint_files(run_dir)[-1]))
    assert tuning.adapters is not None and tuning.trainable == ADAPTERS


# --- the plan ------------------------------------------------------------------------------------


def test_the_plan_gives_frozen_weights_no_gradients_nor_optimizer_states(tmp_path):
    """Under bf16 and Adam: adapters 4 + 4 + 8 bytes each, frozen Linear layers 2 bytes (held
    in bf16), the rest of the frozen base (embeddings, norms) 4."""
    cfg = make_cfg(*tiny_gpt(tmp_path, *LORA, "precision=bf16", "optimizer=adam"))
    plan = rehearse(cfg, "cuda")
    adapters, vocab, width = ADAPTERS, 256, 32
    linear = 2 * (32 * 96 + 96 + 32 * 32 + 32 + 32 * 128 + 128 + 128 * 32 + 32)
    rest = vocab * width + 16 * width + 2 * 4 * width + 2 * width  # wte, wpe, ln_1/ln_2, ln_f
    assert plan.parameters == adapters + linear + rest
    assert plan.trainable_parameters == adapters
    assert plan.bytes["weights"] == 4 * adapters + 2 * linear + 4 * rest
    assert plan.bytes["gradients"] == 4 * adapters
    assert plan.bytes["optimizer"] == 8 * adapters
