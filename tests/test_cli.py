"""Bad input fails before training with one readable message, a non-zero exit, no traceback."""

from __future__ import annotations

import re

import pytest
import torch

from mpexp.errors import ConfigError
from mpexp.tracking import RunContext
from mpexp.train import train
from mpexp.validate import validate
from tests.conftest import TINY, make_cfg, run_cli


def fails_cleanly(tmp_path, *overrides: str) -> str:
    result = run_cli("mpexp.train", "experiment=quickstart", *overrides, cwd=tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "Traceback" not in output
    assert "Epoch:" not in output  # nothing trained
    return output


def test_unknown_option_lists_the_valid_ones(tmp_path):
    output = fails_cleanly(tmp_path, "precision=fp8")
    assert "fp8" in output
    for option in ("bf16", "fp16", "fp32", "tf32"):
        assert option in output


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["optimizer.lr=-0.1"], "optimizer.lr"),
        (["dataset.batch_size=0"], "dataset.batch_size"),
        (["loss_scaling=static", "loss_scaling.scale=0"], "loss_scaling.scale"),
        (["loss_scaling=dynamic", "loss_scaling.growth_factor=1.0"], "loss_scaling.growth_factor"),
        (
            ["loss_scaling=dynamic", "loss_scaling.backoff_factor=1.5"],
            "loss_scaling.backoff_factor",
        ),
        (["loss_scaling=hysteresis", "loss_scaling.hysteresis=0"], "loss_scaling.hysteresis"),
    ],
)
def test_bad_values_fail_before_training(tmp_path, overrides, named):
    assert named in fails_cleanly(tmp_path, *overrides)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_without_a_gpu_says_so(tmp_path):
    output = fails_cleanly(tmp_path, "trainer.device=cuda")
    assert "trainer.device=cuda" in output and "trainer.device=cpu" in output


def test_missing_dataset_says_where_to_put_it(tmp_path):
    output = fails_cleanly(
        tmp_path, "dataset=mnist", f"dataset.root={tmp_path / 'd'}", "dataset.download=false"
    )
    assert "MNIST/raw" in output and "dataset=synthetic" in output


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["loss_scaling=hysteresis", "loss_scaling.hysteresis=0"], "loss_scaling.hysteresis"),
        (["loss_scaling=dynamic", "loss_scaling.min_scale=1e9"], "loss_scaling.min_scale"),
        (["loss_scaling=hysteresis", "loss_scaling.growth_factor=1"], "growth_factor"),
        (["loss_scaling=dynamic", "loss_scaling.on_min_scale=ignore"], "on_min_scale"),
        (["loss_scaling=calibrated", "loss_scaling.margin=0.5"], "loss_scaling.margin"),
        (["loss_scaling=calibrated", "loss_scaling.calibration_steps=0"], "calibration_steps"),
        (["trainer.accumulate=0"], "trainer.accumulate"),
        (["trainer.accumulate=512"], "trainer.accumulate"),
        (["trainer.clip_grad_norm=-1"], "trainer.clip_grad_norm"),
        (["trainer.on_nonfinite_loss=ignore"], "trainer.on_nonfinite_loss"),
        (["diagnostics.grad_stats_every=-1"], "diagnostics.grad_stats_every"),
        (["precision.fp32_modules=[1]"], "precision.fp32_modules"),
        (["scheduler=cosine", "scheduler.min_lr_ratio=2"], "scheduler.min_lr_ratio"),
        (["scheduler=step", "scheduler.gamma=0"], "scheduler.gamma"),
    ],
)
def test_bad_lab_values_are_named(overrides, named):
    with pytest.raises(ConfigError, match=re.escape(named)):
        validate(make_cfg(*overrides))


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["loss_scaling=calibrated", "loss_scaling.calibration_steps=500"], "calibration_steps"),
        (["scheduler=cosine", "scheduler.warmup_steps=500"], "scheduler.warmup_steps"),
        (["precision=fp16", "precision.fp32_modules=[head]"], "precision.fp32_modules"),
    ],
)
def test_values_that_do_not_fit_the_run_fail_before_training(tmp_path, overrides, named):
    with pytest.raises(ConfigError, match=re.escape(named)):
        train(make_cfg(*TINY, *overrides), RunContext(tmp_path))
    assert not (tmp_path / "metrics.jsonl").exists()  # nothing trained
