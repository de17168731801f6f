"""The training entrypoint: `python -m mpexp.train [group=option ...] [key=value ...]`.

`main` is a thin Hydra shell; `train(cfg, run)` does the work and can be called from Python.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, replace
from itertools import islice
from pathlib import Path

import hydra
import torch
import torch.nn.functional as F
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import get_object
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from mpexp import __version__, performance
from mpexp.checkpoint import Checkpointer, Position, Preempted, StopSignals, open_resume
from mpexp.data.base import InMemoryData
from mpexp.diagnostics import Diagnostics
from mpexp.distributed import World, hydra_overrides_for_rank, start_world
from mpexp.errors import ConfigError, NumericsError, UserError
from mpexp.history import StepHistory, StepRow
from mpexp.hydra_hooks import register_resolvers
from mpexp.precision import Precision, run_in_float32, setup_precision
from mpexp.scaling import LossScaler, build_scaler
from mpexp.schedules import build_schedule
from mpexp.system import (
    PeakMemory,
    device_name,
    resolve_device,
    seed_everything,
    set_deterministic,
    synchronize,
)
from mpexp.tracking import NullTracker, RunContext, Tracker, record_failure
from mpexp.validate import validate, validate_run_length

log = logging.getLogger("mpexp")
register_resolvers()  # conf/train.yaml's hydra.run.dir uses mpexp.run_dir


def build(node: DictConfig, **extra):
    """Instantiate a group's `_target_` with its keys, except the descriptive `name`."""
    kwargs = {k: v for k, v in OmegaConf.to_container(node, resolve=True).items() if k != "name"}
    return get_object(kwargs.pop("_target_"))(**kwargs, **extra)


@dataclass
class Stepper:
    """What one training step touches; `step` is the loop's whole per-step work."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: LossScaler
    precision: Precision
    history: StepHistory
    diagnostics: Diagnostics
    accumulate: int = 1
    clip_grad_norm: float | None = None

    def step(self, step: int, images: torch.Tensor, labels: torch.Tensor) -> None:
        """The optimizer step, its history row and the scale update. No host-device
        synchronisation: a GPU test runs this in CUDA's sync-debug error mode."""
        lr = self.optimizer.param_groups[0]["lr"]  # read first: a real step advances the schedule
        loss = train_step(
            self.model,
            images,
            labels,
            self.optimizer,
            self.scaler,
            self.precision,
            self.accumulate,
            self.clip_grad_norm,
            inspect=self.diagnostics.inspector(step),
        )
        # between step() and update(): the scale this step used and whether it was skipped
        self.history.record(step, lr, loss, self.scaler.scale_tensor(), self.scaler.found_inf())
        self.scaler.update()
        self.diagnostics.after_update(step)
        self.optimizer.zero_grad(set_to_none=True)


def train_step(
    model,
    images,
    labels,
    optimizer,
    scaler: LossScaler,
    precision: Precision,
    accumulate: int = 1,
    clip_grad_norm: float | None = None,
    inspect=None,
):
    """One optimizer step; the same code for every precision and loss-scaling strategy.

    The batch is split into `accumulate` micro-batches, each scaled and back-propagated on its own;
    their losses are weighted by size so the gradients add up to the whole batch's. `inspect`, if
    given, sees the gradients in true units before clipping (diagnostics).
    """
    total = torch.zeros((), device=labels.device)
    chunks = list(zip(images.chunk(accumulate), labels.chunk(accumulate), strict=True))
    for i, (x, y) in enumerate(chunks):
        # under DDP, all-reduce the gradients once, with the last micro-batch's backward
        last = i == len(chunks) - 1
        with _no_grad_sync(model, last):
            with precision.autocast():  # forward only: backward runs outside autocast
                loss = F.cross_entropy(model(x), y) * (len(y) / len(labels))
            scaler.scale(loss).backward()
        total += loss.detach()
    scaler.unscale_(optimizer)  # once, after the last micro-batch: true units from here on
    if inspect is not None:
        inspect()
    if clip_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)
    scaler.step(optimizer)  # skipped when the gradients (or the loss) are not finite
    return total


def _no_grad_sync(model, last: bool) -> contextlib.AbstractContextManager:
    if last or not hasattr(model, "no_sync"):  # DDP has no_sync; a plain module needs none
        return contextlib.nullcontext()
    return model.no_sync()


@torch.no_grad()
def evaluate(model, data: InMemoryData, device, precision: Precision) -> tuple[float, float]:
    """Validation loss and accuracy, accumulated on the device and read once."""
    model.eval()
    total = torch.zeros(3, device=device)  # loss sum, correct, count
    for images, labels in data.val_batches(device):
        with precision.autocast():
            logits = model(images)
        loss = F.cross_entropy(logits.float(), labels, reduction="sum")
        correct = (logits.argmax(1) == labels).sum()
        total += torch.stack((loss, correct.float(), torch.tensor(len(labels), device=device)))
    model.train()
    loss_sum, correct, count = total.tolist()
    return loss_sum / count, correct / count


def train(cfg: DictConfig, run: RunContext) -> dict:
    """Train as `cfg` says, log to `run.run_dir` (and W&B), return the final metrics.

    With `trainer.resume`, continue that run instead: in its directory, under its W&B run id.
    """
    validate(cfg)
    resume = open_resume(cfg)
    if resume is not None and cfg.trainer.strategy == "fsdp":
        raise ConfigError("trainer.resume is not supported with trainer.strategy=fsdp yet.")
    set_deterministic(cfg.trainer.deterministic)
    with start_world(cfg.trainer.strategy, resolve_device(cfg.trainer.device)) as world:
        return _train(cfg, run, world, resume)


def _train(cfg: DictConfig, run: RunContext, world: World, resume) -> dict:
    if resume is not None:
        if world.is_main:
            resume.rewind()
        run = replace(run, run_dir=resume.run_dir, wandb_id=resume.wandb_id)
        at = resume.position
        log.info(
            "Resuming %s: epoch %d, batch %d, step %d", resume.path, at.epoch, at.batch, at.step
        )
    run = world.from_rank_zero(run)  # all ranks know where rank 0 writes
    device = world.device
    seed_everything(cfg.trainer.seed)
    precision = setup_precision(cfg.precision.name, device)

    data: InMemoryData = build(cfg.dataset)
    info = data.setup(device)
    data.memory_format = performance.memory_format(cfg.trainer.channels_last)
    data.shard(world.rank, world.size)
    model = build(
        cfg.model,
        in_channels=info.channels,
        num_classes=info.num_classes,
        image_size=(info.height, info.width),
    ).to(device)
    parameters = sum(p.numel() for p in model.parameters())
    fp32_modules = run_in_float32(model, list(cfg.precision.fp32_modules), precision)
    performance.apply_memory_format(model, cfg.trainer)  # before DDP/FSDP takes the parameters
    model = world.wrap(model, precision)
    skip_nonfinite = cfg.trainer.on_nonfinite_loss == "skip"
    scaler = build_scaler(cfg.loss_scaling, precision, device, skip_nonfinite_loss=skip_nonfinite)
    world.prepare_scaler(scaler)
    optimizer = performance.build_optimizer(cfg, model, device, scaler)
    total_steps = data.steps_per_epoch() * cfg.trainer.epochs
    validate_run_length(cfg, total_steps)
    schedule = build_schedule(cfg.scheduler, optimizer, scaler, total_steps)
    performance.configure_backends(device, cfg.trainer)
    forward = performance.compile_model(model, cfg.trainer)

    ran = {
        "device": str(device),
        "device_name": device_name(device),
        "torch_version": torch.__version__,
        "mpexp_version": __version__,
        **precision.record(),
        **scaler.describe(),
        **performance.describe(optimizer, cfg.trainer),
        **world.record(),
        "fp32_modules": fp32_modules,
        "scheduler": cfg.scheduler.name,
        "accumulate": cfg.trainer.accumulate,
        "clip_grad_norm": cfg.trainer.clip_grad_norm,
        "parameters": parameters,
        "steps_per_epoch": data.steps_per_epoch(),
        "deterministic": cfg.trainer.deterministic,
    }
    log.info(
        "Training %s on %s (%d samples) | %s on %s | precision %s (autocast %s, TF32 %s) | "
        "loss scaling %s",
        cfg.model.name,
        cfg.dataset.name,
        data.train_size,
        f"{ran['parameters']:,} parameters",
        ran["device_name"],
        precision.mode,
        ran["autocast_dtype"],
        "on" if ran["tf32_matmul"] else "off",
        ran["loss_scaling"],
    )
    config = {**OmegaConf.to_container(cfg, resolve=True), "ran": ran}
    tracker = Tracker(run, config, cfg.wandb) if world.is_main else NullTracker(run.run_dir)
    # rank 0 writes checkpoints; the other ranks hold the same replicated state (DDP)
    saver = Checkpointer(cfg, run.overrides, device, model, optimizer, scaler, tracker, schedule)
    try:
        with StopSignals() as stop:
            summary = _fit(
                cfg,
                forward,
                data,
                optimizer,
                scaler,
                precision,
                tracker,
                saver,
                resume,
                stop,
                world,
            )
        summary["ran"] = {**ran, "final_scale": summary.pop("amp/final_scale"), **scaler.outcome()}
        summary["ran"].update(world.check_replicas(model))
        tracker.update_summary(summary)
    except (Preempted, KeyboardInterrupt):
        tracker.close("interrupted")
        raise
    except BaseException:
        with contextlib.suppress(OSError):  # a full disk must not hide the error that stopped us
            tracker.close("failed")
        raise
    tracker.close("finished")
    return summary


class StepLog:
    """Writes flushed step rows as metrics; keeps the running skip count and the epoch's losses.

    A non-finite loss stops the run (trainer.on_nonfinite_loss=raise) or is counted (skip: the
    scaler has already skipped that step on the device).
    """

    def __init__(self, tracker: Tracker, on_nonfinite_loss: str = "raise"):
        self.tracker = tracker
        self.skip_nonfinite = on_nonfinite_loss == "skip"
        self.skipped = 0
        self.nonfinite_losses = 0
        self.last_finite: tuple[int, float] | None = None
        self.last_scale = float("nan")
        self.losses: list[float] = []

    def write(self, rows: list[StepRow]) -> None:
        for r in rows:
            if math.isfinite(r.loss):
                self.last_finite = (r.step, r.loss)
            elif self.skip_nonfinite:
                self.nonfinite_losses += 1
            else:
                raise self._nonfinite_error(r)
            self.skipped += r.skipped
            self.last_scale = r.scale
            self.losses.append(r.loss)
            row = {
                "step": r.step,
                "train/loss": r.loss,
                "amp/scale": r.scale,
                "amp/skipped_steps": self.skipped,
                "lr": r.lr,
            }
            if self.skip_nonfinite:
                row["amp/nonfinite_loss_steps"] = self.nonfinite_losses
            self.tracker.log(row)

    def epoch_loss(self) -> float:
        finite = [x for x in self.losses if math.isfinite(x)]
        return sum(finite) / len(finite) if finite else float("nan")

    def _nonfinite_error(self, row: StepRow) -> NumericsError:
        last = (
            f"the last finite loss was {self.last_finite[1]:.4g} at step {self.last_finite[0]}"
            if self.last_finite
            else "no earlier step had a finite loss"
        )
        return NumericsError(
            f"The training loss became {row.loss} at step {row.step}; {last}. The loss is computed "
            "before loss scaling, so scaling neither caused this nor can fix it: the forward pass "
            "itself produced inf/NaN (diverging weights, or activations beyond the format's "
            "range). Lower the learning rate (optimizer.lr=...), clip gradients "
            "(trainer.clip_grad_norm=1.0), run sensitive layers in float32 "
            "(precision.fp32_modules=[...]) or use bf16 (precision=bf16); "
            "trainer.on_nonfinite_loss=skip skips such steps and counts them instead."
        )


def _fit(
    cfg, model, data, optimizer, scaler, precision, tracker, saver, resume, stop, world
) -> dict:
    epochs, seed, log_every = cfg.trainer.epochs, cfg.trainer.seed, cfg.trainer.log_every
    device = world.device
    # in a distributed run each flush averages the losses over ranks (one collective per flush)
    history = StepHistory(reduce_loss=world.mean if world.distributed else None)
    memory = PeakMemory(device)
    steps = StepLog(tracker, cfg.trainer.on_nonfinite_loss)
    diagnostics = Diagnostics(cfg.diagnostics, model, scaler, tracker)
    stepper = Stepper(
        model,
        optimizer,
        scaler,
        precision,
        history,
        diagnostics,
        cfg.trainer.accumulate,
        cfg.trainer.clip_grad_norm,
    )
    hide_bar = {"auto": None, True: False, False: True}[cfg.trainer.progress]
    hide_bar = hide_bar if world.is_main else True
    # FSDP holds each rank's shard of the weights; saving them needs torch.distributed.checkpoint
    sharded = cfg.trainer.strategy == "fsdp"
    if sharded:
        log.warning(
            "trainer.strategy=fsdp writes no checkpoints yet: a stopped FSDP run starts over."
        )
    at, row, resumed_time = Position(), None, 0.0
    if resume is not None:
        at = resume.restore(saver.model, optimizer, scaler, device, saver.schedule)
        carried = resume.log_state
        steps.skipped, steps.last_scale = carried["skipped"], carried["last_scale"]
        steps.nonfinite_losses = carried["nonfinite_losses"]
        diagnostics.floor_hits = carried["floor_hits"]
        steps.last_finite = tuple(carried["last_finite"]) if carried["last_finite"] else None
        steps.losses, row = carried["losses"], carried["epoch_row"]
        resumed_time = carried["elapsed"]  # of the epoch in progress, before the checkpoint
    step = at.step
    model.train()

    def checkpoint(position: Position, elapsed: float, stopping: bool) -> None:
        log_state = {
            "skipped": steps.skipped,
            "last_scale": steps.last_scale,
            "nonfinite_losses": steps.nonfinite_losses,
            "last_finite": steps.last_finite,
            "floor_hits": diagnostics.floor_hits,
            "losses": steps.losses,
            "elapsed": elapsed,
            "epoch_row": row,
        }
        path = saver.save(position, log_state) if world.is_main and not sharded else None
        if stopping and position.epoch <= epochs:  # a signal at the very end lets it finish
            signum = stop.received or signal.SIGTERM  # another rank may have got it
            raise saver.stopped(signum, path, position, data.steps_per_epoch())

    def agreed_stop() -> bool:
        """Whether a signal asks to stop; all ranks of a distributed run decide alike."""
        return world.any(bool(stop.received))

    for epoch in range(at.epoch, epochs + 1):
        done = at.batch if epoch == at.epoch else 0  # batches trained before a resume
        memory.reset()
        if not done:
            steps.losses = []
        bar = tqdm(
            total=data.steps_per_epoch(),
            initial=done,
            desc=f"epoch {epoch}/{epochs}",
            disable=hide_bar,
        )
        start = time.perf_counter() - (resumed_time if done else 0.0)

        batches = islice(data.train_batches(epoch, seed, device), done, None)
        for batch, (images, labels) in enumerate(batches, start=done + 1):
            step += 1
            stepper.step(step, images, labels)
            bar.update()
            if step % log_every == 0:
                steps.write(history.flush())
                diagnostics.flush()
                if steps.losses:
                    seen = len(steps.losses) * data.batch_size
                    rate = seen / (time.perf_counter() - start)
                    bar.set_postfix(loss=f"{steps.losses[-1]:.4f}", samples_s=f"{rate:.0f}")
            # ranks must stop at the same step: they agree where they meet anyway, at a flush
            stopping = agreed_stop() if not world.distributed or step % log_every == 0 else False
            if saver.due(step) or stopping:
                steps.write(history.flush(wait=True))
                diagnostics.flush(wait=True)
                began = time.perf_counter()
                checkpoint(Position(epoch, batch, step), began - start, stopping)
                start += time.perf_counter() - began  # writing checkpoints is not training time

        synchronize(device)
        epoch_time = time.perf_counter() - start
        steps.write(history.flush(wait=True))
        diagnostics.flush(wait=True)
        bar.close()

        val_loss, val_acc = evaluate(model, data, device, precision)
        n_steps = len(steps.losses)
        row = {
            "epoch": epoch,
            "step": step,
            "train/epoch_loss": steps.epoch_loss(),
            "val/loss": val_loss,
            "val/acc": val_acc,
            "perf/epoch_time_s": epoch_time,
            "perf/samples_per_s": n_steps * data.batch_size / epoch_time,
            memory.key: memory.read_mib(),
        }
        row = world.reduce_epoch(row)
        tracker.log(row)
        log.info(
            "Epoch: %d, Loss: %.4f, Elapsed Time: %.2fsec, Val Loss: %.4f, Val Acc: %.2f%%, "
            "Peak Mem: %.0f MiB, Skipped Steps: %d",
            epoch,
            row["train/epoch_loss"],
            row["perf/epoch_time_s"],
            val_loss,
            100 * val_acc,
            row[memory.key],
            steps.skipped,
        )
        checkpoint(Position(epoch + 1, 0, step), 0.0, agreed_stop())

    return {
        **row,
        "amp/skipped_steps": steps.skipped,
        "amp/final_scale": steps.last_scale,
        **({"amp/nonfinite_loss_steps": steps.nonfinite_losses} if steps.skip_nonfinite else {}),
        **diagnostics.outcome(),
    }


def run_context(cfg: DictConfig) -> RunContext:
    """Name the run after its overrides; a multirun's jobs share a group named after the sweep."""
    hc = HydraConfig.get()
    group = cfg.wandb.group
    if group is None and hc.mode == RunMode.MULTIRUN:
        group = "sweep-" + "_".join(Path(hc.sweep.dir).parts[-2:])
    return RunContext(
        run_dir=Path(hc.runtime.output_dir),
        name=hc.job.override_dirname or "defaults",
        group=group,
        tags=list(cfg.wandb.tags),
        overrides=list(hc.overrides.task),
    )


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
def main(cfg: DictConfig) -> float:
    run = run_context(cfg)
    try:
        return train(cfg, run)["val/acc"]
    except Preempted as stopped:
        log.warning("%s", stopped)
        raise SystemExit(128 + stopped.signum) from None  # the shell's convention for a signal
    except Exception as err:
        if int(os.environ.get("RANK", "0")) == 0:  # only rank 0 owns the run dir
            record_failure(run.run_dir, err)  # summary.json: where a sweep's report looks
        if not isinstance(err, UserError):
            raise
        log.error("%s", err)  # also lands in the run's train.log
        if HydraConfig.get().mode == RunMode.RUN:
            raise SystemExit(2) from None
        raise  # in a sweep the other jobs still run; Hydra reports this one at the end


if __name__ == "__main__":
    sys.argv += hydra_overrides_for_rank(sys.argv[1:])  # under torchrun only rank 0 writes
    main()
