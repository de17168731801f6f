"""The report's numbers: `Report`, its configurations (configuration.py) and the runs that could
not be reported (named, not dropped), with the warnings that say when timings cannot be compared;
`build_report` reads them from the runs' folders."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from mpexp.errors import UserError
from mpexp.report.configuration import Config
from mpexp.report.grouping import attach_references, group_configs
from mpexp.report.overrides import in_groups
from mpexp.report.row import Row, measure
from mpexp.report.runs import Run, find_run_dirs, load_run

MIN_TIMED_EPOCHS = 3  # fewer, and a median epoch time is one or two noisy numbers
# a run that waits on its data for more than this share of its epochs times the data, not the step
# (the loop warns at the same share: mpexp/step/epoch_row.py)
DATA_BOUND = 0.1


def step_paths(config: Config) -> str:
    """The step paths its runs recorded, joined ("" where none did)."""
    return " / ".join(sorted({str(r.run.ran["step_path"]) for r in config.rows
                              if r.run.ran.get("step_path")}))  # fmt: skip


def overlapping(rows: list[Row]) -> list[Row]:
    """Runs that trained while another run trained on the same host: a parallel launcher's jobs
    share the machine, so their timings are not comparable. Runs without times are left out."""
    spans = []
    for row in rows:
        summary = row.run.summary
        if summary.get("started_at") and summary.get("ended_at"):
            start = datetime.fromisoformat(summary["started_at"])
            end = datetime.fromisoformat(summary["ended_at"])
            spans.append((row, row.run.ran.get("host"), start, end))
    return [
        row
        for row, host, start, end in spans
        if any(
            other is not row and other_host == host and start < other_end and other_start < end
            for other, other_host, other_start, other_end in spans
        )
    ]


@dataclass
class Report:
    out_dir: Path
    configs: list[Config]
    not_reported: list[tuple[str, Run]]
    tolerance: float | None  # --tolerance; None: each configuration's task's own
    target: float | None = None  # --target, in the result's unit (percent of accuracy, nats)
    plots: dict[str, Path] = field(default_factory=dict)
    plots_drawn: bool = True  # False: --no-plots

    @property
    def path(self) -> Path:
        return self.out_dir / "report.md"

    @property
    def rows(self) -> list[Row]:
        """Every reported run, diverged ones too."""
        return [r for c in self.configs for r in c.members]

    @property
    def diverged(self) -> list[Row]:
        return [r for c in self.configs for r in c.diverged]

    @property
    def worse(self) -> list[Config]:
        return [c for c in self.configs if c.parity == "worse"]

    @property
    def worse_than_bf16(self) -> list[Config]:
        return [c for c in self.configs if c.parity_vs_bf16 == "worse"]

    @property
    def few_timed_epochs(self) -> list[Row]:
        return [r for r in self.rows if len(r.timed) < MIN_TIMED_EPOCHS]

    @property
    def overlapping(self) -> list[Row]:
        return overlapping(self.rows)

    @property
    def other_step_paths(self) -> list[tuple[Config, str, str]]:
        """Configurations whose step ran another way than their fp32 reference's (fused or
        not, compiled, captured, where the schedule ran): (config, its path, the reference's).
        Runs recorded before mpexp recorded the path are left out."""
        found = []
        for c in self.configs:
            ref = c.reference
            if ref is None or ref is c or not c.rows or not ref.rows:
                continue
            path, ref_path = step_paths(c), step_paths(ref)
            if path and ref_path and path != ref_path:
                found.append((c, path, ref_path))
        return found

    @property
    def data_bound(self) -> list[Row]:
        """Runs that waited on their data for more than DATA_BOUND of their timed epochs."""
        return [r for r in self.rows if (r.data_wait_share or 0.0) > DATA_BOUND]

    @property
    def path_line(self) -> str:
        """The console's last line: where report.md is."""
        return (
            f"Sweep report: {self.path} (runs reported: {len(self.rows)}, "
            f"configurations: {len(self.configs)})"
        )

    def console_lines(self) -> list[str]:
        """What the console says of the runs before the bottom line: configurations worse than
        their reference, runs that diverged or could not be reported."""
        lines = []
        for c, reference, d in [
            *((c, "fp32", c.d_result) for c in self.worse),
            *((c, "bf16", c.d_result_vs_bf16) for c in self.worse_than_bf16),
        ]:
            unit, n = c.spec.unit, c.spec.decimals
            lines.append(
                f"  worse than {reference} by more than {c.tolerance:g} {unit} of "
                f"{c.spec.metric}: {c.label} ({d.value:+.{n}f} ± {d.half_width:.{n}f} {unit})"
            )
        if self.diverged:
            names = ", ".join(r.label for r in self.diverged)
            lines.append(f"  diverged (final val loss or result not finite): {names}")
        lines += [f"  not reported: {label}: {run.problem}" for label, run in self.not_reported]
        return lines


def build_report(
    paths: list[Path],
    tolerance: float | None = None,
    out_dir: Path | None = None,
    target: float | None = None,
) -> Report:
    """Read every run under `paths` and compute the tables; nothing is written yet.
    `tolerance` (None: each task's own) and `target` are in the result's unit, as on the command
    line: points and percent of accuracy, nats of a language model's loss."""
    runs = [load_run(p) for p in find_run_dirs(paths)]
    out_dir = report_dir(paths, out_dir)
    labels = _labels(runs, out_dir.resolve())
    rows, not_reported = [], []
    for run in runs:
        folder, label = labels[run.path]
        if run.problem is None:
            try:
                rows.append(measure(run, folder, label))
                continue
            except KeyError as missing:
                run.problem = f"metrics.jsonl has no {missing.args[0]} values"
        not_reported.append((label, run))
    configs = group_configs(rows, tolerance)
    _check_target(target, configs)
    attach_references(configs, target)
    return Report(out_dir, configs, not_reported, tolerance, target)


def report_dir(paths: list[Path], out_dir: Path | None = None) -> Path:
    """Where the report on `paths` goes: `out_dir` (--out), else the folder given, or the common
    parent of several."""
    return out_dir or Path(os.path.commonpath([p.resolve() for p in paths]))


def _check_target(target: float | None, configs: list[Config]) -> None:
    """A target that a configuration's result cannot take: an accuracy outside (0, 100] %."""
    if target is None:
        return
    for config in configs:
        spec = config.spec
        if spec.value_unit == "%" and not 0 < target <= 100:
            raise UserError(
                f"--target {target:g} is not a {spec.metric} in percent (0 to 100]: "
                f"`{config.label}` is judged by {spec.metric}."
            )


def _labels(runs: list[Run], out_dir: Path) -> dict[Path, tuple[str, str]]:
    """Each run's folder and label, `<folder> <overrides that differ between the runs>`, e.g.
    `2 precision=fp16`; those a sweep job's folder is named by are not said twice
    (`2_precision=fp16`), nor where W&B kept it."""
    common = set.intersection(*(set(r.overrides) for r in runs))
    labels = {}
    for run in runs:
        folder = run.path.name if run.path == out_dir else os.path.relpath(run.path, out_dir)
        said = common | set(run.path.name.partition("_")[2].split(","))
        differing = ",".join(
            o for o in run.overrides if o not in said and not in_groups(o, ("wandb",))
        )
        labels[run.path] = (folder, f"{folder} {differing}".strip())
    return labels
