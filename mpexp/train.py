"""The training entrypoint: `python -m mpexp.train [group=option ...] [key=value ...]`.

`main` is a thin Hydra shell; `train(cfg, run)` does the work and can be called from Python.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import hydra
import torch
import torch.nn.functional as F
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import get_object
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from mpexp import __version__, performance
from mpexp.data.base import InMemoryData
from mpexp.distributed import World, hydra_overrides_for_rank, start_world
from mpexp.errors import UserError
from mpexp.history import StepHistory, StepRow
from mpexp.precision import Precision, setup_precision
from mpexp.scaling import LossScaler, build_scaler
from mpexp.system import PeakMemory, device_name, resolve_device, seed_everything, synchronize
from mpexp.tracking import NullTracker, RunContext, Tracker
from mpexp.validate import validate

log = logging.getLogger("mpexp")


def build(node: DictConfig, **extra):
    """Instantiate a group's `_target_` with its keys, except the descriptive `name`."""
    kwargs = {k: v for k, v in OmegaConf.to_container(node, resolve=True).items() if k != "name"}
    return get_object(kwargs.pop("_target_"))(**kwargs, **extra)


def train_step(model, images, labels, optimizer, scaler: LossScaler, precision: Precision):
    """One optimizer step; the same code for every precision and loss-scaling strategy."""
    with precision.autocast():
        loss = F.cross_entropy(model(images), labels)
    scaler.scale(loss).backward()
    scaler.step(optimizer)  # skipped when the scaler finds inf/NaN gradients
    return loss


@torch.no_grad()
def evaluate(model, data: InMemoryData, device, precision: Precision) -> tuple[float, float]:
    """Validation loss and accuracy, accumulated on the device and read once."""
    model.eval()
    total = torch.zeros(3, device=device)  # loss sum, correct, count
    for images, labels in data.val_batches(device):
        with precision.autocast():
            logits = model(images)
        loss = F.cross_entropy(logits.float(), labels, reduction="sum")
        correct = (logits.argmax(1) == labels).sum()
        total += torch.stack((loss, correct.float(), torch.tensor(len(labels), device=device)))
    model.train()
    loss_sum, correct, count = total.tolist()
    return loss_sum / count, correct / count


def train(cfg: DictConfig, run: RunContext) -> dict:
    """Train as `cfg` says, log to `run.run_dir` (and W&B), return the final metrics."""
    validate(cfg)
    with start_world(cfg.trainer.strategy, resolve_device(cfg.trainer.device)) as world:
        return _train(cfg, run, world)


def _train(cfg: DictConfig, run: RunContext, world: World) -> dict:
    run = world.from_rank_zero(run)  # all ranks know where rank 0 writes
    device = world.device
    seed_everything(cfg.trainer.seed)
    precision = setup_precision(cfg.precision.name, device)

    data: InMemoryData = build(cfg.dataset)
    info = data.setup(device)
    data.memory_format = performance.memory_format(cfg.trainer.channels_last)
    data.shard(world.rank, world.size)
    model = build(
        cfg.model,
        in_channels=info.channels,
        num_classes=info.num_classes,
        image_size=(info.height, info.width),
    ).to(device)
    parameters = sum(p.numel() for p in model.parameters())
    performance.apply_memory_format(model, cfg.trainer)  # before DDP/FSDP takes the parameters
    model = world.wrap(model, precision)
    optimizer = performance.build_optimizer(cfg.optimizer, model, device, cfg.trainer.strategy)
    scaler = build_scaler(cfg.loss_scaling, precision, device)
    world.prepare_scaler(scaler)
    performance.configure_backends(device, cfg.trainer.cudnn_benchmark)
    forward = performance.compile_model(model, cfg.trainer)

    ran = {
        "device": str(device),
        "device_name": device_name(device),
        "torch_version": torch.__version__,
        "mpexp_version": __version__,
        **precision.record(),
        **scaler.describe(),
        **performance.describe(optimizer, cfg.trainer),
        **world.record(),
        "parameters": parameters,
        "steps_per_epoch": data.steps_per_epoch(),
    }
    log.info(
        "Training %s on %s (%d samples) | %s on %s | precision %s (autocast %s, TF32 %s) | "
        "loss scaling %s",
        cfg.model.name,
        cfg.dataset.name,
        data.train_size,
        f"{ran['parameters']:,} parameters",
        ran["device_name"],
        precision.mode,
        ran["autocast_dtype"],
        "on" if ran["tf32_matmul"] else "off",
        ran["loss_scaling"],
    )
    config = {**OmegaConf.to_container(cfg, resolve=True), "ran": ran}
    tracker = Tracker(run, config, cfg.wandb) if world.is_main else NullTracker()
    try:
        summary = _fit(cfg, forward, data, optimizer, scaler, precision, device, tracker, world)
        summary["ran"] = {**ran, "final_scale": summary.pop("amp/final_scale")}
        summary["ran"].update(world.check_replicas(model))
        tracker.update_summary(summary)
    except BaseException:
        tracker.close("failed")
        raise
    tracker.close("finished")
    return summary


class StepLog:
    """Writes flushed step rows as metrics; keeps the running skip count and the epoch's losses."""

    def __init__(self, tracker: Tracker):
        self.tracker = tracker
        self.skipped = 0
        self.last_scale = float("nan")
        self.losses: list[float] = []

    def write(self, rows: list[StepRow]) -> None:
        for r in rows:
            self.skipped += r.skipped
            self.last_scale = r.scale
            self.losses.append(r.loss)
            self.tracker.log(
                {
                    "step": r.step,
                    "train/loss": r.loss,
                    "amp/scale": r.scale,
                    "amp/skipped_steps": self.skipped,
                    "lr": r.lr,
                }
            )


def _fit(cfg, model, data, optimizer, scaler, precision, device, tracker, world) -> dict:
    epochs, seed, log_every = cfg.trainer.epochs, cfg.trainer.seed, cfg.trainer.log_every
    # in a distributed run each flush averages the losses over ranks (one collective per flush)
    history = StepHistory(reduce_loss=world.mean if world.distributed else None)
    memory, steps = PeakMemory(device), StepLog(tracker)
    hide_bar = {"auto": None, True: False, False: True}[cfg.trainer.progress]
    hide_bar = hide_bar if world.is_main else True
    step = 0
    model.train()

    for epoch in range(1, epochs + 1):
        memory.reset()
        steps.losses = []
        bar = tqdm(total=data.steps_per_epoch(), desc=f"epoch {epoch}/{epochs}", disable=hide_bar)
        start = time.perf_counter()

        for images, labels in data.train_batches(epoch, seed, device):
            step += 1
            loss = train_step(model, images, labels, optimizer, scaler, precision)
            # between step() and update(): the scale this step used and whether it was skipped
            lr = optimizer.param_groups[0]["lr"]
            history.record(step, lr, loss, scaler.scale_tensor(), scaler.found_inf())
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            bar.update()
            if step % log_every == 0:
                steps.write(history.flush())
                if steps.losses:
                    seen = len(steps.losses) * data.batch_size
                    rate = seen / (time.perf_counter() - start)
                    bar.set_postfix(loss=f"{steps.losses[-1]:.4f}", samples_s=f"{rate:.0f}")

        synchronize(device)
        epoch_time = time.perf_counter() - start
        steps.write(history.flush(wait=True))
        bar.close()

        val_loss, val_acc = evaluate(model, data, device, precision)
        n_steps = len(steps.losses)
        row = {
            "epoch": epoch,
            "step": step,
            "train/epoch_loss": sum(steps.losses) / n_steps,
            "val/loss": val_loss,
            "val/acc": val_acc,
            "perf/epoch_time_s": epoch_time,
            "perf/samples_per_s": n_steps * data.batch_size / epoch_time,
            memory.key: memory.read_mib(),
        }
        row = world.reduce_epoch(row)
        tracker.log(row)
        log.info(
            "Epoch: %d, Loss: %.4f, Elapsed Time: %.2fsec, Val Loss: %.4f, Val Acc: %.2f%%, "
            "Peak Mem: %.0f MiB, Skipped Steps: %d",
            epoch,
            row["train/epoch_loss"],
            row["perf/epoch_time_s"],
            val_loss,
            100 * val_acc,
            row[memory.key],
            steps.skipped,
        )

    return {**row, "amp/skipped_steps": steps.skipped, "amp/final_scale": steps.last_scale}


def run_context(cfg: DictConfig) -> RunContext:
    """Name the run after its overrides; a multirun's jobs share a group named after the sweep."""
    hc = HydraConfig.get()
    group = cfg.wandb.group
    if group is None and hc.mode == RunMode.MULTIRUN:
        group = "sweep-" + "_".join(Path(hc.sweep.dir).parts[-2:])
    return RunContext(
        run_dir=Path(hc.runtime.output_dir),
        name=hc.job.override_dirname or "defaults",
        group=group,
        tags=list(cfg.wandb.tags),
    )


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
def main(cfg: DictConfig) -> float:
    try:
        return train(cfg, run_context(cfg))["val/acc"]
    except UserError as err:
        log.error("%s", err)  # also lands in the run's train.log
        if HydraConfig.get().mode == RunMode.RUN:
            raise SystemExit(2) from None
        raise  # in a sweep the other jobs still run; Hydra reports this one at the end


if __name__ == "__main__":
    sys.argv += hydra_overrides_for_rank(sys.argv[1:])  # under torchrun only rank 0 writes
    main()
