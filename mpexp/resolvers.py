"""What conf/ asks mpexp to resolve as a config is composed, for every command that composes a
run's (mpexp-train, mpexp-plan, mpexp-cache), and what overrides need before Hydra parses them:
the `~` written out, a run directory given to trainer.resume quoted.

`hydra.run.dir` in conf/train.yaml goes through the `mpexp.run_dir` resolver, so
`trainer.resume=<run dir>` continues in that directory: one metrics.jsonl, one train.log.
"""

from __future__ import annotations

import os
from pathlib import Path

from omegaconf import OmegaConf

from mpexp import job_names
from mpexp.errors import ConfigError
from mpexp.rundir import AUTO, hydra_quoted, run_dir_of


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


def result_direction(dataset_target: str) -> str:
    """Optuna's direction for a dataset's runs: "maximize" a classifier's val/acc, "minimize" a
    language model's val/loss (the result metric of the task the dataset serves)."""
    from hydra.utils import get_class  # the dataset's module imports torch: only when asked

    task_type = getattr(get_class(dataset_target), "task_type", None)
    if task_type is None:
        raise ConfigError(
            f"{dataset_target} does not say which task its batches serve, so the direction of "
            "its result is unknown: give the class a task_type (e.g. "
            "mpexp.tasks.classification.Classification), or set hydra.sweeper.direction."
        )
    return task_type.result.direction


def sweep_precisions() -> str:
    """The precisions worth comparing on this machine: fp32, tf32, fp16 and bf16, and fp8 where a
    GPU with fp8 tensor cores (compute capability 8.9 or newer) and torchao are there."""
    modes = "fp32,tf32,fp16,bf16"
    import importlib.util

    import torch

    from mpexp.precision.fp8_support import FP8_CAPABILITY

    hopper = torch.cuda.is_available() and torch.cuda.get_device_capability() >= FP8_CAPABILITY
    return modes + ",fp8" if hopper and importlib.util.find_spec("torchao") else modes


def ema_decay(decay: float, batch: int, every: int, epochs: int) -> float:
    """The decay per update of the weights' average as torchvision's reference train.py derives
    it from its `model_ema_decay` (`decay`): the share (1 - decay) scaled by the images between
    two updates (the optimizer step's `batch` over all processes, `every` steps) over the run's
    `epochs`, at most 1. A recipe that gives the formula, not its value, stays right when the
    epochs or the batch change (conf/experiment/imagenet_resnet50.yaml)."""
    if epochs is None:  # a run of trainer.max_steps: its length in epochs is the data's to say
        raise ValueError(
            "it follows trainer.epochs (the images between two updates of the average over the "
            "run's epochs, as torchvision's train.py scales its model_ema_decay), and "
            "trainer.epochs=null. Give trainer.epochs, or trainer.ema_decay=<a value> "
            f"({ema_decay(decay, batch, every, 600):.7f} is this batch's over 600 epochs), or "
            "trainer.ema_decay=null for no average."
        )
    return 1.0 - min(1.0, (1.0 - decay) * batch * every / epochs)


def expand_home(overrides: list[str]) -> list[str]:
    """`key=~/corpus.txt` with the home folder written out, as a shell does for a word that
    starts with `~` but not after `key=`.

    Hydra's override grammar refuses an unquoted `~` in a value (its lexer stops there, with a
    traceback-like message), so `dataset.path=~/corpus.txt` never reaches mpexp. A `~` at the
    start of a value, or of an item of a sweep's comma list, is rewritten; a quoted value and a
    `~key` (Hydra's delete) are left as they are."""

    def expanded(item: str) -> str:
        return os.path.expanduser(item) if item == "~" or item.startswith("~/") else item

    out = []
    for arg in overrides:
        key, sep, value = arg.partition("=")
        if sep and "~" in value and not key.startswith("-"):
            arg = key + sep + ",".join(expanded(item) for item in value.split(","))
        out.append(arg)
    return out


def job_folder(num: int) -> str:
    """A sweep job's folder in the sweep's, named by its swept overrides (mpexp/job_names.py)."""
    from hydra.core.hydra_config import HydraConfig  # set by Hydra as it resolves the job's dir

    return job_names.job_folder(num, HydraConfig.get())


def quote_run_dirs(overrides: list[str]) -> list[str]:
    """`trainer.resume=<run dir>` with the path quoted as Hydra's grammar needs where its name
    holds `=` or `,` (a sweep job's folder, `0_precision=fp32,trainer.seed=0`); a path that
    does not exist (a sweep over several, `auto`) is left as it is."""
    out = []
    for arg in overrides:
        key, sep, value = arg.partition("=")
        quoted = value[:1] in ("'", '"')
        if sep and key.lstrip("+") == "trainer.resume" and not quoted and Path(value).exists():
            arg = f"{key}={hydra_quoted(value)}"
        out.append(arg)
    return out


def register_resolvers() -> None:
    OmegaConf.register_new_resolver("mpexp.run_dir", resumed_run_dir, replace=True)
    OmegaConf.register_new_resolver("mpexp.job_dir", job_folder, replace=True)
    OmegaConf.register_new_resolver("mpexp.result_direction", result_direction, replace=True)
    OmegaConf.register_new_resolver("mpexp.sweep_precisions", sweep_precisions, replace=True)
    OmegaConf.register_new_resolver("mpexp.ema_decay", ema_decay, replace=True)
