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


def configure_backends(device: torch.device, cudnn_benchmark: bool) -> None:
    """cuDNN autotuning: every batch has the same shape (drop_last), so tuning once pays off."""
    torch.backends.cudnn.benchmark = cudnn_benchmark and device.type == "cuda"


def build_optimizer(cfg: DictConfig, model: nn.Module, device: torch.device):
    """The optimizer of a config group, with fused kernels on CUDA unless `fused` says otherwise.

    Fused Adam/AdamW/SGD take GradScaler's unscale and inf check into the update kernel, so an fp16
    step needs no host read of the overflow flag; the unfused path has GradScaler call `.item()`.
    """
    fused = cfg.get("fused")
    if fused is None:
        fused = device.type == "cuda"
    return instantiate(cfg, fused=bool(fused))(model.parameters())


def memory_format(channels_last: bool) -> torch.memory_format:
    return torch.channels_last if channels_last else torch.contiguous_format


def prepare_model(model: nn.Module, trainer: DictConfig) -> nn.Module:
    """Apply memory format and compilation; return the module the loop should call.

    The returned module may be a compiled wrapper: keep using `model` itself for its weights
    (state_dict, parameter names), which compilation would prefix.
    """
    if trainer.channels_last:
        model.to(memory_format=torch.channels_last)
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
