"""report.md's Plots: the PNGs drawn beside it (plots.py), and why one is missing."""

from __future__ import annotations

from mpexp.report.table import Report

PLOT_TITLES = {
    "result": "The result per epoch and over training time",
    "loss_curves": "Loss curves",
    "epoch_time": "Epoch time and its spread",
    "peak_memory": "Peak memory",
    "loss_scale": "Loss scale per scaled run (skipped steps marked x)",
    "underflow": "fp16 underflow per layer",
}


def section(report: Report) -> list[str]:
    lines = ["## Plots", ""]
    if not report.plots_drawn:
        return [*lines, "This report drew none (`--no-plots`); a PNG beside it is an earlier "
                "report's. The report without `--no-plots` draws them anew.", ""]  # fmt: skip
    for name, title in PLOT_TITLES.items():
        if name in report.plots:
            lines += [f"![{title}]({report.plots[name].name})", ""]
    if "result" not in report.plots:
        lines += [
            "Each run validated once, at its end: its result is a point per run, which the "
            "tables above hold, so there is no result plot.",
            "",
        ]
    if "loss_scale" not in report.plots:
        lines += ["No run used loss scaling, so there is no loss-scale plot.", ""]
    if "underflow" not in report.plots:
        lines += [
            "No run recorded gradient statistics, so there is no underflow plot "
            "(`diagnostics.grad_stats_every=N` records them).",
            "",
        ]
    return lines
