"""`python -m mpexp.report` / `mpexp-report`: write the report for run folders, and log it to W&B.

mpexp-report <run dir or multirun dir> [more dirs] [--tolerance 0.5] [--target 98] [--out DIR]
    [--no-plots]                            report.md alone, without its PNG plots
mpexp-report <multirun dir> --wandb-view    the sweep's W&B view, from the report's wandb-view.json
    [--view-timeout 60]                     seconds W&B may take to save it
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from pathlib import Path

from mpexp.errors import UserError
from mpexp.report import wandb_view
from mpexp.report.bottom_line import plain
from mpexp.report.markdown import render_markdown
from mpexp.report.table import Report, build_report, report_dir
from mpexp.report.wandb_run import log_to_wandb, resolved_mode

log = logging.getLogger(__name__)


def write_report(report: Report, draw: bool = True) -> Path:
    """Write report.md and (when `draw`) the plots into `report.out_dir`; return report.md's
    path."""
    try:
        report.out_dir.mkdir(parents=True, exist_ok=True)
        report.plots_drawn = draw
        if report.rows and draw:
            from mpexp.report import plots  # matplotlib: only when there is something to draw

            report.plots = plots.draw_all(report)
        report.path.write_text(render_markdown(report) + "\n")
    except OSError as err:
        raise UserError(
            f"Cannot write the report to {report.out_dir} ({err.strerror}); "
            "choose a writable folder with --out."
        ) from None
    return report.path


def make_report(
    paths: list[Path],
    tolerance: float | None = None,
    out_dir: Path | None = None,
    *,
    wandb_mode: str = "auto",
    target: float | None = None,
    view_timeout: float = wandb_view.TIMEOUT,
    draw: bool = True,
) -> Report:
    """Build, write and (when the runs were online) log the report and create the sweep's W&B
    view; print where they are.
    `tolerance` (None: the task's own) and `target`, the result to reach for the time to target
    (None: per fp32 reference), are in the result's unit: points and percent of val accuracy,
    nats of a language model's val loss. `view_timeout`: seconds W&B may take to save the view;
    `draw`: False for report.md without its plots."""
    report = build_report(paths, tolerance, out_dir, target)
    write_report(report, draw)
    try:
        view = wandb_view.write_spec(report)
    except OSError as err:  # report.md was written: the view is a convenience beside it
        log.warning("The W&B view's spec was not written (%s).", err)
        view = None
    _print(report.console_lines())
    mode = resolved_mode(report, wandb_mode)
    wandb_view.after_report(view, report.out_dir, mode, view_timeout)
    log_to_wandb(report, mode)
    # the answer, then where it is written: the sweep's last lines
    answer = plain(report)
    _print(["Bottom line:", *(f"  {line}" for line in answer)] if answer else [])
    print(report.path_line)
    return report


def _print(lines: list[str]) -> None:
    if lines:
        print("\n".join(lines))


def _tolerance(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text} is not a non-negative number")
    return value


def _target(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(
            f"{text} is not a result to reach (a val accuracy in percent, a val loss in nats)"
        )
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text} is not a number of seconds above 0")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="mpexp-report",
        description="Compare configurations (runs that differ only in the seed) with their fp32 "
        "reference: report.md and PNG plots from local files.",
    )
    parser.add_argument("dirs", nargs="+", type=Path, help="run directories or multirun folders")
    parser.add_argument(
        "--tolerance",
        type=_tolerance,
        help="how far a configuration's result may fall behind fp32 and still be at parity, in "
        "the result's unit (default: the task's own: 0.5 points of val accuracy, 0.02 nats of "
        "a language model's val loss)",
    )
    parser.add_argument(
        "--target",
        "--target-acc",
        type=_target,
        help="the result to reach for the time-to-target columns: val accuracy in percent, a "
        "language model's val loss in nats (default: the fp32 reference's final result, less "
        "good by the tolerance)",
    )
    parser.add_argument(
        "--out", type=Path, help="where to write (default: the directory given, or their parent)"
    )
    parser.add_argument(
        "--wandb",
        choices=("auto", "online", "offline", "disabled"),
        default="auto",
        help="log the table to W&B as a run in the sweep's group; auto (the default): the way "
        "the runs were logged (online, or offline into <out>/wandb-report for a later wandb "
        "sync), not at all when they were not",
    )
    parser.add_argument(
        "--wandb-view",
        action="store_true",
        help="only create the sweep's W&B view, from the wandb-view.json the report wrote "
        "(after `wandb sync` of an offline sweep), and print its URL; the runs are not read "
        "again, and a view created before is not made twice",
    )
    parser.add_argument(
        "--no-plots",
        dest="draw",
        action="store_false",
        help="write report.md without its PNG plots (drawing them takes most of the report's time)",
    )
    parser.add_argument(
        "--view-timeout",
        type=_seconds,
        default=wandb_view.TIMEOUT,
        metavar="SECONDS",
        help="how long W&B may take to save the sweep's view before the report gives up on it "
        f"and says how to create it later (default: {wandb_view.TIMEOUT:g})",
    )
    args = parser.parse_args(argv)
    try:
        if args.wandb_view:
            out_dir = report_dir(args.dirs, args.out)
            wandb_view.open_view(wandb_view.read_spec(out_dir), out_dir, args.view_timeout)
            return 0
        make_report(args.dirs, args.tolerance, args.out, wandb_mode=args.wandb,
                    target=args.target, view_timeout=args.view_timeout, draw=args.draw)  # fmt: skip
    except UserError as err:
        print(f"mpexp.report: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
