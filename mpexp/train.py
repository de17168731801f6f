"""The training entrypoint: `python -m mpexp.train [group=option ...] [key=value ...]`, or
`mpexp-train` once installed.

`main` is a thin Hydra shell; `train(cfg, run)` builds what the config asks for, hands it to the
loop (mpexp/loop.py) and can be called from Python.
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import signal
import sys
from dataclasses import replace
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import get_object
from omegaconf import DictConfig

from mpexp import __version__, config, flops, performance
from mpexp.checkpoint import (
    AUTO,
    Checkpointer,
    Preempted,
    StopSignals,
    checkpoint_files,
    open_resume,
    preemption_signal,
    rerun_command,
    resume_command,
)
from mpexp.data.base import DataInfo, InMemoryData
from mpexp.distributed import World, hydra_overrides_for_rank, start_world
from mpexp.errors import ConfigError, UserError
from mpexp.hydra_hooks import register_resolvers, sweep_job_name
from mpexp.loop import Fit, Parts
from mpexp.precision import convert_to_fp8, run_in_float32, setup_precision
from mpexp.rundir import RunDirTaken, RunLock, refuse_if_taken
from mpexp.scaling import build_scaler
from mpexp.schedules import build_schedule
from mpexp.system import device_name, resolve_device, seed_everything, set_deterministic
from mpexp.tracking import NullTracker, RunContext, Tracker, error_text, record_end
from mpexp.validate import validate, validate_run_length

log = logging.getLogger("mpexp")
config.register()  # the schemas behind conf/ (mpexp/config.py)
register_resolvers()  # conf/train.yaml's hydra.run.dir uses mpexp.run_dir


def build(node: DictConfig, **extra):
    """Instantiate a group's `_target_` with its other keys (and `extra`)."""
    kwargs = config.to_dict(node)
    return get_object(kwargs.pop("_target_"))(**kwargs, **extra)


def build_model(node: DictConfig, info: DataInfo, name: str | None) -> torch.nn.Module:
    """The model, built for the data's shape and tried on one image of it, so that a model that
    cannot take the data stops the run now with one message, not a traceback mid-step."""
    c, h, w = info.channels, info.height, info.width
    what = f"model={name}" if name else node._target_
    try:
        model = build(node, in_channels=c, num_classes=info.num_classes, image_size=(h, w))
        model.eval()  # no BatchNorm statistics change, no dropout draws from the RNG
        with torch.no_grad():
            shape = tuple(model(torch.zeros(1, c, h, w)).shape)
        model.train()
    except (ValueError, RuntimeError) as err:
        reason = str(err).strip().splitlines()[0]
        raise ConfigError(
            f"{what} cannot take the dataset's {c}x{h}x{w} images: {reason}.\n"
            "Use images it can take (dataset.height, dataset.width) or another model."
        ) from None
    if shape != (1, info.num_classes):
        raise ConfigError(
            f"{what} gives outputs of shape {shape} for one image; the loss needs "
            f"(1, {info.num_classes}), one logit per class."
        )
    return model


def train(cfg: DictConfig, run: RunContext) -> dict:
    """Train as `cfg` says, log to `run.run_dir` (and W&B), return the final metrics.

    With `trainer.resume`, continue that run instead: in its directory, under its W&B run id.
    """
    validate(cfg)
    auto = cfg.trainer.resume == AUTO  # the run dir's newest checkpoint, found once it is known
    resume = None if auto else open_resume(cfg)
    set_deterministic(cfg.trainer.deterministic)
    # signals from here on only ask to stop, at the next point where stopping loses nothing
    with (
        StopSignals() as stop,
        start_world(cfg.trainer.strategy, resolve_device(cfg.trainer.device)) as world,
    ):
        if resume is not None:
            run = replace(run, run_dir=resume.run_dir, wandb_id=resume.wandb_id)
        run = world.from_rank_zero(run)  # all ranks know where rank 0 writes
        if auto:
            resume = open_resume(cfg, run.run_dir)
            if resume is not None:
                run = replace(run, wandb_id=resume.wandb_id)
        # rank 0 owns the run dir until it ends; a second process there is refused
        with RunLock(run.run_dir) if world.is_main else contextlib.nullcontext():
            return _train(cfg, run, world, resume, stop)


def _train(cfg: DictConfig, run: RunContext, world: World, resume, stop: StopSignals) -> dict:
    if world.is_main and resume is None:
        refuse_if_taken(run.run_dir, restart=cfg.trainer.resume == AUTO)
    if resume is not None:
        if world.is_main:
            resume.rewind()
        at = resume.position
        log.info(
            "Resuming %s: epoch %d, batch %d, step %d", resume.path, at.epoch, at.batch, at.step
        )
    device = world.device
    seed_everything(cfg.trainer.seed)
    precision = setup_precision(cfg.precision, device)

    data: InMemoryData = build(cfg.dataset)
    info = data.setup(device)
    data.memory_format = performance.memory_format(cfg.trainer.channels_last)
    data.shard(world.rank, world.size)
    model = build_model(cfg.model, info, run.choices.get("model")).to(device)
    parameters = sum(p.numel() for p in model.parameters())
    # counted once, on the plain model at the run's shapes, before anything wraps it
    batch_shape = (data.batch_size, info.channels, info.height, info.width)
    name = device_name(device)
    throughput = flops.throughput(
        model,
        batch_shape,
        cfg.trainer.peak_tflops or flops.device_peak_tflops(name, precision.effective),
        world.size,
    )
    # fp8 swaps Linear layers: before fp32_modules wraps forwards and DDP/FSDP/compile take them
    model, precision = convert_to_fp8(
        model, precision, list(cfg.precision.fp32_modules), cfg.trainer.compile
    )
    fp32_modules = run_in_float32(model, list(cfg.precision.fp32_modules), precision)
    performance.apply_memory_format(model, cfg.trainer)  # before DDP/FSDP takes the parameters
    model = world.wrap(model, precision)
    skip_nonfinite = cfg.trainer.on_nonfinite_loss == "skip"
    scaler = build_scaler(cfg.loss_scaling, precision, device, skip_nonfinite_loss=skip_nonfinite)
    world.prepare_scaler(scaler)
    optimizer = performance.build_optimizer(cfg, model, device, scaler)
    validate_run_length(cfg, data.steps_per_epoch(), data.train_size // world.size)
    total_steps = data.steps_per_epoch() * cfg.trainer.epochs
    schedule = build_schedule(cfg.scheduler, optimizer, scaler, total_steps)
    performance.configure_backends(device, cfg.trainer)
    forward = performance.compile_model(model, cfg.trainer)

    ran = {
        "device": str(device),
        "device_name": name,
        "host": platform.node(),  # the report warns when jobs on one host overlapped in time
        "torch_version": torch.__version__,
        "mpexp_version": __version__,
        "choices": run.choices,
        **precision.record(),
        **scaler.describe(),
        **performance.describe(optimizer, cfg.trainer),
        **world.record(),
        "fp32_modules": fp32_modules,
        "scheduler": (cfg.scheduler.get("_target_") or "none").rpartition(".")[2],
        "accumulate": cfg.trainer.accumulate,
        "clip_grad_norm": cfg.trainer.clip_grad_norm,
        "parameters": parameters,
        "steps_per_epoch": data.steps_per_epoch(),
        "deterministic": cfg.trainer.deterministic,
    }
    log.info(
        "Training %s on %s (%d samples) | %s on %s | precision %s (autocast %s, TF32 %s) | "
        "loss scaling %s",
        run.choices.get("model") or type(model).__name__,
        run.choices.get("dataset") or type(data).__name__,
        data.train_size,
        f"{ran['parameters']:,} parameters",
        ran["device_name"],
        precision.mode,
        ran["autocast_dtype"],
        "on" if ran["tf32_matmul"] else "off",
        ran["loss_scaling"],
    )
    stop_if_asked(stop, world, run, "while the data loaded and the model was built")
    run_config = {**config.to_dict(cfg), "ran": ran}
    tracker = Tracker(run, run_config, cfg.wandb) if world.is_main else NullTracker(run.run_dir)
    saver = Checkpointer(cfg, run.overrides, world, model, optimizer, scaler, tracker, schedule)
    parts = Parts(model, forward, data, optimizer, scaler, precision, throughput)
    try:
        fit = Fit(cfg, parts, tracker, saver, world, stop)
        if resume is not None:
            fit.restore(resume)
        summary = fit.run()
        counted = throughput.result()
        summary["ran"] = {
            **ran,
            "final_scale": summary.pop("amp/final_scale"),
            **scaler.outcome(),
            "flops_per_sample": counted.flops_per_sample,  # counted in the background
            "peak_tflops": counted.peak_tflops,
        }
        summary["ran"].update(world.check_replicas(model))
        tracker.update_summary(summary)
        fit.check_it_trained()
    except (Preempted, KeyboardInterrupt):
        tracker.close("interrupted")
        raise
    except BaseException as err:
        with contextlib.suppress(OSError):  # a full disk must not hide the error that stopped us
            tracker.close("failed", error=error_text(err))
        raise
    tracker.close("finished")
    return summary


def stop_if_asked(stop: StopSignals, world: World, run: RunContext, where: str) -> None:
    """Before training starts, a stop signal ends the run at once: there is nothing to save.

    From the first step on (W&B may still be starting then, in the background) the loop stops at
    the end of a step and writes a checkpoint instead.
    """
    if world.any(bool(stop.received)):
        name = signal.Signals(stop.received or signal.SIGTERM).name
        if world.is_main:  # no Tracker yet: summary.json must still say how the run ended
            record_end(run.run_dir, "interrupted")
        raise Preempted(
            stop.received or signal.SIGTERM,
            f"Stopped by {name} {where}, before the first step: nothing was trained or saved. "
            f"Start it again with:\n  {rerun_command(run.overrides)}",
        )


def run_context(cfg: DictConfig) -> RunContext:
    """Where the run writes and how W&B names it: a sweep's job by the overrides that vary within
    the sweep (its jobs share a group named after the sweep), a single run by its experiment."""
    hc = HydraConfig.get()
    choices = {g: hc.runtime.choices.get(g) for g in config.GROUPS}
    sweep = hc.mode == RunMode.MULTIRUN
    group = cfg.wandb.group
    if group is None and sweep:
        group = "sweep-" + "_".join(Path(hc.sweep.dir).parts[-2:])
    return RunContext(
        run_dir=Path(hc.runtime.output_dir),
        name=sweep_job_name(hc) if sweep else choices.get("experiment") or "train",
        group=group,
        tags=list(cfg.wandb.tags),
        overrides=list(hc.overrides.task),
        choices=choices,
        in_sweep=sweep,
    )


@hydra.main(version_base="1.3", config_path=str(config.config_dir()), config_name="train")
def main(cfg: DictConfig) -> float:
    # from here on a run directory exists: StopSignals (in train) handles stop signals, and a
    # SIGTERM in the instants before it keeps its default effect, never cli's message
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    run = run_context(cfg)
    try:
        return train(cfg, run)["val/acc"]
    except Preempted as stopped:
        log.warning("%s", stopped)
        if stopped.signum == preemption_signal():
            # the checkpoint is written; submitit's own handler (back in place) requeues the job
            # and exits. The requeued job continues from the checkpoint with trainer.resume=auto.
            signal.raise_signal(stopped.signum)
        raise SystemExit(128 + stopped.signum) from None  # the shell's convention for a signal
    except KeyboardInterrupt:  # a second Ctrl-C: out at once, without a checkpoint
        log.warning("Stopped at once by a second Ctrl-C. %s", last_checkpoint_note(run))
        raise SystemExit(128 + signal.SIGINT) from None
    except Exception as err:
        # only rank 0 owns the run dir, and a dir taken by another run is not this run's to mark
        if int(os.environ.get("RANK", "0")) == 0 and not isinstance(err, RunDirTaken):
            record_end(run.run_dir, "failed", err)  # summary.json: where a sweep's report looks
        if not isinstance(err, UserError):
            raise
        log.error("%s", err)  # also lands in the run's train.log
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
    sys.argv += hydra_overrides_for_rank(sys.argv[1:])  # under torchrun only rank 0 writes
    # a log file that cannot be written (a full disk) must not print a traceback per record
    logging.raiseExceptions = False
    signal.signal(signal.SIGTERM, _stop_before_start)  # until main() starts the run
    try:
        main()
    except KeyboardInterrupt:  # before the run started: Hydra was still composing the config
        sys.stderr.write("Interrupted before the run started; nothing was written.\n")
        raise SystemExit(128 + signal.SIGINT) from None
    except StoppedBeforeStart:
        sys.stderr.write("Stopped by SIGTERM before the run started; nothing was written.\n")
        raise SystemExit(128 + signal.SIGTERM) from None


class StoppedBeforeStart(BaseException):
    """SIGTERM while Hydra composed the config, before any run directory existed."""


def _stop_before_start(signum, frame) -> None:
    raise StoppedBeforeStart


if __name__ == "__main__":
    cli()
