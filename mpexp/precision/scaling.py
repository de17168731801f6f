"""Loss-scaling strategies, all with torch.amp.GradScaler's interface (their base, LossScaler:
mpexp/precision/loss_scaler.py), and the one a `loss_scaling` config asks for (`build_scaler`).

Every strategy is a GradScaler (scale, unscale_, step, update, state_dict), so the training step
is the same code whatever the strategy: a disabled scaler is a no-op. Each one also exposes the
scale it applied and whether the last step was skipped as device tensors, so the loop can keep a
complete scale history without a host-device synchronisation per step.

  none        GradScaler disabled: no scaling, nothing skipped
  static      a constant scale; overflowing steps are skipped
  dynamic     GradScaler's rule, bit for bit: back off on every overflow, grow after
              growth_interval clean steps
  hysteresis  DeepSpeed's rule: tolerate `hysteresis - 1` overflows before backing off; the
              tolerance refills when the scale grows (DeepSpeed's default) or, with
              `consecutive`, after every clean step
  calibrated  measure max |grad| over warm-up steps at scale 1, then fix a power of two (static)

dynamic and hysteresis stop at a floor, `min_scale`. Every scaler also skips a step whose loss is
not finite; such a step is not an overflow (the loss is computed before scaling, so the scale can
neither cause nor cure it) and leaves the scale and its counters alone.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

import torch
from hydra.utils import get_object

from mpexp.config import to_dict
from mpexp.errors import NumericsError
from mpexp.precision.loss_scaler import LossScaler, optimizer_grads
from mpexp.precision.modes import Precision
from mpexp.shards import local_shard

log = logging.getLogger(__name__)

FP16_MAX = 65504.0


def finite_max_abs(grads: list[torch.Tensor]) -> torch.Tensor:
    """The largest finite |g| over all elements of all gradients (0 if none), on the device.

    Elements that are inf or NaN are left out, not the gradients holding them: one overflowing
    parameter must not hide the others' maxima.
    """
    peaks = [g.detach().abs().nan_to_num(0.0, posinf=0.0).amax() for g in grads if g.numel()]
    return torch.stack(peaks).max() if peaks else torch.zeros(())


class DynamicLossScaler(LossScaler):
    """`dynamic` (hysteresis=1: GradScaler's rule), and the base of `hysteresis` (DeepSpeed's).

    An overflowing step is always skipped. The scale moves as torch.amp.GradScaler moves it, bit
    for bit (the same update primitive: factors applied in double precision, no growth past
    float32's range), with two additions:

    - Hysteresis, DeepSpeed's `delayed_shift`: of the overflows, the first `hysteresis - 1` only
      use up a tolerance and leave the scale alone; once it is used up, every overflow backs off.
      The tolerance refills when the scale grows (DeepSpeed's default,
      `consecutive_hysteresis=False`) or, with `consecutive=True`, after every clean step, so that
      only overflows in a row count. Any overflow, tolerated or not, restarts the `growth_interval`
      clean steps that growth needs.
    - A floor: the scale never goes below `min_scale`; a back-off due at the floor sets
      `floor_hit()`, which the loop turns into an error or a warning.

    The whole rule runs on the device.
    """

    strategy = "dynamic"

    def __init__(
        self,
        device: torch.device,
        init_scale: float,
        growth_factor: float,
        backoff_factor: float,
        growth_interval: int,
        hysteresis: int = 1,
        consecutive: bool = False,
        min_scale: float = 0.0,
        on_min_scale: str = "raise",
    ):
        super().__init__(
            device,
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
        )
        self.hysteresis = hysteresis
        self.consecutive = consecutive
        self.min_scale = float(min_scale)
        self.on_min_scale = on_min_scale
        # as DeepSpeed's: the overflows still to be tolerated, plus one
        self._cur_hysteresis = torch.full((), hysteresis, dtype=torch.int32, device=device)
        self._floor_hit = torch.zeros((), device=device)

    def floor_hit(self) -> torch.Tensor:
        return self._floor_hit

    def update(self, new_scale=None) -> None:
        if new_scale is not None:  # GradScaler's manual override
            super().update(new_scale)
            return
        flags = [f for state in self._per_optimizer_states.values()
                 for f in state["found_inf_per_device"].values()]  # fmt: skip
        if self.hysteresis == 1 and len(flags) == 1 and flags[0].device == self.device:
            self._update_without_hysteresis(flags[0])
        else:
            self._update_with_hysteresis()

    def _update_with_hysteresis(self) -> None:
        """The whole rule, for any hysteresis and any number of optimizers."""
        scale, tracker = self._check_scale_growth_tracker("update")
        overflow, clean = self._overflow()

        # GradScaler's own update, on copies: what torch.amp.GradScaler would make of this step
        ruled, counted = scale.clone(), tracker.clone()
        torch._amp_update_scale_(
            ruled,
            counted,
            overflow.float(),
            self._growth_factor,
            self._backoff_factor,
            self._growth_interval,
        )
        tolerated = overflow & (self._cur_hysteresis > 1)
        back_off = overflow & ~tolerated
        self._floor_hit = (back_off & (scale <= self.min_scale)).float()
        lowered = torch.clamp(ruled, min=self.min_scale)
        new = torch.where(back_off, lowered, torch.where(clean, ruled, scale))
        # a step skipped only for its loss leaves the count where it was
        self._growth_tracker.copy_(torch.where(overflow | clean, counted, tracker))

        grown = clean & (counted == 0)  # growth was due: GradScaler restarts its count there
        refill = clean if self.consecutive else grown
        left = torch.where(tolerated, self._cur_hysteresis - 1, self._cur_hysteresis)
        self._cur_hysteresis.copy_(torch.where(refill, self.hysteresis, left))
        super().update(new)

    def _update_without_hysteresis(self, found: torch.Tensor) -> None:
        """The rule above with no overflow tolerated (`dynamic`, the default) in 4 to 7
        operators, where the general one takes about 25: each is a kernel launch on a GPU, and
        on a fast GPU a step's launches are what it waits for. The same results: the tests hold
        both to GradScaler's trajectory and to each other.

        `found`: the step's one skip flag, 1.0 for overflowing gradients or a bad loss."""
        scale, tracker = self._check_scale_growth_tracker("update")
        # a step skipped only for its loss is no overflow (its gradients may be finite)
        overflow = found - self._loss_bad
        if self.min_scale > 0:  # a back-off due at the floor (scale before this update)
            self._floor_hit = overflow * (scale <= self.min_scale)
            floor = overflow * self.min_scale  # the floor where it backs off, else none (0)
        # ... and it leaves scale and count alone: GradScaler's update adds one to the count of
        # a step it takes for clean and grows the scale once the count reaches the interval;
        # one taken off first makes it a no-op (the count stays below the interval)
        tracker.sub_(self._loss_bad)
        torch._amp_update_scale_(
            scale,
            tracker,
            overflow,
            self._growth_factor,
            self._backoff_factor,
            self._growth_interval,
        )
        if self.min_scale > 0:  # the whole rule's clamp, only where it backed off
            torch.maximum(scale, floor, out=scale)
        self._per_optimizer_states.clear()  # what GradScaler.update clears for the next step
        self._loss_bad = self._all_finite

    def describe(self) -> dict:
        described = {
            "loss_scaling": self.strategy,
            "init_scale": self._init_scale,
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "min_scale": self.min_scale,
            "on_min_scale": self.on_min_scale,
        }
        if self.strategy == "hysteresis":
            described["hysteresis"] = self.hysteresis
            described["consecutive"] = self.consecutive
        return described

    def state_dict(self) -> dict:
        state = super().state_dict()
        state["cur_hysteresis"] = int(self._cur_hysteresis)  # checkpoints only: one read
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._cur_hysteresis.fill_(state_dict.get("cur_hysteresis", self.hysteresis))


class HysteresisLossScaler(DynamicLossScaler):
    """`hysteresis`: DeepSpeed's rule, the dynamic rule with a tolerance of `hysteresis - 1`
    overflows before the scale backs off (see DynamicLossScaler)."""

    strategy = "hysteresis"

    def __init__(
        self, device: torch.device, hysteresis: int = 2, consecutive: bool = False, **dynamic
    ):
        super().__init__(device, hysteresis=hysteresis, consecutive=consecutive, **dynamic)


def min_scale_error(step: int, min_scale: float) -> NumericsError:
    """The message for a run stopped at the loss-scale floor."""
    return NumericsError(
        f"Loss scale hit its floor at step {step}: gradients overflowed (inf/NaN) although the "
        f"scale was already at loss_scaling.min_scale={min_scale:g}, so scaling cannot help and "
        "every further step would be skipped.\n"
        "The numbers themselves are too large. Usual remedies: lower the learning rate "
        "(optimizer.lr=...), clip gradients (trainer.clip_grad_norm=1.0), or train in bf16 "
        "(precision=bf16), whose range needs no loss scaling. "
        "diagnostics.overflow_attribution=true names the parameters that overflow; "
        "loss_scaling.on_min_scale=continue keeps training at the floor."
    )


class StaticLossScaler(LossScaler):
    """A constant scale: overflowing steps are skipped, the scale never moves."""

    strategy = "static"

    def __init__(self, device: torch.device, scale: float):
        super().__init__(device, init_scale=scale)
        self._static_scale = float(scale)

    def update(self, new_scale=None) -> None:
        # GradScaler.update with an explicit scale resets the per-step state and keeps the scale
        super().update(self._static_scale if new_scale is None else new_scale)

    def describe(self) -> dict:
        return {"loss_scaling": self.strategy, "scale": self._static_scale}


class NonfiniteGuard(StaticLossScaler):
    """No loss scaling, but a scale-1 scaler all the same, so that a step whose loss or gradients
    are not finite is never applied: it is skipped on the device, and the run then stops at the
    next metrics flush (trainer.on_nonfinite_loss=raise, `continues=False`) or counts it and goes
    on (skip). Exact: multiplying by 1 changes nothing."""

    strategy = "none"

    def __init__(self, device: torch.device, continues: bool = False):
        super().__init__(device, scale=1.0)
        self._continues = continues

    @property
    def scales_loss(self) -> bool:
        return False

    def continues_after_skip(self) -> bool:
        return self._continues

    def scale(self, outputs):
        # the loss's own check only: multiplying by 1 would be one more kernel for nothing
        if not isinstance(outputs, torch.Tensor):
            return super().scale(outputs)
        if self._scale is None:
            self._lazy_init_scale_growth_tracker(outputs.device)
        self._mark_nonfinite_loss(outputs)
        return outputs

    def update(self, new_scale=None) -> None:
        # the scale stays 1: only the step's state is cleared (GradScaler's update would also
        # write the scale again, one kernel per step)
        if new_scale is not None:
            super().update(new_scale)
            return
        self.reset_step()

    def describe(self) -> dict:
        return {"loss_scaling": "none", "nonfinite_guard": True}


# The calibrated scale's ceiling: Apex's largest loss scale (its max_loss_scale default). At 2^24
# fp16 already holds every gradient down to 2^-48 (3.6e-15); a larger scale rescues only smaller
# ones, and a near-zero maximum (1e-42, say) would ask for 2^150, past float32's range.
MAX_CALIBRATED_SCALE = 2.0**24


def calibrated_scale(max_grad: float, margin: float) -> float:
    """The largest power of two S <= MAX_CALIBRATED_SCALE with max_grad * S < 65504 / margin
    (fp16's largest value, with headroom)."""
    limit = FP16_MAX / margin
    ceiling = round(math.log2(MAX_CALIBRATED_SCALE))
    # two logs, not log2(limit / max_grad): that ratio overflows a double for tiny maxima
    exponent = min(math.floor(math.log2(limit) - math.log2(max_grad)), ceiling)
    # log2 may round either way; powers of two multiply exactly, so settle it with products
    while max_grad * 2.0**exponent >= limit:
        exponent -= 1
    while exponent < ceiling and max_grad * 2.0 ** (exponent + 1) < limit:
        exponent += 1
    return 2.0**exponent


class CalibratedLossScaler(StaticLossScaler):
    """Static scaling at a measured scale (the procedure in Alex Minnaar's "Deep Learning GPU
    Performance Analysis: Mixed Precision Training").

    The first `calibration_steps` steps train at scale 1 (overflowing ones skipped) while the
    largest finite |gradient| element is tracked on the device; inf and NaN elements are left out,
    also on a step that is skipped for them. At the end of them the scale becomes the largest
    power of two keeping that maximum, scaled, under 65504 / margin, but at most
    MAX_CALIBRATED_SCALE (2^24), and stays there.
    """

    strategy = "calibrated"

    def __init__(self, device: torch.device, calibration_steps: int, margin: float):
        super().__init__(device, scale=1.0)
        self.calibration_steps = calibration_steps
        self.margin = float(margin)
        self.max_grad: float | None = None
        self.chosen_scale: float | None = None
        self._updates = 0
        self._max = torch.zeros((), device=device)

    def needs_true_units(self) -> bool:
        return self.chosen_scale is None  # calibration measures the unscaled gradients

    def capturable(self) -> bool:
        return self.chosen_scale is not None  # calibration counts its steps on the host

    def unscale_(self, optimizer) -> None:
        super().unscale_(optimizer)
        if self.chosen_scale is None:
            peak = finite_max_abs([local_shard(g) for g in optimizer_grads(optimizer)])
            self._max = torch.maximum(self._max, peak.to(self.device))

    def update(self, new_scale=None) -> None:
        if self.chosen_scale is None and new_scale is None:
            self._updates += 1
            if self._updates == self.calibration_steps:
                self._fix_scale()
        super().update(new_scale)

    def _fix_scale(self) -> None:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            # under FSDP each rank measured its own shard of the gradients
            torch.distributed.all_reduce(self._max, op=torch.distributed.ReduceOp.MAX)
        self.max_grad = float(self._max)  # the run's one read of it, when calibration ends
        if not self.max_grad > 0:
            raise NumericsError(
                f"loss_scaling=calibrated saw no finite non-zero gradient in its "
                f"{self.calibration_steps} calibration steps, so there is nothing to calibrate "
                "against. Check the loss and learning rate, or use loss_scaling=dynamic."
            )
        self.chosen_scale = calibrated_scale(self.max_grad, self.margin)
        self._static_scale = self.chosen_scale
        if self.chosen_scale == MAX_CALIBRATED_SCALE:
            log.warning(
                "Calibrated loss scale at its ceiling, 2^24: the largest |gradient| in "
                "calibration was only %.4g (MAX_CALIBRATED_SCALE in mpexp/precision/scaling.py).",
                self.max_grad,
            )
        log.info(
            "Calibrated loss scale: 2^%d = %g (max |grad| %.4g over %d steps, margin %g: "
            "scaled max %.4g < %.4g)",
            round(math.log2(self.chosen_scale)),
            self.chosen_scale,
            self.max_grad,
            self.calibration_steps,
            self.margin,
            self.max_grad * self.chosen_scale,
            FP16_MAX / self.margin,
        )

    def describe(self) -> dict:
        return {
            "loss_scaling": "calibrated",
            "calibration_steps": self.calibration_steps,
            "margin": self.margin,
        }

    def outcome(self) -> dict:
        return {"calibrated_scale": self.chosen_scale, "calibration_max_grad": self.max_grad}

    def state_dict(self) -> dict:
        state = super().state_dict()
        state["chosen_scale"] = self.chosen_scale
        state["max_grad"] = self.max_grad
        # mid-calibration, the running maximum is only on the device: one read per checkpoint
        state["running_max_grad"] = float(self._max)
        state["calibration_updates"] = self._updates
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self.chosen_scale = state_dict.get("chosen_scale")
        self.max_grad = state_dict.get("max_grad")
        self._updates = state_dict.get("calibration_updates", 0)
        if self.chosen_scale is not None:
            self._static_scale = self.chosen_scale
        self._max.fill_(state_dict.get("running_max_grad", self.max_grad or 0.0))


def _gradient_format(precision: Precision) -> str:
    if precision.fp8 is not None:  # torchao scales each fp8 tensor by its own amax
        return "bfloat16 and in fp8 scaled per tensor by torchao"
    return "bfloat16" if precision.autocast_dtype is torch.bfloat16 else "float32"


def build_scaler(
    cfg: Mapping[str, Any],
    precision: Precision,
    device: torch.device,
    skip_nonfinite_loss: bool = False,
) -> LossScaler:
    """The scaler a `loss_scaling` config asks for under a precision mode.

    `_target_` names the scaler class (none: no scaling); `only_under_fp16` (the `auto` option)
    keeps it for fp16 and drops it otherwise. Without loss scaling a scale-1 guard stands in, so
    that a step with a non-finite loss or gradients is not applied; skip_nonfinite_loss
    (trainer.on_nonfinite_loss=skip) lets training go on after one.
    """
    settings = {k: v for k, v in to_dict(cfg).items() if k not in ("_target_", "only_under_fp16")}
    target = cfg.get("_target_")
    fp16 = precision.autocast_dtype is torch.float16
    if cfg.get("only_under_fp16") and not fp16:
        target = None
    elif target is not None and not fp16:
        log.warning(
            "Loss scaling (%s) under precision=%s: gradients in %s do not underflow like fp16's, "
            "so the scaler only adds work. Honoured as asked; loss_scaling=auto picks none here.",
            target.rpartition(".")[2],
            precision.mode,
            _gradient_format(precision),
        )
    elif target is None and fp16:
        log.info("fp16 without loss scaling: small gradients will underflow to zero (as intended?)")
    if target is None:
        return NonfiniteGuard(device, continues=skip_nonfinite_loss)
    return get_object(target)(device, **settings)
