"""`SeedGroup`: the runs that differ only in `trainer.seed`, their numbers as means over the seeds
with 95 % intervals."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from mpexp.report.overrides import PRECISION_KEYS, in_groups
from mpexp.report.row import Row
from mpexp.report.stats import Estimate, mean
from mpexp.tasks.base import Result


@dataclass(eq=False)
class SeedGroup:
    """The runs that differ only in `trainer.seed`.

    Its numbers come from the runs that did not diverge (`rows`); a group whose every run
    diverged has none.
    """

    label: str
    members: list[Row]  # every run, in job order
    overrides: tuple[str, ...]  # sorted, without the seed
    tolerance: float  # in the result's unit (points of accuracy, nats)

    @property
    def rows(self) -> list[Row]:
        """The runs its numbers come from: those that did not diverge."""
        return [r for r in self.members if not r.diverged]

    @property
    def diverged(self) -> list[Row]:
        return [r for r in self.members if r.diverged]

    @property
    def first(self) -> Row:
        return self.members[0]

    @property
    def n(self) -> int:
        return len(self.rows)

    @property
    def task(self) -> tuple[str, ...]:
        """The overrides its fp32 reference shares: all but precision and loss scaling."""
        return tuple(o for o in self.overrides if not in_groups(o, PRECISION_KEYS))

    def _each(self, attribute: str) -> list[float]:
        return [getattr(r, attribute) for r in self.rows]

    def _mean_of(self, attribute: str, scale: float = 1.0) -> Estimate | None:
        values = self._each(attribute)
        return None if not values or None in values else mean([scale * v for v in values])

    @property
    def spec(self) -> Result:
        return self.first.spec

    @property
    def result(self) -> Estimate:
        """The final result over seeds, in the result's unit (val accuracy in percent)."""
        return self._mean_of("result", self.spec.scale)

    @property
    def val_loss(self) -> Estimate:
        return self._mean_of("val_loss")

    @property
    def epoch_time_s(self) -> Estimate:
        """Over seeds: each run's median epoch time."""
        return self._mean_of("epoch_time_s")

    @property
    def samples_per_s(self) -> Estimate:
        return self._mean_of("samples_per_s")

    @property
    def tflops(self) -> Estimate | None:
        return self._mean_of("tflops")

    @property
    def data_wait_pct(self) -> Estimate | None:
        """Percent of the epochs' time the step waited on its data, where every run logged it."""
        return self._mean_of("data_wait_share", 100.0)

    @property
    def compile_s(self) -> Estimate:
        return self._mean_of("compile_s")

    @property
    def mfu_pct(self) -> Estimate | None:
        return self._mean_of("mfu", 100)

    @property
    def updates_lost(self) -> Estimate | None:
        return self._mean_of("updates_lost")

    @property
    def state_bytes(self) -> dict[str, int] | None:
        """Its runs' bytes of weights, gradients and states (the same for every seed)."""
        return self.first.state_bytes

    @property
    def peak_mem_mib(self) -> float | None:
        return statistics.fmean(self._each("peak_mem_mib")) if self.rows else None

    @property
    def mem_kind(self) -> str:
        return self.first.mem_kind

    @property
    def peak_reserved_mib(self) -> float | None:
        """The mean of its runs' reserved peaks, where each run logged one (a GPU's)."""
        reserved = self._each("peak_reserved_mib")
        return None if not reserved or None in reserved else statistics.fmean(reserved)

    @property
    def planned_peak_mib(self) -> float | None:
        """Its plan's need (the same for every seed: a plan depends on no seed)."""
        planned = [p for p in self._each("planned_peak_mib") if p is not None]
        return max(planned) if planned else None
