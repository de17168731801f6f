"""The report as a W&B run: its table and plots in the sweep's group, next to the training runs."""

from __future__ import annotations

import logging
import shlex
from pathlib import Path

from mpexp.report.table import Report

log = logging.getLogger(__name__)


def log_to_wandb(report: Report, mode: str = "auto") -> None:
    """Log the table and plots as a `report` run in the sweep's W&B group.

    `auto` logs the way the sweep's own runs were logged, into their project and group: online,
    or offline into `<out dir>/wandb` for a later `wandb sync` with the rest.
    """
    targets = [r.run.summary.get("wandb") for r in report.rows if r.run.summary.get("wandb")]
    if mode == "auto":
        modes = {t["mode"] for t in targets}
        mode = next((m for m in ("online", "offline") if m in modes), "disabled")
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
            settings=wandb.Settings(init_timeout=90, silent=True),
        )
        values = [r.values(report.tolerance) for r in report.rows]
        table = wandb.Table(columns=list(values[0]), data=[list(v.values()) for v in values])
        images = {f"report/{n}": wandb.Image(str(p)) for n, p in report.plots.items()}
        wb.log({"report/table": table, **images})
        wb.summary.update(
            {"report/flagged": len(report.flagged), "report/not_reported": len(report.not_reported)}
        )
        report_run = Path(wb.dir).parent  # wb.dir is the run's files/ folder
        wb.finish()
    except Exception as err:  # the report on disk stands without W&B
        log.warning("The report table was not logged to W&B (%s); report.md has it.", err)
        return
    print(f"W&B: report table logged to group {where.get('group')!r} ({mode})")
    if mode == "offline":
        offline = [_offline_run(r.run.path) for r in report.rows if _offline_run(r.run.path)]
        paths = " ".join(shlex.quote(str(p)) for p in [*offline, report_run])
        print(f"W&B runs kept offline: upload them with `wandb sync {paths}`")


def _offline_run(run_dir: Path) -> Path | None:
    """A training run's offline W&B run folder, if it kept one."""
    found = sorted((run_dir / "wandb").glob("offline-run-*"))
    return found[-1] if found else None
