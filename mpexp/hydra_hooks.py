"""What mpexp adds to Hydra: where a resumed run writes, and checks before Hydra writes anything.

`hydra.run.dir` in conf/train.yaml goes through the `mpexp.run_dir` resolver, so
`trainer.resume=<run dir>` continues in that directory: one metrics.jsonl, one train.log. The
`RunChecks` callback stops a run with one message, before Hydra creates or writes anything, when
the output directory cannot be written or `trainer.resume` cannot continue under this config; a
rejected resume so leaves the run's `.hydra/` record as it was.
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from mpexp import checkpoint
from mpexp.errors import OutputError, UserError


def resumed_run_dir(resume: str | None, default: str) -> str:
    """The run directory: the resumed run's own, or `default` for a new run."""
    if not resume:
        return default
    target = Path(resume)
    if target.is_file():
        return str(checkpoint.run_dir_of(target))
    if target.is_dir():
        return str(target)
    return default  # a wrong path is reported by RunChecks, not created


def register_resolvers() -> None:
    OmegaConf.register_new_resolver("mpexp.run_dir", resumed_run_dir, replace=True)


def check_writable(directory: str | Path) -> None:
    """Create `directory` and a file in it, or raise OutputError saying what to do."""
    path = Path(directory)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as err:
        raise OutputError(
            f"Cannot write to the output directory {path}: {err.strerror or err}.\n"
            "Run from a writable directory, or choose one with hydra.run.dir=<dir> "
            "(hydra.sweep.dir=<dir> for a multirun)."
        ) from err


class RunChecks(Callback):
    """Checks that need the whole config, made before Hydra sets up the run directory."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        task = OmegaConf.masked_copy(config, [key for key in config if key != "hydra"])
        _exit_on_user_error(lambda: checkpoint.open_resume(task, mmap=True))
        _exit_on_user_error(lambda: check_writable(config.hydra.run.dir))

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        _exit_on_user_error(lambda: check_writable(config.hydra.sweep.dir))


def _exit_on_user_error(check: Callable[[], object]) -> None:
    # Hydra turns a callback's exceptions into warnings and carries on; SystemExit gets through.
    try:
        check()
    except UserError as err:
        sys.stderr.write(f"{err}\n")
        raise SystemExit(2) from None
