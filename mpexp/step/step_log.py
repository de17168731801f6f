"""The step log: the flushed step rows written as metrics, and a non-finite loss, non-finite
gradients or a loss scale at its floor answered as the run's settings say."""

from __future__ import annotations

import logging
import math

from mpexp.errors import NumericsError
from mpexp.precision.loss_scaler import LossScaler
from mpexp.precision.scaling import min_scale_error
from mpexp.step.history import StepRow
from mpexp.tracking.tracker import Tracker

log = logging.getLogger("mpexp")


class StepLog:
    """Writes flushed step rows as metrics; keeps the running skip count and the epoch's losses.

    A non-finite loss stops the run (trainer.on_nonfinite_loss=raise) or is counted (skip: the
    scaler has already skipped that step on the device). So do non-finite gradients of a finite
    loss without loss scaling (where they are no overflow that a scale answers): the guard has
    skipped the step; under raise the run stops here, under skip they are counted as
    amp/nonfinite_grad_steps. A loss scale that wanted to back off below its floor stops the run
    (loss_scaling.on_min_scale=raise) or is counted.
    """

    def __init__(
        self, tracker: Tracker, on_nonfinite_loss: str = "raise", scaler: LossScaler | None = None
    ):
        self.tracker = tracker
        self.skip_nonfinite = on_nonfinite_loss == "skip"
        self.scaler = scaler
        self.watch_floor = scaler is not None and scaler.min_scale > 0
        self.unscaled = scaler is not None and not scaler.scales_loss
        self.floor_hits = 0
        self.nonfinite_grads = 0
        self.skipped = 0
        self.nonfinite_losses = 0
        self.last_finite: tuple[int, float] | None = None
        self.losses: list[float] = []  # this epoch's
        self.epoch_skipped = 0  # this epoch's skipped steps

    def write(self, rows: list[StepRow]) -> None:
        for r in rows:
            if math.isfinite(r.loss) and r.skipped and self.unscaled:
                if not self.skip_nonfinite:
                    raise self._nonfinite_grads_error(r)
                self.nonfinite_grads += 1
            if math.isfinite(r.loss):
                self.last_finite = (r.step, r.loss)
            elif self.skip_nonfinite:
                self.nonfinite_losses += 1
            else:
                raise self._nonfinite_error(r)
            if r.floor_hit and self.watch_floor:
                self._on_floor(r.step)
            self.skipped += r.skipped
            self.epoch_skipped += r.skipped
            self.losses.append(r.loss)
            row = {
                "step": r.step,
                "train/loss": r.loss,
                "amp/scale": r.scale,
                "amp/skipped_steps": self.skipped,
                "lr": r.lr,
                **r.terms,
            }
            if self.skip_nonfinite:
                row["amp/nonfinite_loss_steps"] = self.nonfinite_losses
                if self.unscaled:
                    row["amp/nonfinite_grad_steps"] = self.nonfinite_grads
            self.tracker.log(row)

    def new_epoch(self) -> None:
        self.losses, self.epoch_skipped = [], 0

    def outcome(self) -> dict:
        """Totals for the run summary."""
        totals = {"amp/floor_hits": self.floor_hits} if self.watch_floor else {}
        if self.skip_nonfinite:
            totals["amp/nonfinite_loss_steps"] = self.nonfinite_losses
            if self.unscaled:
                totals["amp/nonfinite_grad_steps"] = self.nonfinite_grads
        return totals

    def check_any_taken(self, steps: int) -> None:
        """A run whose every step (of `steps`) was skipped trained nothing: it ends failed,
        saying why."""
        if steps and self.skipped >= steps:
            raise NumericsError(
                f"No optimizer step was taken: all {steps} steps were skipped because their "
                "gradients (or losses) were not finite, so the weights are as they were "
                "initialised. Under loss scaling a too-high loss_scaling.init_scale skips steps "
                "until the scale has come down (lower it, e.g. 65536, or train longer); otherwise "
                "lower the learning rate, clip gradients (trainer.clip_grad_norm=1.0) or use bf16. "
                "diagnostics.overflow_attribution=true names the parameters that overflow."
            )

    def _nonfinite_grads_error(self, row: StepRow) -> NumericsError:
        return NumericsError(
            f"The gradients became inf/NaN at step {row.step} while the loss was finite "
            f"({row.loss:.4g}); that step was not applied. Without loss scaling this is no "
            "overflow that a scale could answer: the backward pass itself produced it, e.g. a "
            "function whose derivative is infinite where it was taken (sqrt or log at 0) or "
            "values beyond the format's range. diagnostics.overflow_attribution=true names the "
            "parameters; trainer.clip_grad_norm does not help (the norm is inf); "
            "trainer.on_nonfinite_loss=skip skips such steps and counts them "
            "(amp/nonfinite_grad_steps)."
        )

    def _on_floor(self, step: int) -> None:
        if self.scaler.on_min_scale == "raise":
            raise min_scale_error(step, self.scaler.min_scale)
        if self.floor_hits == 0:
            log.warning(
                "Loss scale at its floor loss_scaling.min_scale=%g at step %d and gradients "
                "still overflow; continuing (loss_scaling.on_min_scale=continue): such steps are "
                "skipped.",
                self.scaler.min_scale,
                step,
            )
        self.floor_hits += 1

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
            "floor_hits": self.floor_hits,
            "nonfinite_grads": self.nonfinite_grads,
        }

    def load_state(self, state: dict) -> None:
        self.skipped = state["skipped"]
        self.nonfinite_losses = state["nonfinite_losses"]
        self.last_finite = tuple(state["last_finite"]) if state["last_finite"] else None
        self.losses = state["losses"]
        self.epoch_skipped = state.get("epoch_skipped", 0)
        self.floor_hits = state.get("floor_hits", 0)
        self.nonfinite_grads = state.get("nonfinite_grads", 0)

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
