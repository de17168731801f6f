"""A run's last line: what it reached (its task's result, final and best), how long it took and
where it wrote it, e.g.

    Done: val/acc 57.03 % (best 57.03 % at epoch 2) | 2 epochs, 21.6 s of training (this
    command: 25.9 s) | outputs/2026-11-28/11-46-43.904018

The values come from the run's metrics.jsonl, which holds every validation, a resumed run's earlier
ones too, as the training time counts its every epoch; the command's time is this process's, from
the start of training's set-up, validation included.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

from mpexp.tasks.base import Result


def last_line(run_dir: Path | str, summary: dict[str, Any], seconds: float, by_steps: bool) -> str:
    """The line, from the run's folder and final summary; `seconds` this command took,
    `by_steps` for a run of a step budget (trainer.max_steps): its length in steps."""
    run_dir = Path(run_dir)  # a run started from Python may name it as a string
    result = Result.from_record(summary["ran"]["task"])
    rows = _validations(run_dir / "metrics.jsonl", result.metric)
    shown = f"{result.metric} {_value(result, summary[result.metric])}"
    if rows:
        best = rows[0]
        for row in rows[1:]:
            if result.better(row[result.metric], best[result.metric]):
                best = row
        by_epoch = not by_steps and len({row["epoch"] for row in rows}) == len(rows)
        where = f"epoch {best['epoch']}" if by_epoch else f"step {best['step']}"
        shown += f" (best {_value(result, best[result.metric])} at {where})"
    trained = sum(r.get("perf/epoch_time_s", 0.0) + r.get("perf/compile_s", 0.0) for r in rows)
    count, unit = (summary["step"], "step") if by_steps else (summary["epoch"], "epoch")
    length = f"{count} {unit}{'s' if count != 1 else ''}"
    return (
        f"Done: {shown} | {length}, {trained:.1f} s of training (this command: {seconds:.1f} s) "
        f"| {_from_here(run_dir)}"
    )


def _from_here(path: Path) -> Path:
    """`path` from the working directory where it lies below it (outputs/<date>/<time>), else
    as it is."""
    try:
        return Path(path).resolve().relative_to(Path.cwd().resolve())
    except ValueError:
        return Path(path)


def _value(result: Result, value: float) -> str:
    return f"{result.scale * value:.{result.decimals}f} {result.shown_in}"


def _validations(metrics: Path, metric: str) -> list[dict[str, Any]]:
    """The rows of `metrics` that hold a validation's `metric` (epoch rows, or every
    trainer.eval_every_steps)."""
    rows = []
    with contextlib.suppress(OSError):
        for line in metrics.read_text().splitlines():
            with contextlib.suppress(ValueError):  # a line cut off by a crash holds nothing
                row = json.loads(line)
                if isinstance(row, dict) and "epoch" in row and metric in row:
                    rows.append(row)
    return rows
