"""Where this process stands in a torchrun launch, from the environment torchrun sets. Read without
importing torch: the command line and Hydra's callbacks need it before torch is imported."""

from __future__ import annotations

import os


def launched_processes() -> int:
    """How many processes the launch started (WORLD_SIZE); 1 outside torchrun."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_rank_zero() -> bool:
    """Whether this is rank 0 of a launch, or the only process: the one that writes the run's
    files (ranks > 0 write nothing, mpexp/distributed.py)."""
    return int(os.environ.get("RANK", "0")) == 0
