"""model=timm: timm's models built for the data under their own module names, trained in every
precision mode through the same step as mpexp's own models, loaded from weights files as timm
loads them, planned, resumed, sharded by their blocks; and what a user gets wrong, refused with
one message. All offline: weights are written here, with torch.save and safetensors."""

from __future__ import annotations

import socket
import sys

import pytest
import safetensors.torch
import timm
import torch
from torch import nn

from mpexp.build import build_model, build_parts, build_training
from mpexp.config import config_dir
from mpexp.distributed import World, start_world
from mpexp.errors import ConfigError
from mpexp.models.timm_models import timm_model
from mpexp.plan.rehearsal import rehearse
from mpexp.precision.fp8 import convert_to_fp8
from mpexp.step import performance
from mpexp.step.capture_check import graph_blocker
from mpexp.step.diagnostics import Diagnostics
from mpexp.step.history import StepHistory
from mpexp.step.parts import Parts
from mpexp.step.stepper import Stepper
from mpexp.tasks.classification import Classification
from tests.conftest import CPU, make_cfg, one_line_failure, precision_of
from tests.test_resume import assert_same_final_state, comparable, crashed_and_resumed
from tests.test_training import read_metrics

# 3x32x32 images, 16 a batch, two steps
DATA = [
    "dataset=synthetic", "dataset.channels=3", "dataset.height=32", "dataset.width=32",
    "dataset.train_size=64", "dataset.val_size=16", "dataset.batch_size=16", "dataset.noise=0.3",
    "trainer.epochs=null", "trainer.max_steps=2", "trainer.log_every=1", "trainer.progress=false",
    "wandb.mode=disabled", "optimizer.lr=1e-3",
]  # fmt: skip
# ViT-Tiny's architecture at 2 blocks of width 64: 4 patches of 16 pixels on 32-pixel images
VIT_KWARGS = {"depth": 2, "embed_dim": 64, "num_heads": 2}
VIT = ["model=timm", "model.name=vit_tiny_patch16_224",
       *(f"model.kwargs.{k}={v}" for k, v in VIT_KWARGS.items())]  # fmt: skip
# a ConvNeXt at a quarter of ConvNeXt-Atto's width, one block a stage, its MLPs Linear layers
CNN_KWARGS = {"dims": [16, 32, 64, 128], "depths": [1, 1, 1, 1], "conv_mlp": False}
CNN = ["model=timm", "model.name=convnext_atto",
       *(f"model.kwargs.{k}={str(v).replace(' ', '')}" for k, v in CNN_KWARGS.items())]  # fmt: skip
VIT_BLOCKS = ["blocks.0", "blocks.1"]
CNN_BLOCKS = [f"stages.{s}.blocks.0" for s in range(4)]


def with_mode(model: list[str], mode: list[str]):
    """The config of `model` (overrides) in `mode` (overrides of the precision and loss_scaling
    groups): the two composed apart, each once for all the tests (Hydra takes most of a second to
    compose a config), and put together."""
    cfg = make_cfg(*DATA, *model)
    modes = make_cfg(*mode)
    cfg.precision, cfg.loss_scaling = modes.precision, modes.loss_scaling
    return cfg


def two_steps(cfg, world: World | None = None):
    """Two optimizer steps of the run `cfg` configures, built as a run builds its parts and
    stepped by its Stepper; the parts, the weights before, the steps' rows and the forward pass
    the loop called."""
    torch.manual_seed(0)
    built = build_parts(cfg, world or World(CPU), {"model": "timm", "dataset": "synthetic"})
    optimizer, schedule, forward = build_training(cfg, built, CPU)
    before = {n: p.detach().float().clone() for n, p in built.model.named_parameters()}
    parts = Parts(built.model, forward, built.data, optimizer, built.scaler, built.precision,
                  built.throughput, built.speed, schedule)  # fmt: skip
    history = StepHistory(capacity=2, device=CPU)
    diagnostics = Diagnostics(cfg.diagnostics, built.model, built.scaler, None, built.precision)
    stepper = Stepper.for_parts(parts, history, diagnostics, 1, None)
    for step, (images, labels) in enumerate(built.data.train_batches(1, 0, CPU), start=1):
        stepper.step(step, images, labels)
        if step == 2:
            break
    return built, before, history.flush(wait=True), forward


MODES = {
    "fp32": ["precision=fp32"],
    "tf32": ["precision=tf32"],
    "bf16": ["precision=bf16"],
    "fp16": ["precision=fp16"],  # loss_scaling=auto: dynamic
    "static": ["precision=fp16", "loss_scaling=static"],
    "hysteresis": ["precision=fp16", "loss_scaling=hysteresis"],
    "calibrated": ["precision=fp16", "loss_scaling=calibrated", "loss_scaling.calibration_steps=1"],
    "fp8": ["precision=fp8"],
    "pure": ["precision=bf16_pure"],
    "kahan": ["precision=bf16_pure_kahan"],
    "stochastic": ["precision=bf16_pure_stochastic"],
}
# the modes that change the model itself (autocast's dtype, fp8's layers, bf16 weights), on the
# CNN too; the loss scalers and pure bf16's roundings act on gradients and updates alike for any
# model, and take the ViT's time only
CNN_MODES = ("fp32", "bf16", "fp16", "fp8", "pure")
GRID = [
    *(pytest.param(VIT, VIT_BLOCKS, mode, id=f"vit-{name}") for name, mode in MODES.items()),
    *(pytest.param(CNN, CNN_BLOCKS, MODES[name], id=f"cnn-{name}") for name in CNN_MODES),
]


@pytest.mark.parametrize(("model", "blocks", "mode"), GRID)
def test_every_precision_mode_trains_a_timm_vit_and_cnn(model, blocks, mode):
    built, before, rows, _ = two_steps(with_mode(model, mode))
    assert [r.step for r in rows] == [1, 2]
    assert all(torch.isfinite(torch.tensor(r.loss)) and not r.skipped for r in rows)
    after = dict(built.model.named_parameters())
    moved = [n for n, p in after.items() if not torch.equal(p.detach().float(), before[n])]
    assert any(n.startswith(blocks[0]) for n in moved)  # the blocks learned, under their names
    if built.precision.pure is not None:
        assert {p.dtype for p in after.values()} == {torch.bfloat16}
    if built.precision.fp8 is not None:  # the blocks' Linear layers; the classifier as it was
        converted = built.precision.fp8.converted
        assert converted and all(any(n.startswith(b) for b in blocks) for n in converted)
        head = "head" if model is VIT else "head.fc"
        assert "model.fp8_head=true" in built.precision.fp8.unconverted[head]


@pytest.mark.parametrize(
    ("model", "blocks"),
    [(VIT, VIT_BLOCKS), pytest.param(CNN, CNN_BLOCKS, marks=pytest.mark.slow)],  # 4 s more
    ids=["vit", "cnn"],
)
def test_a_compiled_timm_model_trains(monkeypatch, model, blocks):
    """Compiled whole with its loss (mpexp/step/objective.py) by TorchDynamo; its graphs run
    as traced (inductor's code generation takes minutes on a loaded CPU: test_compile's)."""
    compile_ = torch.compile
    traced = []

    def eager_backend(module, mode, dynamic):
        def backend(graph, inputs):
            traced.append(graph)
            return graph.forward

        return compile_(module, backend=backend, dynamic=dynamic)

    monkeypatch.setattr(performance.torch, "compile", eager_backend)
    torch._dynamo.reset()
    cfg = with_mode([*model, "trainer.compile=true"], ["precision=bf16"])
    built, before, rows, _ = two_steps(cfg)
    assert built.speed.compile and traced  # the step went through the compiled forward
    assert len(rows) == 2 and not any(r.skipped for r in rows)
    moved = [n for n, p in built.model.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert any(n.startswith(blocks[0]) for n in moved)


# --- built for the data, under timm's own names ---------------------------------------------------


def test_the_model_is_timms_own_built_for_the_datas_channels_classes_and_size():
    model = timm_model(1, 7, (48, 48), "vit_tiny_patch16_224", kwargs=VIT_KWARGS)
    own = timm.create_model("vit_tiny_patch16_224", in_chans=1, num_classes=7, img_size=48,
                            **VIT_KWARGS)  # fmt: skip
    assert type(model) is type(own)
    assert {n: p.shape for n, p in model.named_parameters()} == {
        n: p.shape for n, p in own.named_parameters()
    }
    assert model.patch_embed.grid_size == (3, 3)
    assert [type(m).__name__ for m in model.fsdp_units()] == ["Block", "Block", "LayerNorm"]
    cnn = timm_model(3, 10, (32, 32), "resnet10t")  # a CNN: no image size in its constructor
    assert [n for n, _ in cnn.named_children()][:2] == ["conv1", "bn1"]
    assert [type(m).__name__ for m in cnn.fsdp_units()] == ["BasicBlock"] * 4  # layer1.0 ...


def test_fp8_converts_the_classifier_when_asked():
    """16 classes: a head fp8 can take (sizes multiples of 16), converted on request only."""
    for asked in (False, True):
        model = timm_model(3, 16, (32, 32), "vit_tiny_patch16_224", fp8_head=asked,
                           kwargs=VIT_KWARGS)  # fmt: skip
        _, precision = convert_to_fp8(model, precision_of("fp8"), [], compiled=False)
        assert ("head" in precision.fp8.converted) is asked
        assert len(precision.fp8.converted) == 8 + asked  # 4 Linear layers a block


# --- weights from a file, as timm loads them ------------------------------------------------------

SMALL_RESNET = {"channels": (16, 32, 64, 128), "stem_width": 8}


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """A ResNet's ImageNet-shaped weights (3 channels, 1000 classes), as safetensors and as
    torch.save writes them, and a fine-tuned one's (1 channel, 10 classes)."""
    folder = tmp_path_factory.mktemp("weights")
    torch.manual_seed(1)
    imagenet = timm.create_model("resnet10t", **SMALL_RESNET).state_dict()
    safetensors.torch.save_file(imagenet, folder / "imagenet.safetensors")
    torch.save(imagenet, folder / "imagenet.pth")
    tuned = timm.create_model("resnet10t", in_chans=1, num_classes=10, **SMALL_RESNET)
    torch.save({"state_dict": tuned.state_dict()}, folder / "tuned.pth")  # as a checkpoint
    return folder, imagenet, tuned.state_dict()


@pytest.mark.parametrize("file", ["imagenet.safetensors", "imagenet.pth"])
def test_pretrained_weights_load_as_timm_loads_them_the_classifier_reset(weights, file):
    folder, imagenet, _ = weights
    path = str(folder / file)
    torch.manual_seed(0)
    loaded = timm_model(1, 10, (32, 32), "resnet10t", pretrained=path, kwargs=SMALL_RESNET)
    torch.manual_seed(0)
    own = timm.create_model("resnet10t", pretrained=True, pretrained_cfg_overlay={"file": path},
                            in_chans=1, num_classes=10, **SMALL_RESNET).state_dict()  # fmt: skip
    mine = loaded.state_dict()
    assert mine.keys() == own.keys()
    assert all(torch.equal(mine[k], own[k]) for k in mine)
    # the file's weights, the first convolution's summed over its 3 channels (timm's adapt),
    # the classifier made anew for 10 classes
    assert torch.equal(mine["layer4.0.conv2.weight"], imagenet["layer4.0.conv2.weight"])
    assert torch.equal(mine["conv1.0.weight"], imagenet["conv1.0.weight"].sum(1, keepdim=True))
    assert mine["fc.weight"].shape == (10, 128)


def test_a_file_with_the_datas_classes_keeps_its_classifier(weights):
    """timm compares the classes with its ImageNet configuration's 1000; mpexp with the file's."""
    folder, _, tuned = weights
    loaded = timm_model(1, 10, (32, 32), "resnet10t", pretrained=str(folder / "tuned.pth"),
                        kwargs=SMALL_RESNET).state_dict()  # fmt: skip
    assert all(torch.equal(loaded[k], tuned[k]) for k in tuned)


@pytest.mark.parametrize(
    ("name", "file", "message"),
    [
        ("resnet10t", "none.pth", r"model\.pretrained=.*none\.pth: no such file"),
        # timm's own error, in one line
        ("resnet18", "imagenet.pth", r"does not fit timm's resnet18: Error\(s\) in loading "
         r"state_dict for ResNet: size mismatch for bn1\.weight: .*\(and \d+ more\)\.\n"),
        # classes differ, so timm loads without strict and only logs what the file lacks
        ("vit_tiny_patch16_224", "imagenet.pth", r"does not fit timm's vit_tiny_patch16_224: the "
         r"file has no cls_token, pos_embed, patch_embed\.proj\.weight \(\d+ tensors\); the model "
         r"has no conv1\.0\.weight"),
        ("resnet10t", "notes.pth", r"notes\.pth is not a weights file that torch\.load can read"),
    ],
    ids=["missing", "mismatched", "another-model", "not-weights"],
)  # fmt: skip
def test_a_weights_file_that_does_not_fit_is_refused_in_one_message(weights, name, file, message):
    folder = weights[0]
    (folder / "notes.pth").write_text("not weights")
    with pytest.raises(ConfigError, match=message):
        timm_model(3, 10, (32, 32), name, pretrained=str(folder / file), kwargs={
            "resnet10t": SMALL_RESNET, "resnet18": {}}.get(name, VIT_KWARGS))  # fmt: skip


def test_images_a_pretrained_vit_cannot_take_are_refused_before_the_file_is_read(tmp_path):
    path = tmp_path / "vit.pth"
    path.write_bytes(b"")  # never read: the size is checked first
    cfg = make_cfg(*VIT, f"model.pretrained={path}")
    task = Classification(channels=3, height=40, width=40, num_classes=10)
    with pytest.raises(ConfigError) as refused:
        build_model(cfg.model, task, "model=timm on dataset=synthetic", "dataset.height=40")
    assert str(refused.value) == (
        "model=timm on dataset=synthetic cannot take the dataset's 3x40x40 images: timm's "
        "vit_tiny_patch16_224, made for 224x224 pixels, cuts images into patches of 16x16 "
        "pixels (model.pretrained's weights too: timm resamples their position embeddings to "
        "the data's grid of patches, which must be whole); 40x40 pixels are not a whole number "
        "of them (32 or 48 pixels a side would be).\n"
        "Change the images' size (dataset.height=40 now), or use a model made for this data."
    )


# --- bad input ------------------------------------------------------------------------------------


def test_an_unknown_name_is_refused_with_timms_closest_and_nothing_written(in_process, tmp_path):
    result = in_process(*DATA, "model=timm", "model.name=convnext_tinny", cwd=tmp_path)
    output = one_line_failure(result)
    assert "model.name=convnext_tinny is not a timm model (closest: convnext_tiny," in output
    assert list(tmp_path.iterdir()) == []


def test_without_timm_the_install_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "timm", None)  # import timm raises ImportError
    with pytest.raises(ConfigError, match=r'needs timm.*\n.*pip install "timm>=1.0,<1.1"'):
        timm_model(3, 10, (32, 32), "resnet10t")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_classes": 5}, r"model\.kwargs\.num_classes is mpexp's to set"),
        ({"drop_path_rte": 0.1}, r"does not take these arguments \(ResNet.__init__\(\) got an "
         r"unexpected keyword argument 'drop_path_rte'\)"),
    ],
)  # fmt: skip
def test_model_kwargs_timm_does_not_take_are_refused(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        timm_model(3, 10, (32, 32), "resnet10t", kwargs=kwargs)


def test_a_dataset_of_another_task_is_refused_naming_what_it_gives():
    with pytest.raises(ConfigError, match=r"model=timm classifies images; .* with block_size, "):
        timm_model(vocab_size=256, block_size=64, name="resnet10t")


# --- the step captured, or why not ----------------------------------------------------------------


class ReadsOnTheHost(nn.Module):
    """A model that decides on the host: `if tensor` reads the tensor's value."""

    def __init__(self, in_channels=3, num_classes=10, image_size=(32, 32)):
        super().__init__()
        self.head = nn.Linear(in_channels * image_size[0] * image_size[1], num_classes)

    def forward(self, x):
        y = self.head(x.flatten(1))
        return y / 2 if y.abs().max() > 100 else y


class MasksByValue(ReadsOnTheHost):
    def forward(self, x):
        y = self.head(x.flatten(1))
        return y + y[y > 0].sum()  # a boolean mask: as many elements as are positive


CUDA = torch.device("cuda")
IMAGES = Classification(channels=3, height=32, width=32, num_classes=10)


def test_a_timm_models_step_is_captured_on_cuda():
    cfg = make_cfg(*DATA, *VIT)
    model = timm_model(3, 10, (32, 32), "vit_tiny_patch16_224", kwargs=VIT_KWARGS)
    speed = performance.for_model(performance.plan_speed(cfg, CUDA), cfg, model, IMAGES)
    assert speed.cuda_graph and speed.graph_off is None


@pytest.mark.parametrize(
    ("model", "why"),
    [
        (ReadsOnTheHost, "ReadsOnTheHost reads a tensor's value on the host "
         "(_local_scalar_dense in its forward pass), which a captured step cannot replay"),
        (MasksByValue, "MasksByValue indexes a tensor by a boolean mask, whose count of true "
         "values is read on the host (index in its forward pass), which a captured step "
         "cannot replay"),
    ],
    ids=["host-read", "mask"],
)  # fmt: skip
def test_a_model_that_reads_on_the_host_runs_uncaptured_and_the_run_says_why(model, why):
    model.capturable = True  # its word does not matter: what it does is found
    assert graph_blocker(model(), IMAGES) == why
    cfg = make_cfg(*DATA)
    speed = performance.for_model(performance.plan_speed(cfg, CUDA), cfg, model(), IMAGES)
    assert (speed.cuda_graph, speed.graph_off) == (False, why)
    assert performance.describe(torch.optim.SGD([nn.Parameter(torch.ones(1))]),
                                speed)["cuda_graph_off"] == why  # fmt: skip
    forced = make_cfg(*DATA, "trainer.cuda_graph=true")
    refused = r"trainer\.cuda_graph=true cannot be taken: " + model.__name__
    with pytest.raises(ConfigError, match=refused):
        performance.for_model(performance.plan_speed(forced, CUDA), forced, model(), IMAGES)


def test_the_module_that_reads_is_named_by_the_models_own_names():
    model = timm_model(3, 10, (32, 32), "vit_tiny_patch16_224", kwargs=VIT_KWARGS)
    attention = model.blocks[1].attn
    real = type(attention).forward

    def reads(self, x, *args, **kwargs):
        return real(self, x, *args, **kwargs) * float(x.detach().norm())  # a host read

    attention.forward = reads.__get__(attention)
    assert "(_local_scalar_dense in blocks.1.attn)" in graph_blocker(model, IMAGES)


# --- planned, resumed, sharded, measured ----------------------------------------------------------


def test_the_plan_rehearses_a_timm_model_with_timms_count_of_parameters():
    plan = rehearse(make_cfg(*DATA, *VIT, "precision=bf16"), "cuda")  # mpexp-plan's row
    own = timm.create_model("vit_tiny_patch16_224", img_size=32, num_classes=10, **VIT_KWARGS)
    parameters = sum(p.numel() for p in own.parameters())
    assert plan.parameters == parameters
    assert plan.bytes["weights"] == 4 * parameters  # fp32 weights under bf16 autocast
    assert plan.peak_bytes["train_step"] > 4 * plan.bytes["weights"]  # and Adam's two states
    assert plan.missing == {} and plan.host_reads == 0


def test_a_timm_run_resumes_exactly_with_its_layers_diagnosed_by_their_names(
    tmp_path, monkeypatch, caplog
):
    # checkpoints at steps 2 and 4 (the end): the run dies at the second, resumes from step 2
    args = [*DATA, *VIT, "precision=fp16", "trainer.max_steps=4", "trainer.deterministic=true",
            "trainer.checkpoint_every_steps=2", "diagnostics.grad_stats_every=2"]  # fmt: skip
    whole, resumed = crashed_and_resumed(args, tmp_path, monkeypatch, caplog)
    assert comparable(resumed) == comparable(whole)
    assert_same_final_state(whole, resumed, ("model", "optimizer", "scaler", "position"))
    steps, _ = read_metrics(whole)
    diagnosed = {k for r in steps for k in r if k.startswith("diag/")}
    assert {"diag/blocks.0.attn.qkv/underflow", "diag/head/underflow"} <= diagnosed


@pytest.fixture
def one_process_world(monkeypatch):
    """The environment torchrun gives a world of one process, on a free port."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}  # fmt: skip
    for key, value in env.items():
        monkeypatch.setenv(key, value)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_ddp_and_fsdp_train_a_timm_model_fsdp_sharding_its_blocks(one_process_world, strategy):
    cfg = with_mode([*VIT, f"trainer.strategy={strategy}"], ["precision=bf16"])
    with start_world(strategy, CPU) as world:
        built, before, rows, forward = two_steps(cfg, world)
    assert len(rows) == 2
    model = built.model
    if strategy == "ddp":  # DDP around the model with its loss, compiled where the run compiles
        assert isinstance(forward, nn.parallel.DistributedDataParallel)
        assert forward.module.model is model
        return
    units = [n for n, m in model.named_modules() if type(m).__name__.startswith("FSDP")]
    assert units == ["", "blocks.0", "blocks.1", "norm"]  # the root holds the embeddings, the head
    assert "blocks.0.attn.qkv.weight" in before  # timm's names under FSDP


def test_the_timm_precisions_preset_sweeps_a_convnext_and_a_vit_on_your_folder():
    from omegaconf import OmegaConf

    from mpexp.validate import validate

    with pytest.raises(ConfigError, match=r"dataset=image_folder needs dataset\.path"):
        validate(make_cfg("experiment=timm_precisions"))
    cfg = make_cfg("experiment=timm_precisions", "dataset.path=/data/flowers")
    assert cfg.model._target_ == "mpexp.models.timm_models.timm_model"
    assert cfg.dataset.image_size == 224 and cfg.model.kwargs == {"drop_path_rate": 0.1}
    preset = OmegaConf.load(config_dir() / "experiment" / "timm_precisions.yaml")
    params = preset["hydra"]["sweeper"]["params"]
    assert params["model.name"] == "convnext_tiny,vit_small_patch16_224"
    assert params["trainer.seed"] == "0,1,2"
