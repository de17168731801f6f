"""report.md: the bottom line, warnings, the result and speed tables by configuration (fp8 also
against bf16), the runs, the plots. The result is each task's own metric (val accuracy, a
language model's val loss), shown in its unit. Each section is a module of
mpexp/report/sections/; this one puts them in order."""

from __future__ import annotations

from mpexp.report.sections import (
    bottom_line,
    caveats,
    figures,
    fp8,
    results,
    runs_table,
    speed,
    sweep,
    training_state,
)
from mpexp.report.table import Report

# the sections about the reported runs, in report.md's order; each returns [] where it has
# nothing to say
SECTIONS = (
    bottom_line.section,
    caveats.section,
    results.section,
    sweep.section,
    fp8.section,
    training_state.section,
    speed.section,
    runs_table.section,
)


def render_markdown(report: Report) -> str:
    lines = [f"# Sweep report: {report.out_dir.parent.name}/{report.out_dir.name}", ""]
    rows = report.rows
    lines.append(
        f"Runs under `{report.out_dir}`: {len(rows)} reported in {len(report.configs)} "
        f"configurations, {len(report.not_reported)} not reported."
    )
    if rows:
        machines = sorted(
            {f"{r.run.ran.get('device_name')} ({r.run.ran.get('device')})" for r in rows}
        )
        torches = sorted({str(r.run.ran.get("torch_version")) for r in rows})
        lines.append(f"Ran on {', '.join(machines)} with torch {', '.join(torches)}.")
    lines.append("")
    if rows:
        for section in SECTIONS:
            lines += section(report)
    if report.not_reported:
        lines += ["## Not reported", ""]
        lines += [f"- `{label}`: {run.problem}" for label, run in report.not_reported]
        lines.append("")
    if rows:
        lines += figures.section(report)
    return "\n".join(lines)
