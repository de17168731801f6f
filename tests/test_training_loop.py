"""Training-loop practice: clipping after unscale_, gradient accumulation, schedules that skip
skipped steps, the fused optimizer's own unscale, and modules kept out of autocast."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from mpexp.errors import ConfigError
from mpexp.loop import train_step
from mpexp.models.simplecnn import SimpleCNN
from mpexp.precision import run_in_float32
from mpexp.scaling import build_scaler
from mpexp.schedules import build_schedule, cosine
from tests.conftest import CPU, precision_of

NONE = OmegaConf.create({"_target_": None})


def small_cnn() -> SimpleCNN:
    torch.manual_seed(0)
    return SimpleCNN(in_channels=1, num_classes=4, image_size=(8, 8), width=4)


def batch(n: int = 64):
    generator = torch.Generator().manual_seed(1)
    return torch.rand(n, 1, 8, 8, generator=generator), torch.randint(4, (n,), generator=generator)


def grad_norm(model: nn.Module) -> float:
    return torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])).item()


def test_clipping_acts_on_unscaled_gradients():
    precision = precision_of("fp16")
    scaling = OmegaConf.create(
        {
            "_target_": "mpexp.scaling.StaticLossScaler",
            "scale": 4096.0,
        }  # large enough that clipping scaled grads would show
    )
    images, labels = batch()
    unclipped, clipped = small_cnn(), small_cnn()
    for model, clip in ((unclipped, None), (clipped, 0.05)):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        scaler = build_scaler(scaling, precision, CPU)
        train_step(model, images, labels, optimizer, scaler, precision, clip_grad_norm=clip)
        assert scaler.found_inf().item() == 0.0
    true_norm = grad_norm(unclipped)
    assert true_norm > 0.05  # so the clip has something to do
    # after step() the gradients are in true units: clipped to the threshold, not to 0.05 / 4096
    assert grad_norm(clipped) == pytest.approx(0.05, rel=1e-3)


@pytest.mark.parametrize("n", [64, 63])  # 63: uneven micro-batches are weighted by their size
def test_accumulated_micro_batches_match_one_large_batch_in_fp32(n):
    precision = precision_of("fp32")
    images, labels = batch(n)
    whole, parts = small_cnn(), small_cnn()
    runs = []
    for model, k in ((whole, 1), (parts, 4)):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
        scaler = build_scaler(NONE, precision, CPU)
        losses = []
        for _ in range(3):
            losses.append(train_step(model, images, labels, optimizer, scaler, precision, k).item())
            optimizer.zero_grad()
        runs.append(losses)
    assert runs[1] == pytest.approx(runs[0], rel=1e-5)
    for a, b in zip(whole.parameters(), parts.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert not torch.equal(whole.fc.weight, small_cnn().fc.weight)  # it did train


def test_schedule_advances_only_on_steps_the_optimizer_took():
    precision = precision_of("fp16")
    model = small_cnn()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scaler = build_scaler(
        OmegaConf.create(
            {
                "_target_": "mpexp.scaling.DynamicLossScaler",
                "init_scale": 1024.0,
                "growth_factor": 2.0,
                "backoff_factor": 0.5,
                "growth_interval": 1000,
            }
        ),
        precision,
        CPU,
    )
    halve_each_step = OmegaConf.create(
        {"_target_": "mpexp.schedules.step_decay", "step_size": 1, "gamma": 0.5}
    )
    build_schedule(halve_each_step, optimizer, scaler, total_steps=10)
    images, labels = batch(8)
    rates = []
    for overflow in (False, True, False, True, True, False):
        rates.append(optimizer.param_groups[0]["lr"])
        handle = model.fc.weight.register_hook(lambda g: g * torch.inf) if overflow else None
        train_step(model, images, labels, optimizer, scaler, precision)
        scaler.update()
        optimizer.zero_grad()
        if handle:
            handle.remove()
    assert rates == [1.0, 0.5, 0.5, 0.25, 0.25, 0.25]
    assert optimizer.param_groups[0]["lr"] == 0.125


def test_cosine_warms_up_then_falls_to_the_floor():
    factor = cosine(total_steps=10, warmup_steps=2, min_lr_ratio=0.1)
    assert [factor(s) for s in (0, 1, 2)] == [0.5, 1.0, 1.0]
    assert factor(6) == pytest.approx(0.55)  # halfway through the decay: (1 + 0.1) / 2
    assert factor(10) == pytest.approx(0.1)


@pytest.mark.parametrize(("mode", "low"), [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_fp32_modules_run_in_float32_inside_autocast(mode, low):
    precision = precision_of(mode)
    model = small_cnn()
    assert run_in_float32(model, ["fc"], precision) == ["fc"]
    seen = {}
    for name in ("conv2", "fc"):
        getattr(model, name).register_forward_hook(
            lambda _, inputs, out, name=name: seen.update({name: (inputs[0].dtype, out.dtype)})
        )
    with precision.autocast():
        model(batch(2)[0])
    assert seen["conv2"][1] == low  # the rest of the model is still autocast
    # fc receives conv2's low-precision activations and computes in float32 all the same
    assert seen["fc"] == (low, torch.float32)


def test_fp32_modules_must_exist_and_warn_where_nothing_is_autocast(caplog):
    with pytest.raises(ConfigError, match=r"'head'.*conv1, conv2, fc"):
        run_in_float32(small_cnn(), ["head"], precision_of("fp16"))
    with caplog.at_level(logging.WARNING):
        assert run_in_float32(small_cnn(), ["fc"], precision_of("fp32")) == []
    assert "no effect under precision=fp32" in caplog.text


def test_schedule_refuses_a_fused_optimizer_under_loss_scaling():
    model = small_cnn()
    optimizer = torch.optim.Adam(model.parameters(), fused=True)
    scaler = build_scaler(
        OmegaConf.create({"_target_": "mpexp.scaling.StaticLossScaler", "scale": 8.0}),
        precision_of("fp16"),
        CPU,
    )
    cosine_cfg = OmegaConf.create(
        {"_target_": "mpexp.schedules.cosine", "warmup_steps": 0, "min_lr_ratio": 0.0}
    )
    with pytest.raises(ConfigError, match="fused"):
        build_schedule(cosine_cfg, optimizer, scaler, total_steps=10)
    # without scaling every step is real, so the same schedule is fine
    plain = build_scaler(NONE, precision_of("fp32"), CPU)
    assert build_schedule(cosine_cfg, copy.deepcopy(optimizer), plain, 10) is not None


DYNAMIC = {
    "_target_": "mpexp.scaling.DynamicLossScaler",
    "init_scale": 1024.0,
    "growth_factor": 2.0,
    "backoff_factor": 0.5,
    "growth_interval": 1000,
}


class OpCount(TorchDispatchMode):
    """Counts the operators dispatched (on a GPU, each is at least one kernel launch) and keeps
    their names."""

    def __init__(self):
        super().__init__()
        self.ops, self.names = 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        self.names.add(str(func))
        return func(*args, **(kwargs or {}))


def fused_training(inspect: bool, device: torch.device = CPU):
    """Three fp16 steps of fused Adam at the scale 1000; with `inspect` something reads the
    gradients before the step, so they are unscaled there; without it the fused kernel does it."""
    model = small_cnn().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
    precision = precision_of("fp16", device)
    scaling = OmegaConf.create({"_target_": "mpexp.scaling.StaticLossScaler", "scale": 1000.0})
    scaler = build_scaler(scaling, precision, device)
    seen = []
    optimizer.register_step_pre_hook(lambda opt, *_: seen.append(getattr(opt, "grad_scale", None)))
    images, labels = (t.to(device) for t in batch(16))
    with OpCount() as ops:
        for _ in range(3):
            train_step(model, images, labels, optimizer, scaler, precision,
                       inspect=(lambda: None) if inspect else None)  # fmt: skip
            scaler.update()
            optimizer.zero_grad()
    return model, seen, ops.names


UNSCALE_OP = "aten._amp_foreach_non_finite_check_and_unscale_.default"


@pytest.mark.parametrize("device", [CPU, pytest.param(torch.device("cuda"), marks=pytest.mark.gpu)])
def test_fused_optimizer_unscales_inside_its_kernel_when_nothing_reads_the_gradients(device):
    _, seen, ops = fused_training(inspect=False, device=device)
    assert [s.item() for s in seen] == [1000.0] * 3  # the scale goes to the fused kernel
    # on CUDA the overflow check before it only reads the gradients (no unscale by 1)
    assert (UNSCALE_OP in ops) is (device.type != "cuda")
    _, seen, ops = fused_training(inspect=True, device=device)
    assert seen == [None] * 3  # unscaled before the step: nothing left for the kernel to do
    assert UNSCALE_OP in ops


@pytest.mark.parametrize("device", [CPU, pytest.param(torch.device("cuda"), marks=pytest.mark.gpu)])
def test_both_unscale_paths_agree_to_float32_rounding(device):
    kernel, *_ = fused_training(inspect=False, device=device)
    early, *_ = fused_training(inspect=True, device=device)
    for a, b in zip(kernel.parameters(), early.parameters(), strict=True):
        # g * (1/1000) and g / 1000 may differ in the last bit; Adam carries that along
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert not torch.equal(kernel.fc.weight.cpu(), small_cnn().fc.weight)  # it did train


def test_fused_step_still_skips_an_overflow():
    model = small_cnn()
    optimizer = torch.optim.Adam(model.parameters(), fused=True)
    precision = precision_of("fp16")
    scaler = build_scaler(OmegaConf.create(DYNAMIC), precision, CPU)
    before = [p.detach().clone() for p in model.parameters()]
    handle = model.fc.weight.register_hook(lambda g: g * torch.inf)
    train_step(model, *batch(16), optimizer, scaler, precision)
    handle.remove()
    assert scaler.found_inf().item() == 1.0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    scaler.update()
    assert scaler.get_scale() == 512.0
