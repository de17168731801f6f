"""Training on several processes: DDP or FSDP2, launched by torchrun or as a multi-task SLURM job.

One process per device, every one running the same loop on its own shard of each epoch.
`torchrun --nproc_per_node=N -m mpexp.train trainer.strategy=ddp` sets RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR and MASTER_PORT; in a SLURM job started by hydra-submitit-launcher with
several tasks they are exported here from submitit's job environment. The process group is gloo
on CPU and NCCL on CUDA.

Rank 0 alone writes (run dir, metrics, summary, W&B). What it logs is reduced across ranks at the
points where the loop reads values anyway (each metrics flush and each epoch's end), never per step:
the step loss is averaged over ranks, throughput summed, epoch time and peak memory are the
slowest / largest rank's.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import logging
import os
import sys
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from mpexp.errors import ConfigError, reason
from mpexp.launch import is_rank_zero, launched_processes
from mpexp.precision.modes import Precision
from mpexp.shards import dtensor_combines_overflow_flags

log = logging.getLogger(__name__)

STRATEGIES = ("single", "ddp", "fsdp")

# How each per-rank epoch value becomes the logged one; every other epoch value is already the same
# on all ranks (the loss comes from all-reduced step losses, validation runs on identical weights).
EPOCH_REDUCTIONS: dict[str, Callable] = {
    "perf/epoch_time_s": max,
    "perf/samples_per_s": sum,
    "perf/data_wait_s": max,  # the slowest rank's data holds every rank back
    "perf/data_wait_share": max,
    "mem/peak_allocated_mib": max,
    "mem/peak_reserved_mib": max,
    "mem/peak_rss_mib": max,
}

LAUNCH_HINT = (
    "Start one process per device with torchrun, e.g.\n"
    "  torchrun --nproc_per_node=2 -m mpexp.train trainer.strategy=ddp ...\n"
    "or submit a SLURM job with hydra/launcher=slurm_gpu (docs/scaling-out.md)."
)


@dataclass(frozen=True)
class World:
    """This process's place in the run: its rank among `size` processes and its device."""

    device: torch.device
    strategy: str = "single"
    rank: int = 0
    size: int = 1
    backend: str | None = None

    @property
    def is_main(self) -> bool:
        """True on the one process that writes."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.strategy != "single"

    def record(self) -> dict:
        """The facts every run writes under `ran`."""
        return {"strategy": self.strategy, "world_size": self.size, "backend": self.backend}

    def shard(
        self,
        model: nn.Module,
        precision: Precision,
        compile_unit: Callable[[nn.Module], None] | None = None,
    ) -> nn.Module:
        """Under FSDP2, `model` (on this rank's device) sharded unit by unit, each unit handed to
        `compile_unit` first where given (a compiled run: torchtitan compiles each block, then
        shards it); the model as it is otherwise. Call before the optimizer is built: FSDP2
        replaces the parameters with sharded ones."""
        if self.strategy == "fsdp":
            return _fully_shard(model, precision, self.device, self.size, compile_unit)
        return model

    def replicate(self, forward: nn.Module) -> nn.Module:
        """Under DDP, DDP around `forward`: the model with its loss, compiled already where the
        run compiles (nanoGPT's order, compile then wrap: DDP's own code runs before the graph,
        which holds the model and the loss whole); `forward` as it is otherwise."""
        if self.strategy == "ddp":
            ids = [self.device.index] if self.device.type == "cuda" else None
            # the gradients are views of DDP's buckets, not a second copy of them (mpexp-plan
            # counts the buckets, held for the whole run)
            return nn.parallel.DistributedDataParallel(
                forward, device_ids=ids, gradient_as_bucket_view=True
            )
        return forward

    def sync_buffers(self, model: nn.Module) -> None:
        """Under DDP, rank 0's buffers (BatchNorm's statistics) on every rank, as DDP's next
        forward pass would broadcast them: each rank's last training step updated its own."""
        if self.strategy == "ddp":
            for buffer in model.buffers():
                dist.broadcast(buffer, src=0)

    def gather(self, value: Any) -> list:
        """Every rank's `value`, in rank order (a collective; `[value]` in one process)."""
        return gathered(value) if self.distributed else [value]

    def prepare_scaler(self, scaler) -> None:
        """Under FSDP each rank unscales only its own gradient shard, so overflow flags must be
        combined over ranks before the step is taken or skipped; torch's DTensor dispatch does
        that itself where it can, the scaler otherwise. Under DDP gradients are all-reduced
        before unscaling, so every rank already finds the same."""
        if self.strategy == "fsdp" and not dtensor_combines_overflow_flags():
            scaler.skip_together()

    def mean(self, values: torch.Tensor) -> torch.Tensor:
        """The mean of `values` over ranks (a collective: every rank must call it)."""
        total = values.contiguous().clone()
        dist.all_reduce(total)
        return total / self.size

    def any(self, flag: bool) -> bool:
        """True on every rank when `flag` is true on any rank (a collective; reads one value)."""
        if not self.distributed:
            return flag
        value = torch.tensor(float(flag), device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())

    def reduce_epoch(self, row: dict[str, Any]) -> dict[str, Any]:
        """An epoch's metrics with the per-rank ones combined as EPOCH_REDUCTIONS says."""
        if not self.distributed:
            return row
        mine = {k: row[k] for k in EPOCH_REDUCTIONS if k in row}
        every = [None] * self.size
        dist.all_gather_object(every, mine)
        return {**row, **{k: EPOCH_REDUCTIONS[k](r[k] for r in every) for k in mine}}

    def from_rank_zero(self, value: Any) -> Any:
        """Rank 0's `value`, on every rank (e.g. its run dir)."""
        if not self.distributed:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    @torch.no_grad()
    def check_replicas(self, model: nn.Module) -> dict:
        """Under DDP every rank holds a full copy of the weights; compare them bit for bit.

        They can only differ if ranks took different steps (e.g. a rank-local skip decision),
        which silently spoils the run, so a difference is logged as an error and recorded.
        """
        if self.strategy != "ddp":
            return {}
        bits = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])
        low, high = bits.view(torch.int32), bits.view(torch.int32).clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN)
        dist.all_reduce(high, op=dist.ReduceOp.MAX)
        identical = bool(torch.equal(low, high))
        if not identical and self.is_main:
            log.error(
                "DDP replicas diverged: the ranks' weights differ at the end of training, so "
                "they did not all take the same optimizer steps. Results are not trustworthy."
            )
        return {"replicas_identical": identical}


def gathered(value: Any) -> list:
    """Every rank's `value`, in rank order, where a process group is up; `[value]` otherwise.
    For work split by rank whose results every rank needs (a scan of the data at setup)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [value]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, value)
    return every


@contextlib.contextmanager
def start_world(strategy: str, device: torch.device) -> Iterator[World]:
    """Join the process group that the launcher set up (nothing to join for `single`), and leave
    it at the end."""
    world = _join(strategy, device)
    last = None
    try:
        yield world
        if world.distributed:
            # every rank's collectives are done before any rank tears the group down. This
            # thread holds the barrier's handle and frees it: gloo's barrier keeps the
            # collectives before it, and their tensors, until it is freed, and a gloo worker
            # thread that frees a tensor Python made takes the GIL, which aborts the process
            # if Python is shutting down by then (see leave_if_replica)
            last = dist.barrier(async_op=True)
            last.wait()
    finally:
        if world.distributed and dist.is_initialized():
            # what the run left to the garbage collector (FSDP's modules, DDP's reducer, the
            # handles of their collectives) freed now, while Python is whole
            gc.collect()
            dist.destroy_process_group()
            _release_meshes()
        del last  # freed here, by this thread, with the GIL


# the device meshes FSDP2 shards over, made here (weakly: they go with their modules)
_meshes: list[weakref.ref] = []


def _release_meshes() -> None:
    """Let go of the process groups that FSDP2's device meshes still hold, so that each is
    destroyed now, its gloo worker threads joined, rather than in Python's shutdown.

    destroy_process_group forgets the groups, but a DeviceMesh keeps its group (torch 2.14
    holds it in `_pg_registry`) and DTensor's caches keep the mesh: the group's worker threads
    then lived into the interpreter's shutdown, where one that frees a collective's tensor takes
    the GIL and aborts the process ("terminate called without an active exception", seen
    on rank 1 of tests/distributed_checks.py after every check had run)."""
    for ref in _meshes:
        mesh = ref()
        if mesh is not None:
            getattr(mesh, "_pg_registry", {}).clear()  # older torch names its groups only
    _meshes.clear()


# how long the other ranks wait for rank 0's work in `rank_zero_first`: building an image
# cache takes hours on ImageNet, far past a process group's own timeout
RANK_ZERO_FIRST_TIMEOUT = datetime.timedelta(days=2)


@contextlib.contextmanager
def rank_zero_first() -> Iterator[None]:
    """Rank 0 runs the block while the other ranks wait; then they run it (a cache that rank 0
    builds and the others find built). Outside a process group the block just runs. The wait is
    a barrier of a gloo group of its own, with a timeout long enough for a build."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        yield
        return
    patient = dist.new_group(backend="gloo", timeout=RANK_ZERO_FIRST_TIMEOUT)
    if dist.get_rank() != 0:
        dist.barrier(group=patient)
    try:
        yield
    finally:
        if dist.get_rank() == 0:  # the others go on, whether rank 0's block ended well or not
            dist.barrier(group=patient)


def _join(strategy: str, device: torch.device) -> World:
    if strategy == "single":
        tasks = _launched_processes()
        if tasks > 1:
            raise ConfigError(
                f"This is one of {tasks} processes started together, but trainer.strategy=single: "
                "each would train its own copy of the model.\n"
                "Set trainer.strategy=ddp (or fsdp), or start a single process."
            )
        return World(device=device)
    if "RANK" not in os.environ and os.environ.get("SUBMITIT_EXECUTOR"):
        _export_submitit_env()
    if "RANK" not in os.environ:
        raise ConfigError(
            f"trainer.strategy={strategy} runs one process per device, but this process was not "
            f"started by a distributed launcher (RANK is not set).\n{LAUNCH_HINT}"
        )

    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if device.type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise ConfigError(
                f"Local rank {local_rank} has no GPU: this node shows "
                f"{torch.cuda.device_count()}. Start at most one process per GPU "
                "(torchrun --nproc_per_node, or tasks_per_node = gpus_per_node on SLURM)."
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    world = World(device, strategy, rank, size, backend=dist.get_backend())
    if world.is_main:
        log.info("%s over %d processes (%s)", strategy.upper(), size, world.backend)
    else:
        _quiet_logging()
    return world


def _launched_processes() -> int:
    """How many processes a launcher started together with this one (1 for a plain process)."""
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    if os.environ.get("SUBMITIT_EXECUTOR"):
        import submitit

        return submitit.JobEnvironment().num_tasks
    return 1


def _export_submitit_env() -> None:
    """Each task of a SLURM job (or submitit_local job) becomes a rank: submitit knows the job's
    hosts and task ids and exports them as torch's env:// variables."""
    from submitit.helpers import TorchDistributedEnvironment

    # GPUs are picked by LOCAL_RANK, as under torchrun; CUDA_VISIBLE_DEVICES stays as SLURM set it
    TorchDistributedEnvironment().export(set_cuda_visible_devices=False)


def _quiet_logging() -> None:
    """Ranks > 0 keep warnings and errors on the console and add nothing to rank 0's log file.

    Under torchrun Hydra never opened a log file for them (see `hydra_overrides_for_rank`); in a
    multi-task SLURM job Hydra set up every task alike before this code ran, so the handler on the
    shared train.log is closed here.
    """
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, logging.FileHandler):
            root.removeHandler(handler)
            handler.close()
    root.setLevel(logging.WARNING)


def leave_if_replica() -> None:
    """End a torchrun rank other than 0 at once when its run is over, without Python's shutdown.

    Such a rank has written nothing. In Python's shutdown a gloo worker thread may still free a
    finished collective's tensor, which takes the GIL: that aborts the process ("terminate called
    without an active exception", exit -6, about one run in 30 on 2 CPU cores, always rank 1,
    which reaches its shutdown first), and torchrun then fails the whole run after it finished.
    """
    if launched_processes() == 1 or is_rank_zero():
        return
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def hydra_overrides_for_rank(argv: list[str]) -> list[str]:
    """Hydra overrides that keep ranks > 0 of a torchrun launch from writing anything.

    Hydra creates the run dir, writes .hydra/ and opens train.log before `train` starts, and each
    process resolves `${now:...}` on its own, so ranks could even disagree on the dir by a second.
    Ranks > 0 therefore point Hydra at the working directory (it exists, so nothing is created),
    skip .hydra/ and log to the console only; once the process group is up they learn rank 0's
    run dir from rank 0.
    """
    if launched_processes() == 1:
        return []
    if any(arg in ("-m", "--multirun") or arg.startswith("hydra.mode=") for arg in argv):
        raise SystemExit(
            "A sweep (-m) cannot run inside a torchrun launch: every process would start the "
            "sweep on its own.\nStart one torchrun per job, or sweep with a launcher that starts "
            "the processes per job: hydra/launcher=slurm_gpu (docs/scaling-out.md)."
        )
    if is_rank_zero():
        return []
    return [
        "hydra.run.dir=.",
        "hydra.output_subdir=null",
        "hydra/job_logging=stdout",
        "hydra.job_logging.root.level=WARNING",
    ]


def _fsdp2():
    """fully_shard and MixedPrecisionPolicy: public in torch >= 2.6, under _composable before."""
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
        except ImportError:
            raise ConfigError(
                f"trainer.strategy=fsdp needs FSDP2 (fully_shard), which torch {torch.__version__} "
                "lacks; use torch >= 2.4 or trainer.strategy=ddp."
            ) from None
    return fully_shard, MixedPrecisionPolicy


def _fully_shard(
    model: nn.Module,
    precision: Precision,
    device,
    size: int,
    compile_unit: Callable[[nn.Module], None] | None = None,
) -> nn.Module:
    """Shard parameters, gradients and optimizer state over the ranks with FSDP2.

    Parameters are gathered in the precision mode's autocast dtype (fp16 / bf16; fp32 otherwise)
    and gradients reduced in fp32 (in bf16 under pure bf16, as DDP reduces them). BatchNorm
    layers keep fp32 weights (their running statistics are fp32 and batch_norm wants weights and
    statistics in one dtype), so each is its own unit.
    Then every top-level child with parameters is a unit, so that a layer's weights are gathered
    only while it runs, and the root takes whatever is left. A model whose layers are not its
    top-level children names its units itself with `fsdp_units()` (the GPT: its blocks; its
    token embedding, which the output layer uses too, stays with the root, gathered for the whole
    forward pass). Autocast stays on around the forward pass: it still runs softmax, losses and
    reductions in fp32. A model FSDP2 cannot shard stops the run with one message.
    With `compile_unit`, each unit is compiled before it is sharded, as torchtitan compiles its
    blocks: compiled whole, the model would break its graph at every unit's FSDP hooks.
    """
    from torch.distributed.device_mesh import init_device_mesh

    fully_shard, MixedPrecisionPolicy = _fsdp2()
    # an explicit mesh: without one FSDP2 picks CUDA whenever a GPU exists, even for a gloo group
    mesh = init_device_mesh(device.type, (size,))
    _meshes.append(weakref.ref(mesh))
    # pure bf16: its gradients' own dtype, which DDP reduces them in too (docs/precision.md)
    reduce = torch.bfloat16 if precision.pure is not None else torch.float32
    low = MixedPrecisionPolicy(param_dtype=precision.autocast_dtype, reduce_dtype=reduce)
    full = MixedPrecisionPolicy(reduce_dtype=torch.float32)

    units = model.fsdp_units() if hasattr(model, "fsdp_units") else list(model.children())
    try:
        for module in model.modules():
            if isinstance(module, _BatchNorm):
                fully_shard(module, mesh=mesh, mp_policy=full)
        for unit in units:
            if not isinstance(unit, _BatchNorm) and any(True for _ in unit.parameters()):
                if compile_unit is not None:
                    compile_unit(unit)
                fully_shard(unit, mesh=mesh, mp_policy=low)
        fully_shard(model, mesh=mesh, mp_policy=low)
    except (ValueError, RuntimeError, TypeError) as err:
        raise ConfigError(
            f"FSDP2 cannot shard {type(model).__name__} ({reason(err)}). Use "
            "trainer.strategy=ddp, or give the model an fsdp_units() method that lists the "
            "modules to shard one by one."
        ) from None
    return model
