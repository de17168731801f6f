"""The `_target_` paths that configs name: where a former path leads now, and what a target takes.

Configs written before the loss scalers, schedules and RunChecks moved into packages (users' own,
earlier runs' saved ones) name them by their former paths. One table maps those to the current
ones: a run rewrites its config's `_target_`s through it as it starts, a resume the config saved
in its checkpoint, and Python's import system follows it for the paths that Hydra resolves itself
(`hydra.callbacks` in a user's copy of conf/train.yaml), so no module stays behind for them.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import inspect
import sys
from collections.abc import MutableMapping
from typing import Any

# Nothing here imports Hydra or OmegaConf at the top: `import mpexp` follows the former paths, and
# the command line imports mpexp before Hydra, to catch stop signals from its start.

# former module -> the module that holds its objects now
FORMER_MODULES = {
    "mpexp.scaling": "mpexp.precision.scaling",
    "mpexp.schedules": "mpexp.step.schedules",
    "mpexp.hydra_hooks": "mpexp.run.hydra_hooks",
}


def current_path(target: str) -> str:
    """`target` as it is named now: a former module's object under its current module."""
    module, _, name = target.rpartition(".")
    return f"{FORMER_MODULES[module]}.{name}" if module in FORMER_MODULES else target


def rewrite_targets(cfg: MutableMapping[str, Any]) -> None:
    """Rename, in place, every `_target_` in `cfg` (a DictConfig or a plain dict, nested) that
    names a former path. Interpolations and missing values are left as they are."""
    from omegaconf import DictConfig

    for key in list(cfg.keys()):
        node = cfg._get_node(key) if isinstance(cfg, DictConfig) else cfg[key]
        if isinstance(node, MutableMapping):
            rewrite_targets(node)
            continue
        value = node._value() if isinstance(cfg, DictConfig) else node
        if key == "_target_" and isinstance(value, str) and current_path(value) != value:
            cfg[key] = current_path(value)


def spans_run(target: str | None) -> bool:
    """Whether a schedule is laid out over the run's length (it takes `total_steps`), so that
    training for more epochs would change its shape."""
    from hydra.utils import get_object

    if target is None:
        return False
    return "total_steps" in inspect.signature(get_object(current_path(target))).parameters


class _FormerModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports a former module as its current one (the same module object)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in FORMER_MODULES:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        return importlib.import_module(FORMER_MODULES[spec.name])

    def exec_module(self, module) -> None:
        pass  # the current module ran when create_module imported it


def follow_former_imports() -> None:
    """Let `import mpexp.scaling` (and the other former modules) import the current module."""
    if not any(isinstance(f, _FormerModules) for f in sys.meta_path):
        sys.meta_path.insert(0, _FormerModules())  # before any finder that holds a stale file
