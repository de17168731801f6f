"""report.md's training state against parity, for sweeps with pure bf16: the bytes each
configuration holds between steps beside its parity verdict and its share of updates lost."""

from __future__ import annotations

from mpexp.report import pure_advice
from mpexp.report.configuration import PURE, Config
from mpexp.report.row import STATE_BYTES
from mpexp.report.sections.cells import (
    byte_size,
    estimate,
    number,
    parity_text,
    precision_text,
    table,
)
from mpexp.report.table import Report


def section(report: Report) -> list[str]:
    """Pure bf16's legs: the bytes each holds in weights, gradients and optimizer states beside
    its parity verdict against fp32 and its share of updates lost."""
    if not any(r.precision == PURE for r in report.rows):
        return []
    lines = [
        "## Training state against parity",
        "",
        "What each configuration holds between steps (weights, their gradients, the optimizer's "
        "states: `ran.bytes_*`), the most its optimizer step holds at once (those and the "
        "step's temporaries, where known: `ran.bytes_step_peak`), the held total against its "
        "fp32 reference's, and its parity verdict "
        "from above. Updates lost: the mean of `opt/updates_lost` over the run, the share of "
        "nonzero updates that left a weight unchanged (computed under bf16_pure only). Under "
        "kahan and stochastic rounding an unchanged weight keeps its update (in the "
        "compensation buffer; in expectation), so there it says how often rounding acted, not "
        "what was lost.",
        "",
    ]

    def cells(c: Config) -> list[str]:
        sizes = c.state_bytes or {}
        return [
            c.label,
            precision_text(c.first),
            c.first.rounding or "",
            *(byte_size(sizes.get(k)) for k in STATE_BYTES),
            byte_size(c.first.step_peak_bytes),
            number(c.state_ratio, ".2f") + ("x" if c.state_ratio is not None else ""),
            estimate(c.updates_lost, ".3f"),
            parity_text(c),
        ]

    headers = ["configuration", "precision", "update rounding", "weights", "gradients",
               "optimizer states", "step peak", "vs fp32", "updates lost", "parity"]  # fmt: skip
    advised = [(c.label, pure_advice.advice(c)) for c in report.configs]
    advice = [f"- {label}: {text}." for label, text in advised if text]
    return [
        *lines,
        *table(headers, report.configs, cells),
        "",
        *advice,
        *([""] if advice else []),
    ]
