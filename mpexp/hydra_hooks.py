"""What mpexp adds to Hydra: where a resumed run writes, checks before Hydra writes anything, and
the name a sweep's job goes by.

`hydra.run.dir` in conf/train.yaml goes through the `mpexp.run_dir` resolver, so
`trainer.resume=<run dir>` continues in that directory: one metrics.jsonl, one train.log. The
`RunChecks` callback stops a run with one message, before Hydra creates or writes anything, when
a value cannot work, the output directory cannot be written or `trainer.resume` cannot continue
under this config; a rejected resume so leaves the run's `.hydra/` record as it was.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from mpexp.errors import OutputError, UserError
from mpexp.rundir import AUTO, check_not_locked, refuse_if_taken, run_dir_of
from mpexp.validate import check_schema, validate

T = TypeVar("T")


def resumed_run_dir(resume: str | None, default: str) -> str:
    """The run directory: the resumed run's own, or `default` for a new run."""
    if not resume or resume == AUTO:  # auto: the run dir as it is, e.g. hydra.run.dir
        return default
    target = Path(resume)
    if target.is_file():
        return str(run_dir_of(target))
    if target.is_dir():
        return str(target)
    return default  # a wrong path is reported by RunChecks, not created


def register_resolvers() -> None:
    OmegaConf.register_new_resolver("mpexp.run_dir", resumed_run_dir, replace=True)


# what the writability check writes: on a full disk an empty file may still be created, while
# the first real write (Hydra's config, train.log) fails
PROBE_BYTES = 64 * 1024


def check_writable(directory: str | Path) -> None:
    """Create `directory` and write (and sync) some KiB to a file in it, or raise OutputError
    saying what to do."""
    path = Path(directory)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path) as probe:
            probe.write(bytes(PROBE_BYTES))
            probe.flush()
            os.fsync(probe.fileno())
    except OSError as err:
        raise _unusable(path, err) from None


def check_reachable(directory: str | Path) -> None:
    """Raise OutputError when the OS cannot even look `directory` up (a name too long for the
    file system, a folder on the way that may not be entered): checked before anything reads it."""
    try:
        Path(directory).exists()
    except OSError as err:
        raise _unusable(Path(directory), err) from None


def _unusable(path: Path, err: OSError) -> OutputError:
    return OutputError(
        f"Cannot write to the output directory {path}: {err.strerror or err}.\n"
        "Run from a writable directory, or choose one with hydra.run.dir=<dir> "
        "(hydra.sweep.dir=<dir> for a multirun)."
    )


class RunChecks(Callback):
    """Checks that need the whole config, made before Hydra sets up the run directory."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        task = _task(config)
        run_dir = Path(config.hydra.run.dir)
        _exit_on_user_error(lambda: validate(task))
        _exit_on_user_error(lambda: check_reachable(run_dir))
        resume = None
        if task.trainer.resume:
            from mpexp import checkpoint  # torch: only a resume needs it before the run starts

            resume = _exit_on_user_error(lambda: checkpoint.open_resume(task, run_dir, mmap=True))
        if resume is None and task.trainer.resume != AUTO:
            _exit_on_user_error(lambda: refuse_if_taken(run_dir))
        else:  # the run may still be going on in another process
            _exit_on_user_error(lambda: check_not_locked(run_dir))
        _exit_on_user_error(lambda: check_writable(run_dir))

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        quiet_sweeper_logs(config)
        # the values a sweep varies are checked per job; unknown keys fail every job alike
        _exit_on_user_error(lambda: check_schema(_task(config)))
        sweep_dir = Path(config.hydra.sweep.dir)
        _exit_on_user_error(lambda: check_reachable(sweep_dir))
        if sweep_dir.is_dir():  # a sweep dir given again: its jobs' folders would be reused
            for job in sorted(p for p in sweep_dir.iterdir() if p.is_dir()):
                _exit_on_user_error(lambda job=job: refuse_if_taken(job, key="hydra.sweep.dir"))
        _exit_on_user_error(lambda: check_writable(sweep_dir))


def quiet_sweeper_logs(config: DictConfig) -> None:
    """Keep the set-up chatter of Optuna's sweeper off a sweep's console: Optuna imports alembic,
    whose seven `setup plugin ...` lines come through Hydra's INFO logging, and announces its
    in-memory study, which Hydra's sweeper names again on the next line. Warnings still show.
    Called before Hydra builds the sweeper, which imports optuna."""
    logging.getLogger("alembic").setLevel(logging.WARNING)
    if "optuna" in str(OmegaConf.select(config, "hydra.sweeper._target_", default="")):
        with contextlib.suppress(ImportError):  # Hydra says so itself when it builds the sweeper
            import optuna

            optuna.logging.set_verbosity(optuna.logging.WARNING)


def _task(config: DictConfig) -> DictConfig:
    """The job's own config, without Hydra's node, with its schema types kept."""
    return OmegaConf.masked_copy(config, [key for key in config if key != "hydra"])


def sweep_job_name(hydra_cfg: DictConfig) -> str:
    """A sweep job's name: its overrides of the keys that the sweep varies (`precision=fp16`),
    read from the sweep's multirun.yaml (command-line sweeps and `hydra.sweeper.params`)."""
    task = list(hydra_cfg.overrides.task)
    varying = swept_keys(Path(hydra_cfg.sweep.dir) / "multirun.yaml")
    parser = OverridesParser.create()
    named = [o for o, parsed in zip(task, parser.parse_overrides(task), strict=True)
             if parsed.key_or_group in varying]  # fmt: skip
    return ",".join(named) or hydra_cfg.job.override_dirname or f"job {hydra_cfg.job.num}"


def swept_keys(multirun_yaml: Path) -> set[str]:
    """The keys a sweep varies, from the multirun.yaml Hydra writes into the sweep folder."""
    try:
        saved = OmegaConf.load(multirun_yaml)
    except (OSError, ValueError):
        return set()
    overrides = [str(o) for o in OmegaConf.select(saved, "hydra.overrides.task", default=[])]
    keys = {
        o.key_or_group
        for o in OverridesParser.create().parse_overrides(overrides)
        if o.is_sweep_override()
    }
    params = OmegaConf.select(saved, "hydra.sweeper.params", default=None) or {}
    return keys | set(params)


def _exit_on_user_error(check: Callable[[], T]) -> T:
    # Hydra turns a callback's exceptions into warnings and carries on; SystemExit gets through.
    try:
        return check()
    except UserError as err:
        sys.stderr.write(f"{err}\n")
        raise SystemExit(2) from None
