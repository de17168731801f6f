"""The report's PNG plots, drawn with matplotlib's Agg canvas.

Figures are built with `matplotlib.figure.Figure`, not pyplot, so drawing a report never changes
the process's backend or global figure state (the report also runs inside a Hydra process).

Each configuration keeps one colour, line style and marker in every plot, and its seeds share them:
two configurations whose curves coincide (fp32 and tf32 on a CPU, where TF32 does not exist) still
show both, one dashed over the other, their hollow markers one inside the other or at different
steps.
"""

from __future__ import annotations

import math
import statistics
from itertools import pairwise
from pathlib import Path

from matplotlib import colormaps
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator

from mpexp.report.axes import Curve, SweepAxis, short_labels, sweep_axis
from mpexp.report.configuration import Config
from mpexp.report.row import Row
from mpexp.report.sensitivity import curve_sensitivity
from mpexp.report.table import Report

LINE_STYLES = ["-", "--", ":", "-."]
MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*"]
MARKS_PER_LINE = 8  # markers along a per-step line: enough to tell lines apart, few enough to read
# underflow spans orders of magnitude (a layer losing 0.1 % of its gradient matters as 10 % does)
UNDERFLOW_RANGE_PCT = (1e-3, 100.0)


def _style(index: int) -> dict:
    # hollow markers: a square drawn on a circle at the same point leaves the circle visible
    return {
        "color": f"C{index % 10}",
        "linestyle": LINE_STYLES[index % len(LINE_STYLES)],
        "marker": MARKERS[index % len(MARKERS)],
        "markerfacecolor": "none",
        "markeredgewidth": 1.3,
    }


MAX_FULL_LABELS = 8  # more lines than this, and the legend names them by the keys that differ
MAX_TARGETS_NAMED = 3  # more targets than this, and one legend entry says what their colours mean


def _layer(reference: bool) -> dict:
    """Where a configuration's lines lie: the fp32 references drawn last (on top: a higher
    zorder), thin, the others below, wide and translucent, so that a curve that coincides with
    its reference's shows around it."""
    if reference:
        return {"zorder": 3, "linewidth": 1.0}
    return {"zorder": 2, "linewidth": 2.6, "alpha": 0.55}


def _legend_labels(configs: list[Config]) -> list[str]:
    """A label per configuration: its overrides, or for a sweep of many configurations only the
    keys that differ between them, shortened (axes.short_labels)."""
    if len(configs) <= MAX_FULL_LABELS:
        return [f"{c.label} (n={c.n})" for c in configs]
    return [f"{label} (n={c.n})" for label, c in zip(short_labels(configs), configs, strict=True)]


def _by_steps(configs: list[Config]) -> bool:
    """Whether a run trained to a step budget (Run.step_budget): every figure then draws the
    validation rows against the step, for all runs (one axis holds one quantity)."""
    return any(r.run.step_budget for c in configs for r in c.rows)


def _one_point_each(configs: list[Config]) -> bool:
    """Whether every run validated once: a curve per run would be a point per run, which the
    tables already hold."""
    return all(len(r.run.epochs) <= 1 for c in configs for r in c.rows)


def draw_all(report: Report) -> dict[str, Path]:
    """Draw every plot (`figures`) into the report's folder; their paths by name."""
    return {
        name: _save(fig, report.out_dir / file) for name, (fig, file) in figures(report).items()
    }


def figures(report: Report) -> dict[str, tuple[Figure, str]]:
    """Every plot that has something to show, by name, with its file name: the result's needs
    more than one validation per run, the sweep's a numeric key swept beside the precision, the
    loss-scale plot a scaled run, the underflow plot a run with gradient statistics. Runs that
    diverged are not drawn: their values are not finite."""
    configs = [c for c in report.configs if c.rows]
    if not configs:
        return {}
    drawn = {}
    if not _one_point_each(configs):
        drawn["result"] = (result(configs, asked=report.target is not None), "result.png")
    drawn["loss_curves"] = (loss_curves(configs), "loss_curves.png")
    drawn["epoch_time"] = (epoch_time(configs), "epoch_time.png")
    drawn["peak_memory"] = (peak_memory(configs), "peak_memory.png")
    axis = sweep_axis(report.configs)
    if axis is not None:
        drawn["sweep"] = (sweep(axis), axis.file_name)
    scaled = [(i, r) for i, c in enumerate(configs) for r in c.rows if r.loss_scaling != "none"]
    if scaled:
        drawn["loss_scale"] = (loss_scale(scaled), "loss_scale.png")
    with_stats = [(i, r) for i, c in enumerate(configs) for r in c.rows if _underflow_keys(r)]
    if with_stats:
        drawn["underflow"] = (underflow(with_stats), "underflow.png")
    return drawn


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return path


def _figure_legend(fig: Figure, configs: list[Config], extra: list[tuple[Line2D, str]] = ()):
    """One legend for the figure, below its panels: an entry per configuration."""
    handles = [Line2D([], [], **_style(i), **_layer(c.is_reference)) for i, c in enumerate(configs)]
    labels = _legend_labels(configs)
    handles += [h for h, _ in extra]
    labels += [label for _, label in extra]
    columns = 3 if len(labels) <= MAX_FULL_LABELS else 4  # short labels: more to a row
    fig.legend(handles, labels, loc="outside lower center", ncols=min(columns, len(labels)))


def _marks(count: int, index: int, configs: int) -> tuple[int, int]:
    """markevery for a line of `count` points: configurations start their markers at different
    points, so markers of coinciding lines do not cover each other. The markers are spaced at
    least as many points apart as there are configurations (fewer markers on a short line of
    many configurations), so that each configuration has a start of its own."""
    every = max(1, count // MARKS_PER_LINE, min(configs, count))
    return (index * every // max(1, configs)) % every, every


def _progress(configs: list[Config]) -> tuple[str, str]:
    """The key of the validation rows' x-axis, and its words: the epoch, or for runs that trained
    to a step budget the step (runs of a step budget end mid-epoch, or validate within one)."""
    return ("step", "step") if _by_steps(configs) else ("epoch", "epoch")


def result(configs: list[Config], asked: bool = False) -> Figure:
    """The result (the task's metric: val accuracy, a language model's val loss) per epoch (per
    step for step-budget runs) and against training time, with the targets of time to target
    (`asked`: one given with --target, else each fp32 reference's). Configurations judged by
    another metric than the first's are left out: one axis holds one quantity."""
    spec = configs[0].spec
    key, words = _progress(configs)
    fig = Figure(figsize=(11, 4.8), layout="constrained")
    per_progress, per_time = fig.subplots(1, 2, sharey=True)
    shown = [c for c in configs if c.spec == spec]
    for i, config in enumerate(shown):
        for row in config.rows:
            epochs = row.run.epochs
            values = [spec.scale * e[spec.metric] for e in epochs]
            elapsed, times = 0.0, []
            for e in epochs:  # compilation counts towards the time it takes
                elapsed += e["perf/epoch_time_s"] + e.get("perf/compile_s", 0.0)
                times.append(elapsed)
            layer = _layer(config.is_reference)
            per_progress.plot([e[key] for e in epochs], values, **_style(i), **layer)
            per_time.plot(times, values, **_style(i), **layer)
    extra = _targets(shown, (per_progress, per_time), asked)
    ylabel = f"{spec.name} ({spec.shown_in})"
    per_progress.set(xlabel=words, ylabel=ylabel, title=f"{spec.metric} per {words}")
    per_progress.xaxis.set_major_locator(MaxNLocator(integer=True))
    per_time.set(
        xlabel="training time (s, sum of epoch times)",
        ylabel=ylabel,
        title=f"{spec.metric} over training time",
    )
    per_time.tick_params(labelleft=True)
    _figure_legend(fig, shown, extra)
    return fig


TARGET_STYLE = {"linewidth": 1.2, "linestyle": (0, (4, 3)), "zorder": 1}


def _targets(configs: list[Config], axes, asked: bool) -> list[tuple[Line2D, str]]:
    """A horizontal line at each target of time to target, and their legend entries: one grey
    line for a target asked for (`--target`); else each fp32 reference's, in its colour."""
    spec = configs[0].spec
    if asked:
        levels = {c.target: None for c in configs if c.target is not None}
    else:
        levels = {c.target: c for c in configs if c.is_reference and c.target is not None}
    extra = []
    for target, reference in levels.items():
        color = "0.4" if reference is None else _style(configs.index(reference))["color"]
        for ax in axes:
            ax.axhline(spec.scale * target, color=color, **TARGET_STYLE)
        if asked or len(levels) <= MAX_TARGETS_NAMED:
            whose = "" if reference is None else f" ({reference.label})"
            extra.append((Line2D([], [], color=color, **TARGET_STYLE),
                          f"target: {spec.scale * target:.4g} {spec.shown_in}{whose}"))  # fmt: skip
    if len(extra) < len(levels):
        extra.append((Line2D([], [], color="0.4", **TARGET_STYLE),
                      "target of each fp32 reference, in its colour"))  # fmt: skip
    return extra


def loss_curves(configs: list[Config]) -> Figure:
    """Training loss at every step and validation loss at every epoch (at every validation,
    against the step, for step-budget runs); the training loss alone where each run validated
    once (a point per run: the tables hold it)."""
    key, words = _progress(configs)
    with_val = not _one_point_each(configs)
    fig = Figure(figsize=(11 if with_val else 6.5, 4.8), layout="constrained")
    axes = fig.subplots(1, 2 if with_val else 1, squeeze=False)[0]
    per_step = axes[0]
    for i, config in enumerate(configs):
        layer = _layer(config.is_reference)
        for row in config.rows:
            steps = row.run.steps
            per_step.plot(
                [s["step"] for s in steps],
                [s["train/loss"] for s in steps],
                markersize=5,
                markevery=_marks(len(steps), i, len(configs)),
                **_style(i),
                **{**layer, "linewidth": layer["linewidth"] * 0.6},  # many points: thinner
            )
            if with_val:
                epochs = row.run.epochs
                axes[1].plot(
                    [e[key] for e in epochs], [e["val/loss"] for e in epochs], **_style(i),
                    **layer,
                )  # fmt: skip
    per_step.set(xlabel="step", ylabel="train loss", title="Training loss per step")
    per_step.xaxis.set_major_locator(MaxNLocator(integer=True))
    if with_val:
        axes[1].set(xlabel=words, ylabel="val loss", title=f"Validation loss per {words}")
        axes[1].xaxis.set_major_locator(MaxNLocator(integer=True))
    _figure_legend(fig, configs)
    return fig


def _offsets(count: int) -> list[float]:
    """x offsets of a configuration's runs around its tick, so that they stand side by side."""
    if count == 1:
        return [0.0]
    width = min(0.5, 0.12 * (count - 1))
    return [-width / 2 + width * k / (count - 1) for k in range(count)]


def epoch_time(configs: list[Config]) -> Figure:
    """Every timed epoch of every run (dots), each run's median (marker) and min-max (bar),
    labelled with the configuration's speedup over its fp32 reference; the title says so, or,
    where every run timed one epoch (all three then one point), that it is one epoch a run."""
    fig = Figure(figsize=(max(6.0, 1.4 * len(configs) + 2.5), 4.8), layout="constrained")
    ax = fig.subplots()
    top = 0.0
    for i, config in enumerate(configs):
        style = _style(i)
        for offset, row in zip(_offsets(config.n), config.rows, strict=True):
            x = i + offset
            ax.scatter([x] * len(row.timed), row.timed, s=10, color=style["color"], alpha=0.45)
            ax.vlines(x, min(row.timed), max(row.timed), color=style["color"], linewidth=1.5)
            ax.plot(x, row.epoch_time_s, marker=style["marker"], color=style["color"], ms=8)
            top = max(top, max(row.timed))
        speedup = config.speedup
        if speedup is not None:
            text = f"{speedup.value:.2f}x"
            if speedup.low is not None:
                text += f"\n({speedup.low:.2f} to {speedup.high:.2f})"
            highest = max(max(r.timed) for r in config.rows)
            ax.annotate(
                text,
                (i, highest),
                xytext=(0, 6),
                textcoords="offset points",
                ha="center",
                va="bottom",
                fontsize="small",
            )
    ax.set_xticks(range(len(configs)), _legend_labels(configs), rotation=20, ha="right")
    ax.set_xlim(-0.6, len(configs) - 0.4)
    ax.set_ylim(0, top * 1.3 if top > 0 else 1)  # from zero, so heights compare as ratios
    one_each = all(len(r.timed) == 1 for c in configs for r in c.rows)
    drawn = (
        "one timed epoch per run (the first, which pays warm-up, is not timed)"
        if one_each
        else "each timed epoch (dots), each run's median (marker) and min-max (bar)"
    )
    ax.set(
        xlabel="configuration: its runs side by side",
        ylabel="seconds per epoch",
        title=f"Epoch time: {drawn}\nlabel: speedup over fp32 (95 % interval with 2+ seeds)",
    )
    return fig


def peak_memory(configs: list[Config]) -> Figure:
    """Peak memory per configuration (mean over seeds), labelled with its ratio to fp32."""
    fig = Figure(figsize=(max(6.0, 1.4 * len(configs) + 2.5), 4.8), layout="constrained")
    ax = fig.subplots()
    positions = range(len(configs))
    bars = ax.bar(
        positions,
        [c.peak_mem_mib for c in configs],
        color=[_style(i)["color"] for i in positions],
    )
    notes = ["" if c.mem_ratio is None else f"{c.mem_ratio:.2f}x" for c in configs]
    ax.bar_label(bars, labels=notes, fontsize="small")
    ax.set_xticks(list(positions), _legend_labels(configs), rotation=20, ha="right")
    kinds = {"cuda": "CUDA tensor memory", "rss": "process RSS (CPU)"}
    what = " / ".join(sorted({kinds[c.mem_kind] for c in configs}))
    ax.set(
        xlabel="configuration",
        ylabel=f"peak MiB, {what}",
        title="Peak memory, mean over seeds (label: ratio to fp32)",
    )
    ax.margins(y=0.15)  # room for the labels above the bars
    return fig


def _grid(fig: Figure, count: int, sharey: bool = False):
    """`count` panels, three to a row; the cells left over in the last row are hidden."""
    columns = min(3, count)
    rows = math.ceil(count / columns)
    axes = fig.subplots(rows, columns, squeeze=False, sharey=sharey).flatten()
    for ax in axes[count:]:
        ax.set_visible(False)
    return axes[:count]


def sweep(axis: SweepAxis) -> Figure:
    """The result against the swept key: a panel per combination of the other keys that varied,
    a line per precision through its configurations' means over seeds, with a band from the
    lowest seed's result to the highest's where a point has two seeds or more (the title says
    whether there are bands), fp32 on top; a log axis where the values span a decade. A point
    whose every run diverged is an x at the top of its panel. Under a learning-rate sweep each
    line's legend entry gives its LR sensitivity (sensitivity.py)."""
    spec = axis.panels[0].curves[0].points[0].config.spec
    lines = list(dict.fromkeys(c.precision for panel in axis.panels for c in panel.curves))
    columns = min(3, len(axis.panels))
    height = 3.8 * math.ceil(len(axis.panels) / columns) + 0.8
    fig = Figure(figsize=(4.8 * columns + 0.6, height), layout="constrained")
    banded = False
    for ax, panel in zip(_grid(fig, len(axis.panels), sharey=True), axis.panels, strict=True):
        for curve in panel.curves:
            style = _style(lines.index(curve.precision))
            drawn = [p for p in curve.points if p.config.rows]
            seeds = [[spec.scale * r.result for r in p.config.rows] for p in drawn]
            xs = [p.x for p in drawn]
            means = [statistics.fmean(v) for v in seeds]
            ax.plot(xs, means, label=_line_label(curve, axis.is_lr), **style,
                    **_layer(curve.is_reference))  # fmt: skip
            if any(len(v) > 1 for v in seeds):  # a band needs two seeds somewhere
                banded = True
                ax.fill_between(xs, [min(v) for v in seeds], [max(v) for v in seeds],
                                color=style["color"], alpha=0.15, linewidth=0)  # fmt: skip
            for point in curve.points:
                if not point.config.rows:  # at the panel's top: its value is not finite
                    ax.plot(point.x, 0.96, marker="x", color=style["color"], markersize=9,
                            linestyle="none", transform=ax.get_xaxis_transform(),
                            label=f"{curve.precision}: every seed diverged")  # fmt: skip
        if axis.log:
            ax.set_xscale("log")
            ax.minorticks_off()  # the swept values are the ticks
        ax.set_xticks(axis.values, [axis.shown(x) for x in axis.values])
        ax.set(xlabel=axis.key, ylabel=f"{spec.name} ({spec.shown_in})", title=panel.label)
        ax.tick_params(labelleft=True)
        handles, labels = ax.get_legend_handles_labels()
        unique = dict(zip(labels, handles, strict=True))  # one "diverged" entry per precision
        ax.legend(unique.values(), unique.keys(), fontsize="small")
    drawn = "mean over seeds, band from the lowest seed to the highest" if banded else "one seed"
    fig.suptitle(f"Final {spec.metric}: {drawn}")
    return fig


def _line_label(curve: Curve, lr: bool) -> str:
    """The precision, and under a learning-rate sweep its LR sensitivity."""
    sensitivity = curve_sensitivity(curve) if lr else None
    if sensitivity is None:
        return curve.precision
    value = sensitivity.value
    shown = f"{value.value:.3f}" + (f" ± {value.half_width:.3f}" if value.low is not None else "")
    return f"{curve.precision} (LR sensitivity {shown})"


def loss_scale(runs: list[tuple[int, Row]]) -> Figure:
    """The scale every step used, one panel per run with loss scaling; skipped steps marked x."""
    columns = min(3, len(runs))
    height = 3.2 * math.ceil(len(runs) / columns) + 0.8
    fig = Figure(figsize=(4.2 * columns + 0.6, height), layout="constrained")
    # axes not shared: a shared x would leave panels above an empty cell without step labels
    for ax, (i, row) in zip(_grid(fig, len(runs)), runs, strict=True):
        steps = row.run.steps
        color = _style(i)["color"]
        ax.plot([s["step"] for s in steps], [s["amp/scale"] for s in steps], color=color)
        # amp/skipped_steps is cumulative: a step was skipped where the count goes up
        previous, skipped = 0, []
        for s in steps:
            if s["amp/skipped_steps"] > previous:
                skipped.append(s)
            previous = s["amp/skipped_steps"]
        ax.scatter(
            [s["step"] for s in skipped],
            [s["amp/scale"] for s in skipped],
            color="black",
            marker="x",
            s=36,
            zorder=3,
        )
        ax.set_yscale("log", base=2)
        ax.set_title(f"{row.label}\n{row.loss_scaling}, {row.skipped_steps} skipped", fontsize=9)
        ax.set(xlabel="step", ylabel="loss scale")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle("Loss scale per step (x: skipped step)")
    return fig


def _underflow_keys(row: Row) -> list[str]:
    """The per-layer underflow metrics of a run's gradient statistics, total last."""
    keys = {k for d in row.run.diagnostics for k in d if k.endswith("/underflow")}
    layers = [k for k in keys if k != "diag/total/underflow"]
    ordered = sorted(layers, key=lambda k: [_natural(p) for p in k.split(".")])
    return ordered + (["diag/total/underflow"] if "diag/total/underflow" in keys else [])


def _natural(part: str):
    return (0, int(part), "") if part.isdigit() else (1, 0, part)


def _cell_edges(steps: list[int]) -> list[float]:
    """Edges of cells centred on `steps`: halfway between neighbours, half a gap beyond the ends."""
    if len(steps) == 1:
        return [steps[0] - 0.5, steps[0] + 0.5]
    middles = [(a + b) / 2 for a, b in pairwise(steps)]
    return [
        steps[0] - (steps[1] - steps[0]) / 2,
        *middles,
        steps[-1] + (steps[-1] - steps[-2]) / 2,
    ]


def underflow(runs: list[tuple[int, Row]]) -> Figure:
    """Per layer, the share of non-zero gradient elements that fp16 loses at the step's scale
    (zero or subnormal once scaled), at every step where gradient statistics ran: one heat map
    per run, layers down, steps across, on a log colour scale; white where (next to) nothing was
    lost."""
    tallest = max(len(_underflow_keys(r)) for _, r in runs)
    columns = min(3, len(runs))
    rows = math.ceil(len(runs) / columns)
    fig = Figure(
        figsize=(4.6 * columns + 1.2, rows * (1.0 + 0.22 * tallest) + 0.8), layout="constrained"
    )
    axes = _grid(fig, len(runs))
    cmap = colormaps["magma"].with_extremes(bad="white", under="white")
    norm = LogNorm(*UNDERFLOW_RANGE_PCT, clip=False)
    image = None
    for ax, (_, row) in zip(axes, runs, strict=True):
        keys = _underflow_keys(row)
        stats = [d for d in row.run.diagnostics if keys[0] in d]
        steps = [d["step"] for d in stats]
        grid = [[100 * d.get(k, math.nan) for d in stats] for k in keys]
        edges = _cell_edges(steps)
        image = ax.pcolormesh(edges, range(len(keys) + 1), grid, cmap=cmap, norm=norm)
        ax.set_yticks(
            [k + 0.5 for k in range(len(keys))],
            [k.removeprefix("diag/").removesuffix("/underflow") for k in keys],
            fontsize=8,
        )
        ax.invert_yaxis()  # the first layer on top
        # outside fp16 the gradients never were fp16: what fp16 would lose at that scale
        what = row.precision if row.precision == "fp16" else f"{row.precision}, what-if in fp16"
        ax.set_title(f"{row.label}\n{what}, loss scaling {row.loss_scaling}", fontsize=9)
        ax.set(xlabel="step", ylabel="layer")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.colorbar(
        image,
        ax=list(axes),
        extend="min",
        label="% of non-zero gradient elements lost in fp16 (white: none, or under 0.001 %)",
    )
    fig.suptitle("fp16 gradient underflow per layer (diagnostics.grad_stats_every)")
    return fig
