"""The dtype inside forward and the TF32 switches are what each precision mode says."""

from __future__ import annotations

import functools
import logging

import pytest
import torch
from torch import nn

from mpexp.precision import tf32
from mpexp.precision.modes import setup_precision
from mpexp.precision.tf32 import set_tf32, tf32_flags
from tests.conftest import CPU, make_cfg, precision_of


def dtypes_inside_forward(mode: str) -> dict[str, torch.dtype]:
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.Flatten(), nn.Linear(4 * 26 * 26, 3))
    seen: dict[str, torch.dtype] = {}
    for name, module in model.named_children():
        module.register_forward_hook(lambda m, i, o, name=name: seen.__setitem__(name, o.dtype))
    precision = precision_of(mode)
    with precision.autocast():
        model(torch.randn(2, 1, 28, 28))
    return {"conv": seen["0"], "linear": seen["2"]}


@pytest.mark.parametrize(
    ("mode", "dtype"),
    [
        ("fp32", torch.float32),
        ("tf32", torch.float32),
        ("fp16", torch.float16),
        ("bf16", torch.bfloat16),
    ],
)
def test_conv_and_linear_compute_in_the_modes_dtype(mode, dtype):
    assert dtypes_inside_forward(mode) == {"conv": dtype, "linear": dtype}


@pytest.mark.parametrize("enabled", [True, False])
def test_tf32_switches_matmul_and_cudnn_together(enabled):
    # start from the opposite state so that a forgotten switch is caught
    set_tf32(not enabled)
    set_tf32(enabled)
    flags = tf32_flags()
    assert flags["tf32_matmul"] is flags["tf32_cudnn"] is enabled
    assert flags["float32_matmul_precision"] == ("high" if enabled else "highest")


@pytest.mark.parametrize("mode", ["fp32", "tf32", "fp16", "bf16"])
def test_on_cpu_every_mode_leaves_tf32_off_and_records_it_off(mode):
    set_tf32(True)  # as a previous run in this process may have left them
    record = precision_of(mode).record()
    assert tf32_flags() == {
        "tf32_matmul": False,
        "tf32_cudnn": False,
        "float32_matmul_precision": "highest",
    }
    assert record["tf32_matmul"] is record["tf32_cudnn"] is False
    assert record["float32_matmul_precision"] == "highest"


def test_strict_fp32_turns_off_cudnn_tf32_that_pytorch_leaves_on():
    if tf32.PER_BACKEND:
        torch.backends.cudnn.conv.fp32_precision = "tf32"
    else:
        torch.backends.cudnn.allow_tf32 = True  # PyTorch's own default
    precision_of("fp32")
    assert tf32_flags()["tf32_cudnn"] is False


@pytest.mark.skipif(not tf32.PER_BACKEND, reason="torch < 2.9 has no fp32_precision switches")
@pytest.mark.parametrize(
    "set_by_user",
    [("fp32_precision", "tf32"), ("cuda.matmul.fp32_precision", "tf32"),
     ("cudnn.conv.fp32_precision", "tf32")],
)  # fmt: skip
def test_a_process_that_set_the_newer_tf32_switches_still_sets_up_every_mode(set_by_user):
    # mpexp switched TF32 through the older allow_tf32 flags, whose reading raises a
    # RuntimeError (a mix of the two APIs) once user code has set torch.backends.fp32_precision
    where, value = set_by_user
    *path, name = where.split(".")
    backend = functools.reduce(getattr, path, torch.backends)
    setattr(backend, name, value)
    for mode in ("fp32", "tf32", "bf16"):
        record = precision_of(mode).record()
        assert record["tf32_matmul"] is record["tf32_cudnn"] is False  # on a CPU: strict
    assert torch.backends.cuda.matmul.fp32_precision == "ieee"
    assert torch.backends.cudnn.conv.fp32_precision == "ieee"


def test_tf32_on_cpu_warns_once_and_records_what_acted(caplog):
    from mpexp.precision import modes as module

    module._warned_no_tf32.clear()
    with caplog.at_level(logging.WARNING):
        precision, again = precision_of("tf32"), precision_of("tf32")
    assert precision.effective == again.effective == "fp32"
    record = precision.record()
    assert (record["precision"], record["effective_precision"]) == ("tf32", "fp32")
    assert record["tf32_matmul"] is record["tf32_cudnn"] is False  # as the run computed
    assert record["float32_matmul_precision"] == "highest"
    warnings = [r.getMessage() for r in caplog.records if "TF32 has no effect" in r.getMessage()]
    assert len(warnings) == 1 and "on CPU" in warnings[0]  # once per process, like the others


@pytest.mark.parametrize("mode", ["fp16", "bf16"])
def test_16_bit_autocast_that_this_cpu_emulates_warns_once_and_is_recorded(mode, caplog):
    from mpexp.precision import modes as module

    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[mode]
    native = module.cpu_has_native(dtype)
    module._warned_emulated.discard(dtype)
    with caplog.at_level(logging.WARNING):
        first, second = precision_of(mode), precision_of(mode)
    warnings = [r.getMessage() for r in caplog.records if "emulated" in r.getMessage()]
    assert first.record()["emulated"] is second.emulated is (not native)
    assert len(warnings) == (0 if native else 1)  # once per process, not once per sweep job
    if not native:
        assert f"{mode} autocast is emulated on this CPU" in warnings[0]


def test_fp16_convolutions_on_a_cpu_warn_once_and_are_recorded_as_emulated(caplog):
    # their backward pass is slow on any CPU, float16 instructions or not; Linear layers are not
    from mpexp.precision import modes as module

    conv = nn.Sequential(nn.Conv2d(1, 4, 3), nn.Flatten(), nn.LazyLinear(10))
    linear = nn.Sequential(nn.Flatten(), nn.Linear(784, 10))
    module._warned_emulated.discard("fp16-convolutions")
    with caplog.at_level(logging.WARNING):
        fp16 = precision_of("fp16")
        convs = [module.check_fp16_convolutions_on_cpu(conv, fp16) for _ in range(2)]
        linears = module.check_fp16_convolutions_on_cpu(linear, fp16)
        bf16 = module.check_fp16_convolutions_on_cpu(conv, precision_of("bf16"))
    native = module.cpu_has_native(torch.float16)
    assert [p.record()["emulated"] for p in convs] == [True, True]
    assert linears.emulated is (not native)
    assert bf16.emulated is (not module.cpu_has_native(torch.bfloat16))
    warnings = [r.getMessage() for r in caplog.records if "convolutions is slow" in r.getMessage()]
    # once per process; without float16 instructions the emulation warning has said it already
    assert len(warnings) == (1 if native else 0)


def test_a_16_bit_mode_that_asks_for_tf32_says_so_in_its_name():
    cfg = make_cfg("precision=fp16", "precision.tf32=true").precision
    precision = setup_precision(cfg, CPU)
    assert precision.mode == "fp16+tf32" and precision.effective == "fp16"  # no TF32 on a CPU
