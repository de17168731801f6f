"""What mpexp adds to Hydra's run: checks before Hydra writes anything (the name and folder a
sweep's job goes by: mpexp/job_names.py; the resolvers conf/ names, a resumed run's directory
among them: mpexp/resolvers.py).

The `RunChecks` callback stops a run with one message, before Hydra creates or writes anything,
when a value cannot work, the output directory cannot be written or `trainer.resume` cannot
continue under this config; a rejected resume so leaves the run's `.hydra/` record as it was.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from mpexp.errors import OutputError, UserError
from mpexp.launch import is_rank_zero
from mpexp.rundir import (
    LOCK_FILE,
    RunLock,
    SweepLock,
    check_not_locked,
    holds_run,
    refuse_if_taken,
)
from mpexp.validate import check_schema, validate

T = TypeVar("T")


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
    """Checks that need the whole config, made before Hydra sets up the run directory.

    They also claim the directory: a single run locks its run dir, a sweep its sweep dir, before
    Hydra writes `.hydra/` there, and holds it until it ends. A second process aimed at the same
    folder is refused before it writes anything, so a folder's `.hydra/` is always its run's.
    """

    def __init__(self) -> None:
        self._lock: RunLock | None = None

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        task = _task(config)
        run_dir = Path(config.hydra.run.dir)
        _exit_on_user_error(lambda: validate(task))
        _exit_on_user_error(lambda: check_reachable(run_dir))
        main = is_rank_zero()  # ranks > 0 write nothing (distributed.py)
        continues = bool(task.trainer.resume)  # a resume that cannot continue exits below
        if continues:
            # torch: only a resume needs it before the run starts
            from mpexp.checkpoints.resume import open_resume

            # checked before Hydra writes anything (a live run's folder refused before its
            # checkpoints are read); the run opens it again to train from it
            _exit_on_user_error(lambda: open_resume(task, run_dir, mmap=True))
        made = _outermost_missing(run_dir) if main and not continues else None
        _exit_on_user_error(lambda: check_writable(run_dir))
        if made is not None:
            _MADE[run_dir.resolve()] = made
        if main and continues:  # taken before the lock writes its pid
            log_file = run_dir / f"{config.hydra.job.name}.log"  # Hydra's job log, train.log
            _RECORDS[run_dir.resolve()] = RunRecord(run_dir, log_file)
        if main:
            self._lock = _exit_on_user_error(lambda: RunLock(run_dir).acquire())
        if not continues:
            _exit_on_user_error(lambda: refuse_if_taken(run_dir))

    def on_run_end(self, config: DictConfig, **kwargs) -> None:
        self._release()

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        quiet_sweeper_logs(config)
        # the values a sweep varies are checked per job; unknown keys fail every job alike
        _exit_on_user_error(lambda: check_schema(_task(config)))
        sweep_dir = Path(config.hydra.sweep.dir)
        _exit_on_user_error(lambda: check_reachable(sweep_dir))
        _exit_on_user_error(lambda: check_writable(sweep_dir))
        self._lock = _exit_on_user_error(lambda: SweepLock(sweep_dir).acquire())
        # a sweep dir given again: its jobs' folders would be reused
        for job in sorted(p for p in sweep_dir.iterdir() if p.is_dir()):
            _exit_on_user_error(lambda job=job: refuse_if_taken(job, key="hydra.sweep.dir"))
            _exit_on_user_error(lambda job=job: check_not_locked(job))

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        self._release()  # the last callback to end (Hydra ends them in reverse): after the report

    def _release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None


# new runs' directories, each with the outermost folder made for it (outputs/<date>/ too, where
# that is new): a run refused before it wrote anything of its own leaves none of them behind
_MADE: dict[Path, Path] = {}


def _outermost_missing(path: Path) -> Path | None:
    missing = None
    for folder in [path.resolve(), *path.resolve().parents]:
        if folder.exists():
            return missing
        missing = folder
    return missing


def remove_unstarted_run_dir(run_dir: Path) -> bool:
    """Remove a new run's directory, and the folders made for it, when the run wrote nothing of
    its own there (no metrics, summary or checkpoints: it was refused while its parts were
    built), so that only Hydra's record and the lock would be left. True if it was removed."""
    run_dir = Path(run_dir).resolve()
    made = _MADE.pop(run_dir, None)
    if made is None or holds_run(run_dir) is not None:
        return False
    shutil.rmtree(run_dir, ignore_errors=True)
    for folder in run_dir.parents:
        if not folder.is_relative_to(made):
            break
        with contextlib.suppress(OSError):  # not empty: something else is in it now
            folder.rmdir()
    return True


class RunRecord:
    """What a job's start writes into the run directory it continues before mpexp's last check of
    the resume (Hydra's `.hydra/` and job log, the lock's pid), as it was: a resume refused after
    that puts it back, and leaves the run as it was."""

    def __init__(self, run_dir: Path, log_file: Path):
        self.hydra, self.lock, self.log_file = run_dir / ".hydra", run_dir / LOCK_FILE, log_file
        self.files = {p: p.read_bytes() for p in [*self.hydra.glob("*"), self.lock] if p.is_file()}
        self.log_size = log_file.stat().st_size if log_file.is_file() else None

    def put_back(self) -> None:
        for path in [*self.hydra.glob("*"), self.lock]:
            if path not in self.files:
                path.unlink(missing_ok=True)
        if self.hydra.is_dir() and not any(self.hydra.iterdir()):
            self.hydra.rmdir()
        for path, content in self.files.items():
            path.write_bytes(content)
        if self.log_size is None:
            self.log_file.unlink(missing_ok=True)
        elif self.log_file.is_file():
            with self.log_file.open("r+b") as f:
                f.truncate(self.log_size)


_RECORDS: dict[Path, RunRecord] = {}  # run dirs that a resume continues in this process


def put_back_run_record(run_dir: Path) -> None:
    """Undo what the job's start wrote into `run_dir` when a resume of it was refused."""
    record = _RECORDS.pop(Path(run_dir).resolve(), None)
    if record is not None:
        record.put_back()


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


def _exit_on_user_error(check: Callable[[], T]) -> T:
    # Hydra turns a callback's exceptions into warnings and carries on; SystemExit gets through.
    # A check that fails for a reason of its own must stop the run too, with its traceback.
    try:
        return check()
    except UserError as err:
        sys.stderr.write(f"{err}\n")
        raise SystemExit(2) from None
    except Exception:
        traceback.print_exc()
        raise SystemExit(1) from None
