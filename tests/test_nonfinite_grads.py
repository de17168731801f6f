"""Without loss scaling, a step whose loss is finite but whose gradients are not is never applied:
under trainer.on_nonfinite_loss=raise the run stops saying so, under skip it is skipped and
counted under its own name (amp/nonfinite_grad_steps)."""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import open_dict
from torch import nn

from mpexp.errors import NumericsError
from mpexp.run.runner import train
from mpexp.tracking.run_context import RunContext
from tests.conftest import TINY, make_cfg


class SqrtAtZero(nn.Module):
    """A finite loss whose gradient is infinite: d sqrt(g)/dg at g = 0 (every step: the step
    that would move g is never applied)."""

    def __init__(self, in_channels: int, num_classes: int, image_size: tuple[int, int]):
        super().__init__()
        self.linear = nn.Linear(in_channels * image_size[0] * image_size[1], num_classes)
        self.gate = nn.Parameter(torch.zeros(()))

    def forward(self, x):
        return self.linear(x.flatten(1)) + torch.sqrt(self.gate)


def cfg_with_sqrt(*overrides: str):
    cfg = make_cfg(*TINY, "trainer.epochs=1", *overrides)
    with open_dict(cfg):
        cfg.model = {"_target_": f"{__name__}.SqrtAtZero"}
    return cfg


def test_under_raise_the_step_is_not_applied_and_the_run_stops_naming_the_gradients(tmp_path):
    with pytest.raises(NumericsError, match="gradients became inf/NaN at step 1 while the loss"):
        train(cfg_with_sqrt(), RunContext(tmp_path))
    # before, the step was applied (the weights became NaN) and the run stopped a step later
    # blaming the forward pass for a NaN loss
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "failed"


def test_under_skip_the_steps_are_skipped_and_counted_as_nonfinite_gradients(tmp_path):
    cfg = cfg_with_sqrt("trainer.on_nonfinite_loss=skip")
    with pytest.raises(NumericsError, match="No optimizer step was taken"):
        train(cfg, RunContext(tmp_path))
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["amp/nonfinite_grad_steps"] == saved["amp/skipped_steps"] == 16
    assert saved["amp/nonfinite_loss_steps"] == 0
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/loss" in r]
    assert [r["amp/nonfinite_grad_steps"] for r in steps] == list(range(1, 17))
