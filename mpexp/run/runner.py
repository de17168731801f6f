"""One training run from a composed config: `train(cfg, run)` builds what the config asks for
(data, model, precision, loss scaler, optimizer, schedule: mpexp/build.py; tracker,
checkpoints) and hands it to the loop (mpexp/step/loop.py). mpexp.train's command line calls it;
it can be called from Python too.
"""

from __future__ import annotations

import contextlib
import logging
import platform
import signal
import time
from dataclasses import replace

import torch
from omegaconf import DictConfig

from mpexp import __version__, config
from mpexp.build import Built, build_parts, build_training
from mpexp.checkpoints.checkpoint import Checkpointer
from mpexp.checkpoints.resume import open_resume
from mpexp.distributed import World, start_world
from mpexp.errors import ConfigError, reason
from mpexp.plan.before_run import against_measured, plan_run
from mpexp.precision import pure_updates
from mpexp.run.last_line import last_line
from mpexp.rundir import AUTO, RunLock, refuse_if_taken, rerun_command
from mpexp.step import performance
from mpexp.step.loop import Fit
from mpexp.step.parts import Parts
from mpexp.step.schedules import Schedule
from mpexp.stopping import Preempted, StopSignals
from mpexp.system import resolve_device, seed_everything, set_deterministic
from mpexp.targets import rewrite_targets
from mpexp.tracking.null_tracker import NullTracker
from mpexp.tracking.records import error_text, record_end
from mpexp.tracking.run_context import RunContext
from mpexp.tracking.tracker import Tracker
from mpexp.validate import validate, validate_run_length

log = logging.getLogger("mpexp")


def train(cfg: DictConfig, run: RunContext) -> dict:
    """Train as `cfg` says, log to `run.run_dir` (and W&B), return the final metrics; the last
    line logged says what the run reached and where it is (run/last_line.py).

    With `trainer.resume`, continue that run instead: in its directory, under its W&B run id.
    Stop signals are caught from here on, or from earlier where the command line already does.
    """
    started = time.monotonic()
    rewrite_targets(cfg)  # a config written before a module moved runs what it named
    validate(cfg)
    auto = cfg.trainer.resume == AUTO  # the run dir's newest checkpoint, found once it is known
    resume = None if auto else open_resume(cfg)
    set_deterministic(cfg.trainer.deterministic)
    # signals from here on only ask to stop, at the next point where stopping loses nothing (the
    # command line has caught them since it started; a job run by a launcher catches them here)
    caught = StopSignals.active()
    with (
        contextlib.nullcontext(caught) if caught else StopSignals() as stop,
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
            summary = _train(cfg, run, world, resume, stop)
        if world.is_main:  # after W&B's line: what it reached, and where
            took = time.monotonic() - started
            log.info("%s", last_line(run.run_dir, summary, took, bool(cfg.trainer.max_steps)))
        return summary


def _train(cfg: DictConfig, run: RunContext, world: World, resume, stop: StopSignals) -> dict:
    if world.is_main and resume is None:
        refuse_if_taken(run.run_dir, restart=cfg.trainer.resume == AUTO)
    stop_if_asked(stop, world, run, "as the run started")  # e.g. while torch was imported
    # on a GPU, the run rehearsed on fake tensors first: one that cannot fit stops here
    plan = plan_run(cfg, world, run.run_dir)
    seed_everything(cfg.trainer.seed)
    built = build_parts(cfg, world, run.choices)
    data, model, precision, scaler = built.data, built.model, built.precision, built.scaler
    if cfg.wandb.samples and built.task.name != "language_model":
        raise ConfigError(
            f"wandb.samples={cfg.wandb.samples} samples text from a language model; this run's "
            f"task is {built.task.name}. Drop it, or train model=gpt on dataset=text."
        )
    validate_run_length(cfg, data.steps_per_epoch(), data.train_size)
    data_key = data.resume_key()  # what the checkpoints keep, and a resume must find again
    if resume is not None:
        # the last check a resume can fail comes before the run's files change: a refused resume
        # leaves its run as it was
        resume.check_data(data_key)  # first: a class added also changes the model's head
        resume.check_frozen(built.frozen)  # the weights its checkpoints do not hold
        resume.check_fits(model)
        if world.is_main:
            resume.rewind()
        at = resume.position
        log.info(
            "Resuming %s: epoch %d, batch %d, step %d", resume.path, at.epoch, at.batch, at.step
        )
    # W&B starts here, in a process of its own (mpexp/tracking/wandb_process.py): its second or more
    # of start-up runs on another core while this one imports TorchDynamo (the optimizer's first
    # use, or the FLOP count's) and training begins
    tracker = (
        Tracker(run, config.to_dict(cfg), cfg.wandb, built.task)
        if world.is_main
        else NullTracker(run.run_dir)
    )
    with ended_in_summary(tracker):
        optimizer, schedule, forward = build_training(cfg, built, world.device)
        ran = ran_record(cfg, run, world, built, optimizer, schedule)
        if plan is not None:
            ran["plan"] = plan
        weights = f"{ran['parameters']:,} parameters"
        if ran["trainable_parameters"] < ran["parameters"]:  # frozen ones (fine-tuning)
            weights += f" ({ran['trainable_parameters']:,} trained)"
        log.info(
            "Training %s on %s (%s) | %s | %s on %s | precision %s (autocast %s, TF32 %s) | "
            "loss scaling %s | %s",
            run.choices.get("model") or type(model).__name__,
            run.choices.get("dataset") or type(data).__name__,
            data.describe(),
            built.split.describe(built.task.progress(1).get("tokens")),
            weights,
            ran["device_name"],
            precision.mode,
            ran["autocast_dtype"],
            "on" if ran["tf32_matmul"] else "off",
            ran["loss_scaling"],
            performance.describe_step(built.speed),
        )
        tracker.record_ran(ran)
        if world.is_main:  # e.g. an image folder's validation files, beside the summary
            for name, content in data.run_files().items():
                (run.run_dir / name).write_bytes(content)
        stop_if_asked(stop, world, run, "while the data loaded and the model was built")
        saver = Checkpointer(
            cfg, run.overrides, world, model, optimizer, scaler, tracker, schedule, data_key,
            frozen=built.frozen,
        )  # fmt: skip
        parts = Parts(
            model,
            forward,
            data,
            optimizer,
            scaler,
            precision,
            built.throughput,
            built.speed,
            schedule,
        )
        fit = Fit(cfg, parts, tracker, saver, world, stop)
        if resume is not None:
            fit.restore(resume)
        summary = fit.run()
        counted = built.throughput.result()
        summary["ran"] = {
            **ran,
            **fit.speed_ran(),  # what compilation and the CUDA graph came to
            "final_scale": summary.pop("amp/final_scale"),
            "data": built.data.record(),  # as training left it (an image folder's bad files)
            **scaler.outcome(),
            "flops_per_sample": counted.flops_per_sample,  # counted in the background
            "peak_tflops": counted.peak_tflops,
            # what the weights, gradients and optimizer states hold between steps
            **pure_updates.stored_bytes(optimizer, model),
        }
        summary["ran"].update(world.check_replicas(model))
        summary["ran"]["step_path"] = performance.step_path(summary["ran"])
        summary.update(against_measured(plan, summary))
        tracker.update_summary(summary)
        fit.check_it_trained()
        if cfg.wandb.samples and world.is_main:
            tracker.log_samples(samples_of(run.run_dir, cfg.wandb.samples, world.device))
        return summary


def samples_of(run_dir, count: int, device: torch.device) -> list[tuple[str, str]]:
    """`count` texts sampled from the run's best checkpoint, as `mpexp-sample` samples them (seeds
    0, 1, ...); a sampling that fails is said in a warning, never ending a finished run."""
    from mpexp.sample import Draw, sample

    samples = []
    for seed in range(count):
        try:
            (text,), how = sample(run_dir, Draw(temperature=1.0, seed=seed), "", str(device))
        except Exception as err:  # the run is done: nothing here may fail it
            log.warning("No samples for W&B: sampling the run failed (%s).", reason(err))
            break
        samples.append((how, text))
    return samples


def ran_record(
    cfg: DictConfig,
    run: RunContext,
    world: World,
    built: Built,
    optimizer: torch.optim.Optimizer,
    schedule: Schedule | None,
) -> dict:
    """What runs, as the run's config and summary record it under `ran` (before training; the
    outcome joins it at the end)."""
    return {
        "device": str(world.device),
        "device_name": built.device_name,
        "host": platform.node(),  # the report warns when jobs on one host overlapped in time
        "torch_version": torch.__version__,
        "mpexp_version": __version__,
        "choices": run.choices,
        "task": built.task.record(),
        "data": built.data.record(),
        # the dataset keys that would feed it faster: the report's advice for a data-bound run
        "faster_data": built.data.faster_data_keys(),
        **built.precision.record(),
        **built.scaler.describe(),
        **performance.describe(optimizer, built.speed),
        **world.record(),
        "fp32_modules": built.fp32_modules,
        "scheduler": (cfg.scheduler.get("_target_") or "none").rpartition(".")[2],
        # where the learning rate is computed: on the device keeps the step sync-free
        "schedule": schedule.where if schedule is not None else "none",
        "accumulate": cfg.trainer.accumulate,
        "micro_batch": built.split.micro_batch,  # samples per forward pass, on each process
        "clip_grad_norm": cfg.trainer.clip_grad_norm,
        "parameters": built.parameters,
        # beside them: what trains (LoRA's adapters, what model.freeze left), LoRA as it took
        # effect, and what the frozen weights are held in
        **built.tuning.record(),
        "steps_per_epoch": built.data.steps_per_epoch(),
        "deterministic": cfg.trainer.deterministic,
    }


@contextlib.contextmanager
def ended_in_summary(tracker: Tracker | NullTracker):
    """Close the tracker as the run ends: finished, interrupted (a stop signal, Ctrl-C) or failed
    (with the error), in summary.json and W&B alike."""
    try:
        yield
    except (Preempted, KeyboardInterrupt):
        tracker.close("interrupted")
        raise
    except BaseException as err:
        with contextlib.suppress(OSError):  # a full disk must not hide the error that stopped us
            tracker.close("failed", error=error_text(err))
        raise
    tracker.close("finished")


def stop_if_asked(stop: StopSignals, world: World, run: RunContext, where: str) -> None:
    """Before training starts, a stop signal ends the run at once: there is nothing to save.

    From the first step on (W&B may still be starting then, in the background) the loop stops at
    the end of a step and writes a checkpoint instead.
    """
    if world.any(bool(stop.received)):
        name = signal.Signals(stop.received or signal.SIGTERM).name
        if world.is_main:  # summary.json says how the run ended, with a Tracker or without
            record_end(run.run_dir, "interrupted")
        raise Preempted(
            stop.received or signal.SIGTERM,
            f"Stopped by {name} {where}, before the first step: nothing was trained or saved. "
            f"Start it again with:\n  {rerun_command(run.overrides)}",
        )
