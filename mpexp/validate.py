"""Checks of config values that Hydra cannot check, run before any work starts."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig

from mpexp.distributed import STRATEGIES
from mpexp.errors import ConfigError

DEVICES = ("auto", "cuda", "cpu")
WANDB_MODES = ("auto", "online", "offline", "disabled")
LOADERS = ("device", "dataloader")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")


def _number(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{key}={value!r} is not a number; set it like `{key}=0.001`.")
    if not math.isfinite(value):
        raise ConfigError(f"{key}={value!r} must be finite.")
    return float(value)


def _integer(value: Any, key: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{key}={value!r} must be an integer >= {minimum}.")
    return value


def _choice(value: Any, key: str, options: tuple[str, ...]) -> str:
    if value not in options:
        raise ConfigError(f"{key}={value!r} is not valid; choose one of: {', '.join(options)}.")
    return value


def validate(cfg: DictConfig) -> None:
    """Raise ConfigError naming the first value that cannot work, and the fix."""
    trainer, data, opt, ls = cfg.trainer, cfg.dataset, cfg.optimizer, cfg.loss_scaling

    _integer(trainer.epochs, "trainer.epochs", 1)
    _integer(trainer.log_every, "trainer.log_every", 1)
    _integer(trainer.seed, "trainer.seed", 0)
    _choice(trainer.device, "trainer.device", DEVICES)
    _choice(trainer.strategy, "trainer.strategy", STRATEGIES)
    _choice(cfg.wandb.mode, "wandb.mode", WANDB_MODES)
    _choice(trainer.compile_mode, "trainer.compile_mode", COMPILE_MODES)
    _integer(trainer.keep_checkpoints, "trainer.keep_checkpoints", 1)
    if trainer.checkpoint_every_steps is not None:
        _integer(trainer.checkpoint_every_steps, "trainer.checkpoint_every_steps", 1)
    if not isinstance(trainer.deterministic, bool):
        raise ConfigError(f"trainer.deterministic={trainer.deterministic!r} must be true or false.")
    if _number(cfg.wandb.init_timeout, "wandb.init_timeout") <= 0:
        raise ConfigError(f"wandb.init_timeout={cfg.wandb.init_timeout} must be positive seconds.")

    _integer(data.batch_size, "dataset.batch_size", 1)
    _choice(data.get("loader", "device"), "dataset.loader", LOADERS)
    for key in ("train_size", "val_size"):
        if key in data:
            _integer(data[key], f"dataset.{key}", 1)

    if _number(opt.lr, "optimizer.lr") <= 0:
        raise ConfigError(f"optimizer.lr={opt.lr} must be positive, e.g. optimizer.lr=1e-4.")
    if _number(opt.get("weight_decay", 0.0), "optimizer.weight_decay") < 0:
        raise ConfigError(f"optimizer.weight_decay={opt.weight_decay} must be >= 0.")

    _validate_scaling(ls)


def _validate_scaling(ls: Mapping[str, Any]) -> None:
    name = ls["name"]
    if name == "static" and _number(ls["scale"], "loss_scaling.scale") <= 0:
        raise ConfigError(
            f"loss_scaling.scale={ls['scale']} must be positive; powers of two such as 1024 "
            "scale without rounding error."
        )
    if name in ("dynamic", "auto"):
        if _number(ls["init_scale"], "loss_scaling.init_scale") <= 0:
            raise ConfigError(f"loss_scaling.init_scale={ls['init_scale']} must be positive.")
        if _number(ls["growth_factor"], "loss_scaling.growth_factor") <= 1:
            raise ConfigError(
                f"loss_scaling.growth_factor={ls['growth_factor']} must be > 1 "
                "(the scale grows after clean steps), e.g. 2.0."
            )
        backoff = _number(ls["backoff_factor"], "loss_scaling.backoff_factor")
        if not 0 < backoff < 1:
            raise ConfigError(
                f"loss_scaling.backoff_factor={backoff} must lie in (0, 1) "
                "(the scale shrinks on overflow), e.g. 0.5."
            )
        _integer(ls["growth_interval"], "loss_scaling.growth_interval", 1)
