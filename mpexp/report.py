"""The sweep report: what each precision bought, read from the runs' local files.

    python -m mpexp.report <run dir or multirun dir> [more dirs] [--tolerance 0.5] [--out DIR]

writes `report.md` and PNG plots into the directory given (with several, into their common parent,
or `--out`). One table row per finished run, compared with the fp32 run of the same model and
dataset; a parity check on final accuracy; runs that failed or are incomplete are named, not
dropped. After a multirun the report is written by `mpexp.sweep_report.SweepReport`.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mpexp.errors import UserError
from mpexp.runs import Run, find_run_dirs, load_run

log = logging.getLogger(__name__)

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


# report.md columns: (header, key in Row.values, format)
COLUMNS = [
    ("run", "run", "{}"),
    ("precision", "precision", "{}"),
    ("loss scaling", "loss_scaling", "{}"),
    ("model", "model", "{}"),
    ("dataset", "dataset", "{}"),
    ("epoch time (s)", "epoch_time_s", "{:.2f}"),
    ("speedup", "speedup", "{:.2f}x"),
    ("samples/s", "samples_per_s", "{:.0f}"),
    ("peak memory (MiB)", "peak_mem_mib", "{:.1f}"),
    ("memory vs fp32", "mem_ratio", "{:.2f}x"),
    ("val loss", "val_loss", "{:.4f}"),
    ("Δ val loss", "d_val_loss", "{:+.4f}"),
    ("val acc (%)", "val_acc_pct", "{:.2f}"),
    ("Δ val acc (points)", "d_val_acc_pts", "{:+.2f}"),
    ("skipped steps", "skipped_steps", "{}"),
]


def render_markdown(report: Report) -> str:
    rows = report.rows
    lines = [f"# Sweep report: {report.out_dir.parent.name}/{report.out_dir.name}", ""]
    lines.append(
        f"Runs under `{report.out_dir}`: {len(rows)} reported, "
        f"{len(report.not_reported)} not reported."
    )
    machines = sorted({f"{r.run.ran.get('device_name')} ({r.run.ran.get('device')})" for r in rows})
    torches = sorted({str(r.run.ran.get("torch_version")) for r in rows})
    if rows:
        lines.append(f"Ran on {', '.join(machines)} with torch {', '.join(torches)}.")
    lines.append("")

    if rows:
        lines += _table(report)
        lines += ["", *_notes(report), ""]
        lines += _parity_section(report)
    if report.not_reported:
        lines += ["## Not reported", ""]
        lines += [f"- `{label}`: {run.problem}" for label, run in report.not_reported]
        lines.append("")
    if rows:
        lines += _plots_section(report)
    return "\n".join(lines)


def _table(report: Report) -> list[str]:
    headers = [h for h, _, _ in COLUMNS]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for row in report.rows:
        values = row.values(report.tolerance)
        cells = {
            key: "n/a" if values[key] is None else fmt.format(values[key])
            for _, key, fmt in COLUMNS
        }
        if row.effective_precision != row.precision:
            cells["precision"] += f" (ran as {row.effective_precision})"
        if values["parity"] == "flagged":
            cells["d_val_acc_pts"] = f"**{cells['d_val_acc_pts']}**"
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells.values()) + " |")
    return lines


def _notes(report: Report) -> list[str]:
    notes = [
        "Epoch time and samples/s: median over the epochs after the first, which pays one-off "
        "warm-up costs. Speedup: the fp32 run's epoch time over this run's. Δ columns: this run "
        "minus the fp32 run of the same model and dataset; accuracy in percentage points.",
    ]
    kinds = {r.mem_kind for r in report.rows}
    if "cuda" in kinds:
        notes.append("Peak memory on a GPU: the largest per-epoch peak of CUDA tensor memory.")
    if "rss" in kinds:
        notes.append(
            "Peak memory on CPU: the process's resident set size, which counts the whole Python "
            "process, not only tensors; it is not comparable with GPU memory."
        )
    single = [r.label for r in report.rows if len(r.run.epochs) == 1]
    if single:
        notes.append(f"One-epoch runs (their time includes warm-up): {', '.join(single)}.")
    return [" ".join(notes)]


def _parity_section(report: Report) -> list[str]:
    lines = [
        "## Parity with fp32",
        "",
        f"A run is flagged when its final val accuracy is more than {report.tolerance:g} "
        "points below the fp32 run's (`--tolerance`): mixed precision should match fp32 "
        "accuracy, as the ApX Machine Learning article on mixed precision training advises "
        "checking.",
        "",
    ]
    for row in report.rows:
        verdict = row.parity(report.tolerance)
        acc = f"{100 * row.val_acc:.2f} %"
        if verdict == "baseline":
            lines.append(f"- `{row.label}`: the fp32 reference, {acc}")
        elif verdict == "no fp32 run":
            lines.append(
                f"- `{row.label}`: {acc}, no fp32 run of {row.run.chosen('model')} on "
                f"{row.run.chosen('dataset')} to compare with; add precision=fp32 to the sweep"
            )
        else:
            shown = "**flagged**" if verdict == "flagged" else "ok"
            base = f"{100 * row.baseline.val_acc:.2f} %"
            lines.append(
                f"- {shown} `{row.label}`: {acc} against fp32's {base} "
                f"({row.d_val_acc_pts:+.2f} points)"
            )
    return [*lines, ""]


def _plots_section(report: Report) -> list[str]:
    lines = ["## Plots", ""]
    titles = {
        "loss_curves": "Loss curves",
        "epoch_time": "Epoch time",
        "peak_memory": "Peak memory",
        "loss_scale": "Loss scale (skipped steps marked x)",
    }
    for name, title in titles.items():
        if name in report.plots:
            lines += [f"![{title}]({report.plots[name].name})", ""]
    if "loss_scale" not in report.plots:
        lines += ["No run used loss scaling, so there is no loss-scale plot.", ""]
    return lines


def write_report(report: Report) -> Path:
    """Write report.md and the plots into `report.out_dir`; return report.md's path."""
    from mpexp import plots  # matplotlib is only needed once there is something to draw

    try:
        report.out_dir.mkdir(parents=True, exist_ok=True)
        if report.rows:
            report.plots = plots.draw_all(report.rows, report.out_dir)
        report.path.write_text(render_markdown(report) + "\n")
    except OSError as err:
        raise UserError(
            f"Cannot write the report to {report.out_dir} ({err.strerror}); "
            "choose a writable folder with --out."
        ) from None
    return report.path


def log_to_wandb(report: Report, mode: str = "auto") -> None:
    """Log the table and plots as a `report` run in the sweep's W&B group.

    `auto` logs only when the sweep's own runs were logged online, into their project and group;
    `offline` keeps the report run in `<out dir>/wandb` for a later `wandb sync`.
    """
    targets = [r.run.summary.get("wandb") for r in report.rows if r.run.summary.get("wandb")]
    if mode == "auto":
        mode = "online" if any(t["mode"] == "online" for t in targets) else "disabled"
    if mode == "disabled" or not report.rows:
        return
    first = report.rows[0].run
    where = targets[0] if targets else first.config.get("wandb", {})
    try:
        import wandb

        wb = wandb.init(
            project=where.get("project"),
            entity=where.get("entity"),
            group=where.get("group"),
            name="report",
            job_type="report",
            dir=str(report.out_dir),
            mode=mode,
            config={"tolerance": report.tolerance, "report": str(report.path)},
            settings=wandb.Settings(init_timeout=90),
        )
        values = [r.values(report.tolerance) for r in report.rows]
        table = wandb.Table(columns=list(values[0]), data=[list(v.values()) for v in values])
        images = {f"report/{n}": wandb.Image(str(p)) for n, p in report.plots.items()}
        wb.log({"report/table": table, **images})
        wb.summary.update(
            {"report/flagged": len(report.flagged), "report/not_reported": len(report.not_reported)}
        )
        wb.finish()
    except Exception as err:  # the report on disk stands without W&B
        log.warning("The report table was not logged to W&B (%s); report.md has it.", err)
        return
    print(f"W&B: report table logged to group {where.get('group')!r} ({mode})")


def make_report(
    paths: list[Path],
    tolerance: float = DEFAULT_TOLERANCE,
    out_dir: Path | None = None,
    wandb_mode: str = "auto",
) -> Report:
    """Build, write and (when the runs were online) log the report; print where it is."""
    report = build_report(paths, tolerance, out_dir)
    write_report(report)
    print("\n".join(report.console_lines()))
    log_to_wandb(report, wandb_mode)
    return report


def _tolerance(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text} is not a non-negative number of points")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mpexp.report",
        description="Compare runs against the fp32 run: report.md and PNG plots from local files.",
    )
    parser.add_argument("dirs", nargs="+", type=Path, help="run directories or multirun folders")
    parser.add_argument(
        "--tolerance",
        type=_tolerance,
        default=DEFAULT_TOLERANCE,
        help="val accuracy points a run may fall below fp32 before it is flagged (default 0.5)",
    )
    parser.add_argument(
        "--out", type=Path, help="where to write (default: the directory given, or their parent)"
    )
    parser.add_argument(
        "--wandb",
        choices=("auto", "online", "offline", "disabled"),
        default="auto",
        help="log the table to W&B; auto: only when the runs were logged online (default)",
    )
    args = parser.parse_args(argv)
    try:
        make_report(args.dirs, args.tolerance, args.out, args.wandb)
    except UserError as err:
        print(f"mpexp.report: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
