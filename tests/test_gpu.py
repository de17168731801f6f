"""The precision modes on a real CUDA device; skipped without one, run whenever a GPU is lent."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

import mpexp
from mpexp.errors import ConfigError
from mpexp.precision.fp8 import convert_to_fp8
from mpexp.precision.fp8_support import FP8_CAPABILITY
from mpexp.precision.modes import setup_precision
from mpexp.precision.scaling import DynamicLossScaler
from mpexp.run.runner import train
from mpexp.step.step_graph import WARMUP_STEPS
from mpexp.tasks.classification import Classification
from mpexp.tracking.run_context import RunContext
from mpexp.tracking.tracker import Tracker
from tests.conftest import TINY, TINY_VIT, VIT_FP8_LAYERS, make_cfg, precision_of
from tests.test_image_folder import SMALL, write_images
from tests.test_step_cost import Dispatched
from tests.test_step_graph import (
    CASE_IDS,
    CASES,
    STEPS,
    assert_replayed_as_eager,
    batches,
    run_steps,
    small_net,
)
from tests.test_tokens import bin_pair, tokens_args
from tests.test_training import read_metrics

pytestmark = pytest.mark.gpu


def cuda() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


@pytest.mark.parametrize(
    ("mode", "dtype"), [("fp16", torch.float16), ("bf16", torch.bfloat16), ("tf32", torch.float32)]
)
def test_forward_dtype_on_cuda(mode, dtype):
    if mode == "bf16" and torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("bf16 needs Ampere or newer")
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.Flatten(), nn.Linear(4 * 26 * 26, 3)).cuda()
    with precision_of(mode, cuda()).autocast():
        assert model(torch.randn(2, 1, 28, 28, device="cuda")).dtype == dtype


@pytest.mark.parametrize("mode", ["fp32", "tf32", "fp16", "bf16"])
def test_training_on_cuda_records_what_ran(tmp_path, mode):
    if mode == "bf16" and torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("bf16 needs Ampere or newer")
    train(make_cfg(*TINY, f"precision={mode}", "trainer.device=cuda"), RunContext(tmp_path))
    saved = json.loads((tmp_path / "summary.json").read_text())
    ran = saved["ran"]
    assert ran["device"].startswith("cuda") and ran["device_name"] == torch.cuda.get_device_name()
    ampere = torch.cuda.get_device_capability() >= (8, 0)
    assert ran["effective_precision"] == (mode if mode != "tf32" or ampere else "fp32")
    assert ran["tf32_matmul"] is ran["tf32_cudnn"] is (mode == "tf32" and ampere)
    assert ran["loss_scaling"] == ("dynamic" if mode == "fp16" else "none")
    # CUDA's default: the step captured and replayed, not fallen back to eager
    assert ran["cuda_graph"] is True and ran["graph_replays"] > 0, ran.get("cuda_graph_off")
    assert saved["mem/peak_allocated_mib"] > 0
    assert saved["val/loss"] < 2.3  # below chance level for 10 classes: it learned


def test_tf32_matmul_differs_from_strict_fp32_on_ampere():
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("TF32 needs Ampere or newer")
    a, b = torch.randn(512, 512, device="cuda"), torch.randn(512, 512, device="cuda")
    exact = (a.double() @ b.double()).float()
    precision_of("fp32", cuda())
    strict = (a @ b - exact).abs().max().item()
    precision_of("tf32", cuda())
    tf32 = (a @ b - exact).abs().max().item()
    assert tf32 > 10 * strict  # TF32 keeps 10 mantissa bits: visibly coarser


@pytest.mark.parametrize("switch", ["trainer.channels_last=true", "trainer.compile=true"])
def test_channels_last_and_compile_paths_train_on_cuda(tmp_path, switch):
    train(make_cfg(*TINY, "precision=bf16", "trainer.device=cuda", switch), RunContext(tmp_path))
    saved = json.loads((tmp_path / "summary.json").read_text())
    key = switch.split("=")[0].split(".")[1]
    ran = saved["ran"]
    assert ran[key] and ran["fused_optimizer"]
    assert ran["cuda_graph"] is True and ran["graph_replays"] > 0, ran.get("cuda_graph_off")
    assert saved["val/loss"] < 2.3


@pytest.mark.parametrize("mode", ["fp16"])  # fp32 passed too on an H100; fp16 has more around
def test_cuda_graphs_train_as_eager_does(tmp_path, mode):
    """compile_mode=reduce-overhead replays CUDA graphs of the model's forward and backward, with
    the loss, the loss scaler, the BatchNorm rollback and the history's record running eagerly
    between replays: the run must record one distinct loss per step, close to an eager run's."""
    losses = {}
    for name, extra in {
        "eager": [],
        "graphs": ["trainer.compile=true", "trainer.compile_mode=reduce-overhead"],
    }.items():
        run_dir = tmp_path / name
        tiny = [o for o in TINY if not o.startswith("model")]  # DeepCNN: BatchNorm throughout
        cfg = make_cfg(*tiny, f"precision={mode}", "trainer.device=cuda", "trainer.epochs=1",
                       "trainer.log_every=1", "model=deepcnn", *extra)  # fmt: skip
        train(cfg, RunContext(run_dir))
        steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        losses[name] = [r["train/loss"] for r in steps if "epoch" not in r]
    assert len(losses["graphs"]) == len(losses["eager"]) == 16
    assert len(set(losses["graphs"])) == 16  # each step its own loss, none repeated
    # compiled kernels round differently: close early on, before the runs drift apart
    torch.testing.assert_close(losses["graphs"][:4], losses["eager"][:4], rtol=0.02, atol=0)


# fp16 with BatchNorm, the non-finite-loss guard and diagnostics: buffers saved and restored,
# gradient statistics and overflow attribution on every step
WITH_EVERYTHING = [
    "model._target_=tests.test_training_loop.BatchNormCNN",
    "trainer.on_nonfinite_loss=skip",
    "diagnostics.grad_stats_every=1",
    "diagnostics.overflow_attribution=true",
]


FP8_VIT = [o for o in TINY_VIT if o.startswith("model")] + ["diagnostics.grad_stats_every=1"]


@pytest.mark.parametrize(
    ("mode", "extra"),
    [("fp16", []), ("bf16", []), ("fp32", []), ("fp16", WITH_EVERYTHING), ("fp8", FP8_VIT)],
    ids=["fp16", "bf16", "fp32", "fp16-batchnorm-guard-diagnostics", "fp8-vit-diagnostics"],
)
def test_a_training_step_never_waits_on_the_gpu(tmp_path, mode, extra):
    """The loop's whole per-step work, run in CUDA's sync-debug mode set to error."""
    if mode == "fp8" and torch.cuda.get_device_capability() < FP8_CAPABILITY:
        pytest.skip("fp8 needs compute capability 8.9 or newer")
    from mpexp.build import build
    from mpexp.precision.scaling import build_scaler
    from mpexp.step.diagnostics import Diagnostics
    from mpexp.step.history import StepHistory
    from mpexp.step.performance import build_optimizer
    from mpexp.step.stepper import Stepper
    from mpexp.tracking.null_tracker import NullTracker

    device = cuda()
    cfg = make_cfg(*TINY, f"precision={mode}", "trainer.device=cuda", *extra)
    precision = setup_precision(cfg.precision, device)
    data = build(cfg.dataset)
    info = data.setup(device)
    model = build(cfg.model, in_channels=info.channels, num_classes=info.num_classes,
                  image_size=(info.height, info.width)).to(device)  # fmt: skip
    model, precision = convert_to_fp8(model, precision, [], compiled=False)
    skip = cfg.trainer.on_nonfinite_loss == "skip"
    scaler = build_scaler(cfg.loss_scaling, precision, device, skip_nonfinite_loss=skip)
    optimizer = build_optimizer(cfg, model, device, scaler)
    assert optimizer.defaults["fused"]  # the path that keeps GradScaler off the host
    diagnostics = Diagnostics(cfg.diagnostics, model, scaler, NullTracker(tmp_path), precision)
    stepper = Stepper(model, optimizer, scaler, precision, StepHistory(device=device), diagnostics)
    batches = list(data.train_batches(1, 0, device))
    for step, (images, labels) in enumerate(batches[:3], start=1):  # lazy state is made here
        stepper.step(step, images, labels)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step, (images, labels) in enumerate(batches[3:10], start=4):
            stepper.step(step, images, labels)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("pad", [False, True], ids=["eager", "padded"])
def test_evaluation_waits_on_the_gpu_once(pad):
    """Validation sums on the device and reads the result once: one synchronisation in all,
    none per batch (CUDA's sync-debug mode warns at each), its last batch padded (as for a
    compiled model) or not."""
    import warnings

    from mpexp.data.synthetic import SyntheticData
    from mpexp.step.validation import evaluate

    device = cuda()
    data = SyntheticData(train_size=8, val_size=100, batch_size=32, seed=0)
    data.setup(device)
    model = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 10)).to(device)
    evaluate(model, data, device, precision_of("fp32", device), pad)  # lazy initialisation first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            evaluate(model, data, device, precision_of("fp32", device), pad)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == 1


def test_fp8_on_cuda_trains_in_real_fp8_or_refuses_a_gpu_without_it(tmp_path):
    """On compute capability 8.9 or newer: torchao's fp8 matmuls, not emulated, and the ViT
    learns; below it: one error naming what fp8 needs, before any run file is written."""
    cfg = make_cfg(*TINY_VIT, "precision=fp8", "trainer.device=cuda", "trainer.compile=true")
    if torch.cuda.get_device_capability() < FP8_CAPABILITY:
        with pytest.raises(ConfigError, match="fp8 tensor cores"):
            train(cfg, RunContext(tmp_path))
        assert not (tmp_path / "metrics.jsonl").exists()
        return
    train(cfg, RunContext(tmp_path))
    saved = json.loads((tmp_path / "summary.json").read_text())
    ran = saved["ran"]
    assert (ran["precision"], ran["emulated"], ran["autocast_dtype"]) == ("fp8", False, "bfloat16")
    assert ran["fp8_converted"] == VIT_FP8_LAYERS and list(ran["fp8_unconverted"]) == ["heads.head"]
    # fp8 compiled and captured: torchao's scaling runs inside the graph
    assert ran["cuda_graph"] is True and ran["graph_replays"] > 0, ran.get("cuda_graph_off")
    assert saved["val/loss"] < 2.3 - 0.5  # well below chance level for 10 classes


def test_fp8_on_cuda_rounds_to_e4m3_as_the_emulation_does():
    """The real fp8 matmul and the CPU's emulation give the same product on exact operands."""
    if torch.cuda.get_device_capability() < FP8_CAPABILITY:
        pytest.skip("fp8 needs compute capability 8.9 or newer")
    x = torch.zeros(16, 16)
    x[0, :3] = torch.tensor([448.0, 1.0625, 1.0625 + 2.0**-12])
    outputs = {}
    for device in (torch.device("cpu"), cuda()):
        layer = nn.Sequential(nn.Linear(16, 16, bias=False)).to(device)
        with torch.no_grad():
            layer[0].weight.copy_(torch.eye(16))
        layer, precision = convert_to_fp8(layer, precision_of("fp8", device), [], compiled=False)
        with precision.autocast():
            outputs[device.type] = layer(x.to(device))[0, :3].float().cpu().tolist()
    assert outputs["cuda"] == outputs["cpu"] == [448.0, 1.0, 1.0]


def test_a_scaler_on_cuda_without_an_index_takes_the_short_update():
    """torch.device("cuda") is the GPU its tensors call cuda:0: the `dynamic` scaler's short rule
    (a handful of operators a step) holds for it too, not the whole rule's 25 or so."""
    scaler = DynamicLossScaler(torch.device("cuda"), 1024.0, 2.0, 0.5, 2)
    weight = nn.Parameter(torch.ones(4, device="cuda"))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    scaler.scale((weight * 2).sum()).backward()
    scaler.step(optimizer)
    with Dispatched() as counted:
        scaler.update()
    assert sum(counted.ops.values()) <= 8, counted.ops


@pytest.mark.parametrize("overrides", CASES, ids=CASE_IDS)
def test_a_step_replayed_from_a_cuda_graph_trains_exactly_as_the_eager_step(monkeypatch, overrides):
    """The same comparison as tests/test_step_graph.py, with real CUDA graphs: every step's loss,
    scale, skip and floor flags, and the weights and optimizer state at the end, bit for bit."""
    if "precision=bf16" in overrides and torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("bf16 needs Ampere or newer")
    # the same convolution algorithms (and no atomics in them) for the eager and captured runs
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    assert_replayed_as_eager(overrides, cuda())


def test_replays_of_the_captured_step_never_wait_on_the_gpu():
    """After the warm-up and the capture, replayed steps in CUDA's sync-debug mode set to error
    (the history flushed between blocks of 4 steps, outside it, as a run flushes every
    log_every steps)."""
    device = cuda()
    _, _, _, stepper = run_steps(["precision=fp16"], True, device=device)
    assert stepper.graph.captured
    before = stepper.graph.replays
    images, labels = next(iter(batches(device=device)))
    for block in range(3):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for step in range(4):
                stepper.step(100 + 4 * block + step, images, labels)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        stepper.history.flush(wait=True)
    assert stepper.graph.replays == before + 12


def test_the_default_run_on_cuda_is_compiled_channels_last_and_captured(tmp_path):
    """`python -m mpexp.train` with no speed switch on a GPU: the fast path, recorded, with the
    compile time as its own figure; `trainer.eager=true` is the plain eager run."""
    train(make_cfg(*TINY, "precision=bf16", "trainer.device=cuda"), RunContext(tmp_path / "a"))
    saved = json.loads((tmp_path / "a" / "summary.json").read_text())
    ran = saved["ran"]
    assert (ran["compile"], ran["channels_last"], ran["cuda_graph"]) == ("default", True, True)
    assert ran["graph_replays"] > 0 and saved["perf/compile_s"] > 0
    assert saved["val/loss"] < 2.3
    eager = make_cfg(*TINY, "precision=bf16", "trainer.device=cuda", "trainer.eager=true")
    train(eager, RunContext(tmp_path / "b"))
    ran = json.loads((tmp_path / "b" / "summary.json").read_text())["ran"]
    assert (ran["compile"], ran["cuda_graph"]) == (False, False)


def test_a_captured_run_logs_what_the_eager_run_logs_on_cuda(tmp_path):
    """Through train(), uncompiled, fp16 from a scale that overflows first: the captured run's
    per-step losses, scales and skip counts and its validation are the eager run's."""
    base = [*TINY, "precision=fp16", "trainer.device=cuda", "trainer.compile=false",
            "trainer.deterministic=true", "loss_scaling.init_scale=1099511627776",
            "diagnostics.grad_stats_every=7"]  # fmt: skip
    runs = {}
    for name, graph in (("eager", "false"), ("graph", "true")):
        train(make_cfg(*base, f"trainer.cuda_graph={graph}"), RunContext(tmp_path / name))
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        runs[name] = [json.loads(line) for line in lines]
    ran = json.loads((tmp_path / "graph" / "summary.json").read_text())["ran"]
    assert ran["cuda_graph"] is True and ran["graph_replays"] > 0  # not two eager runs
    keys = ("step", "train/loss", "amp/scale", "amp/skipped_steps", "val/loss", "val/acc")
    steps = {n: [[r.get(k) for k in keys] for r in rows if "step" in r] for n, rows in runs.items()}
    assert steps["graph"] == steps["eager"]
    assert any(r.get("amp/skipped_steps") for r in runs["graph"])


def test_own_tensor_values_never_wait_on_the_gpu_and_replayed_steps_log_none(tmp_path, caplog):
    """mpexp.log of CUDA tensors never synchronises (CUDA's sync-debug mode set to error). In a
    run whose step is a CUDA graph (CUDA's default), the eager warm-up steps log their values;
    the capture logs none, and says so once, as its replays run no Python."""
    calls = tmp_path / "calls"
    disabled = OmegaConf.create({"mode": "disabled"})
    tracker = Tracker(RunContext(calls), {}, disabled, Classification(1, 2, 2, 2))
    x = torch.randn(64, device="cuda")
    try:
        mpexp.log({"my/warm": x.abs().max().half()})  # lazy initialisation first
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(3):
                mpexp.log({"my/absmax": x.abs().max(), "my/count": (x > 0).sum()})
        finally:
            torch.cuda.set_sync_debug_mode("default")
    finally:
        tracker.close()
    rows = [json.loads(line) for line in (calls / "metrics.jsonl").read_text().splitlines()]
    expected = {"my/absmax": x.abs().max().item(), "my/count": (x > 0).sum().item()}
    assert [r for r in rows if "my/absmax" in r] == [{"step": 0, **expected}] * 3

    # a model that logs from its forward does not declare itself capturable: captured on demand
    model = "model._target_=tests.test_host_reads.LoggingCNN"
    forced = make_cfg(*TINY, "trainer.device=cuda", model, "trainer.cuda_graph=true")
    with caplog.at_level(logging.WARNING):
        train(forced, RunContext(tmp_path / "run"))
    ran = json.loads((tmp_path / "run" / "summary.json").read_text())["ran"]
    assert ran["cuda_graph"] and ran["graph_replays"] > 0
    logged = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if "my/absmax" in r] == list(range(1, WARMUP_STEPS + 1))
    assert caplog.text.count("captured as a CUDA graph") == 1


def test_the_default_path_follows_the_eager_run_step_for_step(tmp_path):
    """CUDA's default (compiled, channels_last, the step captured) against trainer.eager=true in
    one process, fp16 from a scale that overflows first. Compilation fuses and reorders kernels,
    so losses agree within a tolerance, not bit for bit: 2 % over the first steps, before the
    runs drift apart, and 0.05 nats in validation at the end. Which steps overflow depends on
    powers of two of the gradients, not on their last bits: the loss scale and the skipped
    steps are the same, step for step. From 2^28 about ten of the epoch's 16 steps overflow
    (on a CPU, eagerly: 10): enough to compare, and steps left to take (a run that takes none
    fails, as it should)."""
    init = 2.0**28
    base = [*TINY, "precision=fp16", "trainer.device=cuda", "trainer.epochs=1",
            f"loss_scaling.init_scale={init:.0f}"]  # fmt: skip
    summaries, rows = {}, {}
    for name, extra in (("eager", ["trainer.eager=true"]), ("default", [])):
        train(make_cfg(*base, *extra), RunContext(tmp_path / name))
        summaries[name] = json.loads((tmp_path / name / "summary.json").read_text())
        rows[name] = read_metrics(tmp_path / name)[0]
    ran = summaries["default"]["ran"]
    assert (ran["compile"], ran["channels_last"], ran["cuda_graph"]) == ("default", True, True)
    assert ran["graph_replays"] > 0
    assert summaries["eager"]["ran"]["cuda_graph"] is False
    for key in ("step", "amp/scale", "amp/skipped_steps"):
        assert [r[key] for r in rows["default"]] == [r[key] for r in rows["eager"]], key
    assert rows["default"][-1]["amp/skipped_steps"] > 0  # the overflows were there to compare
    taken = [i for i, r in enumerate(rows["eager"]) if r["amp/scale"] < init][:4]
    torch.testing.assert_close(
        [rows["default"][i]["train/loss"] for i in taken],
        [rows["eager"][i]["train/loss"] for i in taken],
        rtol=0.02,
        atol=0,
    )
    assert abs(summaries["default"]["val/loss"] - summaries["eager"]["val/loss"]) < 0.05


class HostRead(nn.Module):
    """tests/test_step_graph.py's small network behind a forward pass that does one thing a CUDA
    graph cannot hold; the CPU emulator of tests/replay.py lets each of them through."""

    def __init__(self, read):
        super().__init__()
        self.net = small_net()
        self.read = read

    def forward(self, x):
        self.read(x)
        return self.net(x)


HOST_READS = {
    "tolist": lambda x: x[0, 0, 0, :2].tolist(),
    "cpu": lambda x: x.sum().cpu(),
    "nonzero": lambda x: (x > 0).nonzero(),
    "boolean-mask": lambda x: x[x > 0],
    "torch.tensor": lambda x: torch.tensor([1.0, 2.0], device=x.device),
}


@pytest.mark.parametrize("read", HOST_READS.values(), ids=HOST_READS.keys())
def test_a_real_capture_that_fails_leaves_the_run_eager_with_one_warning(read, caplog):
    """The real CudaGraph (side stream, torch.cuda.graph, its error and the stream put back):
    the capture fails on the host read, the run warns once, goes on eagerly on the stream it
    was on, and trains every step."""
    torch.manual_seed(0)
    net = HostRead(read)
    before = [p.detach().clone() for p in net.parameters()]
    stream = torch.cuda.current_stream()
    with caplog.at_level(logging.WARNING, logger="mpexp"):
        rows, *_, stepper = run_steps(["precision=fp16"], True, device=cuda(), net=net)
    assert torch.cuda.current_stream() == stream
    warned = [r for r in caplog.records if "could not be captured" in r.getMessage()]
    assert len(warned) == 1
    assert stepper.graph.failed and stepper.describe()["cuda_graph"] is False
    assert stepper.describe()["cuda_graph_off"].startswith("the capture failed: ")
    assert [r.step for r in rows] == list(range(1, STEPS + 1))
    assert all(math.isfinite(r.loss) for r in rows)
    assert not all(torch.equal(a, b.cpu()) for a, b in zip(before, net.parameters(), strict=True))


class HostState(nn.Module):
    """A forward pass scaled by a Python float that grows every step: host-side per-step state,
    which a replayed CUDA graph freezes at the captured step's value."""

    def __init__(self):
        super().__init__()
        self.net = small_net()
        self.steps = 0

    def forward(self, x):
        self.steps += 1
        return self.net(x) * (1.0 + 0.25 * self.steps)


def test_a_captured_step_freezes_a_python_scalar_and_a_users_model_is_not_captured(tmp_path):
    """Why a model that does not declare itself capturable is not captured by default: forced
    into a real CUDA graph, its per-step Python float stays at the captured step's value, and it
    trains differently from its eager run. Through train() such a
    model runs compiled without the graph, and its run records why."""
    losses = {}
    for graphed in (False, True):
        rows, *_, stepper = run_steps(["precision=fp32"], graphed, device=cuda(), net=HostState())
        losses[graphed] = [r.loss for r in rows]
        assert (stepper.graph is not None and stepper.graph.replays > 0) is graphed
    assert losses[True][:WARMUP_STEPS] == losses[False][:WARMUP_STEPS]  # eager in both
    assert losses[True][-1] != losses[False][-1]  # the replays' frozen float

    model = "model._target_=tests.test_host_reads.LoggingCNN"  # declares nothing
    train(make_cfg(*TINY, "trainer.device=cuda", model), RunContext(tmp_path))
    ran = json.loads((tmp_path / "summary.json").read_text())["ran"]
    assert ran["compile"] and ran["cuda_graph"] is False
    assert ran["cuda_graph_off"] == "LoggingCNN does not declare itself capturable"


@pytest.mark.parametrize("data", ["tokens", "image_folder"])
def test_a_run_whose_data_threads_call_cuda_meanwhile_is_captured(tmp_path, data):
    """Token windows are gathered and pinned on a thread a batch ahead, and a DataLoader pins its
    batches on a thread of its own: both go on calling CUDA (pinned allocations, event queries)
    while the step is captured, which a process-wide capture counts as an error of its own. GPT-2
    small's default run on an H100 ran uncaptured (2026-11-26)."""
    if data == "tokens":
        overrides = tokens_args(bin_pair(tmp_path / "tokens"), "trainer.epochs=1")
    else:
        for split, count in (("train", 48), ("val", 8)):
            write_images(tmp_path / "images" / split, per_class=count)
        overrides = [*SMALL, f"dataset.path={tmp_path / 'images'}", "dataset.num_workers=1",
                     "trainer.epochs=1"]  # fmt: skip
    summary = train(make_cfg(*overrides, "trainer.device=cuda"), RunContext(tmp_path / "run"))
    ran = summary["ran"]
    assert ran["cuda_graph"] is True, ran.get("cuda_graph_off")
    assert ran["graph_replays"] > 0
