"""The metric sink of ranks > 0 in a distributed run: it writes nothing."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mpexp.tracking.user_logs import take_user_logs
from mpexp.tracking.user_values import taken_values


class NullTracker:
    """The sink of ranks > 0 in a distributed run: rank 0 alone writes metrics and the W&B run."""

    wandb_id = None

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.step = 0
        take_user_logs(self)

    def log(self, row: dict[str, Any]) -> None:
        pass

    def log_own(self, values: Mapping[str, Any], step: int | None = None) -> None:
        taken_values(values, None)  # the same mistakes fail on every rank; rank 0 warns

    def take_waiting(self) -> list[dict[str, Any]]:
        return []

    def update_summary(self, values: dict[str, Any]) -> None:
        pass

    def log_samples(self, samples: list[tuple[str, str]]) -> None:
        pass

    def record_ran(self, ran: dict[str, Any]) -> None:
        pass

    def flush(self) -> int:
        return 0

    def log_checkpoint(self, path: Path, step: int) -> None:
        pass

    def close(self, status: str = "finished", error: str | None = None) -> None:
        take_user_logs(None, self)
