"""Where metrics go: metrics.jsonl and summary.json always, W&B (in a process of its own) if on."""

# `mpexp.tracking.Histogram` is the name users log histograms with (docs/wandb.md, "Your own
# values")
from mpexp.tracking.histogram import Histogram

__all__ = ["Histogram"]
