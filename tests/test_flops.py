"""Achieved TFLOP/s: the FLOP count against a hand count, what the count leaves alone, the peaks."""

from __future__ import annotations

import json
from typing import ClassVar

import pytest
import torch
from omegaconf import OmegaConf
from torch.utils._python_dispatch import TorchDispatchMode

import mpexp
from mpexp.models.deepcnn import DeepCNN
from mpexp.plan.devices import step_seconds
from mpexp.precision.modes import setup_precision
from mpexp.run.runner import train
from mpexp.step.flops import Throughput, device_peak_tflops, flops_per_sample, throughput
from mpexp.step.meta_copy import meta_copy
from mpexp.tasks.classification import Classification
from mpexp.tasks.language_model import LanguageModelling
from mpexp.tracking.run_context import RunContext
from mpexp.tracking.tracker import Tracker
from tests.conftest import TINY, make_cfg
from tests.test_training import read_metrics


def simplecnn_flops(width: int, side: int = 28, classes: int = 10) -> int:
    """SimpleCNN's training FLOPs per sample on a 1 x side x side image, by hand.

    A multiply-add is 2 FLOPs. Backward costs twice the forward (the input's gradient and the
    weights'), except in the first layer, whose input needs no gradient.
    """
    conv1 = 2 * width * 1 * 3 * 3 * side * side  # 'same' padding: side x side outputs
    conv2 = 2 * (2 * width) * width * 3 * 3 * (side // 2) ** 2  # after a 2x2 pool
    fc = 2 * (2 * width * (side // 4) ** 2) * classes  # after the second pool
    return 2 * conv1 + 3 * conv2 + 3 * fc


def test_hand_count_of_a_small_cnn():
    assert simplecnn_flops(8) == 1_627_584  # 2*112,896 + 3*451,584 + 3*15,680


@pytest.mark.parametrize(
    "extra", [[], ["trainer.accumulate=4", "trainer.peak_tflops=0.5"]], ids=["plain", "accumulate"]
)
def test_achieved_tflops_of_a_run_match_the_hand_count(tmp_path, extra):
    cfg = make_cfg(*TINY, "model.width=8", "dataset.train_size=256", *extra)
    train(cfg, RunContext(tmp_path))
    ran = json.loads((tmp_path / "summary.json").read_text())["ran"]
    flops = simplecnn_flops(8)
    assert ran["flops_per_sample"] == flops  # accumulation splits the batch, not the work

    _, epochs = read_metrics(tmp_path)
    samples = (256 // 64) * 64  # trained per epoch (drop_last)
    for epoch in epochs:
        expected = flops * samples / epoch["perf/epoch_time_s"] / 1e12
        assert epoch["perf/tflops"] == pytest.approx(expected, rel=1e-9)
        if extra:
            assert ran["peak_tflops"] == 0.5
            assert epoch["perf/mfu"] == pytest.approx(expected / 0.5, rel=1e-9)
        else:  # a CPU has no known peak: no MFU rather than a made-up one
            assert ran["peak_tflops"] is None and "perf/mfu" not in epoch


def test_counting_leaves_the_model_and_random_state_alone():
    torch.manual_seed(0)
    model = DeepCNN(in_channels=1, num_classes=10, image_size=(28, 28))  # BatchNorm throughout
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()

    flops = flops_per_sample(model, Classification(1, 28, 28, 10), 256)

    assert flops == pytest.approx(2.30e9, rel=0.01)  # docs/benchmarks.md: 2.30 GFLOP per sample
    assert torch.equal(torch.get_rng_state(), rng)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # incl. BatchNorm statistics
    assert all(p.grad is None for p in model.parameters())
    assert next(model.parameters()).device.type == "cpu"


class HookSpy(torch.nn.Module):
    """Records the global module hooks in place while its forward runs (in a class list: the
    count runs on a copy of the model)."""

    seen: ClassVar[list[int]] = []

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 3)

    def forward(self, x):
        from torch.nn.modules import module as m

        HookSpy.seen.append(len(m._global_forward_pre_hooks) + len(m._global_forward_hooks))
        return self.conv(x).flatten(1)


def test_counting_sets_no_global_module_hooks():
    """Global module hooks fire in every thread: set while the background count ran, they broke
    torch.compile's tracing of the model in the training thread (seen on an H100: "already
    tracked for mutation"). The count is a thread-local dispatch mode and sets none."""
    spy = HookSpy()
    # forward and the weight gradient (images need none): 2 FLOPs x 9 taps x 4 channels x 9 pixels
    assert flops_per_sample(spy, Classification(1, 5, 5, 36), 2) == 2 * (2 * 9 * 4 * 9)
    assert HookSpy.seen == [0]


@pytest.mark.parametrize(
    ("name", "precision", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.4),
        ("NVIDIA H100 80GB HBM3", "fp32", 67.0),
        ("NVIDIA H100 PCIe", "fp16", 756.0),
        ("NVIDIA H200", "tf32", 494.7),
        ("NVIDIA A100-SXM4-80GB", "fp16", 312.0),
        ("NVIDIA H100 80GB HBM3", "fp8", 1978.9),
        ("NVIDIA H100 PCIe", "fp8", 1513.0),
        ("NVIDIA A100-SXM4-80GB", "fp8", None),  # no fp8 tensor cores
        ("NVIDIA H100 NVL", "bf16", None),  # other peaks, not listed: no MFU
        ("NVIDIA GeForce RTX 4090", "fp16", None),
        ("AMD EPYC 7B13", "fp32", None),
    ],
)
def test_peak_by_device_name(name, precision, peak):
    assert device_peak_tflops(name, precision) == peak


@pytest.mark.parametrize("preset", ["bf16", "bf16_pure", "bf16_pure_kahan"])
@pytest.mark.parametrize("tf32", [False, True])
def test_a_run_computing_in_bf16_is_measured_against_the_bf16_peak(preset, tf32):
    """Pure bf16 computes in bf16 as autocast does: its perf/mfu, and the plan's time estimate,
    are against the bf16 peak (TF32 for what stays in float32 changes neither)."""
    cfg = make_cfg(f"precision={preset}", f"precision.tf32={tf32}")
    mode = setup_precision(cfg.precision, torch.device("cpu")).mode  # the mode a GPU records
    assert device_peak_tflops("NVIDIA H100 80GB HBM3", mode) == 989.4
    bf16 = step_seconds(1e15, "H100", "bf16", processes=1, mfu=0.5)
    assert step_seconds(1e15, "H100", mode, processes=1, mfu=0.5) == bf16


def test_mfu_of_a_distributed_run_is_against_every_device():
    # the sample rate of a 4-rank run is the sum over ranks, so the peak is 4 devices'
    row = Throughput(flops_per_sample=1e9, peak_tflops=100.0, devices=4).metrics(80_000)
    assert row == {"perf/tflops": pytest.approx(80.0), "perf/mfu": pytest.approx(0.2)}
    assert Throughput(1e9).metrics(80_000) == {"perf/tflops": pytest.approx(80.0)}


class ReadsAValue(torch.nn.Module):
    """A forward that reads a tensor's value on the host: the meta device has none to give."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(x.flatten(1)) * float(x.abs().max() > 0)


def test_a_model_that_cannot_be_counted_trains_without_tflops(caplog):
    with caplog.at_level("WARNING"):
        images = Classification(1, 2, 2, 2)  # 4 values, flattened
        counted = throughput(ReadsAValue(), images, 8, peak_tflops=100.0, devices=1).result()
    assert counted.flops_per_sample is None
    assert counted.metrics(1000.0) == {}  # no perf/tflops, and no MFU from a missing count
    assert "perf/tflops is not logged" in caplog.text


class LogsAValue(torch.nn.Module):
    """A user's model that logs from its forward pass, under a name mpexp.log refuses."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 2)

    def forward(self, x):
        mpexp.log({"train/absmax": x.abs().max(), "my/calls": 1})
        return self.fc(x.flatten(1))


def test_what_the_model_logs_in_the_counts_pass_is_not_logged(tmp_path):
    """The count's pass on the meta device is no training step: the model's mpexp.log calls do
    nothing there, neither a row at whatever step trains meanwhile nor a refusal (which the
    training step's own call makes)."""
    task = Classification(1, 2, 2, 2)  # 4 values, flattened
    tracker = Tracker(RunContext(tmp_path), {}, OmegaConf.create({"mode": "disabled"}), task)
    try:
        counted = throughput(LogsAValue(), task, 8, peak_tflops=None, devices=1).result()
    finally:
        tracker.close()
    assert counted.flops_per_sample == 2 * (2 * 4 * 2)  # the Linear layer: forward, weight grad
    assert not (tmp_path / "metrics.jsonl").read_text()


class TiedNet(torch.nn.Module):
    """An embedding tied to the output layer, a frozen layer and a BatchNorm's buffers."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)
        self.frozen = torch.nn.Linear(8, 8).requires_grad_(False)
        self.norm = torch.nn.BatchNorm1d(8)
        self.out = torch.nn.Linear(8, 16, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, tokens):
        return self.out(self.norm(self.frozen(self.emb(tokens)).transpose(1, 2)).transpose(1, 2))


class TensorsMade(TorchDispatchMode):
    """The devices of the tensors every operation run under it returns."""

    def __init__(self):
        super().__init__()
        self.devices: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.devices.add(t.device.type)
        return out


def lora_wrapped() -> torch.nn.Module:
    import peft

    config = peft.LoraConfig(r=2, target_modules=["frozen"])
    return peft.get_peft_model(TiedNet(), config).base_model.model


@pytest.mark.parametrize("build", [TiedNet, lora_wrapped], ids=["tied", "lora"])
def test_the_counts_copy_never_copies_a_weight_on_the_models_device(build):
    """The copy the count runs on is made on the meta device from the start: a model that fills
    the GPU (an 8B one in bf16) is never there twice, as a deepcopy moved to meta afterwards
    would briefly make it. It keeps what the count needs: shapes, dtypes, which weights train,
    tied weights tied."""
    model = build()
    with TensorsMade() as made:
        meta = meta_copy(model)
    assert made.devices <= {"meta"}  # not one tensor made on the CPU, where the model is
    real, copied = dict(model.named_parameters()), dict(meta.named_parameters())
    assert real.keys() == copied.keys()
    for name, p in real.items():
        c = copied[name]
        alike = (c.shape, c.dtype, c.requires_grad) == (p.shape, p.dtype, p.requires_grad)
        assert c.is_meta and alike, name
        assert p.device.type == "cpu"  # the model itself is left as it was
    assert all(b.is_meta for b in meta.buffers())
    assert meta.out.weight is meta.emb.weight  # tied: counted once, as the model holds it
    task = LanguageModelling(vocab_size=16, block_size=4)
    assert flops_per_sample(meta, task, 2) == flops_per_sample(model, task, 2) > 0
