"""What `mpexp.log` takes: keys of the user's own (never mpexp's), values it can write, and the
message that names the call when it cannot."""

from __future__ import annotations

import logging
import numbers
import sys
from collections.abc import Mapping
from typing import Any

from mpexp.errors import LogError
from mpexp.tracking.histogram import Histogram

log = logging.getLogger(__name__)

# mpexp's own metric names, refused to mpexp.log: a value of the user's under one of them would sit
# among mpexp's rows, where the report reads it as the loss or the accuracy and W&B plots it on
# mpexp's axes
OWN_PREFIXES = ("train/", "val/", "test/", "amp/", "opt/", "perf/", "mem/", "diag/")
OWN_KEYS = ("step", "epoch", "lr", "samples", "tokens")


def taken_values(values: Mapping[str, Any], warned: set | None) -> dict[str, Any]:
    """`values` as mpexp.log writes them: nested dicts flattened (`{"a": {"b": 1}}` -> `a/b`),
    NumPy numbers and one-element arrays as Python's, one-element tensors as 0-d ones. A key of
    mpexp's own or one that is no string raises a LogError naming the call (a name is fixed in
    the code: the first call finds it); a value it cannot take is dropped with a warning naming
    the call, once per call site and key (`warned`; None: silently, on ranks that write nothing),
    for a value's kind can change hours into a run, and must not end it."""
    if not isinstance(values, Mapping):
        raise _log_error(f"it takes a dict of values, not {type(values).__name__}.")
    taken = {}
    for key, value in _flat(values).items():
        if key in OWN_KEYS or key.startswith(OWN_PREFIXES):
            names = ", ".join([*OWN_PREFIXES, *OWN_KEYS])
            step = " (a row's step is mpexp.log's step=...)" if key == "step" else ""
            raise _log_error(
                f"{key!r} is one of mpexp's own metric names ({names}){step}; choose another "
                f"prefix for your values, e.g. 'my/{key}'."
            )
        value, problem = _value(key, value)
        if problem is None:
            taken[key] = value
        elif warned is not None:
            _warn_dropped(key, problem, warned)
    return taken


def _flat(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if not isinstance(key, str):
            raise _log_error(f"{key!r} cannot be a key; name values with strings, e.g. 'my/value'.")
        if isinstance(value, Mapping):
            flat.update(_flat(value, f"{prefix}{key}/"))
        else:
            flat[prefix + key] = value
    return flat


def _value(key: str, value: Any) -> tuple[Any, str | None]:
    """(the value as written, None), or (None, why it cannot be logged and what to pass)."""
    if is_tensor(value):
        return _tensor_value(key, value)
    numpy = sys.modules.get("numpy")  # loaded with torch; a NumPy value exists only once it is
    if numpy is not None and isinstance(value, numpy.generic | numpy.ndarray):
        if value.size != 1:
            return None, (
                f"the value of {key!r} is an array of shape {value.shape}; pass one value: "
                "reduce it first (.mean(), .max()), or log a mpexp.tracking.Histogram of it."
            )
        if value.dtype.kind in "biuf":  # bool, integers, floats
            return value.reshape(()).item(), None
    elif isinstance(value, bool | int | float | str | Histogram):
        return value, None
    if isinstance(value, numbers.Real):  # fractions, and numbers of other libraries
        return float(value), None
    return None, (
        f"the value of {key!r} is a {type(value).__name__}; pass a real number (Python's, "
        "NumPy's, or a one-element tensor), a bool, a string or a mpexp.tracking.Histogram."
    )


def _tensor_value(key: str, value: Any) -> tuple[Any, str | None]:
    if value.numel() != 1:
        return None, (
            f"the value of {key!r} is a tensor of shape {tuple(value.shape)}; pass one value, "
            "a 0-d tensor: reduce it first (.mean(), .max(), .norm()), or log a "
            "mpexp.tracking.Histogram of it."
        )
    if value.is_complex() or value.is_quantized:
        return None, (
            f"the value of {key!r} is a {value.dtype} tensor; pass a real one (.abs(), .real, "
            ".dequantize())."
        )
    return value.reshape(()), None


def _warn_dropped(key: str, problem: str, warned: set) -> None:
    where = _call_site()
    if (where, key) in warned:
        return
    warned.add((where, key))
    log.warning(
        "mpexp.log dropped a value: %s (called at %s; the run goes on, and further values of "
        "%r from there are dropped without a word)",
        problem,
        where or "an unknown place",
        key,
    )


def _call_site() -> str | None:
    """file:line of the user's call to mpexp.log: the first frame outside mpexp.tracking (whose
    modules pass the values on to this one) and torch (whose wrapper keeps torch.compile out of
    mpexp.log: mpexp/__init__.py)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").startswith(
        ("mpexp.tracking.", "torch.")
    ):
        frame = frame.f_back
    return f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame else None


def _log_error(text: str) -> LogError:
    """A LogError that names where mpexp.log was called."""
    where = _call_site()
    return LogError(f"mpexp.log: {text}" + (f" (mpexp.log called at {where})" if where else ""))


def is_tensor(value: Any) -> bool:
    # without importing torch, which the command line leaves out until a run starts: a tensor
    # exists only once torch is loaded
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)
