"""Hydra's composition of the command line, with mpexp's one message for a key that the config
does not have, and for an option that a config group does not have.

Hydra answers `precison=bf16` or `trainer.epoch=1` with seven lines that advise `+precison=bf16`,
which adds the key past the schema, and only then does mpexp's own check say "did you mean
precision?"; and `precision=bf61` with seventeen, its search path among them. So while Hydra
composes, its errors are asked to come here (Hydra re-raises them under HYDRA_FULL_ERROR, its
documented switch) instead of being printed by Hydra: an unknown key becomes mpexp's "Unknown
config key: precison (did you mean precision?)", alone, and an unknown option "precision=bf61 is
none of precision's options: ... The closest: bf16."; any other error of the composition is
printed as Hydra prints it. Once a job starts (`composed`, called by the
run's first Hydra callback), Hydra reports as it always does: a sweep's failed job, a crash.

A schema may take keys beyond its fields: a classmethod `accepts_key(key) -> bool` on it says
which (mpexp.validate.accepts_key; a model option that passes its keys on to another library's
config). A key it accepts is given again as `++key=value`, which adds it, and the command is
composed again.
"""

from __future__ import annotations

import difflib
import os
import re
import sys
from collections.abc import Callable
from dataclasses import fields, is_dataclass

from hydra.core.global_hydra import GlobalHydra
from hydra.errors import (
    CompactHydraException,
    ConfigCompositionException,
    MissingConfigException,
)
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from mpexp.config import GROUPS
from mpexp.validate import accepts_key, unknown_keys_error

FULL_ERROR = "HYDRA_FULL_ERROR"
_OVERRIDDEN = re.compile(r"Could not override '([^']+)'")
_asked = False  # whether this module set FULL_ERROR (a user's own setting is left alone)


def composing(main: Callable[[], None]) -> None:
    """Run Hydra's `main` (a `@hydra.main` function); a mistyped key ends it with one message
    and exit code 2, another composition error as Hydra says it, with exit code 1."""
    global _asked
    if os.environ.get(FULL_ERROR):  # the user asked for Hydra's tracebacks
        main()
        return
    os.environ[FULL_ERROR], _asked = "1", True
    try:
        for _ in range(len(sys.argv)):  # each retry adds one accepted key: bounded by the args
            try:
                main()
                return
            except MissingConfigException as err:  # an option a group does not have
                message = _missing_option(err)
                if message is None:
                    _as_hydra_says(err)
                sys.stderr.write(f"{message}\n")
                raise SystemExit(2) from None
            except ConfigCompositionException as err:
                unknown = _unknown_key(err)
                if unknown is None:
                    _as_hydra_says(err)
                full_key, schema, candidates = unknown
                if not accepts_key(schema, full_key.rsplit(".", 1)[-1]) or not _add(full_key):
                    sys.stderr.write(f"{_message(err, full_key, candidates)}\n")
                    raise SystemExit(2) from None
                GlobalHydra.instance().clear()  # composed again, with the key added
            except CompactHydraException as err:  # a malformed override, say
                _as_hydra_says(err)
    finally:
        composed()


def composed() -> None:
    """Hand error reporting back to Hydra: the config is composed, a job starts."""
    global _asked
    if _asked:
        os.environ.pop(FULL_ERROR, None)
        _asked = False


def mistyped_message(err: BaseException) -> str | None:
    """mpexp's one message where `err` is Hydra's answer to an override of a key the config does
    not have, or of a group to an option it does not have (for the commands that compose through
    Hydra's API: mpexp-plan); None otherwise."""
    if isinstance(err, MissingConfigException):
        return _missing_option(err)
    unknown = _unknown_key(err) if isinstance(err, ConfigCompositionException) else None
    return None if unknown is None else _message(err, unknown[0], unknown[2])


def _missing_option(err: MissingConfigException) -> str | None:
    """`group=value is none of group's options: ...`, with the closest, where `err` says that a
    config group has no option of that name; None for another missing config."""
    group, _, value = (err.missing_cfg_file or "").rpartition("/")
    if not group or not err.options:
        return None
    close = difflib.get_close_matches(value, err.options, n=1)
    closest = f" The closest: {close[0]}." if close else ""
    return (
        f"{group.replace('/', '.')}={value} is none of {group}'s options: "
        f"{', '.join(sorted(err.options))}.{closest}"
    )


def _unknown_key(err: ConfigCompositionException) -> tuple[str, type, list[str]] | None:
    """(the key that is not in the config, its node's schema, the keys it has), where `err` says
    that an override named a key the config does not have; None for any other error."""
    cause = err.__cause__
    if not isinstance(cause, ConfigKeyError | ConfigAttributeError) or not cause.full_key:
        return None
    schema = cause.object_type
    if is_dataclass(schema):
        candidates = [f.name for f in fields(schema)]
    else:
        candidates = [str(k) for k in (cause.parent_node or {})]
    if "." not in cause.full_key:  # at the top: a config group's name is as likely
        candidates += GROUPS
    return cause.full_key, schema, candidates


def _message(err: ConfigCompositionException, full_key: str, candidates: list[str]) -> str:
    """mpexp's message for an unknown key, as mpexp.validate.check_schema words it: the
    override's key, with the closest known one in its place."""
    found = _OVERRIDDEN.search(str(err))
    key = found.group(1) if found and found.group(1).startswith(full_key) else full_key
    head, _, wrong = full_key.rpartition(".")
    close = difflib.get_close_matches(wrong, sorted(set(candidates)), n=1)
    if close:
        suggested = (f"{head}." if head else "") + close[0] + key[len(full_key) :]
        key = f"{key} (did you mean {suggested}?)"
    return str(unknown_keys_error([key]))


def _add(full_key: str) -> bool:
    """Give the override of `full_key` on the command line again as `++` (add or override);
    False where no override names it (it came from a config file)."""
    for index, arg in enumerate(sys.argv[1:], start=1):
        key, sep, _ = arg.lstrip("+").partition("=")
        if sep and key == full_key and not arg.startswith("++"):
            sys.argv[index] = "++" + arg.lstrip("+")
            return True
    return False


def _as_hydra_says(err: CompactHydraException) -> None:
    """Print `err` as Hydra prints a composition error, and exit 1 as Hydra does."""
    sys.stderr.write(f"{err}\n")
    if isinstance(err.__cause__, OmegaConfBaseException):
        sys.stderr.write(f"{err.__cause__}\n")
    sys.stderr.write(f"\nSet the environment variable {FULL_ERROR}=1 for a complete stack trace.\n")
    raise SystemExit(1) from None
