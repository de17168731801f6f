"""report.md's result against fp32: each configuration's result over seeds, its difference from
its fp32 reference and the parity verdict on it."""

from __future__ import annotations

from mpexp.report.configuration import Config
from mpexp.report.sections.cells import (
    by_result,
    estimate,
    n_text,
    parity_text,
    precision_text,
    table,
    value_format,
    value_header,
)
from mpexp.report.table import Report
from mpexp.tasks.base import Result


def section(report: Report) -> list[str]:
    """A table per result metric (one, unless the report holds several tasks)."""
    lines = []
    for spec, configs in by_result(report.configs).items():
        lines += _result_section(spec, configs)
    return lines


def _result_section(spec: Result, configs: list[Config]) -> list[str]:
    tolerance = configs[0].tolerance
    worse, better = ("below", "above") if spec.higher_is_better else ("above", "below")
    lines = [
        f"## {spec.title} against fp32",
        "",
        "One row per configuration: runs that differ only in `trainer.seed`, n of them. Values are "
        "means over the seeds ± the half-width of their 95 % interval (Student's t; none for "
        "n = 1). Δ columns: this configuration minus its fp32 reference (the fp32 configuration "
        "with the same other overrides; in a precision x loss-scaling grid the one without loss "
        "scaling), with its 95 % interval: that of the per-seed differences when both ran the "
        "same seeds (paired), else Welch's. The result is the task's final "
        f"`{spec.metric}` in {spec.shown_in} ({'higher' if spec.higher_is_better else 'lower'} "
        f"is better), Δ in {spec.unit}.",
        "",
        f"Parity judges the interval of Δ {spec.name} against the tolerance of {tolerance:g} "
        f"{spec.unit} (`--tolerance`): *within noise* when the whole interval lies {better} "
        f"{-tolerance if spec.higher_is_better else tolerance:+g} (not worse than fp32 by more "
        f"than the tolerance), *worse by X ± Y* when it lies {worse} "
        f"{-tolerance if spec.higher_is_better else tolerance:+g}, *better by X ± Y* when it lies "
        f"{better} {tolerance if spec.higher_is_better else -tolerance:+g}, *inconclusive* when "
        "one side has a single seed or the interval is too wide to tell (it straddles the "
        "tolerance; more seeds narrow it).",
        "",
    ]
    value = value_format(spec)
    with_loss = spec.metric != "val/loss"

    def cells(c: Config) -> list[str]:
        return [
            c.label,
            c.values()["runs"],
            precision_text(c.first),
            c.first.loss_scaling,
            c.first.run.chosen("model"),
            c.first.run.chosen("dataset"),
            n_text(c),
            estimate(c.result, value),
            estimate(c.d_result, "+" + value),
            parity_text(c),
            *([estimate(c.val_loss, ".4f"), estimate(c.d_val_loss, "+.4f")] if with_loss else []),
        ]

    headers = ["configuration", "runs", "precision", "loss scaling", "model", "dataset", "n",
               value_header(spec), f"Δ {spec.name} ({spec.unit})", "parity",
               *(["val loss", "Δ val loss"] if with_loss else [])]  # fmt: skip
    return [*lines, *table(headers, configs, cells), ""]
