"""A run's summary.json outside the metric sink: written whole or not at all, and the status a run
ends with, recorded also when it ends before a Tracker exists; nested records flattened (a
summary for W&B, a saved config compared key by key)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from mpexp.errors import UserError

log = logging.getLogger(__name__)


def write_json_atomically(value: Any, path: Path) -> None:
    """`path` holds the old JSON or all of the new, never half of it; no temporary file is left."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(value, indent=2, default=str) + "\n")
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def error_text(error: BaseException) -> str:
    """An error as a run's summary records it: a UserError's own message, else type and text."""
    return str(error) if isinstance(error, UserError) else f"{type(error).__name__}: {error}"


def record_end(run_dir: Path, status: str, error: BaseException | None = None) -> None:
    """Set a run's status in its summary.json (with the error), where a sweep's report looks.

    Also covers runs that end before training starts (a bad value, bf16 on a GPU without it, a
    stop signal), when no Tracker exists yet. Best effort: a run dir that cannot be written keeps
    what it has.
    """
    path = Path(run_dir) / "summary.json"
    try:
        summary = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        summary = {}
    summary["status"] = status
    if error is not None:
        summary["error"] = error_text(error)
    try:
        write_json_atomically(summary, path)
    except OSError as err:
        log.warning("Could not record the %s run in %s (%s).", status, path, err)


def flatten(values: dict[str, Any], sep: str = "/", prefix: str = "") -> dict[str, Any]:
    """Nested dicts as one level: {"ran": {"device": x}} -> {"ran/device": x}."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat.update(flatten(value, sep, f"{prefix}{key}{sep}"))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
