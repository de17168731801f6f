"""RunChecks' former path, kept for `_target_: mpexp.hydra_hooks.RunChecks` in users' copies of
conf/train.yaml; it lives in mpexp/run/hydra_hooks.py."""

from mpexp.run.hydra_hooks import RunChecks

__all__ = ["RunChecks"]
