"""LoRA on a pretrained classifier given another class count: the head the build made anew (timm's
classifier reset, transformers' `ignore_mismatched_sizes`) trains whole beside the adapters, is
recorded, checkpointed and resumed with its trained weights, and exported as peft's
`modules_to_save`. Weights files are written here, tiny."""

from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch

from mpexp.build import rebuilt
from mpexp.checkpoints.files import load
from mpexp.export import export, model_kwargs
from mpexp.plan.rehearsal import rehearse
from mpexp.run.runner import train
from mpexp.rundir import checkpoint_files
from mpexp.tracking.run_context import RunContext
from tests.conftest import make_cfg

timm = pytest.importorskip("timm")
transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

# 3x32x32 images in 3 classes, 16 a batch, a checkpoint after each of two steps
DATA = [
    "dataset=synthetic", "dataset.channels=3", "dataset.height=32", "dataset.width=32",
    "dataset.num_classes=3", "dataset.train_size=32", "dataset.val_size=16",
    "dataset.batch_size=16", "trainer.epochs=null", "trainer.max_steps=2",
    "trainer.checkpoint_every_steps=1", "trainer.keep_checkpoints=2", "trainer.log_every=1",
    "trainer.progress=false", "wandb.mode=disabled", "precision=fp32", "model.lora.r=4",
    "model.lora.dropout=0", "optimizer.lr=1e-2",
]  # fmt: skip
VIT_KWARGS = {"depth": 2, "embed_dim": 64, "num_heads": 2}


@pytest.fixture(scope="module")
def timm_run(tmp_path_factory):
    """A timm ViT's weights for 10 classes, LoRA-trained two steps on 3."""
    tmp = tmp_path_factory.mktemp("timm_head")
    torch.manual_seed(1)
    vit = timm.create_model("vit_tiny_patch16_224", img_size=32, num_classes=10, **VIT_KWARGS)
    safetensors.torch.save_file(vit.state_dict(), tmp / "vit.safetensors")
    args = [*DATA, "model=timm", "model.name=vit_tiny_patch16_224",
            f"model.pretrained={tmp / 'vit.safetensors'}",
            *(f"model.kwargs.{k}={v}" for k, v in VIT_KWARGS.items())]  # fmt: skip
    summary = train(make_cfg(*args), RunContext(tmp / "run"))
    return tmp / "run", args, summary


def adapters_of(state: dict) -> int:
    return sum(v.numel() for k, v in state.items() if ".lora_" in k)


def test_a_timm_classifier_made_anew_trains_whole_beside_the_adapters(timm_run):
    run_dir, _, summary = timm_run
    ran = summary["ran"]
    head = 64 * 3 + 3  # the new head: 3 classes of width 64
    assert ran["lora"]["trained_whole"] == ["head"]
    assert ran["lora"]["trained_whole_parameters"] == head
    first, last = (load(path)["model"] for path in checkpoint_files(run_dir))
    assert ran["lora"]["parameters"] == adapters_of(last)
    assert ran["trainable_parameters"] == ran["lora"]["parameters"] + head
    assert first["head.weight"].shape == (3, 64) and first["head.weight"].dtype == torch.float32
    assert not torch.equal(first["head.weight"], last["head.weight"]), "the head trains"


def test_a_resumed_run_continues_from_the_heads_trained_weights(timm_run):
    run_dir, args, _ = timm_run
    first, last = checkpoint_files(run_dir)
    whole = load(last)["model"]
    train(make_cfg(*args, f"trainer.resume={first}"), RunContext(run_dir))
    again = load(checkpoint_files(run_dir)[-1])["model"]
    assert whole.keys() == again.keys()
    assert all(torch.equal(whole[k], again[k]) for k in whole), "the resume repeats the run"


def test_the_plan_counts_the_new_head_as_trained(timm_run):
    """The plan builds on the meta device, the file unread: the head it makes anew is known from
    the file's shapes, and trains there as in the run."""
    _, args, summary = timm_run
    row = rehearse(make_cfg(*args), "cuda", micro_batches=1)
    assert row.trainable_parameters == summary["ran"]["trainable_parameters"]


def test_a_transformers_head_made_anew_trains_and_exports_as_modules_to_save(tmp_path):
    """A ViT folder of 10 labels on 3 classes: its classifier trains whole; the export apart
    holds it as peft's modules_to_save, which PeftModel loads over the base."""
    import peft

    vit = transformers.AutoConfig.for_model(
        "vit", hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        image_size=32, patch_size=8, num_channels=3, num_labels=10,
    )  # fmt: skip
    transformers.AutoModelForImageClassification.from_config(vit).save_pretrained(tmp_path / "vit")
    args = [*DATA, "model=hf", f"model.pretrained={tmp_path / 'vit'}"]
    summary = train(make_cfg(*args), RunContext(tmp_path / "run"))
    ran = summary["ran"]
    assert ran["lora"]["trained_whole"] == ["classifier"]
    assert ran["trainable_parameters"] == ran["lora"]["parameters"] + 32 * 3 + 3

    state = load(checkpoint_files(tmp_path / "run")[-1])
    trained, _ = rebuilt(state, **model_kwargs(ran["task"]))
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        expected = trained.eval()(images)
    export(tmp_path / "run", tmp_path / "apart")
    base = transformers.AutoModelForImageClassification.from_pretrained(tmp_path / "apart")
    config = json.loads((tmp_path / "apart" / "adapter" / "adapter_config.json").read_text())
    assert config["modules_to_save"] == ["classifier"]
    with torch.no_grad():
        loaded = peft.PeftModel.from_pretrained(base, str(tmp_path / "apart" / "adapter")).eval()
        got = loaded(pixel_values=images).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
