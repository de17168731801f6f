"""mpexp: Hydra-configured mixed-precision training experiments in PyTorch."""

__version__ = "0.1.0"

# `mpexp.log({"my/value": 0.5})`: values of your own into the run that is training
from mpexp.tracking.tracker import log_values as log

__all__ = ["__version__", "log"]
