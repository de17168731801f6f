"""mpexp: Hydra-configured mixed-precision training experiments in PyTorch."""

from mpexp.targets import follow_former_imports

__version__ = "0.1.0"

follow_former_imports()  # `_target_: mpexp.scaling.X` and the other paths from before the packages

__all__ = ["__version__", "log"]


def __getattr__(name: str):
    # `mpexp.log({"my/value": 0.5})`: values of your own into the run that is training. Imported
    # on first use: `python -m mpexp.train` imports this package first, and catches stop signals
    # before it imports Hydra (which mpexp.tracking does)
    if name == "log":
        import torch

        from mpexp.tracking.user_logs import log_values

        # called from a model that torch.compile compiles, it runs as Python: a graph break that
        # is taken quietly, where tracing into it warned about the calls it cannot trace. Kept
        # as the module's attribute, so that this runs once
        global log
        log = torch.compiler.disable(log_values)
        return log
    raise AttributeError(f"module 'mpexp' has no attribute {name!r}")
