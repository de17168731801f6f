"""The whole training step captured once and replayed (mpexp/step/step_graph.py) trains exactly as
the eager step does: the same losses, loss scales, skipped steps and floor flags, step by step, and
the same weights, buffers and optimizer state at the end.

On a CPU the capture is emulated by tests/replay.py, which replays the recorded operators on the
same tensors without the Python around them, as a CUDA graph does; tests/test_gpu.py holds the
same comparison for real CUDA graphs.
"""

from __future__ import annotations

import json
import logging
import math
import random

import pytest
import torch
from torch import nn

import mpexp
from mpexp.build import build
from mpexp.data.synthetic import SyntheticData
from mpexp.errors import LogError
from mpexp.models.simplecnn import SimpleCNN
from mpexp.precision.modes import setup_precision
from mpexp.precision.scaling import build_scaler
from mpexp.run.runner import train
from mpexp.step import performance
from mpexp.step.diagnostics import Diagnostics
from mpexp.step.history import StepHistory
from mpexp.step.step_graph import WARMUP_STEPS
from mpexp.step.stepper import Stepper
from mpexp.tasks.classification import Classification
from mpexp.tasks.language_model import LanguageModelling
from mpexp.tracking.run_context import RunContext
from tests.conftest import CPU, TINY, make_cfg
from tests.replay import RecordedGraph

STEPS = 14


def small_net() -> nn.Module:
    """Convolution, BatchNorm (whose statistics a skipped step must put back) and a Linear."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 10)
    )


def batches(poison: int | None = None, device: torch.device = CPU):
    data = SyntheticData(
        train_size=16 * STEPS, val_size=16, height=8, width=8, batch_size=16, noise=0.5
    )
    data.setup(device)
    for i, (images, labels) in enumerate(data.train_batches(1, 0, device, static=True)):
        if i + 1 == poison:  # a NaN in step `poison`'s batch: a non-finite loss
            images[0, 0, 0, 0] = float("nan")
        yield images, labels


def run_steps(
    overrides: list[str],
    graphed: bool,
    poison: int | None = None,
    device: torch.device = CPU,
    net: nn.Module | None = None,
):
    """STEPS steps of `net` (small_net by default), eager or captured and replayed (on a CPU:
    emulated), with the history flushed every 4; the rows, the weights, the optimizer's state
    and the Stepper."""
    cfg = make_cfg("optimizer.fused=true", "optimizer.lr=1e-2", *overrides)
    net = (small_net() if net is None else net).to(device)
    precision = setup_precision(cfg.precision, device)
    skip = cfg.trainer.on_nonfinite_loss == "skip"
    scaler = build_scaler(cfg.loss_scaling, precision, device, skip_nonfinite_loss=skip)
    speed = performance.Speed(False, "default", False, graphed, True)
    optimizer = performance.build_optimizer(cfg, net, device, scaler, speed)
    history = StepHistory(capacity=4, device=device)
    diagnostics = Diagnostics(cfg.diagnostics, net, scaler, None, precision)
    make = Stepper.with_graph if graphed else Stepper
    extra = {"new_graph": RecordedGraph} if graphed and device.type == "cpu" else {}
    args = (net, optimizer, scaler, precision, history, diagnostics)
    stepper = make(*args, cfg.trainer.accumulate, cfg.trainer.clip_grad_norm, **extra)
    rows = []
    for step, (images, labels) in enumerate(batches(poison, device), start=1):
        stepper.step(step, images, labels)
        if step % 4 == 0:
            rows += history.flush(wait=True)
    rows += history.flush(wait=True)
    return rows, net.state_dict(), optimizer.state_dict(), stepper


CASES = [
        ["precision=fp32"],
        ["precision=bf16"],
        # from 2^40 the first steps overflow: skipped, BatchNorm put back, the scale backs off
        ["precision=fp16", "loss_scaling.init_scale=1099511627776",
         "loss_scaling.growth_interval=3"],
        ["precision=fp16", "loss_scaling=static", "loss_scaling.scale=1099511627776"],
        ["precision=fp16", "loss_scaling=hysteresis", "loss_scaling.init_scale=1099511627776"],
        ["precision=fp16", "loss_scaling=calibrated", "loss_scaling.calibration_steps=5"],
        ["precision=fp16", "trainer.accumulate=2", "trainer.clip_grad_norm=0.5"],
        # at the floor: every overflow there is flagged in the step's row
        ["precision=fp16", "loss_scaling.init_scale=1099511627776", "loss_scaling.min_scale=1e12",
         "loss_scaling.on_min_scale=continue"],
]  # fmt: skip
CASE_IDS = ["fp32", "bf16", "dynamic", "static", "hysteresis", "calibrated", "accumulate-clip",
            "floor"]  # fmt: skip


def assert_replayed_as_eager(overrides: list[str], device: torch.device = CPU) -> None:
    eager_rows, eager_weights, eager_opt, _ = run_steps(overrides, False, device=device)
    rows, weights, opt, stepper = run_steps(overrides, True, device=device)
    assert stepper.graph.captured and stepper.graph.replays > 0
    assert rows == eager_rows  # every step's loss, scale, skip flag and floor flag
    for name, value in eager_weights.items():
        assert torch.equal(weights[name], value), name
    for key, state in eager_opt["state"].items():
        for name, value in state.items():
            assert torch.equal(opt["state"][key][name], value), name
    if "init_scale=1099511627776" in str(overrides):
        assert any(r.skipped for r in rows) and rows[-1].scale < rows[0].scale


@pytest.mark.parametrize("overrides", CASES, ids=CASE_IDS)
def test_a_replayed_step_trains_exactly_as_the_eager_step(overrides):
    assert_replayed_as_eager(overrides)


def test_only_steps_after_the_warm_up_are_replayed():
    rows, _, _, stepper = run_steps(["precision=fp32"], graphed=True)
    assert stepper.graph.replays == STEPS - WARMUP_STEPS
    assert [r.step for r in rows] == list(range(1, STEPS + 1))


def test_a_calibrating_scaler_is_captured_once_it_has_fixed_its_scale():
    *_, stepper = run_steps(
        ["precision=fp16", "loss_scaling=calibrated", "loss_scaling.calibration_steps=8"], True
    )
    assert stepper.graph.replays == STEPS - 8  # its eager steps were the warm-up too


def test_a_skipped_nonfinite_loss_is_replayed_as_the_eager_step_skips_it():
    overrides = ["precision=fp32", "trainer.on_nonfinite_loss=skip"]
    eager_rows, eager_weights, *_ = run_steps(overrides, graphed=False, poison=9)
    rows, weights, *_ = run_steps(overrides, graphed=True, poison=9)
    assert [r.skipped for r in rows] == [r.skipped for r in eager_rows]
    assert rows[8].skipped and math.isnan(rows[8].loss)  # step 9: NaN, skipped
    for name, value in eager_weights.items():
        assert torch.equal(weights[name], value), name


class ReadsOnTheHost(nn.Module):
    """A model whose forward pass reads a value on the host: it cannot be captured."""

    def __init__(self):
        super().__init__()
        self.net = small_net()

    def forward(self, x):
        if float(x.abs().sum()) < 0:  # never true, but a host read all the same
            x = -x
        return self.net(x)


def test_a_step_that_cannot_be_captured_runs_eagerly_with_one_warning(caplog):
    cfg = make_cfg("optimizer.fused=true", "precision=fp32")
    torch.manual_seed(0)
    net = ReadsOnTheHost()
    precision = setup_precision(cfg.precision, CPU)
    scaler = build_scaler(cfg.loss_scaling, precision, CPU)
    optimizer = performance.build_optimizer(cfg, net, CPU, scaler)
    history = StepHistory(capacity=4)
    diagnostics = Diagnostics(cfg.diagnostics, net, scaler, None, precision)
    stepper = Stepper.with_graph(
        net, optimizer, scaler, precision, history, diagnostics, new_graph=RecordedGraph
    )
    with caplog.at_level(logging.WARNING, logger="mpexp"):
        for step, (images, labels) in enumerate(batches(), start=1):
            stepper.step(step, images, labels)
    rows = history.flush(wait=True)
    warned = [r for r in caplog.records if "could not be captured" in r.getMessage()]
    assert len(warned) == 1 and "host" in warned[0].getMessage()
    assert stepper.graph.failed and stepper.describe()["cuda_graph"] is False
    assert stepper.describe()["cuda_graph_off"].startswith("the capture failed: ")
    assert [r.step for r in rows] == list(range(1, STEPS + 1))
    eager = small_net()
    assert not torch.equal(eager[0].weight, net.net[0].weight)  # it trained all the same


def _graph_run(monkeypatch, tmp_path, name: str, graphed: bool, *overrides: str):
    if graphed:  # a CUDA graph on a CPU: the emulated one, through the run's own path
        plan = performance.plan_speed
        monkeypatch.setattr(
            performance,
            "plan_speed",
            lambda cfg, device: performance.replace(plan(cfg, device), cuda_graph=True),
        )
        monkeypatch.setattr("mpexp.step.stepper.CudaGraph", RecordedGraph)
    cfg = make_cfg(*TINY, "optimizer.fused=true", *overrides)
    summary = train(cfg, RunContext(tmp_path / name))
    monkeypatch.undo()
    lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    return summary, [r for r in rows if "train/loss" in r], [r for r in rows if "val/acc" in r]


def test_a_whole_run_with_its_step_replayed_logs_what_the_eager_run_logs(monkeypatch, tmp_path):
    """Through train(): warm-up, capture, replays, gradient statistics steps run eagerly in
    between, flushes and the epoch's end; fp16 from a loss scale that overflows first (on 8x8
    images: fp16 convolutions are slow on a CPU)."""
    overrides = ("precision=fp16", "loss_scaling.init_scale=16777216", "dataset.height=8",
                 "dataset.width=8", "dataset.train_size=512", "dataset.batch_size=32",
                 "diagnostics.grad_stats_every=5")  # fmt: skip
    eager, eager_steps, eager_epochs = _graph_run(monkeypatch, tmp_path, "eager", False, *overrides)
    graphed, steps, epochs = _graph_run(monkeypatch, tmp_path, "graph", True, *overrides)
    assert graphed["ran"]["cuda_graph"] is True and graphed["ran"]["graph_replays"] > 20
    assert eager["ran"]["cuda_graph"] is False
    keys = ("step", "train/loss", "amp/scale", "amp/skipped_steps")
    assert [[r[k] for k in keys] for r in steps] == [[r[k] for k in keys] for r in eager_steps]
    assert any(r["amp/skipped_steps"] for r in steps)
    assert [(r["val/loss"], r["val/acc"]) for r in epochs] == [
        (r["val/loss"], r["val/acc"]) for r in eager_epochs
    ]
    # the warm-up and the capture are set-up time, out of the first epoch's time
    assert graphed["perf/compile_s"] > 0 and "perf/compile_s" in epochs[0]
    assert "perf/compile_s" not in epochs[1] and "perf/compile_s" not in eager


class FailsToCompile(nn.Module):
    """What torch.compile gives for a model its backend cannot compile: the first call raises."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self._orig_mod = model  # where torch.compile's wrapper keeps the module it compiles

    def forward(self, inputs, targets):
        raise RuntimeError("backend='inductor' raised: CompilationError: no kernel for this op")


def test_a_model_that_cannot_be_compiled_trains_eagerly_with_one_warning(
    monkeypatch, tmp_path, caplog
):
    monkeypatch.setattr(performance.torch, "compile", lambda model, **_: FailsToCompile(model))
    cfg = make_cfg(*TINY, "trainer.compile=true", "trainer.epochs=1")
    with caplog.at_level(logging.WARNING, logger="mpexp"):
        summary = train(cfg, RunContext(tmp_path / "run"))
    warned = [r.getMessage() for r in caplog.records if "could not compile" in r.getMessage()]
    assert len(warned) == 1 and "CompilationError" in warned[0]
    assert summary["ran"]["compile"] is False
    assert summary["val/loss"] < 2.3  # it trained (and evaluated) the eager model


class LogsUnderMpexpsName(nn.Module):
    """A compiled model whose forward makes a mistake of the user's: mpexp.log under train/."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, inputs, targets):
        mpexp.log({"train/absmax": inputs.abs().max()})
        return self.model(inputs, targets)


def test_a_users_mistake_in_the_first_compiled_step_is_not_taken_for_a_compiler_failure(
    monkeypatch, tmp_path, caplog
):
    """The first step's errors but the user's mean the model cannot be compiled, and it trains
    eagerly; the user's own (mpexp.log refusing a key) stops the run, with its one message."""
    monkeypatch.setattr(performance.torch, "compile", lambda model, **_: LogsUnderMpexpsName(model))
    cfg = make_cfg(*TINY, "trainer.compile=true", "trainer.epochs=1")
    with caplog.at_level(logging.WARNING, logger="mpexp"), pytest.raises(LogError, match="train/"):
        train(cfg, RunContext(tmp_path / "run"))
    assert "could not compile" not in caplog.text


CUDA = torch.device("cuda")  # planned for, never touched: plan_speed and for_model only read it


class PythonRandomDepth(nn.Module):
    """A user's model with stochastic depth drawn from Python's `random`: each training step
    keeps its residual block or not, a choice made on the host, which a replayed graph never
    makes again."""

    def __init__(self, in_channels=1, num_classes=10, image_size=(28, 28), width=4):
        super().__init__()
        self.stem = nn.Conv2d(in_channels, width, 3, padding=1)
        self.block = nn.Conv2d(width, width, 3, padding=1)
        self.fc = nn.Linear(width * image_size[0] * image_size[1], num_classes)

    def forward(self, x):
        x = torch.relu(self.stem(x))
        if not self.training or random.random() < 0.5:
            x = x + torch.relu(self.block(x))
        return self.fc(x.flatten(1))


class CountingCNN(SimpleCNN):
    """A subclass of a capturable model that adds host-side state (a step counter) of its own:
    its parent's declaration is not its own."""

    calls = 0

    def forward(self, x):
        self.calls += 1
        return super().forward(x) * (1.0 if self.calls % 2 else 0.5)


@pytest.mark.parametrize(
    "name", ["deepcnn", "simplecnn", "resnet18_cifar", "resnet18", "vit", "gpt"]
)
def test_mpexps_own_models_are_captured_by_default_on_cuda(name):
    cfg = make_cfg(f"model={name}")
    if name == "gpt":
        task = LanguageModelling(vocab_size=256, block_size=cfg.model.block_size)
    else:
        task = Classification(channels=3, height=32, width=32, num_classes=10)
    model = build(cfg.model, **task.model_kwargs())
    speed = performance.for_model(performance.plan_speed(cfg, CUDA), cfg, model, task)
    assert speed.cuda_graph and speed.graph_off is None
    assert performance.describe_step(speed) == "step compiled, captured as one CUDA graph"


@pytest.mark.parametrize("model", [PythonRandomDepth, CountingCNN])
def test_a_model_that_does_not_declare_itself_capturable_runs_compiled_without_the_graph(
    model, caplog
):
    """On CUDA by default: compiled, uncaptured, said once with the way to opt in, and the
    optimizer's choice left to the config again (a graph would have fused it)."""
    cfg = make_cfg()
    mnist = Classification(channels=1, height=28, width=28, num_classes=10)
    with caplog.at_level(logging.INFO, logger="mpexp"):
        speed = performance.for_model(performance.plan_speed(cfg, CUDA), cfg, model(), mnist)
    name = model.__qualname__
    assert (speed.compile, speed.cuda_graph, speed.fused) == (True, False, None)
    assert speed.graph_off == f"{name} does not declare itself capturable"
    said = [r.getMessage() for r in caplog.records if "not captured" in r.getMessage()]
    assert len(said) == 1 and name in said[0]
    assert "`capturable = True`" in said[0] and "trainer.cuda_graph=true" in said[0]
    assert performance.describe_step(speed) == (
        f"step compiled, no CUDA graph ({name} does not declare itself capturable)"
    )
    forced_cfg = make_cfg("trainer.cuda_graph=true")
    with caplog.at_level(logging.WARNING, logger="mpexp"):
        caplog.clear()
        forced = performance.for_model(
            performance.plan_speed(forced_cfg, CUDA), forced_cfg, model(), mnist
        )
    assert forced.cuda_graph and forced.fused
    assert "frozen" in caplog.text and name in caplog.text


def _mocked_cuda_run(monkeypatch, tmp_path, name: str, *overrides: str):
    """A run planned as on CUDA (its CUDA graph emulated, tests/replay.py), of PythonRandomDepth;
    its summary, per-step losses and log."""
    plan = performance.plan_speed
    monkeypatch.setattr(performance, "plan_speed", lambda cfg, device: plan(cfg, CUDA))
    monkeypatch.setattr("mpexp.step.stepper.CudaGraph", RecordedGraph)
    cfg = make_cfg(*TINY, "model._target_=tests.test_step_graph.PythonRandomDepth",
                   "dataset.train_size=512", "trainer.epochs=1", "trainer.compile=false",
                   "trainer.channels_last=false", "optimizer.fused=true", *overrides)  # fmt: skip
    summary = train(cfg, RunContext(tmp_path / name))
    monkeypatch.undo()
    rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").open()]
    return summary, [r["train/loss"] for r in rows if "train/loss" in r]


def test_by_default_a_user_models_python_state_is_never_frozen_by_a_capture(
    monkeypatch, tmp_path, caplog
):
    """The default run of a model that draws from Python's random in its forward trains as its
    eager run does, and says why its step is not captured; captured on demand, its draws are
    frozen in every replay and it trains differently (what the default spares it)."""
    _, eager_losses = _mocked_cuda_run(monkeypatch, tmp_path, "eager", "trainer.cuda_graph=false")
    with caplog.at_level(logging.INFO, logger="mpexp"):
        default, losses = _mocked_cuda_run(monkeypatch, tmp_path, "default")
    reason = "PythonRandomDepth does not declare itself capturable"
    assert default["ran"]["cuda_graph"] is False and default["ran"]["cuda_graph_off"] == reason
    # the default run's line: the last so far (the eager run's may be among the records too,
    # wherever an earlier test left mpexp's logger at INFO)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Training")]
    assert said[-1].endswith(f"| step eager, no CUDA graph ({reason})")
    assert losses == eager_losses
    forced, forced_losses = _mocked_cuda_run(
        monkeypatch, tmp_path, "forced", "trainer.cuda_graph=true"
    )
    assert forced["ran"]["cuda_graph"] is True and forced["ran"]["graph_replays"] > 0
    assert forced_losses[:WARMUP_STEPS] == eager_losses[:WARMUP_STEPS]
    assert forced_losses != eager_losses


def test_a_schedule_under_loss_scaling_is_replayed_with_the_eager_runs_rates(monkeypatch, tmp_path):
    """fp16 with dynamic loss scaling and a cosine schedule: the step is captured (the rate is
    computed on the device from the count of real steps), and every step's rate, loss, scale and
    skip is the eager run's, skipped steps holding the rate back."""
    overrides = ("precision=fp16", "loss_scaling.init_scale=16777216", "dataset.height=8",
                 "dataset.width=8", "dataset.train_size=384", "dataset.batch_size=32",
                 "scheduler=cosine", "scheduler.warmup_steps=4")  # fmt: skip
    _, eager_steps, _ = _graph_run(monkeypatch, tmp_path, "eager", False, *overrides)
    graphed, steps, _ = _graph_run(monkeypatch, tmp_path, "graph", True, *overrides)
    assert graphed["ran"]["cuda_graph"] is True and graphed["ran"]["graph_replays"] > 10
    assert graphed["ran"]["schedule"] == "device"
    assert graphed["ran"]["step_path"].endswith("captured, schedule on the device")
    keys = ("step", "lr", "train/loss", "amp/scale", "amp/skipped_steps")
    assert [[r[k] for k in keys] for r in steps] == [[r[k] for k in keys] for r in eager_steps]
    skipped = [r["step"] for r, before in zip(steps[1:], steps, strict=False)
               if r["amp/skipped_steps"] > before["amp/skipped_steps"]]  # fmt: skip
    assert skipped  # the high initial scale overflows first
    for step in skipped:  # a skipped step does not advance the schedule
        assert steps[step]["lr"] == steps[step - 1]["lr"]
