"""Errors that reach the user as one readable message instead of a traceback."""

from hydra.errors import CompactHydraException


def reason(err: BaseException) -> str:
    """An exception's message in one line, for a message of ours that quotes it: its first line
    (the error's type where it has none), and the next one too where the first ends with a
    colon, as TorchDynamo's "backend='inductor' raised:" does before what was raised; its
    closing full stop left to the message that quotes it."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    said = " ".join(lines[:2]) if lines[0].endswith(":") else lines[0]
    # the quoting message ends the sentence itself: no double full stop (an ellipsis is kept)
    return said[:-1] if said.endswith(".") and not said.endswith("..") else said


class UserError(CompactHydraException):
    """A problem the user can fix (a config value, a missing file).

    Hydra prints these as their message alone and exits non-zero, in single runs and sweeps alike,
    so every subclass must say what is wrong and how to fix it.
    """


class ConfigError(UserError):
    """A config value that cannot work; raised before training starts."""


class ResumeRefused(ConfigError):
    """`trainer.resume` cannot continue its run: a missing, damaged or foreign checkpoint, or a
    config that differs from the run's. Raised before anything of the run is changed, and the
    run's files are left as they were (its status too: the run did not fail, the resume did)."""


class DataError(UserError):
    """A dataset that cannot be found or read."""


class OutputError(UserError):
    """The run directory cannot be written: permissions, a full disk."""


class NumericsError(UserError):
    """Training became numerically unusable (a non-finite loss, a loss scale at its floor).

    Raised when the per-step values are read back, so the message names the step it happened at.
    """


class LogError(UserError):
    """A call to `mpexp.log` that cannot be logged: a key of mpexp's own, or a value it cannot
    write. Raised at the call, so the message names the line that made it."""
