"""The same optimizer kernel on both sides of a comparison: mixed precision on a CPU takes torch's
fused kernel by default, as pure bf16 does and as CUDA always did; the run records which kernel
stepped it, the sweep report flags legs that ran different ones, and the plan of a pure bf16 run
shows its update's workspace."""

from __future__ import annotations

import json

import pytest
import torch

from mpexp.models.simplecnn import SimpleCNN
from mpexp.plan.rows import Target, plan_rows
from mpexp.plan.table import table
from mpexp.precision.modes import setup_precision
from mpexp.precision.pure_step import CPU_CHUNK, CUDA_CHUNK
from mpexp.precision.scaling import build_scaler
from mpexp.report import cli as report
from mpexp.step import performance
from tests.conftest import CPU, TINY, make_cfg
from tests.test_report_numbers import make_run


def built_optimizer(*overrides: str):
    cfg = make_cfg(*TINY, *overrides)
    precision = setup_precision(cfg.precision, CPU)
    scaler = build_scaler(cfg.loss_scaling, precision, CPU)
    model = SimpleCNN(1, 10, (28, 28), width=4)
    if cfg.precision.get("weights") == "bfloat16":
        model.to(torch.bfloat16)
    return performance.build_optimizer(cfg, model, CPU, scaler)


@pytest.mark.parametrize("optimizer", ["adam", "adamw", "sgd"])
def test_mixed_precision_on_a_cpu_steps_with_torchs_fused_kernel_as_pure_bf16_does(optimizer):
    """bf16 mixed precision took torch's for-loop Adam on a CPU (323 ms a step at 36.8 M
    parameters) where pure bf16 took its fused kernel (41 ms): a comparison of the two timed
    the kernels. Both are fused now, and `optimizer.fused=false` still picks the for-loop."""
    mixed = built_optimizer("precision=bf16", f"optimizer={optimizer}")
    pure = built_optimizer("precision=bf16_pure", f"optimizer={optimizer}")
    assert performance.optimizer_kernel(mixed) == performance.optimizer_kernel(pure) == "fused"
    unfused = built_optimizer("precision=bf16", f"optimizer={optimizer}", "optimizer.fused=false")
    assert performance.optimizer_kernel(unfused) == "for-loop"


def test_a_torch_without_the_cpu_kernel_keeps_the_for_loop(monkeypatch):
    """torch before 2.4 has no fused CPU kernels: asked for one, it raises, and the default
    stays torch's own rather than failing the run."""

    def missing(*args, **kwargs):
        raise RuntimeError("_fused_adam_ is not implemented for CPU")

    monkeypatch.setattr(torch, "_fused_adam_", missing)
    performance._fused_on.cache_clear()
    try:
        assert performance.optimizer_kernel(built_optimizer("precision=bf16")) == "for-loop"
    finally:
        performance._fused_on.cache_clear()


def kernel_run(root, name: str, precision: str, seed: int, kernel: str) -> None:
    path = make_run(root, name, precision, seed, [0.9] * 4, [2.0, 1.0, 1.0, 1.0])
    summary = json.loads((path / "summary.json").read_text())
    summary["ran"]["optimizer_kernel"] = kernel
    (path / "summary.json").write_text(json.dumps(summary))


def warnings_of(root) -> str:
    assert report.main([str(root), "--wandb", "disabled", "--no-plots"]) == 0
    text = (root / "report.md").read_text()
    return text.split("## Warnings", 1)[1].split("\n## ")[0] if "## Warnings" in text else ""


def test_legs_stepped_by_different_optimizer_kernels_are_flagged(tmp_path):
    """The comparison of bf16 mixed precision (torch's for-loop Adam) with pure bf16 (fused)
    is flagged, naming which leg ran which kernel; legs on one kernel are not."""
    kernels = {"fp32": "fused", "bf16": "for-loop", "bf16_pure": "fused"}
    for k, (precision, kernel) in enumerate(kernels.items()):
        for seed in (0, 1):
            kernel_run(tmp_path / "mixed", f"{k}{seed}", precision, seed, kernel)
            kernel_run(tmp_path / "alike", f"{k}{seed}", precision, seed, "fused")
    (flag,) = [w for w in warnings_of(tmp_path / "mixed").splitlines() if "optimizer kernels" in w]
    assert "for-loop: `precision=bf16`" in flag
    assert "`precision=bf16_pure`" in flag.split("fused: ")[1] and "`precision=fp32`" in flag
    assert "optimizer kernels" not in warnings_of(tmp_path / "alike")


def test_a_pure_bf16_plan_shows_its_workspace_sized_for_the_planned_device():
    """`mpexp-plan experiment=bf16_pure trainer.device=cpu` died of a ZeroDivisionError: its
    unfused update read the step count of a fake tensor (0). Planned on fake tensors now, its
    update's workspace is a line of the plan, sized by the device the plan is for."""
    for device, chunk in (("cpu", CPU_CHUNK), ("cuda", CUDA_CHUNK)):
        overrides = [
            "experiment=bf16_pure",
            "precision=bf16_pure_kahan",
            f"trainer.device={device}",
        ]
        (row,) = plan_rows(overrides, Target(device), preset_sweeps=False)
        workspace = row["optimizer_workspace"]
        assert workspace["elements"] == chunk and workspace["bytes"] > 0
        assert row["host_reads_per_step"] == 0
        assert "update workspace: " in table([row])
        assert f"(precision.update_chunk={chunk:,} elements)" in table([row])
