"""How many seeds would decide an undecided parity verdict: a power calculation on the spread the
seeds so far measured.

A verdict is undecided while the 95 % interval of the difference straddles the tolerance (stats.py,
configuration.verdict). With n seeds on each side, run with the same seeds (paired, as a sweep that
adds seeds runs them), the interval's half-width is t.975(n - 1) * s / sqrt(n), s the standard
deviation of the per-seed differences. The verdict is decided once the interval lies on one side of
the tolerance: once the half-width is below the margin, the distance from the difference to the
tolerance (for a difference on the good side, the tolerance plus the gain; on the bad side within
it, the tolerance minus the difference).

If the true difference and spread were the measured ones, a sample of the size where the half-width
just equals the margin would come out on either side of it about equally often: half the time
undecided again. So the seeds asked for are those of a power calculation at 80 %, n such that

    (t.975(n - 1) + t.80(n - 1)) * s / sqrt(n) <= margin,

the textbook approximation to the noncentral t: against the exact noncentral t its power is 73 %
at 2 seeds, 78 % at 4 and 80 % from 8. The measured spread is itself uncertain (from two seeds,
very), so the number is a planning figure, not a promise.

Where the two sides did not run the same seeds, s**2 is the sum of their variances (the spread of
a difference of independent runs; pairing by seed can only narrow it). Where one side has a single
seed, its variance is taken to be the other's.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from mpexp.report.configuration import Config
from mpexp.report.stats import t975

# one-sided 80 % quantiles of Student's t by degrees of freedom (the power's term)
T80 = {
    1: 1.376, 2: 1.061, 3: 0.978, 4: 0.941, 5: 0.920, 6: 0.906, 7: 0.896, 8: 0.889, 9: 0.883,
    10: 0.879, 11: 0.876, 12: 0.873, 13: 0.870, 14: 0.868, 15: 0.866, 16: 0.865, 17: 0.863,
    18: 0.862, 19: 0.861, 20: 0.860, 21: 0.859, 22: 0.858, 23: 0.858, 24: 0.857, 25: 0.856,
    26: 0.856, 27: 0.855, 28: 0.855, 29: 0.854, 30: 0.854, 40: 0.851, 60: 0.848, 120: 0.845,
}  # fmt: skip
POWER = 0.8
MOST_SEEDS = 200  # past this, no practical number of seeds decides it


def t80(df: float) -> float:
    """The quantile at the tabulated df at or below `df` (slightly larger: more seeds, never
    fewer)."""
    return T80[max(k for k in T80 if k <= df + 1e-9)]


@dataclass(frozen=True)
class SeedsNeeded:
    """The seeds each side would need, and what the figure rests on."""

    seeds: int | None  # None: more than MOST_SEEDS (the difference sits at the tolerance)
    spread: float  # s: the standard deviation of a per-seed difference, in the result's unit
    margin: float  # the distance from the measured difference to the tolerance
    paired: bool  # s measured on per-seed differences


def seeds_needed(config: Config) -> SeedsNeeded | None:
    """For a configuration whose verdict against its fp32 reference is undecided, the seeds each
    that would decide it at 80 % power (module docstring); None where no spread was measured (a
    single seed on both sides) or there is nothing to compare."""
    reference, gain = config.reference, config.gain(config.d_result)
    if reference is None or reference is config or gain is None:
        return None
    spread, paired = _spread(config, reference)
    if spread is None:
        return None
    margin = abs(gain.value + config.tolerance)  # the tolerance is at -tolerance in gain terms
    return SeedsNeeded(_smallest_n(spread, margin), spread, margin, paired)


def _spread(config: Config, reference: Config) -> tuple[float | None, bool]:
    scale = config.spec.scale
    mine = {r.seed: scale * r.result for r in config.rows}
    theirs = {r.seed: scale * r.result for r in reference.rows}
    same = mine.keys() == theirs.keys() and len(mine) == config.n and len(theirs) == reference.n
    if same and len(mine) >= 2:
        return statistics.stdev(mine[s] - theirs[s] for s in mine), True
    variances = [statistics.variance(v) for v in (mine.values(), theirs.values()) if len(v) >= 2]
    if not variances:
        return None, False
    if len(variances) == 1:  # the single-seed side is taken to spread as the other does
        variances *= 2
    return math.sqrt(sum(variances)), False


def _smallest_n(spread: float, margin: float) -> int | None:
    if spread == 0:
        return 2
    for n in range(2, MOST_SEEDS + 1):
        if (t975(n - 1) + t80(n - 1)) * spread / math.sqrt(n) <= margin:
            return n
    return None
