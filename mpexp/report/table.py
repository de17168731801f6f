"""The report's numbers: one row per finished run, compared with the fp32 run of the same model
and dataset; a parity check on final accuracy; runs that failed or are incomplete are named, not
dropped."""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mpexp.report.runs import Run, find_run_dirs, load_run

BASELINE = "fp32"
DEFAULT_TOLERANCE = 0.5  # percentage points of val accuracy
MEMORY_KEYS = {"mem/peak_allocated_mib": "cuda", "mem/peak_rss_mib": "rss"}


@dataclass
class Row:
    """One finished run's numbers, and the fp32 run it is compared with."""

    run: Run
    label: str
    epoch_time_s: float
    samples_per_s: float
    peak_mem_mib: float
    mem_kind: str
    val_loss: float
    val_acc: float
    skipped_steps: int
    baseline: Row | None = None

    @property
    def precision(self) -> str:
        return str(self.run.ran.get("precision", self.run.chosen("precision")))

    @property
    def effective_precision(self) -> str:
        return str(self.run.ran.get("effective_precision", self.precision))

    @property
    def loss_scaling(self) -> str:
        return str(self.run.ran.get("loss_scaling", self.run.chosen("loss_scaling")))

    @property
    def speedup(self) -> float | None:
        return self.baseline.epoch_time_s / self.epoch_time_s if self.baseline else None

    @property
    def mem_ratio(self) -> float | None:
        # CUDA tensor memory and CPU process RSS measure different things: no ratio between them
        if self.baseline is None or self.baseline.mem_kind != self.mem_kind:
            return None
        return self.peak_mem_mib / self.baseline.peak_mem_mib

    @property
    def d_val_loss(self) -> float | None:
        return self.val_loss - self.baseline.val_loss if self.baseline else None

    @property
    def d_val_acc_pts(self) -> float | None:
        return 100 * (self.val_acc - self.baseline.val_acc) if self.baseline else None

    def parity(self, tolerance: float) -> str:
        """baseline, ok, flagged (val acc more than `tolerance` points below fp32), or no fp32."""
        if self.baseline is None:
            return "no fp32 run"
        if self.baseline is self:
            return "baseline"
        return "flagged" if -self.d_val_acc_pts > tolerance else "ok"

    def values(self, tolerance: float) -> dict[str, Any]:
        """The row as plain values: the W&B table's columns, and what report.md formats."""
        return {
            "run": self.label,
            "precision": self.precision,
            "effective_precision": self.effective_precision,
            "loss_scaling": self.loss_scaling,
            "model": self.run.chosen("model"),
            "dataset": self.run.chosen("dataset"),
            "epoch_time_s": self.epoch_time_s,
            "speedup": self.speedup,
            "samples_per_s": self.samples_per_s,
            "peak_mem_mib": self.peak_mem_mib,
            "mem_ratio": self.mem_ratio,
            "val_loss": self.val_loss,
            "d_val_loss": self.d_val_loss,
            "val_acc_pct": 100 * self.val_acc,
            "d_val_acc_pts": self.d_val_acc_pts,
            "skipped_steps": self.skipped_steps,
            "parity": self.parity(tolerance),
        }


def measure(run: Run, label: str) -> Row:
    """A finished run's row from its metrics.jsonl.

    Epoch time and samples/s are medians over the epochs after the first: the first pays one-off
    costs (cuDNN autotuning, allocator growth, lazy initialisation) that say nothing about the
    precision. A one-epoch run has only that epoch to offer.
    """
    timed = run.epochs[1:] or run.epochs
    mem_key = next((k for k in MEMORY_KEYS if k in run.epochs[0]), None)
    if mem_key is None:
        raise KeyError("mem/peak_*_mib")
    last = run.epochs[-1]
    skipped = run.steps[-1]["amp/skipped_steps"] if run.steps else 0
    return Row(
        run=run,
        label=label,
        epoch_time_s=statistics.median(e["perf/epoch_time_s"] for e in timed),
        samples_per_s=statistics.median(e["perf/samples_per_s"] for e in timed),
        peak_mem_mib=max(e[mem_key] for e in run.epochs),
        mem_kind=MEMORY_KEYS[mem_key],
        val_loss=last["val/loss"],
        val_acc=last["val/acc"],
        skipped_steps=int(skipped),
    )


def attach_baselines(rows: list[Row]) -> None:
    """Compare each row with the fp32 run of the same model and dataset.

    With several fp32 runs (a precision x loss-scaling grid) the one without loss scaling is the
    reference, as plain fp32 training has none.
    """
    for row in rows:
        same_task = [
            r
            for r in rows
            if r.precision == BASELINE
            and (r.run.chosen("model"), r.run.chosen("dataset"))
            == (row.run.chosen("model"), row.run.chosen("dataset"))
        ]
        same_task.sort(key=lambda r: r.loss_scaling != "none")  # stable: first listed wins ties
        row.baseline = same_task[0] if same_task else None


@dataclass
class Report:
    out_dir: Path
    rows: list[Row]
    not_reported: list[tuple[str, Run]]
    tolerance: float
    plots: dict[str, Path] = field(default_factory=dict)

    @property
    def path(self) -> Path:
        return self.out_dir / "report.md"

    @property
    def flagged(self) -> list[Row]:
        return [r for r in self.rows if r.parity(self.tolerance) == "flagged"]

    def console_lines(self) -> list[str]:
        lines = [f"Sweep report: {self.path} (runs reported: {len(self.rows)})"]
        lines += [
            f"  below fp32 by more than {self.tolerance:g} points: {r.label}" for r in self.flagged
        ]
        lines += [f"  not reported: {label}: {run.problem}" for label, run in self.not_reported]
        return lines


def build_report(paths: list[Path], tolerance: float, out_dir: Path | None = None) -> Report:
    """Read every run under `paths` and compute the table; nothing is written yet."""
    runs = [load_run(p) for p in find_run_dirs(paths)]
    if out_dir is None:
        out_dir = Path(os.path.commonpath([p.resolve() for p in paths]))
    labels = _labels(runs, out_dir.resolve())
    rows, not_reported = [], []
    for run in runs:
        if run.problem is None:
            try:
                rows.append(measure(run, labels[run.path]))
                continue
            except KeyError as missing:
                run.problem = f"metrics.jsonl has no {missing.args[0]} values"
        not_reported.append((labels[run.path], run))
    attach_baselines(rows)
    return Report(out_dir=out_dir, rows=rows, not_reported=not_reported, tolerance=tolerance)


def _labels(runs: list[Run], out_dir: Path) -> dict[Path, str]:
    """`<folder> <overrides that differ between the runs>`, e.g. `2 precision=fp16`."""
    common = set.intersection(*(set(r.overrides) for r in runs))
    labels = {}
    for run in runs:
        folder = run.path.name if run.path == out_dir else os.path.relpath(run.path, out_dir)
        differing = ",".join(o for o in run.overrides if o not in common)
        labels[run.path] = f"{folder} {differing}".strip()
    return labels
