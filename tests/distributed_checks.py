"""Run by tests/test_distributed.py under torchrun with two CPU processes: each rank writes what it
observed to <out>/rank<r>.json, and the test compares the ranks.

`python -m torch.distributed.run --standalone --nproc_per_node=2 tests/distributed_checks.py OUT`
"""

from __future__ import annotations

import functools
import itertools
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn
from torch._dynamo.utils import counters
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from mpexp.distributed import start_world
from mpexp.errors import DataError
from mpexp.precision.loss_scaler import LossScaler
from mpexp.precision.scaling import CalibratedLossScaler
from mpexp.shards import dtensor_combines_overflow_flags
from mpexp.step.diagnostics import Diagnostics
from mpexp.step.history import StepHistory
from mpexp.step.stepper import Stepper
from mpexp.tracking.histogram import Histogram
from mpexp.tracking.null_tracker import NullTracker
from tests.conftest import make_cfg, precision_of

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
    model = world.replicate(small_model(0))
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
    model = fsdp.shard(small_model(0), precision)
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
        model = replace(world, strategy=strategy).shard(small_model(0), precision_of("fp32"))
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
    model = replace(world, strategy="fsdp").shard(small_model(0), precision_of("fp32"))
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
    model = ranks.replicate(ranks.shard(small_model(0), precision))
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


class Graphs:
    """A torch.compile backend that keeps the operators of each graph TorchDynamo hands it and
    runs the graph as traced: the graphs and breaks are TorchDynamo's own, whichever backend,
    without Inductor's minutes of code generation on a CPU."""

    def __init__(self) -> None:
        self.graphs: list[set[str]] = []

    def __call__(self, graph, example_inputs):
        calls = [n for n in graph.graph.nodes if n.op.startswith("call")]
        self.graphs.append({getattr(n.target, "__name__", str(n.target)) for n in calls})
        return graph.forward


def token_folder(folder: Path, tokens: int = 4096, vocab: int = 64) -> Path:
    """nanoGPT's layout: train.bin and val.bin of uint16 ids below `vocab`."""
    folder.mkdir(parents=True, exist_ok=True)
    ids = np.random.default_rng(0).integers(0, vocab, tokens).astype(np.uint16)
    ids.tofile(folder / "train.bin")
    ids[: tokens // 4].tofile(folder / "val.bin")
    return folder


def compiled_step(world, strategy: str, out: Path) -> dict:
    """A tiny GPT built as a run builds it (build_parts, build_training) with
    trainer.compile=true under `strategy`, trained for two optimizer steps of two micro-batches
    each: the graphs TorchDynamo captured, its graph breaks, and how often DDP all-reduced."""
    from mpexp.build import build_parts, build_training
    from mpexp.step.train_step import train_step

    backend = Graphs()
    real = torch.compile
    torch.compile = functools.partial(_compile_with, real, backend)
    torch._dynamo.reset()
    counters.clear()
    try:
        cfg = make_cfg(
            "model=gpt", "model.n_layer=2", "model.n_head=2", "model.n_embd=32",
            "model.block_size=16", "dataset=tokens", "dataset.vocab_size=64",
            f"dataset.path={token_folder(out / f'tokens{world.rank}')}", "dataset.batch_size=16",
            "dataset.train_size=64", "dataset.val_size=16", "trainer.accumulate=4",
            f"trainer.strategy={strategy}", "trainer.compile=true", "wandb.mode=disabled",
        )  # fmt: skip
        ranks = replace(world, strategy=strategy)
        built = build_parts(cfg, ranks, {})
        optimizer, _, forward = build_training(cfg, built, world.device)
        syncs = []
        if strategy == "ddp":
            forward.register_comm_hook(syncs, _counted_all_reduce)
        batches = built.data.train_batches(1, 0, world.device)
        for inputs, targets in itertools.islice(batches, 2):
            train_step(forward, inputs, targets, optimizer, built.scaler, built.precision,
                       accumulate=built.split.accumulate_per_process, loss_fn=None)  # fmt: skip
            built.scaler.update()
            optimizer.zero_grad(set_to_none=True)
    finally:
        torch.compile = real
    graphs = backend.graphs
    return {
        "graphs": len(graphs),
        "breaks": sum(counters["graph_break"].values()),
        "model_and_loss": [("embedding" in g, "logsumexp" in g) for g in graphs],
        "block": [("scaled_dot_product_attention" in g) for g in graphs],
        "all_reduces": len(syncs),
        "weights": weights(built.model) if strategy == "ddp" else None,
    }


def split_validation(world, out: Path) -> dict:
    """Validation of a tiny GPT on 20 windows and of a CNN on 20 images (held on the device, and
    through a DataLoader), each rank evaluating its share: the samples it evaluated, and
    whether the metrics summed over the ranks are one process's of the whole set."""
    from mpexp.data.synthetic import SyntheticData
    from mpexp.data.tokens import TokenFiles
    from mpexp.models.gpt import GPT
    from mpexp.models.simplecnn import SimpleCNN
    from mpexp.step.validation import evaluate

    cpu, fp32 = torch.device("cpu"), precision_of("fp32")
    found = {}
    for name, data in (
        ("windows", TokenFiles(str(token_folder(out / f"val{world.rank}")), vocab_size=64,
                               block_size=16, val_size=20, batch_size=8)),
        ("device", SyntheticData(train_size=64, val_size=20, batch_size=8, loader="device")),
        ("dataloader", SyntheticData(train_size=64, val_size=20, batch_size=8,
                                     loader="dataloader")),
    ):  # fmt: skip
        task = data.setup(cpu)
        torch.manual_seed(0)
        model = GPT(**task.model_kwargs(), block_size=16, n_layer=1, n_embd=32, n_head=2) \
            if name == "windows" else SimpleCNN(**task.model_kwargs(), width=4)  # fmt: skip
        one = evaluate(model, data, cpu, fp32, micro_batch=4)
        data.shard(world.rank, world.size)
        mine = sum(len(targets) for _, targets in data.val_batches(cpu))
        ranks = evaluate(model, data, cpu, fp32, micro_batch=4, world=world)
        found[name] = {
            "samples": mine,
            "same": all(abs(ranks[k] - v) <= 1e-6 * abs(v) for k, v in one.items()),
            "keys": sorted(ranks) == sorted(one),
        }
    return found


def split_token_scan(world, out: Path) -> dict:
    """The check of every token id at setup, split among the ranks: the stretches each rank
    scans, and what each says of files whose one id out of range lies in rank 1's share."""
    from mpexp.data import tokens
    from mpexp.data.tokens import TokenFiles, scan_share

    folder = token_folder(out / f"scan{world.rank}", tokens=4096)
    bad = np.fromfile(folder / "val.bin", dtype=np.uint16)
    bad[300] = 99  # the val.bin's second stretch of 256: rank 1's of the four
    bad.tofile(folder / "val.bin")
    real, tokens.SCAN = tokens.SCAN, 256
    try:
        arrays = [np.zeros(4096), np.zeros(1024)]
        data = TokenFiles(str(folder), vocab_size=64, block_size=16)
        data.shard(world.rank, world.size)
        try:
            data.setup(torch.device("cpu"))
            said = None
        except DataError as err:
            said = str(err)
        return {
            "mine": scan_share(arrays, world.rank, world.size),
            "all": scan_share(arrays, 0, 1),
            "said": said,
        }
    finally:
        tokens.SCAN = real


def _compile_with(real, backend, model=None, **kwargs):
    kwargs.pop("mode", None)
    return real(model, backend=backend, **kwargs)


def _counted_all_reduce(calls: list, bucket):
    calls.append(bucket.index())
    return default_hooks.allreduce_hook(None, bucket)


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
            "ddp_compiled": compiled_step(world, "ddp", out),
            "fsdp_compiled": compiled_step(world, "fsdp", out),
            "split_validation": split_validation(world, out),
            "split_token_scan": split_token_scan(world, out),
        }
        (out / f"rank{world.rank}.json").write_text(json.dumps(result))
    # the world torn down: no gloo thread of its groups lives on into Python's shutdown, where
    # one that frees a tensor aborts the process (mpexp.distributed._release_meshes)
    (out / f"threads{world.rank}.json").write_text(json.dumps(gloo_threads()))


def gloo_threads() -> list[str]:
    """The names of this process's gloo threads (Linux names its threads in /proc)."""
    tasks = Path("/proc/self/task")
    names = [(t / "comm").read_text().strip() for t in tasks.iterdir()] if tasks.is_dir() else []
    return [name for name in names if "gloo" in name]


if __name__ == "__main__":
    main(Path(sys.argv[1]))
