"""Bad input fails before training with one readable message, a non-zero exit, no traceback."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import run_cli


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
