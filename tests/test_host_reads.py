"""No host read of a tensor value per training step, for every precision, loss-scaling strategy and
training-loop option, on the fused-optimizer path that CUDA takes by default.

Reading a device value on the host (`.item()`, `float(t)`, `if t:`, GradScaler's `get_scale()`)
makes the CPU wait for the GPU. On any device each such read is one `aten._local_scalar_dense`
call, so counting those calls over the real training loop on CPU stands in, in every CI run, for
the GPU's sync-debug test (tests/test_gpu.py). Two runs take the same number of metric flushes,
epochs and checkpoints but one takes twice the steps: any read per step shows as a difference.
A user's model that logs tensors every step (`mpexp.log`) adds none either.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import mpexp
from mpexp.models.simplecnn import SimpleCNN
from mpexp.run.runner import train
from mpexp.tracking.run_context import RunContext
from tests.conftest import make_cfg


class HostReads(TorchDispatchMode):
    """Counts the reads of a tensor value on the host while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


class LoggingCNN(SimpleCNN):
    """A user's model that logs values of its forward pass every step, as tensors (no .item())."""

    def forward(self, x):
        if self.training:
            # under fp16 autocast a float16 value, and an integer count: any dtype is taken
            mpexp.log({"my/absmax": x.abs().max(), "my/nonzero": (x != 0).sum()})
        out = super().forward(x)
        if self.training:
            mpexp.log({"my/out_absmax": out.abs().max(), "my/note": "ok"})
        return out


BASE = [
    "dataset=synthetic",
    "dataset.val_size=64",
    "dataset.batch_size=32",
    "model=simplecnn",
    "model.width=4",
    "optimizer.fused=true",  # CUDA's path: GradScaler leaves the overflow flag on the device
    "trainer.epochs=1",
    "trainer.progress=false",
    "wandb.mode=disabled",
]


def reads(tmp_path, name: str, steps: int, flushes: int, *overrides: str) -> int:
    base = BASE
    if any(o.startswith("model=") for o in overrides):  # another model: none of simplecnn's keys
        base = [b for b in BASE if not b.startswith("model")]
    cfg = make_cfg(
        *base,
        f"dataset.train_size={32 * steps}",
        f"trainer.log_every={steps // flushes}",
        *overrides,
    )
    with HostReads() as mode:
        train(cfg, RunContext(tmp_path / name))
    return mode.count


@pytest.mark.parametrize(
    "overrides",
    [
        ["precision=fp32"],
        ["precision=bf16"],
        ["precision=fp16", "loss_scaling=dynamic"],
        ["precision=fp16", "loss_scaling=static"],
        ["precision=fp16", "loss_scaling=hysteresis"],
        ["precision=fp16", "loss_scaling=calibrated", "loss_scaling.calibration_steps=2"],
        ["precision=fp16", "trainer.accumulate=2", "trainer.clip_grad_norm=1.0"],
        ["precision=fp32", "trainer.on_nonfinite_loss=skip"],
        # a schedule on the device: fp16 under loss scaling keeps the fused, sync-free step
        ["precision=fp16", "loss_scaling=dynamic", "scheduler=cosine"],
        ["precision=bf16", "optimizer=adamw", "scheduler=step", "trainer.accumulate=2"],
        [
            "precision=fp16",
            "diagnostics.grad_stats_every=2",
            "diagnostics.overflow_attribution=true",
        ],
        # BatchNorm: a skipped step puts its statistics back, on the device
        # (mpexp/step/rollback.py).
        # fp32 under a scaler, as 16-bit convolutions are slow on a CPU (emulated where it has
        # no bf16 instructions); the path is the same
        pytest.param(
            [
                "precision=fp32",
                "loss_scaling=dynamic",
                "model=resnet18_cifar",
                "dataset.height=8",
                "dataset.width=8",
            ],
            marks=pytest.mark.slow,  # ResNet-18 on a CPU: about 6 s
        ),
        [
            "precision=fp16",
            "loss_scaling=dynamic",
            "model._target_=tests.test_host_reads.LoggingCNN",
        ],
        # a classifier's recipe: mixed batches (draws on the host, no tensor read) and the
        # weights' average updated after every step on the device
        [
            "precision=bf16",
            "trainer.label_smoothing=0.1",
            "trainer.mixup_alpha=0.2",
            "trainer.cutmix_alpha=1.0",
            "trainer.ema_decay=0.9",
            "trainer.ema_every=1",
        ],
        # pure bf16's own update (fused by default) counts its lost updates on the device
        ["precision=bf16_pure_kahan", "dataset.height=8", "dataset.width=8"],
    ],
    ids=lambda o: ",".join(x.split(".")[-1] for x in o),
)
def test_no_host_read_per_step(tmp_path, overrides):
    short = reads(tmp_path, "short", 8, 4, *overrides)
    long = reads(tmp_path, "long", 16, 4, *overrides)
    assert long == short, f"{long - short} reads for 8 more steps"
