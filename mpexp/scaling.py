"""The loss scalers' former path, kept for `_target_: mpexp.scaling.X` in users' own configs and in
the saved configs of earlier runs; they live in mpexp/precision/scaling.py."""

from mpexp.precision.scaling import (
    CalibratedLossScaler,
    DynamicLossScaler,
    HysteresisLossScaler,
    LossScaler,
    StaticLossScaler,
)

__all__ = [
    "CalibratedLossScaler",
    "DynamicLossScaler",
    "HysteresisLossScaler",
    "LossScaler",
    "StaticLossScaler",
]
