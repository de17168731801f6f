"""The data-wait clock (mpexp/step/data_wait.py) and the advice a starved run gets.

On a GPU the data wait is the device's idle time between steps, from events on the step's
stream; the arithmetic is tested here with events of known times, the loop's use of it with events
that read the host clock (a CPU's step is synchronous, so its host time is its device time), and
the real CUDA events in the `gpu` test. The advice names the keys the run's own dataset has.
"""

from __future__ import annotations

import logging
import time

import pytest
import torch

from mpexp.config import ImageFolderDatasetConfig, SyntheticDatasetConfig, WindowsConfig
from mpexp.data.image_folder import ImageFolderData
from mpexp.data.synthetic import SyntheticData
from mpexp.data.text import TextData
from mpexp.report import cli as report
from mpexp.run.runner import train
from mpexp.step import data_wait
from mpexp.step.data_wait import CudaEvents, DeviceIdleClock, HostWaitClock, wait_clock
from mpexp.tracking.run_context import RunContext
from tests.conftest import make_cfg
from tests.test_report_numbers import make_run
from tests.test_training import TINY, read_metrics


class KnownEvents:
    """Events whose times are given in advance, in order; `passed` of them are done."""

    def __init__(self, times: list[float]):
        self.times = iter(times)
        self.recorded: list[float] = []
        self.passed = len(times)

    def record(self) -> int:
        self.recorded.append(next(self.times))
        return len(self.recorded) - 1

    def done(self, marker: int) -> bool:
        return marker < self.passed

    def wait(self, marker: int) -> None:
        self.passed = max(self.passed, marker + 1)

    def seconds_between(self, earlier: int, later: int) -> float:
        assert earlier < self.passed and later < self.passed, "read before the device passed it"
        return self.recorded[later] - self.recorded[earlier]


def run_steps(clock: DeviceIdleClock, steps: int, forget_after: int | None = None) -> None:
    for i in range(steps):
        clock.step_began()
        clock.step_ended()
        if i == forget_after:
            clock.forget()


def test_the_device_clock_adds_the_gaps_from_each_steps_end_to_the_next_ones_beginning():
    # (begin, end) of four steps: gaps of 3, 0 and 0.5 s
    events = KnownEvents([0.0, 10.0, 13.0, 20.0, 20.0, 25.0, 25.5, 30.0])
    clock = DeviceIdleClock(events)
    run_steps(clock, 4)
    assert clock.take() == pytest.approx(3.5)
    assert clock.take() == 0.0  # taken once


def test_the_device_clock_reads_at_a_flush_only_what_the_device_has_passed():
    events = KnownEvents([0.0, 1.0, 3.0, 4.0, 7.0, 8.0])
    clock = DeviceIdleClock(events)
    run_steps(clock, 3)
    events.passed = 3  # the device is inside the second step: the first gap only
    clock.read()
    assert clock.seconds == pytest.approx(2.0)
    assert clock.take() == pytest.approx(5.0)  # the interval's end waits for the rest


def test_a_forgotten_gap_counts_nothing_and_a_negative_one_counts_zero():
    # the gap after the second step spans a checkpoint (forgotten); the last one is negative, as
    # events of two streams may be
    events = KnownEvents([0.0, 1.0, 2.0, 3.0, 100.0, 101.0, 100.5, 102.0])
    clock = DeviceIdleClock(events)
    run_steps(clock, 4, forget_after=1)
    assert clock.take() == pytest.approx(1.0)


def test_the_clock_is_the_devices_on_cuda_and_the_hosts_elsewhere():
    assert isinstance(wait_clock(torch.device("cpu")), HostWaitClock)
    on_gpu = wait_clock(torch.device("cuda", 0))  # built without touching a GPU
    assert isinstance(on_gpu, DeviceIdleClock) and isinstance(on_gpu.events, CudaEvents)


class HostTimeEvents:
    """Events at the host's time: a CPU's step is synchronous, so this is its device's time."""

    def record(self) -> float:
        return time.perf_counter()

    def done(self, marker: float) -> bool:
        return True

    def wait(self, marker: float) -> None:
        pass

    def seconds_between(self, earlier: float, later: float) -> float:
        return later - earlier


def test_the_loop_times_the_gaps_between_steps_with_the_device_clock(tmp_path, monkeypatch):
    """The loop marks each step's beginning and end and takes the gaps once per epoch: a batch
    that arrives 250 ms late is 250 ms of the device's idle time."""
    monkeypatch.setattr(
        "mpexp.step.loop.wait_clock", lambda device: DeviceIdleClock(HostTimeEvents())
    )
    cfg = make_cfg(
        *TINY,
        "dataset._target_=tests.test_training.SlowData",
        "dataset.train_size=192",
        "trainer.epochs=1",
    )
    train(cfg, RunContext(tmp_path))
    _, (epoch,) = read_metrics(tmp_path)
    # 3 batches, each 250 ms late; the first one's wait is before any step: no gap
    assert 0.5 <= epoch["perf/data_wait_s"] < 0.75


def test_compute_only_steps_time_the_step_on_a_batch_kept_on_the_device(tmp_path):
    """After training: a rate of its own, in the summary and a row, none of its steps logged as
    training's, and the validation metrics those of training."""
    cfg = make_cfg(*TINY, "trainer.epochs=1", "trainer.compute_only_steps=9")
    summary = train(cfg, RunContext(tmp_path))
    steps, (epoch,) = read_metrics(tmp_path)
    assert summary["perf/compute_only_samples_per_s"] > 0
    trained = [s["step"] for s in steps if "train/loss" in s]
    assert trained == list(range(1, 17))  # 1024 / 64: training's alone
    assert summary["val/acc"] == epoch["val/acc"]
    rows = (tmp_path / "metrics.jsonl").read_text()
    assert rows.count("perf/compute_only_samples_per_s") == 1


@pytest.mark.gpu
def test_cuda_events_time_the_gpus_idle_time_not_the_hosts_wait():
    """Steps of 20 ms on the GPU with the host 5 ms late for each batch: the host waited 5 ms a
    step, but the GPU never idled (it had queued steps to run). Steps of 5 ms with the host
    20 ms late: the GPU idled about 15 ms a step."""
    device = torch.device("cuda")
    cycles = _cycles_per_ms(device)

    def idle(step_ms: float, late_ms: float, steps: int = 20) -> float:
        clock = wait_clock(device)
        torch.cuda.synchronize()
        for _ in range(steps):
            time.sleep(late_ms / 1000)  # the batch arrives late
            clock.step_began()
            torch.cuda._sleep(int(step_ms * cycles))
            clock.step_ended()
        clock.read()  # no waiting: what has passed
        return clock.take() / (steps - 1) * 1000

    assert idle(step_ms=20, late_ms=5) < 1.0
    assert 10.0 < idle(step_ms=5, late_ms=20) < 20.0


def _cycles_per_ms(device: torch.device) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / start.elapsed_time(end)


# --- what a starved run is told ------------------------------------------------------------------


def declared(schema) -> set[str]:
    return {f"dataset.{name}" for name in schema.__dataclass_fields__}


@pytest.mark.parametrize(
    ("dataset", "schema", "keys"),
    [
        (  # the GPU's decoder is suggested only to a CUDA run of JPEGs (test_folder_edges.py)
            lambda: ImageFolderData(path="x"),
            ImageFolderDatasetConfig,
            ["dataset.num_workers", "dataset.cache=resized"],
        ),
        (  # cache=resized is refused beside decode=gpu
            lambda: ImageFolderData(path="x", decode="gpu"),
            ImageFolderDatasetConfig,
            ["dataset.num_workers"],
        ),
        (
            lambda: ImageFolderData(path="x", cache="resized"),
            ImageFolderDatasetConfig,
            ["dataset.num_workers"],
        ),
        (
            lambda: ImageFolderData(path="x", decode="auto"),
            ImageFolderDatasetConfig,
            ["dataset.num_workers", "dataset.cache=resized"],
        ),
        (lambda: SyntheticData(batch_size=8, loader="device"), SyntheticDatasetConfig, []),
        (
            lambda: SyntheticData(batch_size=8, loader="dataloader"),
            SyntheticDatasetConfig,
            ["dataset.loader=device", "dataset.num_workers"],
        ),
        (lambda: TextData(), WindowsConfig, []),
    ],
)
def test_each_dataset_names_its_own_keys_that_feed_it_faster(dataset, schema, keys):
    data = dataset()
    assert data.faster_data_keys() == keys
    assert {key.split("=")[0] for key in keys} <= declared(schema)
    hint = data.faster_data_hint()
    assert all(key in hint for key in keys)
    if not keys:
        assert "no loading setting" in hint


def test_an_image_folder_is_never_told_of_a_loader_key_it_lacks():
    """The bug: image-folder runs were told to set dataset.loader=device."""
    hint = ImageFolderData(path="x").faster_data_hint()
    assert "dataset.loader" not in hint and "loader" not in declared(ImageFolderDatasetConfig)


def test_the_warning_of_a_starved_image_folder_run_names_its_keys(tmp_path, caplog, monkeypatch):
    """A real image-folder run whose batches wait: its warning and its recorded advice name
    the image folder's keys."""
    from PIL import Image

    for split in ("train", "val"):
        for label in ("a", "b"):
            folder = tmp_path / "images" / split / label
            folder.mkdir(parents=True)
            for i in range(4):
                Image.new("RGB", (12, 12), (40 * i, 0, 0)).save(folder / f"{i}.png")
    monkeypatch.setattr(data_wait, "STARVED_SHARE", -1.0)  # whatever it waited, it is told
    monkeypatch.setattr("mpexp.step.epoch_row.STARVED_SHARE", -1.0)
    cfg = make_cfg(
        "dataset=image_folder",
        f"dataset.path={tmp_path / 'images'}",
        "dataset.image_size=8",
        "dataset.batch_size=4",
        "dataset.num_workers=0",
        "dataset.mean=[0.5,0.5,0.5]",
        "dataset.std=[0.5,0.5,0.5]",
        "model=simplecnn",
        "model.width=4",
        "trainer.epochs=1",
        "trainer.progress=false",
        "wandb.mode=disabled",
    )
    with caplog.at_level(logging.WARNING, logger="mpexp"):
        summary = train(cfg, RunContext(tmp_path / "run"))
    (starved,) = [r.message for r in caplog.records if "for data" in r.message]
    # not dataset.decode=gpu: the same run refuses it on a CPU, and for PNGs
    assert "dataset.cache=resized" in starved and "dataset.decode=gpu" not in starved
    assert "dataset.loader" not in starved
    assert summary["ran"]["faster_data"] == ["dataset.num_workers", "dataset.cache=resized"]


def test_the_report_names_each_data_bound_runs_own_keys(tmp_path):
    import json

    make_run(tmp_path, "0", "fp32", 0, [0.9] * 2, [5.0, 1.0], data_wait=[0.5, 0.5])
    make_run(tmp_path, "1", "bf16", 0, [0.9] * 2, [5.0, 1.0], data_wait=[0.5, 0.5])
    for name, keys in (("0", ["dataset.num_workers", "dataset.cache=resized"]), ("1", [])):
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        summary["ran"]["faster_data"] = keys
        (tmp_path / name / "summary.json").write_text(json.dumps(summary))
    assert report.main([str(tmp_path), "--wandb", "disabled", "--no-plots"]) == 0
    warnings = (tmp_path / "report.md").read_text().split("## Warnings", 1)[1]
    (bound,) = [line for line in warnings.splitlines() if "Waiting on data" in line]
    fp32, bf16 = bound.split("; ")
    assert "a higher `dataset.num_workers`, or `dataset.cache=resized`" in fp32
    assert "no loading setting" in bf16 and "dataset.loader" not in bound
