"""The parts a run trains: built once (mpexp/build.py), handed to the loop by run/runner.py."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

import torch

from mpexp.data.base import TrainingData
from mpexp.precision.loss_scaler import LossScaler
from mpexp.precision.modes import Precision
from mpexp.step.flops import Throughput
from mpexp.step.performance import Speed
from mpexp.step.schedules import Schedule


@dataclass
class Parts:
    """What the loop trains: built once by mpexp.train, never re-decided here."""

    model: torch.nn.Module  # the module whose weights are saved (DDP/FSDP-wrapped if so)
    # what the loop calls: the model with its task's loss (mpexp/step/objective.py), or its
    # torch.compile wrapper, which compiles the two together
    forward: torch.nn.Module
    data: TrainingData  # set up: `data.task` says what its batches mean
    optimizer: torch.optim.Optimizer
    scaler: LossScaler
    precision: Precision
    # FLOPs per sample, counted once in the background from setup on, and the device's peak
    throughput: Future[Throughput]
    speed: Speed | None = None  # the speed switches decided at setup (None: all off)
    schedule: Schedule | None = None  # the learning-rate schedule (None: a constant rate)
