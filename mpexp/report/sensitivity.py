"""The learning-rate sensitivity of Wortsman et al. (2023), "Small-scale proxies for large-scale
Transformer training instabilities" (arXiv:2309.14322):

    LR sensitivity = mean over the swept rates r of min(loss(r), initial loss) - best loss

with loss(r) the final loss of a run at rate r, the initial loss the loss at initialisation and
the best loss the lowest over the rates (of the capped values). Capping at the initial loss counts
a run that diverged, or ended worse than it began, as one that learned nothing, however far its
loss went: one rate that blows up does not swamp the mean. 0 means every rate reaches the best
loss; the larger, the narrower the range of rates that trains well.

The initial loss is what the runs record of it: each run's first logged training loss, the loss
of its initial weights on its first batch (step 1's loss is computed before the first update).
For a language model that is close to ln(vocabulary), the loss of a uniform prediction. The
result it is computed on is the run's final result when the result is a loss (a language model's
val loss); a classifier, judged by accuracy, gets none.

Seeds: the sensitivity is computed for each seed over that seed's runs at every rate, then
averaged, with its 95 % interval over the seeds (stats.mean).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from mpexp.report.axes import Curve, Point
from mpexp.report.stats import Estimate, mean


def lr_sensitivity(losses: Sequence[float], initial: float) -> float:
    """mean(min(loss, initial)) - min(min(loss, initial)) over the rates; a loss that is not
    finite (a run that diverged) counts as the initial loss."""
    capped = [_capped(loss, initial) for loss in losses]
    return statistics.fmean(capped) - min(capped)


def _capped(loss: float, initial: float) -> float:
    return min(loss, initial) if math.isfinite(loss) else initial


@dataclass(frozen=True)
class Sensitivity:
    """A curve's LR sensitivity, its best rate and the rates within the tolerance of its best."""

    value: Estimate  # over seeds, in the result's unit
    seeds: int
    initial: float  # the mean initial loss of its runs
    best: Point  # the rate with the lowest mean capped loss
    best_loss: float
    # the widest run of neighbouring rates around the best whose mean capped loss is within the
    # tolerance of the best loss: (lowest, highest)
    within: tuple[Point, Point]
    tolerance: float


def curve_sensitivity(curve: Curve) -> Sensitivity | None:
    """The sensitivity of a precision's curve over the rates; None where the result is no loss,
    a run recorded no training loss, or no seed ran at every rate."""
    spec = curve.points[0].config.spec
    if spec.higher_is_better:
        return None
    by_point = [{r.seed: r for r in reversed(p.config.members)} for p in curve.points]
    if any(not r.run.steps for runs in by_point for r in runs.values()):
        return None
    seeds = sorted(set.intersection(*(set(runs) for runs in by_point)), key=str)
    if not seeds:
        return None
    finals: dict[object, list[float]] = {}
    initials: dict[object, float] = {}
    for seed in seeds:
        runs = [runs[seed] for runs in by_point]
        finals[seed] = [spec.scale * r.result for r in runs]
        initials[seed] = statistics.fmean(spec.scale * r.run.steps[0]["train/loss"] for r in runs)
    per_seed = [lr_sensitivity(finals[s], initials[s]) for s in seeds]
    capped = [
        statistics.fmean(_capped(finals[s][k], initials[s]) for s in seeds)
        for k in range(len(curve.points))
    ]
    best = min(range(len(capped)), key=capped.__getitem__)
    tolerance = curve.points[0].config.tolerance
    low = high = best
    while low > 0 and capped[low - 1] <= capped[best] + tolerance:
        low -= 1
    while high < len(capped) - 1 and capped[high + 1] <= capped[best] + tolerance:
        high += 1
    return Sensitivity(
        value=mean(per_seed),
        seeds=len(seeds),
        initial=statistics.fmean(initials.values()),
        best=curve.points[best],
        best_loss=capped[best],
        within=(curve.points[low], curve.points[high]),
        tolerance=tolerance,
    )
