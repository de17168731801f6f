"""The training loop, in three layers a reader can take one at a time:

- `train_step`: one optimizer step, the same code for every precision and loss-scaling strategy;
- `Stepper`: a step plus its bookkeeping on the device (history row, scale update, diagnostics);
- `Fit`: the run's epochs: metric flushes, validation, checkpoints and stop signals.

Nothing here reads a device value on the host per step: values are gathered on the device and read
back every `trainer.log_every` steps (see mpexp/history.py).
"""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import time
from concurrent.futures import Future
from dataclasses import dataclass
from itertools import islice

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from tqdm import tqdm

from mpexp.checkpoint import Checkpointer, Position, Resume
from mpexp.data.base import InMemoryData
from mpexp.diagnostics import Diagnostics
from mpexp.distributed import World
from mpexp.errors import NumericsError
from mpexp.flops import Throughput
from mpexp.history import StepHistory, StepRow
from mpexp.precision import Precision
from mpexp.rollback import BufferRollback
from mpexp.scaling import LossScaler
from mpexp.stopping import StopSignals
from mpexp.system import PeakMemory, synchronize
from mpexp.tracking import Tracker

log = logging.getLogger("mpexp")


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

    Gradients are unscaled before the step only when something reads them there (`inspect`,
    clipping, a calibrating scaler). Otherwise `scaler.step` unscales them: a fused optimizer
    does it inside its update kernel, sparing a separate multiply over every gradient.
    """
    if accumulate == 1:  # the common case, straight: no chunks, no weights, no accumulator
        with precision.autocast():  # forward only: backward runs outside autocast
            loss = F.cross_entropy(model(images), labels)
        scaler.scale(loss).backward()
        total = loss.detach()
    else:
        total = torch.zeros((), device=labels.device)
        chunks = list(zip(images.chunk(accumulate), labels.chunk(accumulate), strict=True))
        for i, (x, y) in enumerate(chunks):
            # under DDP, all-reduce the gradients once, with the last micro-batch's backward
            last = i == len(chunks) - 1
            with _no_grad_sync(model, last):
                with precision.autocast():
                    loss = F.cross_entropy(model(x), y) * (len(y) / len(labels))
                scaler.scale(loss).backward()
            total += loss.detach()
    if inspect is not None or clip_grad_norm is not None or scaler.needs_true_units():
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

    def __post_init__(self) -> None:
        self.buffers = BufferRollback.for_step(self.model, can_skip=self.scaler.is_enabled())

    def step(self, step: int, images: torch.Tensor, labels: torch.Tensor) -> None:
        """The optimizer step, its history row and the scale update; a skipped step leaves the
        model's buffers (BatchNorm statistics) as they were. No host-device synchronisation: a
        GPU test runs this in CUDA's sync-debug error mode."""
        lr = self.optimizer.param_groups[0]["lr"]  # read first: a real step advances the schedule
        self.buffers.save()
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
        self.buffers.restore_if(self.scaler.found_inf())
        # between step() and update(): the scale this step used and whether it was skipped
        self.history.record(step, lr, loss, self.scaler.scale_tensor(), self.scaler.found_inf())
        self.scaler.update()
        self.diagnostics.after_update(step)
        self.optimizer.zero_grad(set_to_none=True)


@torch.no_grad()
def evaluate(model, data: InMemoryData, device, precision: Precision) -> tuple[float, float]:
    """Validation loss and accuracy, accumulated on the device and read once."""
    model.eval()
    total = torch.zeros(2, device=device)  # loss sum, correct
    count = 0  # on the host: a batch's size is known there, and a tensor of it would be a copy
    for images, labels in data.val_batches(device):
        with precision.autocast():
            logits = model(images)
        loss = F.cross_entropy(logits.float(), labels, reduction="sum")
        correct = (logits.argmax(1) == labels).sum()
        total += torch.stack((loss, correct.float()))
        count += len(labels)
    model.train()
    loss_sum, correct = total.tolist()
    return loss_sum / count, correct / count


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
        self.losses: list[float] = []  # this epoch's
        self.epoch_skipped = 0  # this epoch's skipped steps

    def write(self, rows: list[StepRow]) -> None:
        for r in rows:
            if math.isfinite(r.loss):
                self.last_finite = (r.step, r.loss)
            elif self.skip_nonfinite:
                self.nonfinite_losses += 1
            else:
                raise self._nonfinite_error(r)
            self.skipped += r.skipped
            self.epoch_skipped += r.skipped
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

    def new_epoch(self) -> None:
        self.losses, self.epoch_skipped = [], 0

    def epoch_loss(self) -> float:
        finite = [x for x in self.losses if math.isfinite(x)]
        return sum(finite) / len(finite) if finite else float("nan")

    def state(self) -> dict:
        """What a checkpoint keeps of it (the epoch's losses included)."""
        return {
            "skipped": self.skipped,
            "nonfinite_losses": self.nonfinite_losses,
            "last_finite": self.last_finite,
            "losses": self.losses,
            "epoch_skipped": self.epoch_skipped,
        }

    def load_state(self, state: dict) -> None:
        self.skipped = state["skipped"]
        self.nonfinite_losses = state["nonfinite_losses"]
        self.last_finite = tuple(state["last_finite"]) if state["last_finite"] else None
        self.losses = state["losses"]
        self.epoch_skipped = state.get("epoch_skipped", 0)

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


@dataclass
class Parts:
    """What the loop trains: built once by mpexp.train, never re-decided here."""

    model: torch.nn.Module  # the module whose weights are saved (DDP/FSDP-wrapped if so)
    forward: torch.nn.Module  # what the loop calls: `model`, or its torch.compile wrapper
    data: InMemoryData
    optimizer: torch.optim.Optimizer
    scaler: LossScaler
    precision: Precision
    # FLOPs per sample, counted once in the background from setup on, and the device's peak
    throughput: Future[Throughput]


class Fit:
    """One run's epochs: steps, metric flushes, validation, checkpoints and stop signals."""

    def __init__(
        self,
        cfg: DictConfig,
        parts: Parts,
        tracker: Tracker,
        saver: Checkpointer,
        world: World,
        stop: StopSignals,
    ):
        self.trainer = cfg.trainer
        self.parts, self.tracker, self.saver, self.world, self.stop = (
            parts,
            tracker,
            saver,
            world,
            stop,
        )
        self.device = world.device
        # in a distributed run each flush averages the losses over ranks (one collective per flush)
        self.history = StepHistory(reduce_loss=world.mean if world.distributed else None)
        self.memory = PeakMemory(self.device)
        self.steps = StepLog(tracker, cfg.trainer.on_nonfinite_loss)
        self.diagnostics = Diagnostics(
            cfg.diagnostics, parts.model, parts.scaler, tracker, parts.precision
        )
        self.stepper = Stepper(
            parts.forward,
            parts.optimizer,
            parts.scaler,
            parts.precision,
            self.history,
            self.diagnostics,
            cfg.trainer.accumulate,
            cfg.trainer.clip_grad_norm,
        )
        progress = cfg.trainer.progress
        self.hide_bar = (None if progress is None else not progress) if world.is_main else True
        self.position = Position()  # where training stands: the next epoch, batches done in it
        self.row: dict | None = None  # the last epoch's metrics
        self.resumed_time = 0.0  # time the epoch in progress had taken before a checkpoint

    def restore(self, resume: Resume) -> None:
        """Continue from a checkpoint: weights, optimizer, scaler, schedule, RNGs and the log."""
        p = self.parts
        schedule = self.saver.schedule
        self.position = resume.restore(p.model, p.optimizer, p.scaler, self.world, schedule)
        carried = resume.log_state
        self.steps.load_state(carried)
        self.diagnostics.floor_hits = carried["floor_hits"]
        self.row = carried["epoch_row"]
        self.resumed_time = carried["elapsed"]

    def run(self) -> dict:
        """Train the remaining epochs; return the final metrics."""
        self.parts.model.train()
        for epoch in range(self.position.epoch, self.trainer.epochs + 1):
            self.row = self._epoch(epoch)
            self._checkpoint(Position(epoch + 1, 0, self.position.step), 0.0, self._stop_agreed())
        steps, diagnostics = self.steps, self.diagnostics
        return {
            **self.row,
            "amp/skipped_steps": steps.skipped,
            # after the last update: the scale the next step would use (one read, at the end)
            "amp/final_scale": float(self.parts.scaler.scale_tensor()),
            **(
                {"amp/nonfinite_loss_steps": steps.nonfinite_losses} if steps.skip_nonfinite else {}
            ),
            **diagnostics.outcome(),
        }

    def check_it_trained(self) -> None:
        """A run whose every step was skipped trained nothing: it ends failed, saying why."""
        steps = self.position.step
        if steps and self.steps.skipped >= steps:
            raise NumericsError(
                f"No optimizer step was taken: all {steps} steps were skipped because their "
                "gradients (or losses) were not finite, so the weights are as they were "
                "initialised. Under loss scaling a too-high loss_scaling.init_scale skips steps "
                "until the scale has come down (lower it, e.g. 65536, or train longer); otherwise "
                "lower the learning rate, clip gradients (trainer.clip_grad_norm=1.0) or use bf16. "
                "diagnostics.overflow_attribution=true names the parameters that overflow."
            )

    def _epoch(self, epoch: int) -> dict:
        data, step = self.parts.data, self.position.step
        done = self.position.batch if epoch == self.position.epoch else 0  # trained before a resume
        self.memory.reset()
        if not done:
            self.steps.new_epoch()
        bar = tqdm(
            total=data.steps_per_epoch(),
            initial=done,
            desc=f"epoch {epoch}/{self.trainer.epochs}",
            disable=self.hide_bar,
        )
        start = time.perf_counter() - (self.resumed_time if done else 0.0)
        batches = islice(data.train_batches(epoch, self.trainer.seed, self.device), done, None)
        for batch, (images, labels) in enumerate(batches, start=done + 1):
            step += 1
            self.tracker.step = step  # where the user's own mpexp.log() calls log
            self.stepper.step(step, images, labels)
            bar.update()
            flush = step % self.trainer.log_every == 0
            if flush:
                self._flush()
                self._show_progress(bar, start)
            # ranks must stop at the same step: they agree where they meet anyway, at a flush
            stopping = self._stop_agreed() if flush or not self.world.distributed else False
            if self.saver.due(step) or stopping:
                self._flush(wait=True)
                began = time.perf_counter()
                self._checkpoint(Position(epoch, batch, step), began - start, stopping)
                start += time.perf_counter() - began  # writing checkpoints is not training time

        synchronize(self.device)
        epoch_time = time.perf_counter() - start
        self._flush(wait=True)
        bar.close()
        self.position = Position(epoch + 1, 0, step)
        return self._epoch_row(epoch, step, epoch_time)

    def _epoch_row(self, epoch: int, step: int, epoch_time: float) -> dict:
        p = self.parts
        val_loss, val_acc = evaluate(p.forward, p.data, self.device, p.precision)
        row = {
            "epoch": epoch,
            "step": step,
            "train/epoch_loss": self.steps.epoch_loss(),
            "val/loss": val_loss,
            "val/acc": val_acc,
            "perf/epoch_time_s": epoch_time,
            "perf/samples_per_s": p.data.samples_per_epoch() / epoch_time,
            self.memory.key: self.memory.read_mib(),
        }
        row = self.world.reduce_epoch(row)
        # from the samples/s already computed (summed over ranks): no device read of its own
        row.update(p.throughput.result().metrics(row["perf/samples_per_s"]))
        self.tracker.log(row)
        steps = len(self.steps.losses)
        if steps and self.steps.epoch_skipped == steps:
            log.warning(
                "Epoch %d took no optimizer step: all %d of its steps were skipped (non-finite "
                "gradients or losses), so the weights did not change in it.%s",
                epoch,
                steps,
                " Under loss scaling, a scale still coming down from a high "
                "loss_scaling.init_scale does this."
                if p.scaler.is_enabled()
                else "",
            )
        log.info(
            "Epoch: %d, Loss: %.4f, Elapsed Time: %.2fsec, Val Loss: %.4f, Val Acc: %.2f%%, "
            "Peak Mem: %.0f MiB, Skipped Steps: %d",
            epoch,
            row["train/epoch_loss"],
            row["perf/epoch_time_s"],
            val_loss,
            100 * val_acc,
            row[self.memory.key],
            self.steps.skipped,
        )
        return row

    def _flush(self, wait: bool = False) -> None:
        """Read back what the device has gathered (all of it with wait=True: one sync)."""
        self.steps.write(self.history.flush(wait))
        self.diagnostics.flush(wait)

    def _show_progress(self, bar: tqdm, start: float) -> None:
        if self.steps.losses:
            rate = (
                len(self.steps.losses) * self.parts.data.batch_size / (time.perf_counter() - start)
            )
            bar.set_postfix(loss=f"{self.steps.losses[-1]:.4f}", samples_s=f"{rate:.0f}")

    def _stop_agreed(self) -> bool:
        """Whether a signal asks to stop; all ranks of a distributed run decide alike."""
        return self.world.any(bool(self.stop.received))

    def _checkpoint(self, position: Position, elapsed: float, stopping: bool) -> None:
        log_state = {
            **self.steps.state(),
            "floor_hits": self.diagnostics.floor_hits,
            "elapsed": elapsed,
            "epoch_row": self.row,
        }
        path = self.saver.save(position, log_state)  # every rank: FSDP's all write their shards
        if stopping and position.epoch <= self.trainer.epochs:  # a signal at the end lets it finish
            signum = self.stop.received or signal.SIGTERM  # another rank may have got it
            raise self.saver.stopped(signum, path, position, self.parts.data.steps_per_epoch())
