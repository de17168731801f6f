"""The report's PNG plots, drawn with matplotlib's Agg canvas.

Figures are built with `matplotlib.figure.Figure`, not pyplot, so drawing a report never changes
the process's backend or global figure state (the report also runs inside a Hydra process).
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from mpexp.report.table import Row


def _colour(index: int) -> str:
    return f"C{index % 10}"  # the same colour for a run in every plot


def draw_all(rows: list[Row], out_dir: Path) -> dict[str, Path]:
    """Every plot that has something to show, by name; the loss-scale plot needs a scaled run."""
    drawn = {
        "loss_curves": loss_curves(rows, out_dir / "loss_curves.png"),
        "epoch_time": epoch_time_bars(rows, out_dir / "epoch_time.png"),
        "peak_memory": peak_memory_bars(rows, out_dir / "peak_memory.png"),
    }
    if any(r.loss_scaling != "none" for r in rows):
        drawn["loss_scale"] = loss_scale_history(rows, out_dir / "loss_scale.png")
    return drawn


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return path


def loss_curves(rows: list[Row], path: Path) -> Path:
    """Training loss at every step and validation loss at every epoch, one line per run."""
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    per_step, per_epoch = fig.subplots(1, 2)
    for i, row in enumerate(rows):
        steps = row.run.steps
        per_step.plot(
            [s["step"] for s in steps],
            [s["train/loss"] for s in steps],
            color=_colour(i),
            linewidth=0.8,
            alpha=0.8,
            label=row.label,
        )
        epochs = row.run.epochs
        per_epoch.plot(
            [e["epoch"] for e in epochs],
            [e["val/loss"] for e in epochs],
            color=_colour(i),
            marker="o",
            label=row.label,
        )
    per_step.set(xlabel="step", ylabel="train loss", title="Training loss per step")
    per_epoch.set(xlabel="epoch", ylabel="val loss", title="Validation loss per epoch")
    per_epoch.xaxis.set_major_locator(MaxNLocator(integer=True))
    per_epoch.legend(fontsize="small")
    return _save(fig, path)


def _bars(rows: list[Row], heights: list[float], notes: list[str], ylabel: str, title: str):
    fig = Figure(figsize=(max(5.0, 1.1 * len(rows) + 2), 4.2), layout="constrained")
    ax = fig.subplots()
    positions = range(len(rows))
    bars = ax.bar(positions, heights, color=[_colour(i) for i in positions])
    ax.bar_label(bars, labels=notes, fontsize="small")
    ax.set_xticks(list(positions), [r.label for r in rows], rotation=30, ha="right")
    ax.set(ylabel=ylabel, title=title)
    ax.margins(y=0.15)  # room for the labels above the bars
    return fig


def epoch_time_bars(rows: list[Row], path: Path) -> Path:
    """Median epoch time per run, labelled with the speedup over fp32."""
    notes = ["" if r.speedup is None else f"{r.speedup:.2f}x" for r in rows]
    fig = _bars(
        rows,
        [r.epoch_time_s for r in rows],
        notes,
        "seconds per epoch (median after the first)",
        "Epoch time (label: speedup over fp32)",
    )
    return _save(fig, path)


def peak_memory_bars(rows: list[Row], path: Path) -> Path:
    """Peak memory per run, labelled with its ratio to fp32."""
    notes = ["" if r.mem_ratio is None else f"{r.mem_ratio:.2f}x" for r in rows]
    kinds = {"cuda": "CUDA tensor memory", "rss": "process RSS (CPU)"}
    what = " / ".join(sorted({kinds[r.mem_kind] for r in rows}))
    fig = _bars(
        rows,
        [r.peak_mem_mib for r in rows],
        notes,
        f"peak MiB, {what}",
        "Peak memory (label: ratio to fp32)",
    )
    return _save(fig, path)


def loss_scale_history(rows: list[Row], path: Path) -> Path:
    """The scale every step used, for the runs with loss scaling; skipped steps marked x."""
    fig = Figure(figsize=(9, 4.2), layout="constrained")
    ax = fig.subplots()
    for i, row in enumerate(rows):
        if row.loss_scaling == "none":
            continue
        steps = row.run.steps
        ax.plot(
            [s["step"] for s in steps],
            [s["amp/scale"] for s in steps],
            color=_colour(i),
            drawstyle="steps-post",
            label=f"{row.label} ({row.skipped_steps} skipped)",
        )
        # amp/skipped_steps is cumulative: a step was skipped where the count goes up
        previous, skipped = 0, []
        for s in steps:
            if s["amp/skipped_steps"] > previous:
                skipped.append(s)
            previous = s["amp/skipped_steps"]
        ax.scatter(
            [s["step"] for s in skipped],
            [s["amp/scale"] for s in skipped],
            color=_colour(i),
            marker="x",
            s=36,
            zorder=3,
        )
    ax.set_yscale("log", base=2)
    ax.set(xlabel="step", ylabel="loss scale", title="Loss scale per step (x: skipped step)")
    ax.legend(fontsize="small")
    return _save(fig, path)
