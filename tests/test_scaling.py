"""Loss scalers skip overflowing steps and move (or keep) the scale as their strategy says."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from mpexp.precision import setup_precision
from mpexp.scaling import build_scaler
from mpexp.train import train_step

CPU = torch.device("cpu")


def setup(scaling: dict):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    precision = setup_precision("fp16", CPU)
    scaler = build_scaler(OmegaConf.create(scaling), precision, CPU)
    return model, optimizer, precision, scaler


def step(model, optimizer, precision, scaler, poison: bool):
    """One training step; with poison, an inf lands in the weight's gradient."""
    handle = None
    if poison:
        handle = model[1].weight.register_hook(
            lambda g: g.index_fill(0, torch.tensor([0]), torch.inf)
        )
    images, labels = torch.randn(8, 1, 4, 4), torch.randint(4, (8,))
    train_step(model, images, labels, optimizer, scaler, precision)
    used, skipped = scaler.scale_tensor().item(), scaler.found_inf().item()
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    if handle:
        handle.remove()
    return used, skipped


DYNAMIC = {
    "name": "dynamic",
    "init_scale": 1024.0,
    "growth_factor": 2.0,
    "backoff_factor": 0.5,
    "growth_interval": 2,
}


def test_dynamic_inf_gradient_skips_the_step_and_backs_off():
    model, optimizer, precision, scaler = setup(DYNAMIC)
    before = [p.detach().clone() for p in model.parameters()]
    used, skipped = step(model, optimizer, precision, scaler, poison=True)
    assert (used, skipped) == (1024.0, 1.0)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert scaler.get_scale() == 512.0


def test_dynamic_scale_grows_after_growth_interval_clean_steps():
    model, optimizer, precision, scaler = setup(DYNAMIC)
    before = model[1].weight.detach().clone()
    history = [step(model, optimizer, precision, scaler, poison=False) for _ in range(3)]
    assert history == [(1024.0, 0.0), (1024.0, 0.0), (2048.0, 0.0)]
    assert not torch.equal(before, model[1].weight)


def test_static_inf_gradient_skips_without_changing_the_scale():
    model, optimizer, precision, scaler = setup({"name": "static", "scale": 256.0})
    before = [p.detach().clone() for p in model.parameters()]
    assert step(model, optimizer, precision, scaler, poison=True) == (256.0, 1.0)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert step(model, optimizer, precision, scaler, poison=False) == (256.0, 0.0)
    assert [step(model, optimizer, precision, scaler, poison=False)[0] for _ in range(5)] == [
        256.0
    ] * 5


def test_without_scaling_the_scale_reads_one_and_nothing_is_skipped():
    model, optimizer, precision, scaler = setup({"name": "none"})
    assert step(model, optimizer, precision, scaler, poison=False) == (1.0, 0.0)


@pytest.mark.parametrize("scaling", ["static", "dynamic"])
def test_explicit_scaler_under_bf16_is_honoured_with_a_warning(scaling, caplog):
    cfg = OmegaConf.create(
        {"name": scaling, "scale": 8.0, **{k: v for k, v in DYNAMIC.items() if k != "name"}}
    )
    scaler = build_scaler(cfg, setup_precision("bf16", CPU), CPU)
    assert scaler.is_enabled()
    assert "does not underflow" in caplog.text or "do not underflow" in caplog.text
