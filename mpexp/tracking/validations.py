"""The epochs' validation results as a run logs them: which epoch's weights a checkpoint holds, and
whether they are the best so far (a W&B checkpoint's `best` alias)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

from mpexp.tasks.base import Result


class Validations:
    """The epochs' validation results as they are logged, for a checkpoint's W&B artifact: which
    epoch's weights it holds, their val metrics, and whether they are the best so far by the
    task's result metric."""

    def __init__(self, result: Result) -> None:
        self.result = result
        self.best: float | None = None
        self.last: dict[str, Any] | None = None  # the last epoch's: step, metrics, best

    def add(self, row: dict[str, Any]) -> None:
        if "epoch" not in row or self.result.metric not in row:
            return
        value = row[self.result.metric]
        best = self.result.better(value, self.best)
        if best:
            self.best = value
        metrics = {k: v for k, v in row.items() if k == "epoch" or k.startswith("val/")}
        self.last = {"step": row.get("step"), "metrics": metrics, "best": best}

    @classmethod
    def read(cls, metrics: Path, result: Result) -> Validations:
        """The epochs already in `metrics` (a resumed run's; none for a new run)."""
        found = cls(result)
        if metrics.is_file() and metrics.stat().st_size:
            for line in metrics.read_text().splitlines():
                with contextlib.suppress(ValueError):  # a cut-off line holds no epoch
                    found.add(json.loads(line))
        return found
