"""Bad input fails before training with one readable message, a non-zero exit, no traceback."""

from __future__ import annotations

import re

import pytest
import torch

from mpexp.errors import ConfigError
from mpexp.run.runner import train
from mpexp.tracking.run_context import RunContext
from mpexp.validate import validate
from tests.conftest import TINY, make_cfg, one_line_failure, run_cli


@pytest.fixture
def refused(tmp_path, in_process):
    """`mpexp-train experiment=quickstart <overrides>` run in this process, from tmp_path, for a
    mistake that the command refuses before training: its output, once it was checked that the
    command exited non-zero, with no traceback and nothing trained. The command's own process
    is test_a_typo_in_a_sweep_fails_before_any_job's."""

    def run(*overrides: str) -> str:
        return one_line_failure(in_process("experiment=quickstart", *overrides, cwd=tmp_path))

    return run


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("+trainer.epoch=3", "trainer.epoch (did you mean trainer.epochs?)"),  # Hydra's own hint
        ("+trainer.foo=1", "Unknown config key: trainer.foo"),
        ("+foo=1", "Unknown config key: foo"),
        ("+model.depth=3", "Unknown config key: model.depth"),
        ("trainer.epochs=abc", "could not be converted to Integer"),
        ("optimizer.lr=fast", "could not be converted to Float"),
        ("trainer.device=gpu", "Invalid value 'gpu', expected one of [auto, cuda, cpu]"),
        ("trainer.progress=maybe", "'maybe' is not a valid bool"),
        ("trainer.strategy=zero3", "expected one of [single, ddp, fsdp]"),
        ("wandb.mode=sometimes", "expected one of [auto, online, offline, disabled]"),
        ("loss_scaling.on_min_scale=ignore", "expected one of [raise, continue]"),
        ("trainer.on_nonfinite_loss=ignore", "expected one of [raise, skip]"),
        ("dataset.loader=magic", "expected one of [device, dataloader]"),
        ("trainer.epochs=0", "trainer.epochs=0 must be an integer >= 1"),  # a range, not a type
    ],
)
def test_schema_refuses_bad_keys_and_values_before_any_run_dir_exists(
    refused, tmp_path, override, message
):
    output = refused(override)
    assert message in output
    assert not (tmp_path / "outputs").exists()  # no junk run folder per typo


def test_a_typo_in_a_sweep_fails_before_any_job(tmp_path):
    result = run_cli(
        "mpexp.train", "-m", "experiment=quickstart", "precision=fp32,bf16", "+trainer.epoch=3",
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode != 0
    assert "trainer.epoch (did you mean trainer.epochs?)" in result.stdout + result.stderr
    assert not list((tmp_path / "outputs" / "multirun").glob("*/*/*"))  # no job folder


def test_unknown_option_lists_the_valid_ones(refused):
    output = refused("precision=fp4")
    assert "fp4" in output
    for option in ("bf16", "fp16", "fp32", "fp8", "tf32"):
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
def test_bad_values_fail_before_training(refused, tmp_path, overrides, named):
    assert named in refused(*overrides)
    assert not (tmp_path / "outputs").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_without_a_gpu_says_so(refused):
    output = refused("trainer.device=cuda")
    assert "trainer.device=cuda" in output and "trainer.device=cpu" in output


def test_missing_dataset_says_where_to_put_it(refused, tmp_path):
    output = refused("dataset=mnist", f"dataset.root={tmp_path / 'd'}", "dataset.download=false")
    assert "MNIST/raw" in output and "dataset=synthetic" in output


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["loss_scaling=hysteresis", "loss_scaling.hysteresis=0"], "loss_scaling.hysteresis"),
        (["loss_scaling=dynamic", "loss_scaling.min_scale=1e9"], "loss_scaling.min_scale"),
        (["loss_scaling=hysteresis", "loss_scaling.growth_factor=1"], "growth_factor"),
        (["loss_scaling=calibrated", "loss_scaling.margin=0.5"], "loss_scaling.margin"),
        (["loss_scaling=calibrated", "loss_scaling.calibration_steps=0"], "calibration_steps"),
        (
            ["trainer.seed=4294967296"],
            "trainer.seed=4294967296 must be an integer in [0, 4294967295]",
        ),
        (["trainer.accumulate=0"], "trainer.accumulate"),
        (["trainer.accumulate=512"], "trainer.accumulate"),
        (["trainer.clip_grad_norm=-1"], "trainer.clip_grad_norm"),
        (["trainer.peak_tflops=0"], "trainer.peak_tflops"),
        (["diagnostics.grad_stats_every=-1"], "diagnostics.grad_stats_every"),
        (["scheduler=cosine", "scheduler.min_lr_ratio=2"], "scheduler.min_lr_ratio"),
        (["scheduler=step", "scheduler.gamma=0"], "scheduler.gamma"),
    ],
)
def test_bad_lab_values_are_named(overrides, named):
    with pytest.raises(ConfigError, match=re.escape(named)):
        validate(make_cfg(*overrides))


@pytest.mark.parametrize(("batch", "accumulate"), [(6, 4), (256, 100), (64, 65)])
def test_accumulate_must_split_the_batch_into_equal_micro_batches(batch, accumulate):
    # chunk() would make 3 micro-batches of 6 where 4 were asked for, and 86 of 256 for 100
    cfg = make_cfg(f"dataset.batch_size={batch}", f"trainer.accumulate={accumulate}")
    with pytest.raises(ConfigError) as refused:
        validate(cfg)
    message = str(refused.value)
    assert f"trainer.accumulate={accumulate} does not divide dataset.batch_size={batch}" in message
    assert "\n" not in message
    valid = {6: "1, 2, 3, 6.", 256: "1, 2, 4, 8, 16, 32, 64, 128, 256.", 64: "32, 64."}[batch]
    assert message.endswith(valid)
    validate(make_cfg(f"dataset.batch_size={batch}", "trainer.accumulate=2"))  # a divisor runs


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
