"""The report as a W&B run: its tables and plots in the sweep's group, next to the training runs."""

from __future__ import annotations

import hashlib
import logging
import shlex
import shutil
from pathlib import Path

from mpexp.report.bottom_line import markdown
from mpexp.report.row import run_values
from mpexp.report.table import Report

log = logging.getLogger(__name__)


def log_to_wandb(report: Report, mode: str = "auto") -> None:
    """Log the tables and plots as a `report` run in the sweep's W&B group: `report/table`, one
    row per configuration (the figures of report.md's accuracy and speed tables, intervals as
    `<name>_low` and `<name>_high`), and `report/runs`, one row per run; report.md's bottom line
    in the run's summary (`report/bottom_line`, Markdown).

    `auto` logs the way the sweep's own runs were logged, into their project and group: online,
    or offline into `<out dir>/wandb-report/wandb` for a later `wandb sync` with the rest. Not
    `<out dir>/wandb`: a report on one run is written into that run's folder, whose `wandb/` (and
    its `latest-run` link) belong to the training run.

    report.md and its plots go with it as an artifact (type `report`). There is one report run
    per output folder: its id comes from the folder, so a report written again updates that run
    (online) or replaces its offline copy, instead of adding a second `report` run to the group.
    """
    mode = resolved_mode(report, mode)
    if mode == "disabled" or not report.rows:
        return
    where = wandb_target(report)
    try:
        import wandb

        wandb_dir = report.out_dir / "wandb-report"
        wandb_dir.mkdir(parents=True, exist_ok=True)
        run_id = report_run_id(report.out_dir)
        wb = wandb.init(
            id=run_id,
            resume="allow",
            project=where.get("project"),
            entity=where.get("entity"),
            group=where.get("group"),
            name="report",
            job_type="report",
            dir=str(wandb_dir),
            mode=mode,
            config={
                "tolerance": report.tolerance,
                "target": report.target,
                "report": str(report.path),
            },
            settings=wandb.Settings(init_timeout=90, silent=True),
        )
        configs = [c.values() for c in report.configs]
        runs = [run_values(r, c.target) for c in report.configs for r in c.members]
        images = {f"report/{n}": wandb.Image(str(p)) for n, p in report.plots.items()}
        wb.log(
            {"report/table": _table(wandb, configs), "report/runs": _table(wandb, runs), **images}
        )
        wb.summary.update(
            {
                "report/bottom_line": markdown(report),
                "report/worse": len(report.worse),
                "report/not_reported": len(report.not_reported),
            }
        )
        files = wandb.Artifact(run_id, type="report")
        for path in [report.path, *report.plots.values()]:
            files.add_file(str(path))
        wb.log_artifact(files)
        report_run = Path(wb.dir).parent  # wb.dir is the run's files/ folder
        wb.finish()
        if mode == "offline":  # the report written before is this one's older copy
            for older in (wandb_dir / "wandb").glob(f"offline-run-*-{run_id}"):
                if older.resolve() != report_run.resolve():
                    shutil.rmtree(older, ignore_errors=True)
    except Exception as err:  # the report on disk stands without W&B
        log.warning("The report table was not logged to W&B (%s); report.md has it.", err)
        return
    group = where.get("group")
    print(f"W&B: report table logged to {f'group {group}' if group else 'no group'} ({mode})")
    if mode == "offline":
        offline = [p for r in report.rows for p in _offline_runs(r.run)]
        paths = " ".join(shlex.quote(str(p)) for p in [*offline, report_run])
        print(f"W&B runs kept offline: upload them with `wandb sync {paths}`")


def resolved_mode(report: Report, mode: str) -> str:
    """`auto` as the sweep's own runs were logged: online if any was, else offline if any was,
    else disabled; any other mode as given."""
    if mode != "auto":
        return mode
    modes = {t["mode"] for t in _targets(report)}
    return next((m for m in ("online", "offline") if m in modes), "disabled")


def wandb_target(report: Report) -> dict:
    """Where the sweep's runs went in W&B (`project`, `entity`, `group`): the first run's record,
    or its `wandb` config where none logged to W&B. The report must have runs."""
    targets = _targets(report)
    return targets[0] if targets else report.rows[0].run.config.get("wandb", {})


def _targets(report: Report) -> list[dict]:
    """The W&B runs that the reported runs recorded in their summary.json."""
    return [r.run.summary["wandb"] for r in report.rows if r.run.summary.get("wandb")]


def report_run_id(out_dir: Path) -> str:
    """The W&B id of the report on `out_dir`: the same for every report written there."""
    return "report-" + hashlib.sha256(str(out_dir.resolve()).encode()).hexdigest()[:12]


def _table(wandb, rows: list[dict]):
    return wandb.Table(columns=list(rows[0]), data=[list(r.values()) for r in rows])


def _offline_runs(run) -> list[Path]:
    """A training run's offline W&B run folders: those of the run's W&B id (a resumed run keeps
    one per segment, and each must be synced), never the report run written beside them."""
    wandb_id = (run.summary.get("wandb") or {}).get("id")
    return sorted((run.path / "wandb").glob(f"offline-run-*-{wandb_id or '*'}"))
