"""Device choice, seeding and memory readings."""

from __future__ import annotations

import contextlib
import os
import platform
import random
import sys
from pathlib import Path

import numpy as np
import torch

from mpexp.errors import ConfigError


def resolve_device(choice: str) -> torch.device:
    """auto takes CUDA when present; cuda without a GPU is an error, not a silent CPU run."""
    if choice == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if choice == "cuda":
        raise ConfigError(
            "trainer.device=cuda but PyTorch sees no CUDA GPU (torch.cuda.is_available() is "
            "False).\nUse trainer.device=cpu (or auto), or a CUDA build of torch on a GPU machine."
        )
    return torch.device("cpu")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # seeds every CUDA device too


def set_deterministic(enabled: bool) -> None:
    """PyTorch's reproducibility switches, set both ways since they are process-wide.

    On: only deterministic kernels (an op without one raises instead of silently varying) and no
    cuDNN autotuning, which may pick different algorithms from run to run.
    """
    if enabled:
        # cuBLAS is deterministic only with a fixed workspace; read when its handle is created
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
    # the call imports torch._inductor (over a second): only make it when the switch changes
    if torch.are_deterministic_algorithms_enabled() != enabled:
        torch.use_deterministic_algorithms(enabled)
    torch.backends.cudnn.deterministic = enabled


def available_memory_bytes() -> int | None:
    """Memory the system can give a process now without swapping (Linux's MemAvailable); None
    where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class PeakMemory:
    """Peak memory over an interval: CUDA allocator bytes on a GPU, resident set size on CPU.

    On a GPU also the allocator's reserved bytes (`mem/peak_reserved_mib`): a step captured as
    a CUDA graph allocates its activations once, in a pool of its own that stays reserved, so
    the allocated peak of its replays leaves them out; the reserved one is what must fit."""

    RESERVED = "mem/peak_reserved_mib"

    def __init__(self, device: torch.device):
        self.device = device
        self.key = "mem/peak_allocated_mib" if device.type == "cuda" else "mem/peak_rss_mib"

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            _reset_peak_rss()

    def read_mib(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**20
        return _peak_rss_kib() / 1024

    def read(self) -> dict[str, float]:
        """The interval's peaks by metric name."""
        row = {self.key: self.read_mib()}
        if self.device.type == "cuda":
            row[self.RESERVED] = torch.cuda.max_memory_reserved(self.device) / 2**20
        return row


def _reset_peak_rss() -> None:
    # Linux resets VmHWM (the RSS high-water mark) on writing 5 to clear_refs; elsewhere the peak
    # simply stays the process's lifetime peak.
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def _peak_rss_kib() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return float(line.split()[1])
    except OSError:
        pass
    import resource

    peak = float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    return peak / 1024 if sys.platform == "darwin" else peak  # bytes on macOS, KiB elsewhere
