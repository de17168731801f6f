"""One run per directory: a new run never writes where another run's results are, and no two
processes write into one directory at once.

Run directories are named to the microsecond (conf/train.yaml), so two runs started in the same
second get two directories. A directory that already holds a run (its metrics, summary or
checkpoints) is refused to a new run: `trainer.resume` is the way to continue it. While a process
trains in a directory it holds an exclusive lock on `<run dir>/.lock` (fcntl.flock), which the OS
releases when the process ends, however it ends; a second process is refused with one line.

Also here: where a run keeps its checkpoints, and the commands that start a run again or resume it.
None of it needs torch, so the command line can check a run directory before importing it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shlex
import sys
import time
from pathlib import Path

from mpexp.errors import OutputError

# fcntl.flock itself, not the filelock package (installed with torch, at no version mpexp sets):
# the lock file holds the holder's pid, which the refusal names, and older filelock releases open
# it with O_TRUNC, so that a refused contender erases it (filelock issue #591); where flock is
# missing, newer releases fall back to a lock file's existence, which a killed process leaves
# behind, while this lock must end with its process. The reentrant count for Hydra's callback and
# the run (_HELD) would stay ours either way.
try:  # POSIX; elsewhere runs are not locked
    import fcntl
except ImportError:  # pragma: no cover - not on the platforms mpexp runs on
    fcntl = None

log = logging.getLogger(__name__)

LOCK_FILE = ".lock"
SUBDIR = (
    "checkpoints"  # where a run's checkpoints are (mpexp/checkpoints/checkpoint.py writes them)
)
RUN_FILES = ("metrics.jsonl", "summary.json", SUBDIR)
AUTO = "auto"  # trainer.resume=auto: the run dir's newest checkpoint, if it has one


class RunDirTaken(OutputError):
    """The run directory belongs to another run: nothing may be written into it."""


def train_command() -> list[str]:
    """The training command as the user would type it: `mpexp-train` where one of the installed
    scripts runs (mpexp-train, mpexp-plan, ...), else `python -m mpexp.train`."""
    installed = Path(sys.argv[0]).name.startswith("mpexp-")
    return ["mpexp-train"] if installed else ["python", "-m", "mpexp.train"]


def rerun_command(overrides: list[str]) -> str:
    """The command line that runs the same configuration again, as a user would type it."""
    return shlex.join([*train_command(), *overrides])


def resume_command(overrides: list[str], target: str | Path) -> str:
    """The command line that continues a run from `target` (its directory or a checkpoint)."""
    kept = [o for o in overrides if not o.startswith("trainer.resume=")]
    return rerun_command([*kept, f"trainer.resume={hydra_quoted(str(target))}"])


def hydra_quoted(value: str) -> str:
    """`value` as Hydra's override grammar reads it back unchanged: as it is when it is a plain
    path, else single-quoted, with the quotes in it, the backslashes before them (or before the
    closing quote) and `${` (an interpolation) escaped."""
    if re.fullmatch(r"[\w/.+@-]+", value):
        return value
    escaped = re.sub(r"(\\*)'", lambda m: 2 * m.group(1) + "\\'", value)
    escaped = re.sub(r"(\\+)$", lambda m: 2 * m.group(1), escaped)
    return "'" + re.sub(r"(\\*)\$\{", lambda m: 2 * m.group(1) + "\\${", escaped) + "'"


# the names mpexp gives checkpoints (a file, or a sharded run's folder), what a write that a crash
# cut short leaves (or a sharded folder it left aside while replacing it), and a checkpoint file's
# checksum; any other file in checkpoints/ is not mpexp's
CHECKPOINT_NAME = re.compile(r"step-(\d+)(\.pt)?")
REPLACED = ".replaced"  # a sharded folder moved aside while one of its name replaces it
CUT_SHORT_NAME = re.compile(rf"step-\d+(\.pt\.tmp|\.pt\.tmp\.sha256|\.tmp|{re.escape(REPLACED)})")
CHECKSUM_NAME = re.compile(r"step-\d+\.pt\.sha256")


def checkpoint_files(run_dir: str | Path) -> list[Path]:
    """A run's complete checkpoints, oldest first: `step-<N>.pt` files, and the `step-<N>/`
    folders of sharded (FSDP) runs. Half-written `.tmp` ones, and files mpexp did not name, are
    not among them."""
    found = []
    for path in (Path(run_dir) / SUBDIR).glob("step-*"):
        name = CHECKPOINT_NAME.fullmatch(path.name)
        if name and (path.is_file() if name[2] else path.is_dir()):
            found.append(path)
    return sorted(found, key=checkpoint_step)


def leftover_files(run_dir: str | Path) -> list[Path]:
    """What mpexp left in a run's checkpoints/ that is no checkpoint: a write that a crash cut
    short (`.tmp` files and folders, their checksums), a checksum whose checkpoint is gone
    (a kill between writing the one and renaming the other into place), and a sharded folder
    that a kill left aside once its replacement was in place."""
    return [
        path
        for path in (Path(run_dir) / SUBDIR).glob("step-*")
        if CUT_SHORT_NAME.fullmatch(path.name)
        or (CHECKSUM_NAME.fullmatch(path.name) and not path.with_suffix("").is_file())
    ]


def put_back_replaced(run_dir: str | Path) -> None:
    """A sharded checkpoint's folder that a kill left aside, between the two renames that replace
    it (mpexp/checkpoints/sharded.py), goes back under its name: it is whole, and nothing took
    its place."""
    for aside in (Path(run_dir) / SUBDIR).glob(f"step-*{REPLACED}"):
        name = aside.with_name(aside.name.removesuffix(REPLACED))
        if aside.is_dir() and not name.exists():
            os.replace(aside, name)


def checkpoint_step(path: Path) -> int:
    """The step a checkpoint was written after, read from its name."""
    return int(CHECKPOINT_NAME.fullmatch(path.name)[1])


def validated_losses(run_dir: str | Path) -> dict[int, float]:
    """The finite val/loss at each step a run validated, from its metrics.jsonl ({} without it);
    a last line that a crash cut off is left out."""
    losses = {}
    try:
        lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return losses
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        loss = row.get("val/loss")
        if isinstance(loss, int | float) and math.isfinite(loss):
            losses[row["step"]] = loss
    return losses


def best_validated(files: list[Path], losses: dict[int, float]) -> Path | None:
    """Of `files` (checkpoints), the one whose step has the lowest of `losses`; None when none
    was validated."""
    validated = [p for p in files if checkpoint_step(p) in losses]
    return min(validated, key=lambda p: losses[checkpoint_step(p)], default=None)


def run_dir_of(checkpoint: str | Path) -> Path:
    """The run directory a checkpoint file belongs to."""
    checkpoint = Path(checkpoint)
    return checkpoint.parent.parent if checkpoint.parent.name == SUBDIR else checkpoint.parent


def holds_run(run_dir: Path) -> str | None:
    """What run `run_dir` already holds ("a finished run", ...), or None if it holds none.

    Hydra's own `.hydra/` and `train.log` do not count: Hydra writes them before a run starts.
    """
    run_dir = Path(run_dir)
    if not any((run_dir / name).exists() for name in RUN_FILES):
        return None
    try:
        status = json.loads((run_dir / "summary.json").read_text()).get("status", "unknown")
    except (OSError, ValueError):
        status = "unknown"
    return f"a run (status: {status})" if status != "unknown" else "a run's files"


def refuse_if_taken(run_dir: Path, restart: bool = False, key: str = "hydra.run.dir") -> None:
    """Raise RunDirTaken when a new run would write into a directory that holds one.

    With `restart` (trainer.resume=auto found no checkpoint there), a run that did not finish
    starts again from scratch: it has nothing to continue from, so its rows are dropped. `key`
    is the setting that chose the directory, for the advice.
    """
    held = holds_run(run_dir)
    if held is not None and restart and "finished" not in held:
        log.warning(
            "trainer.resume=auto: %s holds %s but no checkpoint: the run starts again from "
            "scratch, and the rows it had written are dropped.",
            run_dir,
            held,
        )
        (Path(run_dir) / "metrics.jsonl").unlink(missing_ok=True)
        return
    if held is not None:
        raise RunDirTaken(
            f"{run_dir} already holds {held}; a new run would mix its results into it.\n"
            f"To continue that run: {shlex.quote(f'trainer.resume={hydra_quoted(str(run_dir))}')} "
            "(with the run's own overrides). "
            f"For a new run, leave {key} out (each run gets a fresh directory) or choose "
            "another."
        )


# the directories this process holds locked: directory -> [its lock file, how many hold it]
_HELD: dict[Path, list] = {}


def _let_go_in_child() -> None:
    """In a forked child (a DataLoader worker), close the lock files it inherited. A flock lock
    belongs to the open file, which a fork shares: a worker that outlives its killed run would
    otherwise hold the run's directory, and refuse its resume, until the worker noticed and
    exited. Closing the child's copy leaves the parent's lock as it is."""
    for handle, _ in _HELD.values():
        handle.close()
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_let_go_in_child)
# how long a claim waits out another process's look at the lock (check_not_locked holds it shared
# for an instant), so that a look is not taken for a run that holds the folder
LOOK_S = 0.25


def _lock_soon(handle) -> None:
    """Take the exclusive lock, or raise BlockingIOError if it is still held after LOOK_S."""
    deadline = time.monotonic() + LOOK_S
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


class RunLock:
    """An exclusive lock on a run directory for as long as this process works in it.

    The process that holds it may take it again: Hydra's callback claims a run directory before
    Hydra writes `.hydra/` into it (mpexp/run/hydra_hooks.py), and the run takes it again to train.
    """

    def __init__(self, run_dir: Path):
        self.directory = Path(run_dir).resolve()  # one key per folder, however it is written
        self.path = self.directory / LOCK_FILE
        self._holding = False

    def acquire(self) -> RunLock:
        if fcntl is None:
            return self
        held = _HELD.get(self.directory)
        if held is None:
            self.directory.mkdir(parents=True, exist_ok=True)
            handle = self.path.open("a+")
            try:
                _lock_soon(handle)
            except BlockingIOError:
                handle.seek(0)
                holder = handle.read().strip() or "unknown"
                handle.close()
                raise RunDirTaken(self.refusal(holder)) from None
            handle.seek(0)
            handle.truncate()
            handle.write(f"{os.getpid()}\n")
            handle.flush()
            held = _HELD[self.directory] = [handle, 0]
        held[1] += 1
        self._holding = True
        return self

    def release(self) -> None:
        if not self._holding:
            return
        self._holding = False
        held = _HELD[self.directory]
        held[1] -= 1
        if held[1] == 0:
            del _HELD[self.directory]
            held[0].close()  # closing releases the lock

    def refusal(self, holder: str) -> str:
        return (
            f"Another process (pid {holder}) is training in {self.directory}; two runs in one "
            "directory would overwrite each other's results. Wait for it to end (or stop it), "
            "then resume with trainer.resume, or start a new run elsewhere."
        )

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


class SweepLock(RunLock):
    """The lock a sweep holds on its `hydra.sweep.dir` while its jobs run: a second sweep into the
    same folder would have its jobs write `.hydra/` into the folders of the first one's."""

    def refusal(self, holder: str) -> str:
        return (
            f"Another sweep (pid {holder}) is running into {self.directory}; its jobs' folders "
            "would be shared by this sweep's. Wait for it to end, or give this sweep another "
            "hydra.sweep.dir (leave it out and each sweep gets a fresh one)."
        )


def check_not_locked(run_dir: Path) -> None:
    """Raise RunDirTaken if another process holds `run_dir`'s lock now: a look that writes
    nothing (a shared lock, dropped at once, cannot be had beside the holder's exclusive one)."""
    lock = RunLock(run_dir)
    if fcntl is None or lock.directory in _HELD:  # this process's own run
        return
    try:
        handle = lock.path.open("r")
    except OSError:  # no lock file, so no holder; one that cannot be read is the claim's to report
        return
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunDirTaken(lock.refusal(handle.read().strip() or "unknown")) from None
