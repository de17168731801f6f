"""A run rehearsed on fake tensors: the parts built as `mpexp-train` builds them (model, precision
with its fp8 conversion or pure bf16 update rounding, loss scaler, optimizer, accumulation), then
one optimizer step through every micro-batch, the diagnostics' pass and one validation batch,
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
from mpexp.plan.live_bytes import LiveBytes
from mpexp.precision.fp8 import convert_to_fp8
from mpexp.precision.fp32_modules import run_in_float32
from mpexp.precision.modes import setup_precision
from mpexp.precision.pure_updates import COMPENSATION, hold_in_bf16
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
    bytes: dict[str, int]  # held between steps: weights, gradients, optimizer, buffers, ...
    peak_bytes: dict[str, int | None]  # train_step, validation (None: could not be followed)
    largest: dict[str, list[dict]]  # per peak, the largest storages live at it
    flops_per_step: float | None  # matrix products of one optimizer step, forward and backward
    samples_per_step: int
    tokens_per_step: int | None
    micro_batch: int  # what one forward takes, in training and validation alike
    processes: int = 1  # the plan is one process's (under torchrun, each holds as much)
    missing: dict[str, str] = field(default_factory=dict)  # a number not given -> why
    # values one optimizer step reads on the host (each a host-device synchronisation on a GPU)
    host_reads: int = 0


def rehearse(
    cfg: DictConfig, device_type: str, micro_batches: int | None = None, processes: int = 1
) -> Rehearsal:
    """Build `cfg`'s run on fake tensors as a run on `device_type` would build it, and follow one
    optimizer step and one validation batch. A config the run would refuse is refused here with
    the same message (ConfigError).

    `micro_batches` rehearses that many of the step's micro-batches instead of all: from the
    second on, each holds what the one before it held (the gradients being summed into), so two
    reach the whole step's peak; the FLOPs are counted for all of them. With `processes` (under
    torchrun), one process is rehearsed: its share of the batch and of the micro-batches
    (mpexp/batches.py), its replica of the model; the FLOPs are all processes'."""
    rewrite_targets(cfg)
    validate(cfg)
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
    with FakeTensorMode(allow_non_fake_inputs=True), stage.tracker:
        try:
            stage.build(meta, precision, what, tuning)
            stage.step(micro_batches)
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
        self.model = self.optimizer = None
        self.parameters = self.trainable = 0
        kinds = ("weights", "gradients", "optimizer", "compensation", "buffers", "weight_average")
        self.held = dict.fromkeys(kinds, 0)
        self.average = None
        self.missing: dict[str, str] = {}
        self.precision_name = ""
        self._handles: list = []

    def build(self, meta: torch.nn.Module, precision, what: str, tuning: FineTuning) -> None:
        """The model as the run has it when its first step starts, its loss scaler and
        optimizer (mpexp/build.py's order)."""
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
        fp32_modules = list(cfg.precision.fp32_modules)
        model, precision = convert_to_fp8(model, precision, fp32_modules, compiled=False)
        run_in_float32(model, fp32_modules, precision)
        sharded = cfg.trainer.strategy == "fsdp"
        tuning.hold_frozen(model, precision.autocast_dtype, fp32_modules, sharded)
        speed = _speed_for(performance.plan_speed(cfg, CPU), cfg, self.device_type)
        if speed.channels_last:  # as the run's model.to(memory_format=...), which fake
            for p in model.parameters():  # parameters refuse (it swaps tensors)
                if p.dim() == 4:
                    p.data = p.data.contiguous(memory_format=torch.channels_last)
        skip = cfg.trainer.on_nonfinite_loss == "skip"
        self.scaler = build_scaler(cfg.loss_scaling, precision, CPU, skip)
        fused = performance.choose_fused(cfg, torch.device(self.device_type), self.scaler, speed)
        speed = dataclasses.replace(speed, fused=fused)
        self.optimizer = performance.build_optimizer(cfg, model, CPU, self.scaler, speed)
        self.diagnostics = Diagnostics(
            cfg.diagnostics, model, self.scaler, None, precision, self.optimizer
        )
        # trainer.ema_decay's fp32 copy of the weights, made where the loop makes it
        self.average = weight_average(cfg.trainer, model)
        self.model, self.precision, self.speed = model, precision, speed
        # what the loop calls: the model with its task's loss, as one module (compiled whole)
        self.objective = Objective(model, task)
        self._handles = self.tracker.watch(model)

    def step(self, micro_batches: int | None) -> None:
        """One optimizer step through `micro_batches` of the step's micro-batches (all: None),
        after a first step that makes the optimizer's states."""
        inputs, targets = self.task.example(self.batch, CPU)
        if inputs.dim() == 4:  # images, as the data hands them to a channels-last step
            inputs = inputs.contiguous(memory_format=self.speed.memory_format())
        # a first update makes the optimizer's states (and pure bf16's compensation), which
        # every later step holds through its forward and backward
        for p in self.model.parameters():
            if p.requires_grad:  # frozen weights (model.freeze, LoRA's base) get none
                p.grad = torch.zeros_like(p)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.tracker.start("train_step")
        inspect = self.diagnostics.inspector(0)
        if inspect is not None:  # the diagnostics' pass before the step, where one is due
            self.diagnostics.measure_attention(0, inputs.chunk(self.accumulate))
        self.tracker.count_flops = True  # the step's own FLOPs
        self.rehearsed = min(micro_batches or self.accumulate, self.accumulate)
        size = self.rehearsed * self.micro
        self._train_step(inputs[:size], targets[:size], self.rehearsed, inspect)
        self.tracker.count_flops = False

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
        self.held = held_bytes(self.model, self.optimizer, self.tracker, self.average)
        self.optimizer.zero_grad(set_to_none=True)  # as the loop does after each step

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
            self.held["weights"] = self.tracker.live_bytes(list(self.model.parameters()))

    def stop_watching(self) -> None:
        for handle in self._handles:
            handle.remove()

    def rehearsal(self) -> Rehearsal:
        peaks = {
            phase: self.tracker.peaks[phase].nbytes
            if phase in self.tracker.peaks and phase not in self.missing else None
            for phase in ("train_step", "validation")
        }  # fmt: skip
        tokens = getattr(self.task, "block_size", None)
        counted = "flops_per_step" not in self.missing
        return Rehearsal(
            precision=self.precision_name,
            device=self.device_type,
            parameters=self.parameters,
            trainable_parameters=self.trainable,
            bytes=self.held,
            peak_bytes=peaks,
            largest={phase: self.tracker.largest_at(phase) for phase in peaks if peaks[phase]},
            flops_per_step=self.tracker.flops * self.accumulate / self.rehearsed
            * self.split.processes
            if counted else None,
            samples_per_step=self.split.batch,
            tokens_per_step=self.split.batch * tokens if tokens else None,
            micro_batch=self.micro,
            processes=self.split.processes,
            missing=self.missing,
            host_reads=self.tracker.host_reads.get("train_step", 0),
        )  # fmt: skip


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


def _speed_for(speed, cfg: DictConfig, device_type: str):
    """The memory format a run on `device_type` trains in (channels_last: on by default on CUDA)."""
    channels_last = cfg.trainer.channels_last
    if channels_last is None:
        channels_last = device_type == "cuda"
    return dataclasses.replace(speed, channels_last=bool(channels_last))


def held_bytes(model, optimizer, tracker: LiveBytes, average=None) -> dict[str, int]:
    """What stays between steps, by kind, each storage counted once; the storages named, so that
    the lists of the largest tensors say whose they are."""
    weights = list(model.parameters())
    names = {id(p): n for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        tracker.name(p, f"weight {n}")
        if p.grad is not None:
            tracker.name(p.grad, f"gradient of {n}")
    grads = [p.grad for p in weights if p.grad is not None]
    states, compensation = [], []
    for p, state in optimizer.state.items():
        for key, value in state.items():
            if not isinstance(value, torch.Tensor) or value.ndim == 0:
                continue  # step counters
            tracker.name(value, f"{key} of {names.get(id(p), 'a parameter')}")
            (compensation if key == COMPENSATION else states).append(value)
    return {
        "weights": tracker.live_bytes(weights),
        "gradients": tracker.live_bytes(grads),
        "optimizer": tracker.live_bytes(states + compensation),
        "compensation": tracker.live_bytes(compensation),
        # BatchNorm's statistics, fp8's amax histories where a recipe keeps them
        "buffers": tracker.live_bytes(list(model.buffers())),
        "weight_average": tracker.live_bytes(average.average) if average is not None else 0,
    }


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
