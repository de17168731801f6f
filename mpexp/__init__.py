"""mpexp: Hydra-configured mixed-precision training experiments in PyTorch."""

__version__ = "0.1.0"

__all__ = ["__version__", "log"]


def __getattr__(name: str):
    # `mpexp.log({"my/value": 0.5})`: values of your own into the run that is training. Imported
    # on first use: `python -m mpexp.train` imports this package first, and catches stop signals
    # before it imports Hydra (which mpexp.tracking does)
    if name == "log":
        from mpexp.tracking.tracker import log_values

        return log_values
    raise AttributeError(f"module 'mpexp' has no attribute {name!r}")
