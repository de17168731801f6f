"""Every option of every config group composes and builds; every preset composes with every model
and dataset; the schema behind the YAML types what it declares."""

from __future__ import annotations

import functools

import pytest
import torch
from hydra.utils import get_object, instantiate
from omegaconf import OmegaConf

from mpexp.build import build
from mpexp.config import (
    AdamConfig,
    Device,
    SimpleCNNConfig,
    TorchvisionDatasetConfig,
    TrainerConfig,
)
from mpexp.data.base import TrainingData
from mpexp.data.windows import TokenWindows
from mpexp.precision.modes import setup_precision
from mpexp.precision.scaling import build_scaler
from mpexp.step.performance import optimizer_spec
from mpexp.tasks.classification import Classification
from mpexp.tasks.language_model import LanguageModelling
from mpexp.validate import unknown_keys
from tests.conftest import CONF, CPU, make_cfg, run_cli

GROUPS = ["dataset", "model", "precision", "loss_scaling", "optimizer", "scheduler", "experiment"]


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


# the options for language models; every other model and dataset is for image classification
TEXT_DATASETS = ("text", "tiny_shakespeare", "tokens")
TEXT_MODELS = ("gpt", "gpt2_small", "hf_llama_1b", "hf_llama_tiny")
# model=hf builds what model.config names (its presets name one): no model until then
NAMES_ITS_MODEL = ("hf",)
IMAGE_MODELS = [m for m in options("model") if m not in TEXT_MODELS + NAMES_ITS_MODEL]
# models too large to initialise on a CPU in a test: their shapes are checked on the meta device
LARGE_MODELS = ("gpt2_small", "hf_llama_1b")
# what an option needs beside itself to build: model=timm, the name of one of timm's models
NEEDS = {"timm": ("model.name=resnet10t",)}


def test_groups_hold_the_documented_options():
    assert options("dataset") == [
        "cifar10",
        "fashion_mnist",
        "image_folder",
        "mnist",
        "synthetic",
        "synthetic_cifar10",
        "text",
        "tiny_shakespeare",
        "tokens",
    ]
    assert options("model") == [
        "deepcnn",
        "gpt",
        "gpt2_small",
        "hf",
        "hf_llama_1b",
        "hf_llama_tiny",
        "resnet18",
        "resnet18_cifar",
        "resnet50",
        "simplecnn",
        "simplecnn_small",
        "timm",
        "vit",
        "vit_base",
    ]
    assert options("precision") == [
        "bf16",
        "bf16_pure",
        "bf16_pure_kahan",
        "bf16_pure_stochastic",
        "fp16",
        "fp32",
        "fp8",
        "tf32",
    ]
    assert options("loss_scaling") == [
        "auto",
        "calibrated",
        "dynamic",
        "hysteresis",
        "none",
        "static",
    ]
    assert options("optimizer") == ["adam", "adamw", "sgd"]
    assert options("scheduler") == ["cosine", "none", "step"]
    assert options("experiment") == [
        "bf16_pure",
        "cifar10_resnet",
        "finetune_lora",
        "fp8_vit",
        "gpt2_small",
        "gpt_precisions",
        "hparams_search",
        "imagenet_resnet50",
        "lr_sensitivity",
        "precision_grid",
        "quickstart",
        "timm_precisions",
        "world4ai",
    ]


def test_help_lists_the_groups_a_user_chooses_from_and_no_schema(tmp_path):
    result = run_cli("mpexp.train", "--help", cwd=tmp_path)
    section = result.stdout.split("== Configuration groups ==", 1)[1].split("\n== ")[0]
    listed = [line.split(":")[0] for line in section.splitlines()[2:] if ":" in line]
    assert listed == sorted(GROUPS)  # not the schemas behind them (schema/dataset, ...)
    assert (
        "precision: bf16, bf16_pure, bf16_pure_kahan, bf16_pure_stochastic, fp16, fp32, fp8, tf32"
        in section
    )


def test_datasets_live_in_one_folder_per_user_not_where_the_run_starts(monkeypatch):
    monkeypatch.delenv("MPEXP_DATA_DIR", raising=False)
    for option in ("mnist", "fashion_mnist", "cifar10"):
        assert make_cfg(f"dataset={option}").dataset.root == "~/.cache/mpexp/data"
    monkeypatch.setenv("MPEXP_DATA_DIR", "/srv/datasets")
    assert make_cfg("dataset=mnist").dataset.root == "/srv/datasets"
    assert make_cfg("dataset=mnist", "dataset.root=here").dataset.root == "here"  # still wins
    assert OmegaConf.structured(TorchvisionDatasetConfig).root == "/srv/datasets"  # your own


def test_defaults_are_the_world4ai_experiment():
    cfg = make_cfg()
    assert cfg.dataset._target_.endswith("MNISTData") and cfg.model._target_.endswith("DeepCNN")
    assert (cfg.precision.autocast, cfg.precision.tf32) == (None, False)  # strict fp32
    assert cfg.optimizer._target_ == "torch.optim.Adam"
    assert cfg.optimizer.lr == 1e-4
    assert cfg.dataset.batch_size == 256 and cfg.dataset.drop_last
    assert cfg.trainer.epochs == 10
    assert cfg.loss_scaling.only_under_fp16


@pytest.mark.parametrize("group", GROUPS[:-1])
def test_no_group_option_carries_a_descriptive_name_key(group):
    """The chosen option is Hydra's record (hydra.runtime.choices), not a key that can disagree."""
    for option in options(group):
        if (group, option) == ("model", "timm"):
            continue  # model.name is what it builds: timm's name of the architecture
        assert "name" not in make_cfg(f"{group}={option}")[group], option


@pytest.mark.parametrize(
    ("node", "schema"),
    [
        ("trainer", TrainerConfig),
        ("dataset", TorchvisionDatasetConfig),
        ("optimizer", AdamConfig),
    ],
)
def test_each_node_is_backed_by_its_schema(node, schema):
    assert OmegaConf.get_type(make_cfg()[node]) is schema
    assert OmegaConf.get_type(make_cfg("model=simplecnn").model) is SimpleCNNConfig


def test_closed_choices_compose_to_their_values():
    cfg = make_cfg("trainer.device=cpu")
    assert cfg.trainer.device is Device.cpu
    assert cfg.trainer.device == "cpu" and f"{cfg.trainer.device}" == "cpu"


def test_keys_added_past_the_schema_are_found_with_the_closest_declared_one():
    cfg = make_cfg("+trainer.epoch=3", "+model.depth=2", "+wandb.projct=x")
    assert unknown_keys(cfg) == [
        "model.depth",
        "trainer.epoch (did you mean trainer.epochs?)",
        "wandb.projct (did you mean wandb.project?)",
    ]
    assert unknown_keys(make_cfg()) == []


@pytest.mark.parametrize("option", options("dataset"))
def test_dataset_options_build(option):
    data = build(make_cfg(f"dataset={option}").dataset)
    if option in TEXT_DATASETS:
        assert isinstance(data, TokenWindows) and data.task_type is LanguageModelling
        assert data.block_size is None  # model=deepcnn has no context length to take
        assert build(make_cfg(f"dataset={option}", "model=gpt").dataset).block_size == 64
    else:
        assert isinstance(data, TrainingData) and data.task_type is Classification
        assert data.batch_size == 256


@pytest.mark.parametrize("option", TEXT_MODELS)
def test_language_models_build_for_byte_tokens(option):
    cfg = make_cfg(f"model={option}", "dataset=text")
    assert cfg.dataset.block_size == cfg.model.block_size  # the data's windows fit the model
    task = LanguageModelling(vocab_size=256, block_size=cfg.model.block_size)
    device = "meta" if option in LARGE_MODELS else "cpu"
    with torch.device(device):
        model = build(cfg.model, **task.model_kwargs())
        tokens, _ = task.example(2, device)
        assert task.check_output(tuple(model(tokens[:1]).shape)) is None


@pytest.mark.parametrize("option", IMAGE_MODELS)
@pytest.mark.parametrize("shape", [(1, 28, 28), (3, 32, 32)])
def test_model_options_build_and_adapt_to_the_data(option, shape):
    c, h, w = shape
    model = build(
        make_cfg(f"model={option}", *NEEDS.get(option, ())).model,
        in_channels=c,
        num_classes=7,
        image_size=(h, w),
    )
    assert model(torch.randn(2, c, h, w)).shape == (2, 7)


@pytest.mark.parametrize("option", options("optimizer"))
def test_optimizer_options_build(option):
    cfg = make_cfg(f"optimizer={option}", "optimizer.lr=0.5")
    opt = instantiate(optimizer_spec(cfg.optimizer))([torch.nn.Parameter(torch.zeros(2))])
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.param_groups[0]["lr"] == 0.5


@pytest.mark.parametrize("precision", options("precision"))
@pytest.mark.parametrize("scaling", options("loss_scaling"))
def test_every_precision_and_scaling_pair_builds(precision, scaling):
    cfg = make_cfg(f"precision={precision}", f"loss_scaling={scaling}")
    mode = setup_precision(cfg.precision, CPU)
    # bf16_pure_kahan and _stochastic are bf16_pure with an update rounding
    assert mode.mode == precision.removesuffix("_kahan").removesuffix("_stochastic")
    scaler = build_scaler(cfg.loss_scaling, mode, CPU)
    expected = {"auto": "dynamic" if precision == "fp16" else "none"}.get(scaling, scaling)
    assert scaler.describe()["loss_scaling"] == expected
    assert scaler.scales_loss == (expected != "none")


# every model (with a dataset of its task: a model for another task is refused by a run) and
# every dataset (with a model of its task): a preset composes with each of them, each model and
# each dataset in one pair. Presets set no key that only some models or datasets have, so pairs
# beyond these add nothing but time
def pairs(models: list[str], datasets: list[str]) -> list[tuple[str, str]]:
    """Each of `models` beside one of `datasets` and each of `datasets` beside one of `models`."""
    n = max(len(models), len(datasets))
    return [(models[i % len(models)], datasets[i % len(datasets)]) for i in range(n)]


IMAGE_DATASETS = [d for d in options("dataset") if d not in TEXT_DATASETS]
PAIRS = pairs(IMAGE_MODELS, IMAGE_DATASETS) + pairs(list(TEXT_MODELS), list(TEXT_DATASETS))
# presets that set keys only image sets have (dataset.augment) compose with those alone
IMAGE_PRESETS = ("cifar10_resnet",)
# and presets that set an image folder's own keys (dataset.resize_size) with it alone
FOLDER_PRESETS = ("imagenet_resnet50",)
# and presets that set timm's own keys (model.name, model.kwargs) on an image folder alone
TIMM_PRESETS = ("timm_precisions",)
PRESET_CASES = [
    (experiment, model, dataset)
    for experiment in options("experiment")
    for model, dataset in PAIRS
    if (experiment not in IMAGE_PRESETS or dataset not in TEXT_DATASETS)
    and (experiment not in FOLDER_PRESETS or dataset == "image_folder")
    and experiment not in TIMM_PRESETS
] + [(experiment, "timm", "image_folder") for experiment in TIMM_PRESETS]


@pytest.mark.parametrize(("experiment", "model", "dataset"), PRESET_CASES)
def test_every_preset_composes_and_builds_with_every_model_and_dataset(experiment, model, dataset):
    needs = () if experiment in TIMM_PRESETS else NEEDS.get(model, ())
    cfg = make_cfg(f"experiment={experiment}", f"model={model}", f"dataset={dataset}", *needs)
    assert unknown_keys(cfg) == []
    text = dataset in TEXT_DATASETS
    block_size = cfg.dataset.block_size if text else None
    model = OmegaConf.to_yaml(cfg.model, resolve=True)
    assert output_shape_problem(model, text, block_size) is None


@functools.cache
def output_shape_problem(model: str, text: bool, block_size: int | None) -> str | None:
    """What is wrong with the output of the model that `model` (its config's YAML) builds for a
    task's example; the same model for the same task, as most presets leave the model, is tried
    once."""
    if text:
        task = LanguageModelling(vocab_size=256, block_size=block_size)
    else:
        task = Classification(channels=3, height=32, width=32, num_classes=10)
    # the shapes are what is checked here (each model computes on the CPU in
    # test_model_options_build_and_adapt_to_the_data), and the meta device propagates them
    # without computing: ResNet-18's, ViT-Base's and GPT-2 small's millions of parameters take
    # seconds to initialise on a CPU
    with torch.device("meta"):
        net = build(OmegaConf.create(model), **task.model_kwargs()).eval()  # as build_model does
        inputs, _ = task.example(1, "meta")
        return task.check_output(tuple(net(inputs).shape))


def test_quickstart_experiment_is_offline_and_small():
    cfg = make_cfg("experiment=quickstart")
    assert cfg.dataset._target_.endswith("SyntheticData")
    assert cfg.model.width == 16
    assert cfg.wandb.mode == "offline"


def test_world4ai_is_the_tutorials_experiment_as_a_seeded_sweep():
    cfg = make_cfg("experiment=world4ai", "model=simplecnn")  # a preset never pins the model
    assert cfg.model._target_.endswith("SimpleCNN")
    cfg = make_cfg("experiment=world4ai")
    assert cfg.model._target_.endswith("DeepCNN") and cfg.dataset._target_.endswith("MNISTData")
    assert (cfg.optimizer.lr, cfg.dataset.batch_size, cfg.trainer.epochs) == (1e-4, 256, 10)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("mpexp.scaling.DynamicLossScaler", "mpexp.precision.scaling.DynamicLossScaler"),
        ("mpexp.scaling.LossScaler", "mpexp.precision.scaling.LossScaler"),
        ("mpexp.schedules.cosine", "mpexp.step.schedules.cosine"),
        ("mpexp.hydra_hooks.RunChecks", "mpexp.run.hydra_hooks.RunChecks"),
        ("mpexp.tracking.Histogram", "mpexp.tracking.histogram.Histogram"),
    ],
)
def test_paths_from_before_the_packages_still_name_the_same_objects(old, new):
    """Configs written before mpexp's modules moved into packages (users' own, earlier runs'
    saved ones) still build what they named."""
    assert get_object(old) is get_object(new)
