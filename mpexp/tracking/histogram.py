"""A histogram logged as one value, `mpexp.tracking.Histogram` (docs/wandb.md, "Your own
values")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Histogram:
    """Counts over bins (len(edges) == len(counts) + 1): a W&B histogram in W&B, and
    {"edges": [...], "counts": [...]} in metrics.jsonl."""

    counts: list[float]
    edges: list[float]


def histogram_json(value: Any) -> dict:
    """A Histogram as metrics.jsonl writes it (json.dumps's `default`)."""
    if isinstance(value, Histogram):
        return {"edges": value.edges, "counts": value.counts}
    raise TypeError(f"{type(value).__name__} is not JSON serializable")
