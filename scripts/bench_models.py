"""A library's model (model=timm) trained by mpexp's step and by a plain PyTorch loop, side by
side in one process: what mpexp's step costs on a model it did not write.

Both steps train copies of one model, built as a run builds it (`model=timm`: timm.create_model
for the data), on the same batches, with the same optimizer (AdamW), in the same precision:

  mpexp  the loop's Stepper: the model and its task's loss as one Objective, the precision's
         autocast, the loss scaler the precision takes by default (loss_scaling=auto: dynamic
         under fp16), the step history on the device;
  plain  forward and F.cross_entropy under the same autocast, a GradScaler under fp16,
         backward, AdamW's step, zero_grad.

Each round times `--steps` steps of one, then of the other (the order alternating), after
`--warmup` untimed steps of each; mpexp / plain is the median of the rounds' ratios of their
samples per second. A case is a model option and the task its batches serve (CASES); another
library's model is another case.

    python scripts/bench_models.py                                   # timm's convnext_atto, CPU
    python scripts/bench_models.py --case timm --name vit_tiny_patch16_224 --image-size 64
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mpexp import config
from mpexp.build import build
from mpexp.precision.modes import setup_precision
from mpexp.precision.scaling import build_scaler
from mpexp.step.diagnostics import Diagnostics
from mpexp.step.history import StepHistory
from mpexp.step.objective import Objective
from mpexp.step.stepper import Stepper
from mpexp.tasks.base import Task
from mpexp.tasks.classification import Classification
from mpexp.tracking.null_tracker import NullTracker

CPU = torch.device("cpu")


@dataclass(frozen=True)
class Case:
    """A model option as both loops train it: the overrides that build it (the name added by
    --name), and the task whose batches it takes."""

    overrides: tuple[str, ...]
    name_key: str  # the override --name sets
    default_name: str

    def task(self, args) -> Task:
        return Classification(3, args.image_size, args.image_size, args.classes)


CASES = {"timm": Case(("model=timm",), "model.name", "convnext_atto")}


def composed(overrides: list[str]):
    config.register()
    with initialize_config_dir(config_dir=str(config.config_dir()), version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


def mpexp_step(cfg, model, task, lr: float):
    precision = setup_precision(cfg.precision, CPU)
    scaler = build_scaler(cfg.loss_scaling, precision, CPU)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    diagnostics = Diagnostics(cfg.diagnostics, model, scaler, NullTracker("."))
    history = StepHistory(capacity=1024, device=CPU)
    stepper = Stepper(
        Objective(model, task), optimizer, scaler, precision, history, diagnostics, loss_fn=None
    )
    count = 0

    def step(x, y, last: bool):
        nonlocal count
        count += 1
        stepper.step(count, x, y)
        if last:
            history.flush(wait=True)  # once a round, as the loop reads it once per log_every

    return step


def plain_step(cfg, model, lr: float):
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    precision = setup_precision(cfg.precision, CPU)
    dtype = precision.autocast_dtype
    scaler = torch.amp.GradScaler("cpu", enabled=dtype is torch.float16)

    def step(x, y, last: bool):
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", choices=sorted(CASES), default="timm")
    parser.add_argument("--name", default=None, help="the model's name (timm: model.name)")
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="torch's intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)  # one: a shared machine's second core comes and goes
    case = CASES[args.case]
    name = args.name or case.default_name
    task = case.task(args)
    torch.manual_seed(0)
    inputs, _ = task.example(args.batch_size, CPU)
    batches = [
        (torch.randn_like(inputs), torch.randint(args.classes, (args.batch_size,)))
        for _ in range(args.steps)
    ]
    print(f"{args.case} {name}, batch {args.batch_size}, {task.describe_inputs()}, CPU")
    for mode in args.precisions.split(","):
        cfg = composed([*case.overrides, f"{case.name_key}={name}", f"precision={mode}"])
        torch.manual_seed(0)
        base = build(cfg.model, **task.model_kwargs())
        steps = {
            "mpexp": mpexp_step(cfg, copy.deepcopy(base), task, cfg.optimizer.lr),
            "plain": plain_step(cfg, copy.deepcopy(base), cfg.optimizer.lr),
        }
        for step in steps.values():
            for i, (x, y) in enumerate(batches[: args.warmup]):
                step(x, y, i == args.warmup - 1)
        rates = {label: [] for label in steps}
        for round_ in range(args.rounds):
            order = list(steps) if round_ % 2 == 0 else list(reversed(steps))
            for label in order:
                began = time.perf_counter()
                for i, (x, y) in enumerate(batches):
                    steps[label](x, y, i == len(batches) - 1)
                rates[label].append(args.steps * args.batch_size / (time.perf_counter() - began))
        ratios = [m / p for m, p in zip(rates["mpexp"], rates["plain"], strict=True)]
        print(
            f"{mode:5s} mpexp {statistics.median(rates['mpexp']):8,.1f} samples/s | plain "
            f"{statistics.median(rates['plain']):8,.1f} samples/s | mpexp/plain "
            f"{statistics.median(ratios):.3f} (rounds {min(ratios):.3f} to {max(ratios):.3f})",
            flush=True,
        )


if __name__ == "__main__":
    main()
