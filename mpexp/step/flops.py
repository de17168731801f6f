"""Achieved TFLOP/s: the training FLOPs of one sample, counted once at start, and device peaks.

The count is PyTorch's FlopCounterMode over one batch at the run's shapes, forward, loss and
backward, on a copy of the model on the meta device (`meta_copy`): shapes propagate without memory
or compute, and the real model's weights, gradients, BatchNorm statistics and the random number
generators are left as they were. The counter counts matrix multiplications and convolutions (the
convention behind MFU figures); elementwise work is small next to them. A batch split for
`trainer.accumulate` does the same work per sample, so the figure holds under accumulation too.

The loop turns it into `perf/tflops` from numbers it has anyway (samples trained / epoch time): no
extra synchronisation. The count runs in a background thread while training begins: the first
dispatch mode a process enters imports TorchDynamo, over a second of start-up that the first epoch
need not wait for.

The count is not FlopCounterMode itself but a dispatch mode over its formulas: FlopCounterMode
attributes FLOPs to modules through global module hooks, which fire in every thread. On an H100
they fired inside torch.compile's tracing of the model in the training thread and broke it
("already tracked for mutation"). A dispatch mode is thread-local: the training thread never
sees it.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from mpexp.data.workers import wait_before_forking
from mpexp.step.meta_copy import meta_copy
from mpexp.tasks.base import Task
from mpexp.tracking.user_logs import user_logs_off

log = logging.getLogger(__name__)

# Dense (no sparsity) peak TFLOP/s from the vendors' datasheets: fp32 without tensor cores, TF32,
# fp16/bf16 and fp8 tensor-core math. Matched against the device name in this order, so that a
# variant with other peaks is listed before the name it contains. A variant whose peaks are not
# known here maps to None: no MFU rather than a wrong one (`trainer.peak_tflops` sets it). An fp8
# run's MFU is against the fp8 peak, although the layers fp8 leaves alone compute in bf16.
PEAK_TFLOPS: tuple[tuple[str, dict[str, float] | None], ...] = (
    ("H100 PCIe", {"fp32": 51.2, "tf32": 378.0, "fp16": 756.0, "bf16": 756.0, "fp8": 1513.0}),
    ("NVL", None),
    ("H200", {"fp32": 67.0, "tf32": 494.7, "fp16": 989.4, "bf16": 989.4, "fp8": 1978.9}),
    ("H100", {"fp32": 67.0, "tf32": 494.7, "fp16": 989.4, "bf16": 989.4, "fp8": 1978.9}),
    ("A100", {"fp32": 19.5, "tf32": 156.0, "fp16": 312.0, "bf16": 312.0}),  # no fp8 units
)


def device_peak_tflops(device_name: str, precision: str) -> float | None:
    """The dense peak of a listed GPU for a precision mode (fp32, tf32, fp16, bf16, fp8,
    bf16_pure, each maybe `+tf32`), else None."""
    for key, peaks in PEAK_TFLOPS:
        if key in device_name:
            return peaks.get(arithmetic(precision)) if peaks else None
    return None


def arithmetic(mode: str) -> str:
    """The peak a precision mode's matrix products are held to: pure bf16 computes in bf16 as
    autocast does, and `+tf32` (TF32 for what a 16-bit mode leaves in float32) changes nothing
    for the products that count."""
    kind = mode.split("+")[0]
    return "bf16" if kind == "bf16_pure" else kind


def flops_per_sample(model: nn.Module, task: Task, batch: int) -> float:
    """Forward and backward FLOPs of one training sample, counted on a batch of `batch` samples
    of the task's shapes, through the task's loss."""
    meta = model if any(p.is_meta for p in model.parameters()) else meta_copy(model)
    inputs, targets = task.example(batch, "meta")
    with _FlopCount() as counter:
        task.loss(meta(inputs), targets).backward()
    return counter.total / batch


class _FlopCount(TorchDispatchMode):
    """FlopCounterMode's total with its formulas (torch.utils.flop_counter.flop_registry), and none
    of its module tracking: nothing outside this thread's dispatch changes while it counts."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            self.total += formula(*args, **kwargs, out_val=out)
        return out


@dataclass(frozen=True)
class Throughput:
    """What an epoch's sample rate means in FLOP/s, and as a fraction of the devices' peak."""

    flops_per_sample: float | None  # None: the model could not be counted
    peak_tflops: float | None = None  # one device's, for the precision that ran
    devices: int = 1  # a distributed run's sample rate is the sum over its ranks

    def metrics(self, samples_per_s: float) -> dict[str, float]:
        """`perf/tflops`, and `perf/mfu` (a fraction of the peak) where the peak is known."""
        if self.flops_per_sample is None:
            return {}
        tflops = self.flops_per_sample * samples_per_s / 1e12
        row = {"perf/tflops": tflops}
        if self.peak_tflops:
            row["perf/mfu"] = tflops / (self.peak_tflops * self.devices)
        return row


def throughput(
    model: nn.Module, task: Task, batch: int, peak_tflops: float | None, devices: int
) -> Future[Throughput]:
    """The run's Throughput, counted in a background thread on a copy of the model taken now (so
    that training may change the model meanwhile). A model the meta device cannot run (a forward
    that reads a tensor's value, say) trains all the same, without perf/tflops: the count is a
    measurement, not a reason to stop."""
    meta = meta_copy(model)

    def count() -> Throughput:
        try:
            # the count's pass is no training step: what the model logs there is not logged
            with user_logs_off():
                per_sample = flops_per_sample(meta, task, batch)
        except Exception as err:
            log.warning("perf/tflops is not logged: counting the model's FLOPs failed (%s).", err)
            per_sample = None
        return Throughput(per_sample, peak_tflops, devices)

    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flop-count")
    counting = pool.submit(count)
    pool.shutdown(wait=False)  # the thread ends with the count
    # a loader's workers are forked once it has ended: a fork while it runs torch's code can
    # leave a worker hung (mpexp/data/workers.py)
    wait_before_forking(lambda: pool.shutdown(wait=True))
    return counting
