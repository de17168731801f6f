"""The schedules' former path, kept for `_target_: mpexp.schedules.X` in users' own configs and in
the saved configs of earlier runs; they live in mpexp/step/schedules.py."""

from mpexp.step.schedules import cosine, step_decay

__all__ = ["cosine", "step_decay"]
