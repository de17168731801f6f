"""A run rehearsed on fake tensors: the parts built as `mpexp-train` builds them for the planned
device (model, precision with its fp8 conversion or pure bf16 update rounding, loss scaler,
optimizer, accumulation, DDP's buckets, the data it keeps on the device), then two optimizer
steps (the first makes the optimizer's states, which the second holds throughout, as every
later step does) through every micro-batch, the diagnostics' pass and one validation batch,
with every storage followed (mpexp/plan/live_bytes.py) and every matrix product counted.

Fake tensors carry shapes, dtypes and devices but no data: nothing is computed and no data is read
beyond what the shapes need (`TrainingData.planned_task`). They are made on the CPU, where
PyTorch's autograd engine runs without a GPU: a CUDA run is rehearsed with the choices it would
make on CUDA (the fused optimizer, fp8 matrix products rather than their CPU emulation), under
CPU autocast, whose op lists put the same matrix products in 16 bits. The rehearsal runs eagerly:
torch.compile's fusions, where the run compiles, only lower the real peak.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
from dataclasses import dataclass, field

import torch
from omegaconf import DictConfig
from torch._subclasses.fake_tensor import FakeTensorMode

from mpexp.batches import BatchSplit
from mpexp.build import (
    build,
    checked,
    fake_tensor_limit,
    model_trial,
    output_shape,
    with_objective,
)
from mpexp.errors import reason
from mpexp.finetune.prepare import FineTuning, fine_tune, import_peft_if_asked
from mpexp.plan.held import allocate_data, held_bytes, nothing_held
from mpexp.plan.live_bytes import LiveBytes
from mpexp.plan.sharing import Buckets, fsdp_share
from mpexp.precision.fp8 import convert_to_fp8
from mpexp.precision.fp32_modules import run_in_float32
from mpexp.precision.modes import setup_precision
from mpexp.precision.pure_updates import hold_in_bf16
from mpexp.precision.scaling import build_scaler
from mpexp.step import performance
from mpexp.step.diagnostics import Diagnostics
from mpexp.step.objective import Objective
from mpexp.step.train_step import train_step
from mpexp.step.validation import evaluate
from mpexp.step.weight_average import weight_average
from mpexp.targets import rewrite_targets
from mpexp.validate import validate

log = logging.getLogger(__name__)

CPU = torch.device("cpu")


@dataclass
class Rehearsal:
    """What one configuration needs, in bytes and FLOPs (see `rehearse`)."""

    precision: str
    device: str  # the device type rehearsed for: cuda or cpu
    parameters: int
    trainable_parameters: int  # those with gradients and optimizer states
    bytes: dict[str, int]  # held from step to step, by kind (mpexp/plan/held.py's HELD)
    peak_bytes: dict[str, int | None]  # train_step, validation (None: could not be followed)
    # what validation allocates beyond what it starts with (beside a captured step's pool)
    validation_extra: int | None
    largest: dict[str, list[dict]]  # per peak, the largest storages live at it
    flops_per_step: float | None  # matrix products of one optimizer step, forward and backward
    samples_per_step: int
    tokens_per_step: int | None
    micro_batch: int  # what one forward takes, in training and validation alike
    processes: int = 1  # the plan is one process's (under torchrun, each holds as much)
    missing: dict[str, str] = field(default_factory=dict)  # a number not given -> why
    # values one optimizer step reads on the host (each a host-device synchronisation on a GPU)
    host_reads: int = 0
    captured: bool = False  # the step runs as a CUDA graph, in a memory pool of its own
    strategy: str = "single"
    estimated: list[str] = field(default_factory=list)  # numbers estimated, not rehearsed
    # pure bf16's update workspace: its elements and bytes at most (None: no such optimizer)
    workspace: dict | None = None


def rehearse(
    cfg: DictConfig, device_type: str, micro_batches: int | None = None, processes: int = 1
) -> Rehearsal:
    """Build `cfg`'s run on fake tensors as a run on `device_type` would build it, and follow two
    optimizer steps and one validation batch. A config the run would refuse is refused here
    with the same message (ConfigError).

    `micro_batches` rehearses that many of the step's micro-batches instead of all: from the
    second on, each holds what the one before it held (the gradients being summed into), so two
    reach the whole step's peak; the FLOPs are counted for all of them. With `processes` (under
    torchrun), one process is rehearsed: its share of the batch and of the micro-batches
    (mpexp/batches.py), its replica of the model; the FLOPs are all processes'."""
    rewrite_targets(cfg)
    validate(cfg)
    # pure bf16 counts its lost updates on each log interval's last step, through a float32
    # workspace: the second rehearsed step is such a step
    cfg.trainer.log_every = 2
    with quiet():  # the emulation and TF32 warnings speak of this CPU, not of the planned device
        precision = setup_precision(cfg.precision, CPU)
    if device_type == "cuda":  # what runs on the GPU: no emulation, fp8 products in fp8
        precision = dataclasses.replace(precision, emulated=False)
    data = build(cfg.dataset)
    task = data.planned_task()
    if task is None:  # the shapes need the data: set it up as the run would
        task = data.setup(CPU)
    data.task = task = with_objective(task, cfg.trainer)
    what = f"model={cfg.model._target_}"
    import_peft_if_asked(cfg.model)
    with model_trial(task, what), torch.device("meta"):  # no memory, and no initialisation
        meta = build(cfg.model, **task.model_kwargs())
        # LoRA's adapters and frozen weights, as the run adds them to the model as built
        tuning = fine_tune(meta, cfg.model, pure=precision.pure is not None)
    stage = Stage(
        cfg, data, device_type, BatchSplit(data.batch_size, cfg.trainer.accumulate, processes)
    )
    with FakeTensorMode(allow_non_fake_inputs=True), stage.tracker, quiet():
        try:
            stage.build(meta, precision, what, tuning)
            stage.steps(micro_batches)
            stage.validate()
        except RuntimeError as err:
            if not fake_tensor_limit(err):
                raise
            stage.cannot(err)
        finally:
            stage.stop_watching()
    return stage.rehearsal()


class Stage:
    """One rehearsal's parts and what it has measured so far (see `rehearse`)."""

    def __init__(self, cfg: DictConfig, data, device_type: str, split: BatchSplit) -> None:
        self.cfg, self.data, self.task = cfg, data, data.task
        self.device_type = device_type
        self.tracker = LiveBytes()
        self.split = split
        self.batch = split.per_process  # what one process takes a step
        self.accumulate = split.accumulate_per_process
        self.micro = split.micro_batch
        self.rehearsed = self.accumulate
        self.model = self.optimizer = self.average = self.buckets = None
        self.parameters = self.trainable = 0
        self.held = nothing_held()
        self.extras: dict[str, list[torch.Tensor]] = {}
        self.missing: dict[str, str] = {}
        self.precision_name = ""
        self.captured = False
        self.host_reads = 0
        self._handles: list = []

    def build(self, meta: torch.nn.Module, precision, what: str, tuning: FineTuning) -> None:
        """The model as the run has it when its first step starts, its loss scaler and
        optimizer (mpexp/build.py's order), and what the data keeps on the device."""
        cfg, task = self.cfg, self.task
        self.precision_name = precision.mode
        bf16 = torch.bfloat16 if precision.pure is not None else None
        model = materialize(meta, bf16)
        if precision.pure is not None:
            # its weights are bfloat16 already: the hooks
            model = hold_in_bf16(model, not self.task.takes_16_bit_output)
        self.model = model
        self.parameters = sum(p.numel() for p in model.parameters())
        self.trainable = tuning.trainable
        with model_trial(task, what):
            shape = output_shape(model, task)
        checked(model, shape, task, what)
        device = torch.device(self.device_type)  # the planned one: no tensor is made there
        speed = performance.for_model(performance.plan_speed(cfg, device), cfg, model, task)
        self.captured = speed.cuda_graph
        fp32_modules = list(cfg.precision.fp32_modules)
        model, precision = convert_to_fp8(model, precision, fp32_modules, compiled=False)
        run_in_float32(model, fp32_modules, precision)
        sharded = cfg.trainer.strategy == "fsdp"
        tuning.hold_frozen(model, precision.autocast_dtype, fp32_modules, sharded)
        if speed.channels_last:  # as the run's model.to(memory_format=...), which fake
            for p in model.parameters():  # parameters refuse (it swaps tensors)
                if p.dim() == 4:
                    p.data = p.data.contiguous(memory_format=torch.channels_last)
        if cfg.trainer.strategy == "ddp":  # its buckets, made as it wraps the model
            self.buckets = Buckets(model)
            self.extras["ddp_buckets"] = self.buckets.storages()
        skip = cfg.trainer.on_nonfinite_loss == "skip"
        self.scaler = build_scaler(cfg.loss_scaling, precision, CPU, skip)
        # as the run builds it on the planned device (fused or not, pure bf16's chunks), but
        # not capturable: its step count would have to be on a GPU
        uncaptured = dataclasses.replace(speed, cuda_graph=False)
        self.optimizer = performance.build_optimizer(cfg, model, device, self.scaler, uncaptured)
        self.diagnostics = Diagnostics(
            cfg.diagnostics, model, self.scaler, None, precision, self.optimizer
        )
        # trainer.ema_decay's fp32 copy of the weights, made where the loop makes it
        self.average = weight_average(cfg.trainer, model)
        if self.average is not None:
            self.extras["weight_average"] = self.average.average
        kinds = self.data.device_bytes(self.device_type, self.batch)
        self.extras.update(allocate_data(self.tracker, kinds))
        self.model, self.precision, self.speed = model, precision, speed
        # what the loop calls: the model with its task's loss, as one module (compiled whole)
        self.objective = Objective(model, task)
        self._handles = self.tracker.watch(model)

    def steps(self, micro_batches: int | None) -> None:
        """Two optimizer steps through `micro_batches` of the step's micro-batches each (all:
        None): the first makes the optimizer's states (and pure bf16's compensation), which
        the second holds through its forward and backward passes, as every later step does.
        The step's peak is the larger."""
        inputs, targets = self.task.example(self.batch, CPU)
        if inputs.dim() == 4:  # images, as the data hands them to a channels-last step
            inputs = inputs.contiguous(memory_format=self.speed.memory_format())
        self.rehearsed = min(micro_batches or self.accumulate, self.accumulate)
        size = self.rehearsed * self.micro
        self.tracker.start("train_step")
        self._train_step(inputs[:size], targets[:size], self.rehearsed, None)
        first = self.tracker.host_reads.get("train_step", 0)
        # the diagnostics' pass, where one is due: on the step that holds the states
        inspect = self.diagnostics.inspector(0)
        if inspect is not None:
            self.diagnostics.measure_attention(0, inputs.chunk(self.accumulate))
        self.tracker.count_flops = True  # one step's FLOPs, and its host reads
        self._train_step(inputs[:size], targets[:size], self.rehearsed, inspect)
        self.tracker.count_flops = False
        self.host_reads = self.tracker.host_reads.get("train_step", 0) - first

    def _train_step(self, inputs, targets, accumulate: int, inspect) -> None:
        clip = self.cfg.trainer.clip_grad_norm
        p = self
        train_step(
            p.objective, inputs, targets, p.optimizer, p.scaler, p.precision, accumulate, clip,
            inspect=inspect, loss_fn=None,
        )  # fmt: skip
        self.scaler.update()
        if self.average is not None:  # an update is due at every ema_every-th step
            self.average.after_step(self.average.every)
        fp8 = self.precision.fp8.converted if self.precision.fp8 is not None else ()
        self.held = held_bytes(self.tracker, self.model, self.optimizer, self.extras, fp8)
        self.optimizer.zero_grad(set_to_none=True)  # as the loop does after each step
        if self.buckets is not None:
            self.buckets.point()

    def validate(self) -> None:
        """One validation batch, as validation runs it: in the step's micro-batches (as many
        of them as the step rehearsed: each holds what the one before it held)."""
        self.tracker.start("validation")
        inputs, targets = self.task.example(self.batch, CPU)  # the batch as the data hands it
        size = min(self.batch, self.rehearsed * self.micro)
        batches = [(inputs[:size], targets[:size])]
        passes = [contextlib.nullcontext()]
        if self.average is not None:  # validated again with the average swapped in
            passes.append(self.average.swapped_in())
        for weights in passes:
            with weights:
                evaluate(self.objective, self.data, CPU, self.precision, batches=batches,
                         micro_batch=self.micro)  # fmt: skip

    def cannot(self, err: RuntimeError) -> None:
        """What fake tensors cannot run (a custom kernel without a shape rule, a value read on
        the host): the numbers that need it are not given, and the plan says why."""
        op = getattr(err, "func", None)
        named = re.search(r"CustomOpDef\((.+?)\)", str(err))
        if named:
            op = f"{named[1]} (a custom operator with no fake implementation: its register_fake)"
        why = f"fake tensors cannot run {op or reason(err)}, so no peak or FLOPs are planned"
        for phase in ("train_step", "validation", "flops_per_step"):
            self.missing[phase] = why
        if self.model is not None:
            weights = self.tracker.live_bytes(list(self.model.parameters()))
            self.held = {**nothing_held(), "weights": weights}

    def stop_watching(self) -> None:
        for handle in self._handles:
            handle.remove()

    def rehearsal(self) -> Rehearsal:
        peaks = {
            phase: self.tracker.peaks[phase].nbytes
            if phase in self.tracker.peaks and phase not in self.missing else None
            for phase in ("train_step", "validation")
        }  # fmt: skip
        largest = {phase: self.tracker.largest_at(phase) for phase in peaks if peaks[phase]}
        extra = None
        if peaks["validation"] is not None:
            extra = peaks["validation"] - self.tracker.peaks["validation"].base
        held, estimated = self.held, []
        strategy = self.cfg.trainer.strategy
        if strategy == "fsdp" and self.model is not None and not self.missing:
            held, peaks = self._fsdp_share(peaks)
            estimated.append("fsdp")
        tokens = getattr(self.task, "block_size", None)
        counted = "flops_per_step" not in self.missing
        return Rehearsal(
            precision=self.precision_name,
            device=self.device_type,
            parameters=self.parameters,
            trainable_parameters=self.trainable,
            bytes=held,
            peak_bytes=peaks,
            validation_extra=extra,
            largest=largest,
            flops_per_step=self.tracker.flops * self.accumulate / self.rehearsed
            * self.split.processes
            if counted else None,
            samples_per_step=self.split.batch,
            tokens_per_step=self.split.batch * tokens if tokens else None,
            micro_batch=self.micro,
            processes=self.split.processes,
            missing=self.missing,
            host_reads=self.host_reads,
            captured=self.captured,
            strategy=strategy,
            estimated=estimated,
            workspace=getattr(self.optimizer, "workspace_plan", lambda: None)(),
        )  # fmt: skip

    def _fsdp_share(self, peaks: dict) -> tuple[dict, dict]:
        """One FSDP rank's bytes and peaks (mpexp/plan/sharing.py), its units gathered in the
        autocast dtype and its gradients reduced in float32 (bfloat16 under pure bf16), as
        mpexp/distributed.py shards the model."""
        p = self.precision
        reduce = torch.bfloat16 if p.pure is not None else torch.float32
        compute = p.autocast_dtype or torch.float32
        processes = self.split.processes
        return fsdp_share(self.held, peaks, self.model, compute, reduce, processes)


def materialize(meta: torch.nn.Module, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """The meta-device model with fake CPU tensors for its parameters and buffers (floating ones
    in `dtype`, where given), shared parameters kept shared. Assigned rather than converted by
    `Module.to`, which swaps a tensor subclass's objects and fails on fake tensors."""
    made: dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            cast = dtype if dtype is not None and t.is_floating_point() else t.dtype
            new = torch.empty_like(t, device="cpu", dtype=cast)
            if isinstance(t, torch.nn.Parameter):
                new = torch.nn.Parameter(new, requires_grad=t.requires_grad)
            made[id(t)] = new
        return made[id(t)]

    for module in meta.modules():
        for group in (module._parameters, module._buffers):
            for name, t in group.items():
                if t is not None:
                    group[name] = fake(t)
    return meta


@contextlib.contextmanager
def quiet():
    """mpexp's warnings off while the rehearsal builds what they would speak of."""
    logger = logging.getLogger("mpexp")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
