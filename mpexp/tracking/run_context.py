"""What a run hands its tracker: its directory, its names in W&B, its command line."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class RunContext:
    """Where a run writes and how it is named in W&B."""

    run_dir: Path
    name: str | None = None
    group: str | None = None
    tags: list[str] = field(default_factory=list)
    wandb_id: str | None = None  # set to continue an existing W&B run (a resumed training run)
    overrides: list[str] = field(default_factory=list)  # the command line's, to say how to resume
    choices: dict[str, str | None] = field(default_factory=dict)  # option per group (Hydra's)
    in_sweep: bool = False  # a multirun job: the sweep prints one `wandb sync` for all its jobs
