"""Run by tests/test_distributed.py under torchrun with two CPU processes: each rank writes what it
observed to <out>/rank<r>.json, and the test compares the ranks.

`python -m torch.distributed.run --standalone --nproc_per_node=2 tests/distributed_checks.py OUT`
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn

from mpexp.distributed import start_world
from mpexp.precision.loss_scaler import LossScaler
from mpexp.precision.scaling import CalibratedLossScaler
from mpexp.shards import dtensor_combines_overflow_flags
from mpexp.step.diagnostics import Diagnostics
from mpexp.step.history import StepHistory
from mpexp.step.stepper import Stepper
from mpexp.tracking.histogram import Histogram
from mpexp.tracking.null_tracker import NullTracker
from tests.conftest import precision_of

try:
    from torch.distributed.tensor import distribute_tensor
except ImportError:  # torch < 2.5
    from torch.distributed._tensor import distribute_tensor


def small_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 8 * 8, 10),
    )


def batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(100 + rank)
    return torch.randn(8, 1, 8, 8), torch.randint(0, 10, (8,))


def weights(model: nn.Module) -> list[float]:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()


def ddp_overflow_on_one_rank(world) -> dict:
    """Rank 1's batch overflows; with DDP's all-reduced gradients both ranks must skip."""
    model = world.wrap(small_model(0), precision_of("fp32", world.device))
    before = weights(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = LossScaler(world.device, init_scale=1024.0)
    images, labels = batch(world.rank)
    if world.rank == 1:
        images[0, 0, 0, 0] = float("inf")
    scaler.scale(F.cross_entropy(model(images), labels)).backward()
    scaler.step(optimizer)
    skipped = scaler.found_inf().item()
    scaler.update()
    return {"skipped": skipped, "scale": scaler.get_scale(), "unchanged": weights(model) == before}


def fsdp_overflow_in_one_shard(world) -> dict:
    """FSDP2 under fp16: weights gathered in fp16 (BatchNorm's in fp32), and an inf in rank 1's
    gradient shard makes both ranks skip."""
    fsdp = replace(world, strategy="fsdp")
    precision = precision_of("fp16", world.device)
    model = fsdp.wrap(small_model(0), precision)
    seen = {}

    def record_dtype(name):
        def hook(module, args):
            seen[name] = str(module.weight.dtype)

        return hook

    model[4].register_forward_pre_hook(record_dtype("linear"))
    model[1].register_forward_pre_hook(record_dtype("norm"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = LossScaler(world.device, init_scale=1024.0)
    fsdp.prepare_scaler(scaler)
    images, labels = batch(world.rank)
    with precision.autocast():
        loss = F.cross_entropy(model(images), labels)
    scaler.scale(loss).backward()
    if world.rank == 1:
        model[4].weight.grad.to_local()[0, 0] = float("inf")
    with counting_all_reduces() as all_reduces:
        scaler.step(optimizer)
    skipped = scaler.found_inf().item()
    scaler.update()
    return {
        "skipped": skipped,
        "scale": scaler.get_scale(),
        "dtypes_in_forward": seen,
        "all_reduces_in_step": len(all_reduces),
        "torch_combines_flags": dtensor_combines_overflow_flags(),
    }


class counting_all_reduces:
    """Counts torch.distributed.all_reduce calls (mpexp's own; DTensor's go another way)."""

    def __enter__(self) -> list:
        self.calls, self.original = [], torch.distributed.all_reduce

        def counted(*args, **kwargs):
            self.calls.append(args)
            return self.original(*args, **kwargs)

        torch.distributed.all_reduce = counted
        return self.calls

    def __exit__(self, *exc) -> None:
        torch.distributed.all_reduce = self.original


class Rows:
    """A tracker that keeps what is logged, histograms as plain dicts."""

    def __init__(self) -> None:
        self.rows = []

    def log(self, row: dict) -> None:
        self.rows.append({k: asdict(v) if isinstance(v, Histogram) else v for k, v in row.items()})


def full_gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    """The same gradients on every rank: magnitudes from 2^-40 to 2^20, a tenth of them zero,
    and one inf in the last row of the classifier's weight (rank 1's shard under FSDP)."""
    generator = torch.Generator().manual_seed(7)
    grads = {}
    for name, p in model.named_parameters():
        g = torch.randn(p.shape, generator=generator)
        g *= 2.0 ** torch.randint(-40, 20, p.shape, generator=generator)
        g[torch.rand(p.shape, generator=generator) < 0.1] = 0.0
        grads[name] = g
    grads["4.weight"][-1, 0] = float("inf")
    return grads


def fsdp_diagnostics(world) -> dict:
    """Gradient statistics and overflow attribution of the same gradients, sharded by FSDP2 over
    the ranks and whole in one process: each rank counts its shard, the flush adds them up."""
    diag = OmegaConf.create({"grad_stats_every": 1, "overflow_attribution": True, "max_names": 8})
    figures = {}
    for strategy in ("fsdp", "single"):
        model = replace(world, strategy=strategy).wrap(small_model(0), precision_of("fp32"))
        grads = full_gradients(model)
        for name, p in model.named_parameters():
            sharded = strategy == "fsdp"
            p.grad = (
                distribute_tensor(grads[name], p.device_mesh, p.placements)
                if sharded
                else grads[name]
            )
        scaler = LossScaler(world.device, init_scale=16.0)
        rows = Rows()
        diagnostics = Diagnostics(diag, model, scaler, rows)
        diagnostics.inspector(1)()
        diagnostics.after_update(1)
        diagnostics.flush(wait=True)
        figures[strategy] = rows.rows
    return figures


def fsdp_calibration(world) -> dict:
    """`calibrated` under FSDP: each rank measures the maximum of its own shards, and the ranks
    settle on the whole model's (3.0, on rank 1's shard only)."""
    model = replace(world, strategy="fsdp").wrap(small_model(0), precision_of("fp32"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = CalibratedLossScaler(world.device, calibration_steps=1, margin=8.0)
    for name, p in model.named_parameters():
        grad = torch.full(p.shape, 1e-3)
        if name == "4.weight":
            grad[-1, 0] = 3.0
        p.grad = distribute_tensor(grad, p.device_mesh, p.placements)
    scaler.scale(torch.ones(()))
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()
    return scaler.outcome()


def buffers(model: nn.Module) -> list:
    return [b.tolist() for b in model.buffers()]


def skipped_step_keeps_buffers(world, strategy: str) -> dict:
    """Rank 1's batch holds an inf, so its loss is not finite and every rank skips the step; the
    BatchNorm statistics that the step's forward pass changed are put back on every rank. The
    next, clean step moves them as usual."""
    ranks = replace(world, strategy=strategy)
    precision = precision_of("fp32", world.device)
    model = ranks.wrap(small_model(0), precision)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = LossScaler(world.device, init_scale=1024.0)
    ranks.prepare_scaler(scaler)
    off = OmegaConf.create({"grad_stats_every": 0, "overflow_attribution": False, "max_names": 8})
    diagnostics = Diagnostics(off, model, scaler, NullTracker(Path(".")))
    stepper = Stepper(model, optimizer, scaler, precision, StepHistory(), diagnostics)
    before = buffers(model)
    images, labels = batch(world.rank)
    if world.rank == 1:
        images[0, 0, 0, 0] = float("inf")
    stepper.step(1, images, labels)
    skipped, kept = scaler.found_inf().item(), buffers(model) == before
    stepper.step(2, *batch(world.rank))
    return {"skipped": skipped, "kept": kept, "moved_after": buffers(model) != before}


def rank_local_overflow(world, together: bool) -> dict:
    """Gradients that differ by rank (as FSDP shards do), inf on rank 1 only: `skip_together`
    decides whether rank 0 skips too. (Recent torch also reduces the flag inside DTensor's
    unscale kernel; this checks the scaler's own reduction, whatever the torch version.)"""
    model = small_model(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = LossScaler(world.device, init_scale=1024.0)
    if together:
        scaler.skip_together()
    images, labels = batch(world.rank)
    scaler.scale(F.cross_entropy(model(images), labels)).backward()
    if world.rank == 1:
        model[4].weight.grad[0, 0] = float("inf")
    scaler.step(optimizer)
    skipped = scaler.found_inf().item()
    scaler.update()
    return {"skipped": skipped, "scale": scaler.get_scale()}


def replica_check(world) -> dict:
    return {
        "same_seed": world.check_replicas(small_model(0))["replicas_identical"],
        "seed_per_rank": world.check_replicas(small_model(world.rank))["replicas_identical"],
    }


def main(out: Path) -> None:
    with start_world("ddp", torch.device("cpu")) as world:
        result = {
            "ddp": ddp_overflow_on_one_rank(world),
            "fsdp": fsdp_overflow_in_one_shard(world),
            "together": rank_local_overflow(world, together=True),
            "alone": rank_local_overflow(world, together=False),
            "replicas": replica_check(world),
            "fsdp_diagnostics": fsdp_diagnostics(world),
            "fsdp_calibration": fsdp_calibration(world),
            "ddp_buffers": skipped_step_keeps_buffers(world, "ddp"),
            "fsdp_buffers": skipped_step_keeps_buffers(world, "fsdp"),
        }
        (out / f"rank{world.rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
