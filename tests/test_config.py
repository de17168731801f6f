"""Every option of every config group composes and builds."""

from __future__ import annotations

import pytest
import torch
from hydra.utils import instantiate

from mpexp.data.base import InMemoryData
from mpexp.precision import setup_precision
from mpexp.scaling import build_scaler
from mpexp.train import build
from tests.conftest import CONF, make_cfg

GROUPS = ["dataset", "model", "precision", "loss_scaling", "optimizer", "scheduler"]


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def test_groups_hold_the_documented_options():
    assert options("dataset") == ["cifar10", "fashion_mnist", "mnist", "synthetic"]
    assert options("model") == ["deepcnn", "resnet18", "simplecnn"]
    assert options("precision") == ["bf16", "fp16", "fp32", "tf32"]
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


def test_defaults_are_the_world4ai_experiment():
    cfg = make_cfg()
    assert (cfg.dataset.name, cfg.model.name, cfg.precision.name) == ("mnist", "deepcnn", "fp32")
    assert cfg.optimizer._target_ == "torch.optim.Adam"
    assert cfg.optimizer.lr == 1e-4
    assert cfg.dataset.batch_size == 256 and cfg.dataset.drop_last
    assert cfg.trainer.epochs == 10
    assert cfg.loss_scaling.name == "auto"


@pytest.mark.parametrize("option", options("dataset"))
def test_dataset_options_build(option):
    data = build(make_cfg(f"dataset={option}").dataset)
    assert isinstance(data, InMemoryData)
    assert data.batch_size == 256


@pytest.mark.parametrize("option", options("model"))
@pytest.mark.parametrize("shape", [(1, 28, 28), (3, 32, 32)])
def test_model_options_build_and_adapt_to_the_data(option, shape):
    c, h, w = shape
    model = build(
        make_cfg(f"model={option}").model, in_channels=c, num_classes=7, image_size=(h, w)
    )
    assert model(torch.randn(2, c, h, w)).shape == (2, 7)


@pytest.mark.parametrize("option", options("optimizer"))
def test_optimizer_options_build(option):
    cfg = make_cfg(f"optimizer={option}", "optimizer.lr=0.5")
    opt = instantiate(cfg.optimizer)([torch.nn.Parameter(torch.zeros(2))])
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.param_groups[0]["lr"] == 0.5


@pytest.mark.parametrize("precision", options("precision"))
@pytest.mark.parametrize("scaling", options("loss_scaling"))
def test_every_precision_and_scaling_pair_builds(precision, scaling):
    cfg = make_cfg(f"precision={precision}", f"loss_scaling={scaling}")
    device = torch.device("cpu")
    scaler = build_scaler(cfg.loss_scaling, setup_precision(cfg.precision.name, device), device)
    expected = {"auto": "dynamic" if precision == "fp16" else "none"}.get(scaling, scaling)
    assert scaler.describe()["loss_scaling"] == expected
    assert scaler.is_enabled() == (expected != "none")


def test_quickstart_experiment_is_offline_and_small():
    cfg = make_cfg("experiment=quickstart")
    assert cfg.dataset.name == "synthetic" and cfg.model.name == "simplecnn"
    assert cfg.wandb.mode == "offline"
