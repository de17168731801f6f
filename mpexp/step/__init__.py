"""The training step and what it is measured by: the loop, the captured step, per-step history,
BatchNorm rollback, learning-rate schedules, numerics diagnostics, speed switches and FLOPs."""
