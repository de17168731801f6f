"""`Row`: one finished run's numbers, from its metrics.jsonl (`measure`), and as plain values
(`run_values`). A run whose final val loss or result (its task's result metric: val accuracy, a
language model's val loss) is not finite (NaN, inf) diverged: it is shown, marked, and left out of
its configuration's numbers."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

from mpexp.report.runs import Run
from mpexp.tasks.base import Result

# what a run's weights, gradients and optimizer states hold between steps (ran, from
# mpexp.precision.pure_updates.stored_bytes)
STATE_BYTES = ("bytes_weights", "bytes_grads", "bytes_states")
# a run's peak memory, by what it measures: CUDA tensors, or a CPU process's resident set
PEAK_KEYS = {"mem/peak_allocated_mib": "cuda", "mem/peak_rss_mib": "rss"}
# on a GPU beside the allocated peak: the allocator's reserved bytes, which hold a captured step's
# pool (mpexp.system.PeakMemory), the figure that must fit the device
RESERVED_KEY = "mem/peak_reserved_mib"
MEMORY_KEYS = (*PEAK_KEYS, RESERVED_KEY)  # every memory metric a run logs


@dataclass(eq=False)  # identity: a run is itself, whatever its numbers
class Row:
    """One finished run's numbers. Timing and peak memory come from the epochs after the first,
    which pays one-off costs (cuDNN autotuning, allocator growth, lazy initialisation) that say
    nothing about the precision; a one-epoch run has only that epoch to offer."""

    run: Run
    folder: str  # its directory, relative to the report's
    label: str  # the folder and the overrides that differ between the runs
    timed: list[float]  # seconds of each timed epoch
    samples_per_s: float
    tflops: float | None
    mfu: float | None
    data_wait_share: float | None  # of the epoch's time spent waiting on batches; None: not logged
    peak_mem_mib: float
    mem_kind: str
    peak_reserved_mib: float | None  # a GPU's; None on a CPU and for runs from before it
    val_loss: float
    result: float  # the final value of the task's result metric (val/acc, val/loss)
    skipped_steps: int

    @property
    def seed(self) -> Any:
        return self.run.config.get("trainer", {}).get("seed")

    @property
    def spec(self) -> Result:
        """What its result is and how it compares (the task it recorded; val accuracy before)."""
        return Result.from_record(self.run.ran.get("task"))

    @property
    def diverged(self) -> bool:
        """Its final val loss or result is not finite: no number of it can be averaged."""
        return not (math.isfinite(self.val_loss) and math.isfinite(self.result))

    @property
    def precision(self) -> str:
        return str(self.run.ran.get("precision", self.run.chosen("precision")))

    @property
    def effective_precision(self) -> str:
        return str(self.run.ran.get("effective_precision", self.precision))

    @property
    def loss_scaling(self) -> str:
        return str(self.run.ran.get("loss_scaling", self.run.chosen("loss_scaling")))

    @property
    def epoch_time_s(self) -> float:
        return statistics.median(self.timed)

    @property
    def compile_s(self) -> float:
        """Set-up time out of the epochs' times: compilation, the CUDA graph's warm-up and
        capture (0 for a run that had none)."""
        return sum(e.get("perf/compile_s", 0.0) for e in self.run.epochs)

    @property
    def state_bytes(self) -> dict[str, int] | None:
        """Bytes of its weights, gradients and optimizer states; None for a run from before
        mpexp recorded them."""
        ran = self.run.ran
        return {k: ran[k] for k in STATE_BYTES} if all(k in ran for k in STATE_BYTES) else None

    @property
    def planned_peak_mib(self) -> float | None:
        """Its plan's need (mpexp/plan/: a GPU run plans itself), in MiB, what the run logged as
        `mem/planned_peak_mib`; None for a run that was not planned."""
        plan = self.run.ran.get("plan") or {}
        needed = plan.get("need_bytes")
        if needed is None:  # a plan recorded before it had a need: its larger peak was that
            known = [p for p in (plan.get("peak_bytes") or {}).values() if p is not None]
            needed = max(known) if known else None
        return None if needed is None else needed / 2**20

    @property
    def step_peak_bytes(self) -> int | None:
        """The most its optimizer step holds at once (held bytes and the step's temporaries),
        where the run knows it (mpexp.precision.pure_updates.stored_bytes)."""
        return self.run.ran.get("bytes_step_peak")

    @property
    def updates_lost(self) -> float | None:
        """The mean of its opt/updates_lost over the run; None where it was not computed."""
        values = [d["opt/updates_lost"] for d in self.run.diagnostics if "opt/updates_lost" in d]
        return statistics.fmean(values) if values else None

    @property
    def rounding(self) -> str | None:
        """Pure bf16's update rounding and optimizer states' dtype, e.g. `kahan, states bf16`."""
        ran = self.run.ran
        if ran.get("update_rounding") is None:
            return None
        states = str(ran.get("optimizer_states")).replace("bfloat16", "bf16").replace("float", "fp")
        return f"{ran['update_rounding']}, states {states}"

    def time_to(self, target: float | None) -> float | None:
        """Training seconds (the epochs' times, warm-up and compilation included, validation
        not) until the result first reached `target`; None where it never did."""
        if target is None:
            return None
        spec, elapsed = self.spec, 0.0
        for epoch in self.run.epochs:
            elapsed += epoch["perf/epoch_time_s"] + epoch.get("perf/compile_s", 0.0)
            if spec.reached(epoch[spec.metric], target):
                return elapsed
        return None


def measure(run: Run, folder: str, label: str) -> Row:
    """A finished run's row; KeyError names a metric its metrics.jsonl lacks."""
    timed_epochs = run.epochs[1:] or run.epochs
    mem_key = next((k for k in PEAK_KEYS if k in run.epochs[0]), None)
    if mem_key is None:
        raise KeyError("mem/peak_*_mib")
    last = run.epochs[-1]
    skipped = run.steps[-1]["amp/skipped_steps"] if run.steps else 0
    return Row(
        run=run,
        folder=folder,
        label=label,
        timed=[e["perf/epoch_time_s"] for e in timed_epochs],
        samples_per_s=statistics.median(e["perf/samples_per_s"] for e in timed_epochs),
        tflops=_median_of(timed_epochs, "perf/tflops"),  # runs from before mpexp logged it lack it
        mfu=_median_of(timed_epochs, "perf/mfu"),  # only where the device's peak was known
        data_wait_share=_median_of(timed_epochs, "perf/data_wait_share"),  # logged since issue 38
        # the timed epochs' too: the first epoch's CUDA peak holds cuDNN's autotuning workspaces
        # (DeepCNN in fp32 on an H100: 4628 MiB, then 1120), which are no precision's footprint
        peak_mem_mib=max(e[mem_key] for e in timed_epochs),
        mem_kind=PEAK_KEYS[mem_key],
        peak_reserved_mib=_max_of(timed_epochs, RESERVED_KEY),
        val_loss=last["val/loss"],
        result=last[Result.from_record(run.ran.get("task")).metric],
        skipped_steps=int(skipped),
    )


def _median_of(epochs: list[dict], key: str) -> float | None:
    values = [e[key] for e in epochs if key in e]
    return statistics.median(values) if len(values) == len(epochs) else None


def _max_of(epochs: list[dict], key: str) -> float | None:
    values = [e[key] for e in epochs if key in e]
    return max(values) if values and len(values) == len(epochs) else None


def run_values(row: Row, target: float | None) -> dict[str, Any]:
    """One run as plain values (the W&B runs table, report.md's runs table)."""
    return {
        "run": row.label,
        "seed": row.seed,
        "precision": row.precision,
        "effective_precision": row.effective_precision,
        "loss_scaling": row.loss_scaling,
        "diverged": row.diverged,
        "result_metric": row.spec.metric,
        "result": row.spec.scale * row.result,
        "val_loss": row.val_loss,
        "epoch_time_s": row.epoch_time_s,
        "epoch_time_min_s": min(row.timed),
        "epoch_time_max_s": max(row.timed),
        "timed_epochs": len(row.timed),
        "samples_per_s": row.samples_per_s,
        "tflops": row.tflops,
        "mfu_pct": None if row.mfu is None else 100 * row.mfu,
        "data_wait_pct": None if row.data_wait_share is None else 100 * row.data_wait_share,
        "time_to_target_s": row.time_to(target),
        "peak_mem_mib": row.peak_mem_mib,
        "peak_reserved_mib": row.peak_reserved_mib,
        "planned_peak_mib": row.planned_peak_mib,
        "skipped_steps": row.skipped_steps,
        "update_rounding": row.rounding,
        "updates_lost": row.updates_lost,
        **{k: (row.state_bytes or {}).get(k) for k in STATE_BYTES},
    }
