"""report.md's Bottom line, its opening section: a line per configuration against its fp32
reference (use it, don't, undecided with the seeds that would decide it; bottom_line.py), and
the command that adds those seeds."""

from __future__ import annotations

from mpexp.report.bottom_line import markdown
from mpexp.report.power import POWER
from mpexp.report.table import Report


def section(report: Report) -> list[str]:
    """[] where no configuration has a reference other than itself (a sweep of fp32 alone)."""
    text = markdown(report)
    if not text:
        return []
    return [
        "## Bottom line",
        "",
        "Each configuration against its fp32 reference (the parity verdict and speed below): *use "
        "it*, *don't* (worse than fp32 by more than the tolerance, or slower), or *undecided*, "
        "with the seeds each that would decide it at the spread measured (a power calculation at "
        f'{POWER * 100:.0f} %, explained in docs/report.md, "The bottom line").',
        "",
        text,
        "",
    ]
