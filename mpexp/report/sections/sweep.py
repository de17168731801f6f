"""report.md's result against the key swept beside the precision (a learning rate, say): a row
per precision and panel, the LR sensitivity under a learning-rate sweep, and up to which value
each precision keeps fp32's result."""

from __future__ import annotations

import math
import statistics

from mpexp.report.axes import Curve, Panel, SweepAxis, kept_up_to, sweep_axis
from mpexp.report.configuration import Config
from mpexp.report.sections.cells import estimate, table, value_format
from mpexp.report.sensitivity import curve_sensitivity
from mpexp.report.table import Report


def section(report: Report) -> list[str]:
    """The result against the numeric key swept beside the precision (axes.py), a row per
    precision and panel; under a learning-rate sweep also each row's LR sensitivity; then, per
    precision, up to which value it keeps fp32's result."""
    axis = sweep_axis(report.configs)
    if axis is None:
        return []
    spec = axis.panels[0].curves[0].points[0].config.spec
    value, unit = value_format(spec), spec.unit
    tolerance = axis.panels[0].curves[0].points[0].config.tolerance
    others = f", and {_keys(axis.panel_keys)} (a panel per value)" if axis.panel_keys else ""
    lines = [
        f"## {spec.title} against {axis.key}",
        "",
        f"The sweep varied `{axis.key}` beside the precision{others}. A row per precision"
        f"{' and panel' if axis.panel_keys else ''}: its final {spec.name} at each value, the "
        "mean over seeds ± the half-width of its 95 % interval; **bold** where it is worse than "
        "fp32 at the same values of every other key (its parity verdict above), *diverged* where "
        "every seed diverged.",
        "",
    ]
    sensitive = axis.is_lr and not spec.higher_is_better
    if sensitive:
        lines += [
            "LR sensitivity (Wortsman et al. 2023): over the swept rates, the mean of "
            f"min({spec.name}, initial loss) minus the best {spec.name}, per seed over that "
            "seed's runs at every rate, then mean ± its 95 % interval over seeds. The initial "
            "loss is each run's first logged training loss, the loss of its initial weights "
            "(near ln(vocabulary) for a language model): a run that diverged counts as one that "
            f"learned nothing. Best rate: the lowest mean {spec.name}; within {tolerance:g} "
            f"{unit}: the widest range of neighbouring rates around it whose mean is no more "
            "than that above the best."
            + (" One seed: the sensitivities and best rates are indicative only."
               if any(p.config.n == 1 for c in _curves(axis) for p in c.points) else ""),
            "",
        ]  # fmt: skip
    headers = [
        *(["panel"] if axis.panel_keys else []),
        "precision",
        *(f"{axis.key}={axis.shown(x)}" for x in axis.values),
        *(["LR sensitivity", "best rate", f"within {tolerance:g} {unit} of the best"]
          if sensitive else []),
    ]  # fmt: skip
    items = [(panel, curve) for panel in axis.panels for curve in panel.curves]

    def cells(item) -> list[str]:
        panel, curve = item
        at = {p.x: p.config for p in curve.points}
        row = [*([panel.label] if axis.panel_keys else []), curve.precision]
        row += [_sweep_cell(at.get(x), value) for x in axis.values]
        if sensitive:
            found = curve_sensitivity(curve)
            row += ["n/a"] * 3 if found is None else [
                estimate(found.value, value),
                found.best.shown,
                f"{found.within[0].shown} to {found.within[1].shown}",
            ]  # fmt: skip
        return row

    lines += [*table(headers, items, cells), ""]
    if sensitive:
        edges = [e for e in (_edge_text(axis, p, c) for p, c in items) if e]
        lines += [*(f"- {e}" for e in edges), *([""] if edges else [])]
    kept = [k for k in (_kept_text(axis, p, c, tolerance) for p, c in items) if k]
    lines += [*(f"- {k}" for k in kept), *([""] if kept else [])]
    if "sweep" in report.plots:
        lines += [f"![{spec.title} against {axis.key}]({report.plots['sweep'].name})", ""]
    return lines


def _keys(keys: list[str]) -> str:
    return ", ".join(f"`{k}`" for k in keys)


def _sweep_cell(config: Config | None, value: str) -> str:
    if config is None:
        return ""
    if not config.rows:
        return "*diverged*"
    shown = estimate(config.result, value)
    return f"**{shown}**" if config.parity == "worse" else shown


def _kept_text(axis: SweepAxis, panel: Panel, curve: Curve, tolerance: float) -> str | None:
    """`bf16 keeps fp32's val loss (within 0.02 nats) up to optimizer.lr=3e-3; above it, Δ
    +0.151 nats on average (at most +0.190)`; None for fp32."""
    kept = kept_up_to(curve)
    if kept is None:
        return None
    spec = curve.points[0].config.spec
    where = f"**{panel.label}**: " if panel.label else ""
    unsure = _unsure(curve)
    if unsure:  # by the means alone, which the verdicts do not back
        where += f"{unsure[0].upper()}{unsure[1:]}: indicative only. By the mean, "
    keeps = f"{where}{curve.precision} keeps fp32's {spec.name} (within {tolerance:g} {spec.unit})"
    if not kept.above:
        return f"{keeps} at every {axis.key} swept, up to {curve.points[-1].shown}."
    sign = 1 if not spec.higher_is_better else -1
    finite = [sign * behind for _, behind in kept.above if math.isfinite(behind)]
    diverged = [p.shown for p, behind in kept.above if not math.isfinite(behind)]
    value = "+" + value_format(spec)
    parts = []
    if len(finite) == 1:
        parts.append(f"Δ {finite[0]:{value}} {spec.unit}")
    elif finite:
        worst = max(finite) if sign > 0 else min(finite)
        parts.append(f"Δ {statistics.fmean(finite):{value}} {spec.unit} on average (at most "
                     f"{worst:{value}})")  # fmt: skip
    if diverged:
        parts.append(f"every seed diverged at {axis.key}={', '.join(diverged)}")
    if kept.up_to is None:
        return (f"{where}{curve.precision} falls behind fp32 from the smallest {axis.key}, "
                f"{curve.points[0].shown}: {'; '.join(parts)}.")  # fmt: skip
    return f"{keeps} up to {axis.key}={kept.up_to.shown}; above it, {'; '.join(parts)}."


def _unsure(curve: Curve) -> str | None:
    """Why the curve's verdicts do not decide where it keeps up: "one seed" where a point has a
    single seed on a side, "undecided at N seeds" where an interval straddles the tolerance;
    None where every point's verdict is decided (within noise, better, worse, diverged)."""
    verdicts = [p.config.parity for p in curve.points]
    if "single seed" in verdicts:
        return "one seed"
    if "too wide" in verdicts:
        seeds = min(p.config.n for p in curve.points if p.config.parity == "too wide")
        return f"undecided at {seeds} seeds"
    return None


def _edge_text(axis: SweepAxis, panel: Panel, curve: Curve) -> str | None:
    """`fp32's best optimizer.lr, 1e-3, is the lowest swept: ...; try 0.0001 next`, where a
    curve's best value is at an end of the grid; None where it lies inside."""
    found = curve_sensitivity(curve)
    values = axis.values
    if found is None or len(values) < 2 or found.best.x not in (values[0], values[-1]):
        return None
    low = found.best.x == values[0]
    end, inner = (values[0], values[1]) if low else (values[-1], values[-2])
    # a step as the grid takes it: a factor on a log axis, a difference on a linear one
    following = end * end / inner if axis.log else 2 * end - inner
    where = f"**{panel.label}**: " if panel.label else ""
    side = "lowest" if low else "highest"
    text = (f"{where}{curve.precision}'s best {axis.key}, {found.best.shown}, is the {side} "
            f"swept: its optimum may lie {'below' if low else 'above'} the grid")  # fmt: skip
    if following > 0 or not axis.is_lr:
        text += f"; try {axis.key}={following:g} next"
    return text + "."


def _curves(axis: SweepAxis) -> list[Curve]:
    return [curve for panel in axis.panels for curve in panel.curves]
