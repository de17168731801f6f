"""Speed switches that do not change the numerics: fused optimizers, memory format, compilation.

Each is decided once at setup. None of them is allowed to fall back silently: a switch that cannot
take effect here says so.
"""

from __future__ import annotations

import logging

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch import nn

log = logging.getLogger(__name__)


def configure_backends(device: torch.device, trainer: DictConfig) -> None:
    """cuDNN autotuning: every batch has the same shape (drop_last), so tuning once pays off.

    Not under `trainer.deterministic`: autotuning may pick different algorithms from run to run.
    """
    if trainer.cudnn_benchmark and trainer.deterministic and device.type == "cuda":
        log.warning("trainer.deterministic=true turns trainer.cudnn_benchmark off.")
    torch.backends.cudnn.benchmark = (
        trainer.cudnn_benchmark and device.type == "cuda" and not trainer.deterministic
    )


def build_optimizer(cfg: DictConfig, model: nn.Module, device: torch.device, scaler):
    """The `optimizer` group's optimizer, fused on CUDA unless `optimizer.fused` says otherwise.

    Fused Adam/AdamW/SGD skip an overflowing step inside the update kernel, so an fp16 step needs
    no host read of the overflow flag; on the unfused path GradScaler reads it every step. The
    automatic choice stays unfused where that read is needed: under FSDP (overflow flags of
    sharded gradients are combined across ranks first, see mpexp.distributed) and with a learning
    rate schedule under loss scaling (the schedule advances only on steps really taken).
    """
    fused = cfg.optimizer.get("fused")
    if fused is None:
        scheduled = cfg.scheduler.get("_target_") is not None and scaler.is_enabled()
        fused = device.type == "cuda" and cfg.trainer.strategy != "fsdp" and not scheduled
        if device.type == "cuda" and not fused:
            log.info("Unfused optimizer: GradScaler reads the overflow flag on the host per step.")
    return instantiate(cfg.optimizer, fused=bool(fused))(model.parameters())


def memory_format(channels_last: bool) -> torch.memory_format:
    return torch.channels_last if channels_last else torch.contiguous_format


def apply_memory_format(model: nn.Module, trainer: DictConfig) -> None:
    """NHWC weights when asked; done before DDP/FSDP wrap the parameters."""
    if trainer.channels_last:
        model.to(memory_format=torch.channels_last)


def compile_model(model: nn.Module, trainer: DictConfig) -> nn.Module:
    """The module the loop should call: `model` itself, or its compiled wrapper.

    Keep using `model` for its weights (state_dict, parameter names), which compilation prefixes.
    """
    if not trainer.compile:
        return model
    return torch.compile(model, mode=trainer.compile_mode)


def describe(optimizer, trainer: DictConfig) -> dict:
    """The speed settings that ran, for the run record."""
    return {
        "fused_optimizer": bool(optimizer.defaults.get("fused")),
        "channels_last": bool(trainer.channels_last),
        "compile": trainer.compile_mode if trainer.compile else False,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
    }
