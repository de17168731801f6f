"""Run by tests/test_distributed.py under torchrun with two CPU processes: each rank writes what it
observed to <out>/rank<r>.json, and the test compares the ranks.

`python -m torch.distributed.run --standalone --nproc_per_node=2 tests/distributed_checks.py OUT`
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from mpexp.distributed import start_world
from mpexp.scaling import LossScaler
from tests.conftest import precision_of


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
    scaler.step(optimizer)
    skipped = scaler.found_inf().item()
    scaler.update()
    return {"skipped": skipped, "scale": scaler.get_scale(), "dtypes_in_forward": seen}


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
        }
        (out / f"rank{world.rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
