"""Short real training runs on synthetic data, one per precision, on CPU."""

from __future__ import annotations

import json
import logging
import time

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from mpexp.data.synthetic import SyntheticData
from mpexp.run.runner import train
from mpexp.step.validation import evaluate
from mpexp.tracking.run_context import RunContext
from tests.conftest import CPU, TINY, make_cfg, precision_of

STEP_KEYS = {"step", "train/loss", "amp/scale", "amp/skipped_steps", "lr"}
EPOCH_KEYS = {
    "epoch",
    "train/epoch_loss",
    "val/loss",
    "val/acc",
    "perf/epoch_time_s",
    "perf/samples_per_s",
    "perf/data_wait_s",
    "perf/data_wait_share",
    "mem/peak_rss_mib",
}


def read_metrics(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "epoch" not in r], [r for r in rows if "epoch" in r]


@pytest.mark.parametrize(
    ("precision", "effective", "scaling", "autocast"),
    [
        ("fp32", "fp32", "none", "none"),
        ("tf32", "fp32", "none", "none"),  # no TF32 on a CPU: recorded as what ran
        ("fp16", "fp16", "dynamic", "float16"),
        ("bf16", "bf16", "none", "bfloat16"),
    ],
)
def test_each_precision_trains_and_the_loss_falls(
    tmp_path, precision, effective, scaling, autocast
):
    summary = train(make_cfg(*TINY, f"precision={precision}"), RunContext(tmp_path))

    steps, epochs = read_metrics(tmp_path)
    assert len(epochs) == 2 and len(steps) == 2 * (1024 // 64)
    assert epochs[1]["train/epoch_loss"] < epochs[0]["train/epoch_loss"]
    assert epochs[1]["val/loss"] < epochs[0]["val/loss"]
    # over a window of steps: TINY learns slowly at first, and one step's loss is noisy
    losses = [r["train/loss"] for r in steps]
    assert sum(losses[-4:]) < sum(losses[:4])
    assert all(r.keys() >= STEP_KEYS for r in steps)
    assert all(r.keys() >= EPOCH_KEYS for r in epochs)
    assert [r["step"] for r in steps] == list(range(1, len(steps) + 1))

    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["status"] == "finished"
    ran = saved["ran"]
    assert ran["precision"] == precision
    assert ran["effective_precision"] == effective
    assert ran["autocast_dtype"] == autocast
    assert ran["loss_scaling"] == scaling
    assert ran["device"] == "cpu"
    assert summary["ran"] == ran


def test_scale_history_is_complete_under_fp16(tmp_path):
    cfg = make_cfg(
        *TINY,
        "precision=fp16",
        "loss_scaling=dynamic",
        "loss_scaling.init_scale=4",
        "loss_scaling.growth_interval=3",
        "dataset.train_size=512",  # 8 steps: three growth intervals and more
        "trainer.epochs=1",
    )
    train(cfg, RunContext(tmp_path))
    steps, _ = read_metrics(tmp_path)
    scales = [r["amp/scale"] for r in steps]
    assert len(scales) == 8
    # no overflow at these tiny scales: the scale doubles after every 3 clean steps
    assert scales[:7] == [4.0, 4.0, 4.0, 8.0, 8.0, 8.0, 16.0]
    assert {r["amp/skipped_steps"] for r in steps} == {0}


def test_final_scale_is_the_one_after_the_last_update(tmp_path):
    cfg = make_cfg(
        *TINY,
        "precision=fp16",
        "loss_scaling=dynamic",
        "loss_scaling.init_scale=4",
        "loss_scaling.growth_interval=8",
        "trainer.epochs=1",
    )
    summary = train(cfg, RunContext(tmp_path))
    steps, _ = read_metrics(tmp_path)
    # 16 clean steps: the scale grew after step 8 and again after step 16, the last one
    assert [r["amp/scale"] for r in steps][-1] == 8.0
    assert summary["ran"]["final_scale"] == 16.0  # what a step after the run would use


def test_samples_per_second_counts_the_last_partial_batch(tmp_path):
    cfg = make_cfg(*TINY, "dataset.train_size=1000", "dataset.drop_last=false", "trainer.epochs=1")
    train(cfg, RunContext(tmp_path))
    steps, (epoch,) = read_metrics(tmp_path)
    assert len(steps) == 16  # 15 batches of 64 and one of 40
    assert epoch["perf/samples_per_s"] * epoch["perf/epoch_time_s"] == pytest.approx(1000)


class SlowData(SyntheticData):
    """Synthetic data whose every training batch takes 250 ms to arrive: a starved step."""

    def train_batches(self, *args, **kwargs):
        for batch in super().train_batches(*args, **kwargs):
            time.sleep(0.25)
            yield batch


def test_a_run_that_waits_on_its_data_says_so_once(tmp_path, caplog):
    cfg = make_cfg(
        *TINY,
        "dataset._target_=tests.test_training.SlowData",
        "dataset.train_size=128",
        "dataset.loader=dataloader",
        "dataset.num_workers=0",
        "trainer.epochs=3",
    )
    with caplog.at_level(logging.WARNING, logger="mpexp"):
        train(cfg, RunContext(tmp_path))
    _, epochs = read_metrics(tmp_path)
    for epoch in epochs:  # 2 batches of 250 ms each
        assert 0.5 <= epoch["perf/data_wait_s"] < epoch["perf/epoch_time_s"]
        assert epoch["perf/data_wait_share"] == pytest.approx(
            epoch["perf/data_wait_s"] / epoch["perf/epoch_time_s"]
        )
    starved = [r.message for r in caplog.records if "for data" in r.message]
    assert len(starved) == 1, starved  # once a run, from the second epoch on
    assert starved[0].startswith("Epoch 2 waited")
    # the keys of this dataset that feed it faster (tests/test_data_wait.py: each dataset's)
    assert "dataset.loader=device" in starved[0] and "dataset.num_workers" in starved[0]


class HostTensors(TorchDispatchMode):
    """Counts tensors made from host values (torch.tensor(...)): on CUDA each is a blocking
    copy to the device."""

    def __init__(self):
        super().__init__()
        self.made = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.made += func is torch.ops.aten.lift_fresh.default
        return func(*args, **(kwargs or {}))


def test_evaluation_reads_the_device_once_and_makes_no_host_tensors():
    data = SyntheticData(train_size=8, val_size=100, batch_size=32, seed=0)  # 3 x 32 and 4
    data.setup(CPU)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 10))
    with HostTensors() as host:
        metrics = evaluate(model, data, CPU, precision_of("fp32"))
    assert host.made == 0
    images, labels = data.val
    logits = model(images)
    expected = nn.functional.cross_entropy(logits, labels).item()
    assert metrics["val/loss"] == pytest.approx(expected, rel=1e-6)
    assert metrics["val/acc"] == (logits.argmax(1) == labels).float().mean().item()
