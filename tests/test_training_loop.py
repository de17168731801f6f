"""Training-loop practice: clipping after unscale_, gradient accumulation, schedules that skip
skipped steps, skipped steps that leave BatchNorm's statistics alone, the fused optimizer's own
unscale, and modules kept out of autocast."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from mpexp.data.synthetic import SyntheticData
from mpexp.errors import ConfigError
from mpexp.models.simplecnn import SimpleCNN
from mpexp.precision.fp32_modules import run_in_float32
from mpexp.precision.scaling import build_scaler
from mpexp.run.runner import train
from mpexp.step.diagnostics import Diagnostics
from mpexp.step.history import StepHistory
from mpexp.step.rollback import BufferRollback
from mpexp.step.schedules import build_schedule, cosine
from mpexp.step.stepper import Stepper
from mpexp.step.train_step import train_step
from mpexp.tracking.null_tracker import NullTracker
from mpexp.tracking.run_context import RunContext
from tests.conftest import CPU, TINY, make_cfg, precision_of

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
            "_target_": "mpexp.precision.scaling.StaticLossScaler",
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
            scaler.update()  # as the loop does: the non-finite guard ends its step there
            optimizer.zero_grad()
        runs.append(losses)
    assert runs[1] == pytest.approx(runs[0], rel=1e-5)
    for a, b in zip(whole.parameters(), parts.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert not torch.equal(whole.fc.weight, small_cnn().fc.weight)  # it did train


def int_only_halving(step_size: int):
    """A schedule factor written for ints only (math, not torch): it keeps the host schedule."""
    return lambda step: math.pow(0.5, step // step_size)


def _fp16_scaler():
    return build_scaler(
        OmegaConf.create(
            {
                "_target_": "mpexp.precision.scaling.DynamicLossScaler",
                "init_scale": 1024.0,
                "growth_factor": 2.0,
                "backoff_factor": 0.5,
                "growth_interval": 1000,
            }
        ),
        precision_of("fp16"),
        CPU,
    )


@pytest.mark.parametrize(
    ("target", "fused", "where"),
    [
        ("mpexp.step.schedules.step_decay", False, "device"),
        ("mpexp.step.schedules.step_decay", True, "device"),  # skips inside the fused kernel
        ("tests.test_training_loop.int_only_halving", False, "host"),
    ],
)
def test_schedule_advances_only_on_steps_the_optimizer_took(target, fused, where):
    precision = precision_of("fp16")
    model = small_cnn()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0, fused=fused)
    scaler = _fp16_scaler()
    halve_each_step = OmegaConf.create({"_target_": target, "step_size": 1})
    if "step_decay" in target:
        halve_each_step.gamma = 0.5
    schedule = build_schedule(halve_each_step, optimizer, scaler, total_steps=10)
    assert schedule.where == where
    images, labels = batch(8)
    rates = []
    for overflow in (False, True, False, True, True, False):
        rates.append(float(optimizer.param_groups[0]["lr"]))
        handle = model.fc.weight.register_hook(lambda g: g * torch.inf) if overflow else None
        train_step(model, images, labels, optimizer, scaler, precision, schedule=schedule)
        scaler.update()
        optimizer.zero_grad()
        if handle:
            handle.remove()
    assert rates == [1.0, 0.5, 0.5, 0.25, 0.25, 0.25]
    assert float(optimizer.param_groups[0]["lr"]) == 0.125


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


def test_a_fused_optimizer_under_loss_scaling_takes_a_device_schedule_or_is_refused():
    model = small_cnn()
    optimizer = torch.optim.Adam(model.parameters(), fused=True)
    scaler = build_scaler(
        OmegaConf.create({"_target_": "mpexp.precision.scaling.StaticLossScaler", "scale": 8.0}),
        precision_of("fp16"),
        CPU,
    )
    cosine_cfg = OmegaConf.create(
        {"_target_": "mpexp.step.schedules.cosine", "warmup_steps": 0, "min_lr_ratio": 0.0}
    )
    # the fused step skips on the device, and the schedule counts on the device: it can follow
    assert build_schedule(cosine_cfg, optimizer, scaler, total_steps=10).where == "device"
    # a factor for ints only could not see the kernel's skips without a host read per step
    int_only = OmegaConf.create(
        {"_target_": "tests.test_training_loop.int_only_halving", "step_size": 1}
    )
    fresh = torch.optim.Adam(small_cnn().parameters(), fused=True)
    with pytest.raises(ConfigError, match="fused"):
        build_schedule(int_only, fresh, scaler, total_steps=10)
    # without scaling every step is real, so the same schedule is fine on the host
    plain = build_scaler(NONE, precision_of("fp32"), CPU)
    assert build_schedule(int_only, fresh, plain, 10).where == "host"


class BatchNormCNN(nn.Module):
    """`blocks` x (conv, BatchNorm, ReLU), then a linear classifier; a `model` for the config."""

    def __init__(self, in_channels=1, num_classes=4, image_size=(8, 8), width=4, blocks=1):
        super().__init__()
        layers, channels = [], in_channels
        for _ in range(blocks):
            layers += [nn.Conv2d(channels, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU()]
            channels = width
        self.features = nn.Sequential(*layers)
        self.fc = nn.Linear(width * image_size[0] * image_size[1], num_classes)

    def forward(self, x):
        return self.fc(self.features(x).flatten(1))


class OneHugeImage(SyntheticData):
    """The synthetic set with its first training image scaled by 1e6: fp16 cannot hold what
    that image makes of the first convolution, so the step that holds it has an inf loss."""

    def load(self):
        (images, labels), val, classes = super().load()
        images = images.clone()
        images[0] *= 1e6
        return (images, labels), val, classes


def stepper_for(model, scaling: dict, device: torch.device = CPU) -> Stepper:
    precision = precision_of("fp16", device)
    scaler = build_scaler(
        OmegaConf.create(scaling),
        precision,
        device,
        skip_nonfinite_loss=scaling["_target_"] is None,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    off = OmegaConf.create({"grad_stats_every": 0, "overflow_attribution": False, "max_names": 8})
    diagnostics = Diagnostics(off, model, scaler, NullTracker("."))
    return Stepper(model, optimizer, scaler, precision, StepHistory(device=device), diagnostics)


def buffers(model: nn.Module) -> list[torch.Tensor]:
    return [b.detach().clone() for b in model.buffers()]


DYNAMIC = {
    "_target_": "mpexp.precision.scaling.DynamicLossScaler",
    "init_scale": 1024.0,
    "growth_factor": 2.0,
    "backoff_factor": 0.5,
    "growth_interval": 1000,
}


@pytest.mark.parametrize(
    ("scaling", "cause"),
    [
        (DYNAMIC, "huge image"),  # a non-finite loss
        (DYNAMIC, "inf gradient"),  # an overflow, the loss finite
        (NONE.copy(), "huge image"),  # no scaling: the non-finite-loss guard skips it
    ],
    ids=["nonfinite-loss", "overflow", "guard-without-scaling"],
)
@pytest.mark.parametrize("device", [CPU, pytest.param(torch.device("cuda"), marks=pytest.mark.gpu)])
def test_a_skipped_step_leaves_batchnorm_statistics_as_they_were(scaling, cause, device):
    model = BatchNormCNN(blocks=2).to(device)
    stepper = stepper_for(model, dict(scaling), device)
    images, labels = (t.to(device) for t in batch(16))
    stepper.step(1, images, labels)  # a clean step first: the statistics move
    before = buffers(model)
    handle = None
    if cause == "huge image":
        images = images.clone()
        images[0] *= 1e6
    else:
        handle = model.fc.weight.register_hook(lambda g: g * torch.inf)
    stepper.step(2, images, labels)
    if handle:
        handle.remove()
    assert stepper.scaler.found_inf().item() == 1.0
    after = buffers(model)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))  # bit for bit
    stepper.step(3, *(t.to(device) for t in batch(16)))
    assert not torch.equal(before[0], model.features[1].running_mean)  # real steps still move


def test_after_a_skipped_inf_loss_evaluation_stays_finite(tmp_path):
    """The reported case, as a user meets it: fp16, BatchNorm, one training image scaled by 1e6,
    trainer.on_nonfinite_loss=skip. The step holding that image is skipped; before the fix its
    forward pass had left NaN running statistics, and every evaluation after it was NaN."""
    cfg = make_cfg(
        *TINY,
        "precision=fp16",
        "trainer.on_nonfinite_loss=skip",
        "trainer.epochs=1",
        f"dataset._target_={__name__}.OneHugeImage",
        f"model._target_={__name__}.BatchNormCNN",
    )
    summary = train(cfg, RunContext(tmp_path))
    assert summary["amp/nonfinite_loss_steps"] == 1
    assert math.isfinite(summary["val/loss"]) and summary["val/acc"] > 0.5


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


def rollback_ops(blocks: int, can_skip: bool = True) -> int:
    model = BatchNormCNN(blocks=blocks)
    rollback = BufferRollback.for_step(model, can_skip)
    skipped = torch.ones(())
    with OpCount() as count:
        rollback.save()
        rollback.restore_if(skipped)
    return count.ops


def test_restoring_buffers_costs_the_same_few_operators_for_any_depth():
    # 3 buffers per BatchNorm layer, in two dtypes (float statistics, an integer batch count)
    assert rollback_ops(blocks=1) == rollback_ops(blocks=12) <= 10
    assert rollback_ops(blocks=12, can_skip=False) == 0  # no step can be skipped: no work


def fused_training(inspect: bool, device: torch.device = CPU):
    """Three fp16 steps of fused Adam at the scale 1000; with `inspect` something reads the
    gradients before the step, so they are unscaled there; without it the fused kernel does it."""
    model = small_cnn().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
    precision = precision_of("fp16", device)
    scaling = OmegaConf.create(
        {"_target_": "mpexp.precision.scaling.StaticLossScaler", "scale": 1000.0}
    )
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
