"""The training entrypoint: `python -m mpexp.train [group=option ...] [key=value ...]`, or
`mpexp-train` once installed.

A thin Hydra shell around `mpexp.run.runner.train(cfg, run)`. It imports torch only once a run
starts (in `main`), so a config error, `--help`, `--cfg` and tab completion answer at once.
"""

from __future__ import annotations

import sys
from pathlib import Path

from mpexp.stopping import (
    INTERRUPTED_BEFORE_START,
    StopSignals,
    catch_from_start,
    quiet_exit,
)

# Run as the command (`python -m mpexp.train`, `mpexp-train`), a stop signal only asks to stop
# from here on: Hydra's and OmegaConf's imports below take a noticeable fraction of a second.
# Imported from Python, signals are left as they are.
if __name__ == "__main__" or Path(sys.argv[0]).name == "mpexp-train":
    catch_from_start()

import logging
import signal

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from mpexp import config
from mpexp.composition import composed, composing
from mpexp.errors import ConfigError, ResumeRefused, UserError
from mpexp.job_names import job_name
from mpexp.launch import is_rank_zero, launched_processes
from mpexp.resolvers import expand_home, quote_run_dirs, register_resolvers
from mpexp.run.hydra_hooks import put_back_run_record, remove_unstarted_run_dir
from mpexp.rundir import RunDirTaken, checkpoint_files, rerun_command, resume_command
from mpexp.stopping import Preempted, preemption_signal
from mpexp.tracking.records import record_end
from mpexp.tracking.run_context import RunContext
from mpexp.tracking.wandb_mode import sweep_group

log = logging.getLogger("mpexp")
config.register()  # the schemas behind conf/ (mpexp/config/)
register_resolvers()  # conf/train.yaml's hydra.run.dir uses mpexp.run_dir


def run_context(cfg: DictConfig) -> RunContext:
    """Where the run writes and how W&B names it: a sweep's job by the overrides that vary within
    the sweep (its jobs share a group named after the sweep), a single run by its experiment."""
    hc = HydraConfig.get()
    choices = {g: hc.runtime.choices.get(g) for g in config.GROUPS}
    sweep = hc.mode == RunMode.MULTIRUN
    group = cfg.wandb.group
    if group is None and sweep:
        group = sweep_group(Path(hc.sweep.dir))
    return RunContext(
        run_dir=Path(hc.runtime.output_dir),
        name=job_name(hc) if sweep else choices.get("experiment") or "train",
        group=group,
        tags=list(cfg.wandb.tags),
        overrides=list(hc.overrides.task),
        choices=choices,
        in_sweep=sweep,
    )


@hydra.main(version_base="1.3", config_path=str(config.config_dir()), config_name="train")
def main(cfg: DictConfig) -> float:
    composed()  # from here on Hydra reports a job's errors its own way
    run = run_context(cfg)
    try:
        from mpexp.run.runner import train  # torch and the rest: only now that a run starts

        summary = train(cfg, run)  # under cli's StopSignals, when cli started it
        # the task's result (val/acc, val/loss): what Optuna's sweeper optimises
        return summary[summary["ran"]["task"]["metric"]]
    except Preempted as stopped:
        log.warning("%s", stopped)
        if stopped.signum == preemption_signal():
            # the checkpoint is written; submitit's own handler (back in place) requeues the job
            # and exits. The requeued job continues from the checkpoint with trainer.resume=auto.
            signal.raise_signal(stopped.signum)
        raise SystemExit(128 + stopped.signum) from None  # the shell's convention for a signal
    except KeyboardInterrupt:  # a second Ctrl-C: out at once, without a checkpoint
        if is_rank_zero():
            record_end(run.run_dir, "interrupted")  # also when it came before the first step
        log.warning("Stopped at once by a second Ctrl-C. %s", last_checkpoint_note(run))
        raise SystemExit(128 + signal.SIGINT) from None
    except Exception as err:
        # only rank 0 owns the run dir; a dir taken by another run is not this run's to mark,
        # and a refused resume changed nothing of the run it would have continued
        not_ours = isinstance(err, RunDirTaken | ResumeRefused)
        # a config mistake found before the run wrote anything (building its model, say)
        # leaves no run directory, as one found before Hydra made it does
        left_none = isinstance(err, ConfigError) and remove_unstarted_run_dir(run.run_dir)
        if is_rank_zero() and not not_ours and not left_none:
            record_end(run.run_dir, "failed", err)  # summary.json: where a sweep's report looks
        if not isinstance(err, UserError):
            raise
        log.error("%s", err)  # also lands in the run's train.log
        if isinstance(err, ResumeRefused):
            put_back_run_record(run.run_dir)  # .hydra/, train.log and .lock as they were
        if HydraConfig.get().mode == RunMode.RUN:
            raise SystemExit(2) from None
        raise  # in a sweep the other jobs still run; Hydra reports this one at the end


def last_checkpoint_note(run: RunContext) -> str:
    """Where a run stopped without a checkpoint can be continued from, if anywhere."""
    saved = checkpoint_files(run.run_dir)
    if not saved:
        return f"No checkpoint was written; start it again with:\n  {rerun_command(run.overrides)}"
    return (
        f"The last checkpoint is {saved[-1]}; continue with:\n  "
        f"{resume_command(run.overrides, run.run_dir)}"
    )


def cli() -> None:
    """The `mpexp-train` command (and `python -m mpexp.train`)."""
    # run as the command, stop signals are caught from this module's top (catch_from_start)
    command = StopSignals.active() is not None
    status = 1  # a crash's, unless the command ends as below
    try:
        _command()
        status = 0
    except SystemExit as exiting:
        status = exiting.code if isinstance(exiting.code, int) else int(exiting.code is not None)
        raise
    finally:
        if command:  # a Ctrl-C while Python exits (its exit hooks) ends it at once, quietly
            quiet_exit(status)


def _command() -> None:
    # dataset.path=~/corpus.txt; trainer.resume=<a sweep job's folder, named with = and ,>
    sys.argv[1:] = quote_run_dirs(expand_home(sys.argv[1:]))
    if launched_processes() > 1:  # under torchrun only rank 0 writes
        from mpexp.distributed import hydra_overrides_for_rank

        sys.argv += hydra_overrides_for_rank(sys.argv[1:])
    # a log file that cannot be written (a full disk) must not print a traceback per record
    logging.raiseExceptions = False
    # From the start a stop signal only asks to stop: while Hydra composes the config and the
    # run imports torch (seconds, with the run dir already made), the run checks it before its
    # first step and ends as interrupted, with one line. Caught since this module's top when it
    # runs as the command; from here when cli() is called from Python.
    stop = StopSignals.active() or StopSignals().__enter__()
    stop.before_start = False  # a second signal now raises KeyboardInterrupt, caught below
    try:
        composing(main)  # a mistyped key: mpexp's one message, not Hydra's advice to add it
    except KeyboardInterrupt:  # a second Ctrl-C before the run started
        sys.stderr.write(INTERRUPTED_BEFORE_START)
        raise SystemExit(128 + signal.SIGINT) from None
    finally:
        stop.__exit__()
    if stop.received:  # nothing ran that would have answered it: --help, --cfg, a sweep's end
        name = signal.Signals(stop.received).name
        sys.stderr.write(f"Stopped by {name}; nothing was trained.\n")
        raise SystemExit(128 + stop.received)
    if launched_processes() > 1:
        from mpexp.distributed import leave_if_replica

        leave_if_replica()


if __name__ == "__main__":
    cli()
