"""Means, differences and ratios with their 95 % intervals, for a handful of seeds.

With n this small the intervals use Student's t, not a normal approximation. A difference of two
means is paired when the two samples are the same seeds (each pair shares its initial weights and
data order, and the interval is that of the per-seed differences), else Welch's (the two variances
need not be equal). The quantiles come from a table: a new dependency for one number is not worth
it, and scipy.stats.t.ppf used only where scipy happens to be installed would give the same sweep
two different reports (the table rounds a fractional Welch df down, to a slightly wider interval).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

# two-sided 95 % quantiles of Student's t (its 0.975 quantile) by degrees of freedom
T975 = {
    1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
    10: 2.228, 11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110,
    18: 2.101, 19: 2.093, 20: 2.086, 21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060,
    26: 2.056, 27: 2.052, 28: 2.048, 29: 2.045, 30: 2.042, 40: 2.021, 60: 2.000, 120: 1.980,
}  # fmt: skip


def t975(df: float) -> float:
    """The quantile for `df` degrees of freedom, at the tabulated df at or below it: a fractional
    (Welch) or untabulated df gets a slightly wider interval, never a narrower one."""
    if df < 1:
        raise ValueError(f"{df} degrees of freedom: an interval needs at least two values")
    # a hair of slack: rounding in Welch's formula must not cost a whole degree of freedom
    return T975[max(k for k in T975 if k <= df + 1e-9)]


@dataclass(frozen=True)
class Estimate:
    """A value and its 95 % interval; `low` and `high` are None where there is no interval
    (a single value)."""

    value: float
    low: float | None = None
    high: float | None = None

    @property
    def half_width(self) -> float | None:
        """± for a symmetric interval (means and differences)."""
        return None if self.low is None else (self.high - self.low) / 2


def mean(values: Sequence[float]) -> Estimate:
    """The mean, with the t interval when there are two values or more."""
    m = statistics.fmean(values)
    if len(values) < 2:
        return Estimate(m)
    half = t975(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return Estimate(m, m - half, m + half)


def _welch(terms: Sequence[tuple[float, int]]) -> tuple[float, float] | None:
    """(standard error, Welch's degrees of freedom) from (variance of a mean, n) per sample;
    None when a sample has fewer than two values; a zero spread gives (0, inf)."""
    if any(n < 2 for _, n in terms):
        return None
    total = sum(v for v, _ in terms)
    if total == 0:
        return 0.0, math.inf
    df = total**2 / sum(v**2 / (n - 1) for v, n in terms)
    return math.sqrt(total), df


def paired_difference(a: Sequence[float], b: Sequence[float]) -> Estimate:
    """mean(a - b) of paired values (a[i] with b[i]), with the t interval of the differences."""
    return mean([x - y for x, y in zip(a, b, strict=True)])


def difference(a: Sequence[float], b: Sequence[float]) -> Estimate:
    """mean(a) - mean(b) of independent samples, with Welch's t interval when both have two
    values or more."""
    d = statistics.fmean(a) - statistics.fmean(b)
    welch = _welch([(_var_of_mean(a), len(a)), (_var_of_mean(b), len(b))])
    if welch is None:
        return Estimate(d)
    se, df = welch
    half = se * t975(df) if se else 0.0
    return Estimate(d, d - half, d + half)


def ratio(a: Sequence[float], b: Sequence[float]) -> Estimate:
    """mean(a) / mean(b), with an interval from Welch's t on the log scale (the delta method:
    each mean's relative standard error), so the interval is never below zero."""
    r = statistics.fmean(a) / statistics.fmean(b)
    welch = _welch([(_rel_var_of_mean(a), len(a)), (_rel_var_of_mean(b), len(b))])
    if welch is None:
        return Estimate(r)
    se, df = welch
    factor = math.exp(se * t975(df)) if se else 1.0
    return Estimate(r, r / factor, r * factor)


def _var_of_mean(values: Sequence[float]) -> float:
    return statistics.variance(values) / len(values) if len(values) > 1 else math.nan


def _rel_var_of_mean(values: Sequence[float]) -> float:
    return _var_of_mean(values) / statistics.fmean(values) ** 2
