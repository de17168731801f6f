"""`Config`: a configuration's runs (a SeedGroup) compared with its fp32 reference, the fp32
configuration with the same other overrides (in a precision x loss-scaling grid, the one without
loss scaling); an fp8 configuration also with its bf16 reference, chosen the same way. Judged by
their task's result metric: parity verdicts, speedups, the time to a target, and its values for
the tables."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mpexp.report.row import STATE_BYTES
from mpexp.report.runs import job_number
from mpexp.report.seed_group import SeedGroup
from mpexp.report.stats import Estimate, difference, mean, paired_difference, ratio

BASELINE = "fp32"
# fp8 is also compared with bf16: what it leaves unconverted runs in bf16, and bf16 is the mode
# it would replace
BF16, FP8 = "bf16", "fp8"
PURE = "bf16_pure"


@dataclass(eq=False)
class Config(SeedGroup):
    """A configuration and the fp32 configuration it is compared with; one whose every run
    diverged is compared with nothing."""

    reference: Config | None = None
    target: float | None = None  # the result metric's value (a fraction of accuracy) to reach
    bf16_reference: Config | None = None  # an fp8 configuration's bf16 counterpart

    @property
    def is_reference(self) -> bool:
        return self.reference is self

    @property
    def state_ratio(self) -> float | None:
        """Its weights', gradients' and states' bytes over its fp32 reference's."""
        mine = self.state_bytes
        theirs = self.reference.state_bytes if self.reference is not None else None
        if mine is None or theirs is None or not sum(theirs.values()):
            return None
        return sum(mine.values()) / sum(theirs.values())

    def _difference(
        self, attribute: str, scale: float = 1.0, other: Config | None = None
    ) -> Estimate | None:
        """This configuration's mean minus its reference's (or `other`'s): paired by seed when
        both ran the same seeds (the same initial weights and data order on each side of a pair),
        else Welch's."""
        other = other or self.reference
        if not self._comparable(other):
            return None
        if other is self:
            return Estimate(0.0)
        mine = {r.seed: scale * getattr(r, attribute) for r in self.rows}
        theirs = {r.seed: scale * getattr(r, attribute) for r in other.rows}
        if len(mine) == self.n and len(theirs) == other.n and mine.keys() == theirs.keys():
            return paired_difference([mine[s] for s in mine], [theirs[s] for s in mine])
        return difference(
            [scale * v for v in self._each(attribute)],
            [scale * v for v in other._each(attribute)],
        )

    def _comparable(self, other: Config | None) -> bool:
        """Both sides have runs that did not diverge."""
        return other is not None and bool(self.rows) and bool(other.rows)

    @property
    def d_result(self) -> Estimate | None:
        """The result minus its fp32 reference's, in the result's unit (points, nats)."""
        return self._difference("result", self.spec.scale)

    @property
    def d_val_loss(self) -> Estimate | None:
        return self._difference("val_loss")

    @property
    def parity(self) -> str:
        """How its final result compares with the fp32 reference's, at 95 %: `diverged` (every
        run did), `reference`, `no reference`, `reference diverged`, `single seed` (no interval
        on one side), `within noise` (the interval of the difference lies on the good side of
        -tolerance: not worse by more than the tolerance), `worse` (it lies beyond the tolerance
        on the bad side), `better` (beyond it on the good side), or `too wide` (it straddles the
        tolerance: more seeds would tell). Good and bad follow the result's direction: a higher
        accuracy, a lower language-model loss."""
        return self._parity(self.reference, self.d_result)

    def _parity(self, reference: Config | None, diff: Estimate | None) -> str:
        if not self.rows:
            return "diverged"
        if reference is None:
            return "no reference"
        if reference is self:
            return "reference"
        if not reference.rows:
            return "reference diverged"
        return verdict(self.gain(diff), self.tolerance)

    def gain(self, diff: Estimate | None) -> Estimate | None:
        """A difference turned so that positive is better: the loss's difference negated."""
        if diff is None or self.spec.higher_is_better:
            return diff
        low = None if diff.high is None else -diff.high
        high = None if diff.low is None else -diff.low
        return Estimate(-diff.value, low, high)

    @property
    def d_result_vs_bf16(self) -> Estimate | None:
        """An fp8 configuration's result minus its bf16 reference's, in the result's unit."""
        if self.bf16_reference is None:
            return None
        return self._difference("result", self.spec.scale, self.bf16_reference)

    @property
    def parity_vs_bf16(self) -> str | None:
        """For an fp8 configuration, the parity verdict against its bf16 reference (`no
        reference` without one); None for the other precisions."""
        if self.first.precision != FP8:
            return None
        return self._parity(self.bf16_reference, self.d_result_vs_bf16)

    @property
    def speedup_vs_bf16(self) -> Estimate | None:
        """The bf16 reference's mean epoch time over this fp8 configuration's."""
        if not self._comparable(self.bf16_reference):
            return None
        return ratio(self.bf16_reference._each("epoch_time_s"), self._each("epoch_time_s"))

    @property
    def speedup(self) -> Estimate | None:
        """The reference's mean epoch time over this one's."""
        if not self._comparable(self.reference):
            return None
        if self.is_reference:
            return Estimate(1.0)
        return ratio(self.reference._each("epoch_time_s"), self._each("epoch_time_s"))

    @property
    def times_to_target(self) -> list[float | None]:
        return [r.time_to(self.target) for r in self.rows]

    @property
    def time_to_target(self) -> Estimate | None:
        """Mean over seeds, when every seed reached the target."""
        times = self.times_to_target
        return None if self.target is None or not times or None in times else mean(times)

    @property
    def reached(self) -> int:
        return sum(t is not None for t in self.times_to_target)

    @property
    def speedup_at_target(self) -> Estimate | None:
        """The reference's time to the target over this one's: the speedup at equal accuracy."""
        if self.reference is None or None in (self.time_to_target, self.reference.time_to_target):
            return None
        if self.is_reference:
            return Estimate(1.0)
        return ratio(self.reference.times_to_target, self.times_to_target)

    @property
    def mem_ratio(self) -> float | None:
        # CUDA tensor memory and CPU process RSS measure different things: no ratio between them
        if not self._comparable(self.reference) or self.reference.mem_kind != self.mem_kind:
            return None
        return self.peak_mem_mib / self.reference.peak_mem_mib

    def values(self) -> dict[str, Any]:
        """The configuration as plain values: the W&B table's columns, what report.md formats."""
        values: dict[str, Any] = {
            "configuration": self.label,
            "runs": ", ".join(job_number(r.folder) for r in self.members),
            "precision": self.first.precision,
            "effective_precision": self.first.effective_precision,
            "loss_scaling": self.first.loss_scaling,
            "model": self.first.run.chosen("model"),
            "dataset": self.first.run.chosen("dataset"),
            "n": self.n,
            "diverged": len(self.diverged),
            "parity": self.parity,
            "bf16_reference": self.bf16_reference.label if self.bf16_reference else None,
            "parity_vs_bf16": self.parity_vs_bf16,
            "result_metric": self.spec.metric,
            "target": None if self.target is None else self.spec.scale * self.target,
            "reached_target": None if self.target is None else self.reached,
            "mem_kind": self.mem_kind,
            "peak_mem_mib": self.peak_mem_mib,
            "peak_reserved_mib": self.peak_reserved_mib,
            "planned_peak_mib": self.planned_peak_mib,
            "mem_ratio": self.mem_ratio,
            "update_rounding": self.first.rounding,
            **{k: (self.state_bytes or {}).get(k) for k in STATE_BYTES},
            "state_ratio": self.state_ratio,
        }
        estimates = {
            "result": self.result,
            "d_result": self.d_result,
            "d_result_vs_bf16": self.d_result_vs_bf16,
            "val_loss": self.val_loss,
            "d_val_loss": self.d_val_loss,
            "epoch_time_s": self.epoch_time_s,
            "speedup": self.speedup,
            "speedup_vs_bf16": self.speedup_vs_bf16,
            "time_to_target_s": self.time_to_target,
            "speedup_at_target": self.speedup_at_target,
            "samples_per_s": self.samples_per_s,
            "tflops": self.tflops,
            "mfu_pct": self.mfu_pct,
            "data_wait_pct": self.data_wait_pct,
            "updates_lost": self.updates_lost,
        }
        for name, estimate in estimates.items():
            values[name] = None if estimate is None else estimate.value
            values[f"{name}_low"] = None if estimate is None else estimate.low
            values[f"{name}_high"] = None if estimate is None else estimate.high
        return values


def verdict(diff: Estimate, tolerance: float) -> str:
    """The parity verdict on the interval of a difference turned so that positive is better
    (points of accuracy; a loss's negated) at `tolerance`:
    `single seed` (no interval), `worse` (it lies below -tolerance), `better` (above +tolerance),
    `within noise` (above -tolerance: not worse by more than the tolerance) or `too wide` (it
    straddles -tolerance: more seeds would tell)."""
    if diff.low is None:
        return "single seed"
    if diff.high < -tolerance:
        return "worse"
    if diff.low > tolerance:
        return "better"
    if diff.low >= -tolerance:
        return "within noise"
    return "too wide"
