"""The devices a plan can be made for by name (`--device-memory h100`), and the time a step may
take on one: its FLOPs at a typical share of the device's dense peak, an estimate."""

from __future__ import annotations

from dataclasses import dataclass

from mpexp.step.flops import device_peak_tflops

MiB = 2**20
# the memory PyTorch reports for each card (total_memory, as public logs of it show), and the
# name mpexp.step.flops.PEAK_TFLOPS knows its peaks by (None: no peaks listed there)
DEVICES: dict[str, tuple[int, str | None]] = {
    "h100": (81_090 * MiB, "H100"),  # the 80 GB SXM card
    "h100-80gb": (81_090 * MiB, "H100"),
    "h200": (143_156 * MiB, "H200"),
    "a100-40gb": (40_536 * MiB, "A100"),
    "a100-80gb": (81_920 * MiB, "A100"),
    "l4": (23_034 * MiB, None),
    "rtx4090": (24_563 * MiB, None),
}
# perf/mfu that a step reaches when nothing else is known: GPT-2 small's in bf16 on an H100,
# compiled (33.6 %, docs/benchmarks.md)
TYPICAL_MFU = 0.33


@dataclass(frozen=True)
class Device:
    """A device a plan is judged against: its memory, and its name where known."""

    memory: int | None
    name: str | None = None


def named(text: str) -> Device | None:
    """The device `text` names (h100, a100-40gb, ...), or None."""
    known = DEVICES.get(text.strip().lower().replace("_", "-"))
    return None if known is None else Device(known[0], known[1])


def names() -> str:
    return ", ".join(DEVICES)


def peak_tflops(device_name: str | None, precision: str) -> float | None:
    """The dense peak for `precision` (a row's effective precision) of a device known by name."""
    return None if device_name is None else device_peak_tflops(device_name, precision)


def step_seconds(
    flops: float | None, device_name: str | None, precision: str, processes: int, mfu: float
) -> float | None:
    """An optimizer step's time at `mfu` of the devices' peak (None: no FLOPs or no peak)."""
    peak = peak_tflops(device_name, precision)
    if flops is None or peak is None:
        return None
    return flops / (peak * 1e12 * mfu * processes)
