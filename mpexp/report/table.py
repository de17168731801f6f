"""The report's numbers.

- `Row`: one finished run, from its metrics.jsonl; a run whose final val loss or result (its task's
  result metric: val accuracy, a language model's val loss) is not finite (NaN, inf) diverged: it
  is shown, marked, and left out of its configuration's numbers;
- `Config`: the runs that differ only in `trainer.seed`, as means with 95 % intervals over seeds,
  judged by their task's result metric and compared with their fp32 reference: the fp32
  configuration with the same other overrides (in a
  precision x loss-scaling grid, the one without loss scaling); an fp8 configuration also with its
  bf16 reference, chosen the same way;
- `Report`: the configurations, the runs that could not be reported (named, not dropped) and the
  warnings that say when timings cannot be compared.
"""

from __future__ import annotations

import math
import os
import statistics
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from mpexp.errors import UserError
from mpexp.report.runs import Run, find_run_dirs, load_run
from mpexp.report.stats import Estimate, difference, mean, paired_difference, ratio
from mpexp.tasks.base import Result

BASELINE = "fp32"
# fp8 is also compared with bf16: what it leaves unconverted runs in bf16, and bf16 is the mode
# it would replace
BF16, FP8 = "bf16", "fp8"
PURE = "bf16_pure"
# what a run's weights, gradients and optimizer states hold between steps (ran, from
# mpexp.precision.pure_updates.stored_bytes)
STATE_BYTES = ("bytes_weights", "bytes_grads", "bytes_states")
MEMORY_KEYS = {"mem/peak_allocated_mib": "cuda", "mem/peak_rss_mib": "rss"}
MIN_TIMED_EPOCHS = 3  # fewer, and a median epoch time is one or two noisy numbers
# a run that waits on its data for more than this share of its epochs times the data, not the step
# (the loop warns at the same share: mpexp/step/loop.py)
DATA_BOUND = 0.1
SEED = "trainer.seed"
# overrides that do not make another configuration: seeds are its repeats, a resumed run is itself
NOT_CONFIG = (SEED, "trainer.resume")
# overrides that a configuration's fp32 reference may differ in
PRECISION_KEYS = ("precision", "loss_scaling")


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
        """The larger of its plan's peaks (mpexp/plan/: a GPU run plans itself), in MiB; None for
        a run that was not planned."""
        peaks = (self.run.ran.get("plan") or {}).get("peak_bytes") or {}
        known = [p for p in peaks.values() if p is not None]
        return max(known) / 2**20 if known else None

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
    mem_key = next((k for k in MEMORY_KEYS if k in run.epochs[0]), None)
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
        mem_kind=MEMORY_KEYS[mem_key],
        val_loss=last["val/loss"],
        result=last[Result.from_record(run.ran.get("task")).metric],
        skipped_steps=int(skipped),
    )


def _median_of(epochs: list[dict], key: str) -> float | None:
    values = [e[key] for e in epochs if key in e]
    return statistics.median(values) if len(values) == len(epochs) else None


def _key(override: str) -> str:
    """The config key an override sets: `+trainer.seed=3` -> `trainer.seed`."""
    return override.split("=", 1)[0].lstrip("+~")


def _in(override: str, groups: tuple[str, ...]) -> bool:
    key = _key(override)
    return any(key == g or key.startswith(g + ".") for g in groups)


@dataclass(eq=False)
class Config:
    """The runs that differ only in `trainer.seed`, and the fp32 configuration compared with.

    Its numbers come from the runs that did not diverge (`rows`); a configuration whose every run
    diverged has none, and is compared with nothing.
    """

    label: str
    members: list[Row]  # every run, in job order
    overrides: tuple[str, ...]  # sorted, without the seed
    tolerance: float  # in the result's unit (points of accuracy, nats)
    reference: Config | None = None
    target: float | None = None  # the result metric's value (a fraction of accuracy) to reach
    bf16_reference: Config | None = None  # an fp8 configuration's bf16 counterpart

    @property
    def rows(self) -> list[Row]:
        """The runs its numbers come from: those that did not diverge."""
        return [r for r in self.members if not r.diverged]

    @property
    def diverged(self) -> list[Row]:
        return [r for r in self.members if r.diverged]

    @property
    def first(self) -> Row:
        return self.members[0]

    @property
    def n(self) -> int:
        return len(self.rows)

    @property
    def task(self) -> tuple[str, ...]:
        """The overrides its fp32 reference shares: all but precision and loss scaling."""
        return tuple(o for o in self.overrides if not _in(o, PRECISION_KEYS))

    @property
    def is_reference(self) -> bool:
        return self.reference is self

    def _each(self, attribute: str) -> list[float]:
        return [getattr(r, attribute) for r in self.rows]

    def _mean_of(self, attribute: str, scale: float = 1.0) -> Estimate | None:
        values = self._each(attribute)
        return None if not values or None in values else mean([scale * v for v in values])

    @property
    def spec(self) -> Result:
        return self.first.spec

    @property
    def result(self) -> Estimate:
        """The final result over seeds, in the result's unit (val accuracy in percent)."""
        return self._mean_of("result", self.spec.scale)

    @property
    def val_loss(self) -> Estimate:
        return self._mean_of("val_loss")

    @property
    def epoch_time_s(self) -> Estimate:
        """Over seeds: each run's median epoch time."""
        return self._mean_of("epoch_time_s")

    @property
    def samples_per_s(self) -> Estimate:
        return self._mean_of("samples_per_s")

    @property
    def tflops(self) -> Estimate | None:
        return self._mean_of("tflops")

    @property
    def data_wait_pct(self) -> Estimate | None:
        """Percent of the epochs' time the step waited on its data, where every run logged it."""
        return self._mean_of("data_wait_share", 100.0)

    @property
    def compile_s(self) -> Estimate:
        return self._mean_of("compile_s")

    @property
    def mfu_pct(self) -> Estimate | None:
        return self._mean_of("mfu", 100)

    @property
    def updates_lost(self) -> Estimate | None:
        return self._mean_of("updates_lost")

    @property
    def state_bytes(self) -> dict[str, int] | None:
        """Its runs' bytes of weights, gradients and states (the same for every seed)."""
        return self.first.state_bytes

    @property
    def state_ratio(self) -> float | None:
        """Its weights', gradients' and states' bytes over its fp32 reference's."""
        mine = self.state_bytes
        theirs = self.reference.state_bytes if self.reference is not None else None
        if mine is None or theirs is None or not sum(theirs.values()):
            return None
        return sum(mine.values()) / sum(theirs.values())

    @property
    def peak_mem_mib(self) -> float | None:
        return statistics.fmean(self._each("peak_mem_mib")) if self.rows else None

    @property
    def mem_kind(self) -> str:
        return self.first.mem_kind

    @property
    def planned_peak_mib(self) -> float | None:
        """Its plan's peak (the same for every seed: a plan depends on no seed)."""
        planned = [p for p in self._each("planned_peak_mib") if p is not None]
        return max(planned) if planned else None

    def _difference(
        self, attribute: str, scale: float = 1.0, other: Config | None = None
    ) -> Estimate | None:
        """This configuration's mean minus its reference's (or `other`'s): paired by seed when
        both ran the same seeds (the same initial weights and data order on each side of a pair),
        else Welch's."""
        other = other or self.reference
        if not self._comparable(other):
            return None
        if other is self:
            return Estimate(0.0)
        mine = {r.seed: scale * getattr(r, attribute) for r in self.rows}
        theirs = {r.seed: scale * getattr(r, attribute) for r in other.rows}
        if len(mine) == self.n and len(theirs) == other.n and mine.keys() == theirs.keys():
            return paired_difference([mine[s] for s in mine], [theirs[s] for s in mine])
        return difference(
            [scale * v for v in self._each(attribute)],
            [scale * v for v in other._each(attribute)],
        )

    def _comparable(self, other: Config | None) -> bool:
        """Both sides have runs that did not diverge."""
        return other is not None and bool(self.rows) and bool(other.rows)

    @property
    def d_result(self) -> Estimate | None:
        """The result minus its fp32 reference's, in the result's unit (points, nats)."""
        return self._difference("result", self.spec.scale)

    @property
    def d_val_loss(self) -> Estimate | None:
        return self._difference("val_loss")

    @property
    def parity(self) -> str:
        """How its final result compares with the fp32 reference's, at 95 %: `diverged` (every
        run did), `reference`, `no reference`, `reference diverged`, `single seed` (no interval
        on one side), `within noise` (the interval of the difference lies on the good side of
        -tolerance: not worse by more than the tolerance), `worse` (it lies beyond the tolerance
        on the bad side), `better` (beyond it on the good side), or `too wide` (it straddles the
        tolerance: more seeds would tell). Good and bad follow the result's direction: a higher
        accuracy, a lower language-model loss."""
        return self._parity(self.reference, self.d_result)

    def _parity(self, reference: Config | None, diff: Estimate | None) -> str:
        if not self.rows:
            return "diverged"
        if reference is None:
            return "no reference"
        if reference is self:
            return "reference"
        if not reference.rows:
            return "reference diverged"
        return verdict(self.gain(diff), self.tolerance)

    def gain(self, diff: Estimate | None) -> Estimate | None:
        """A difference turned so that positive is better: the loss's difference negated."""
        if diff is None or self.spec.higher_is_better:
            return diff
        low = None if diff.high is None else -diff.high
        high = None if diff.low is None else -diff.low
        return Estimate(-diff.value, low, high)

    @property
    def d_result_vs_bf16(self) -> Estimate | None:
        """An fp8 configuration's result minus its bf16 reference's, in the result's unit."""
        if self.bf16_reference is None:
            return None
        return self._difference("result", self.spec.scale, self.bf16_reference)

    @property
    def parity_vs_bf16(self) -> str | None:
        """For an fp8 configuration, the parity verdict against its bf16 reference (`no
        reference` without one); None for the other precisions."""
        if self.first.precision != FP8:
            return None
        return self._parity(self.bf16_reference, self.d_result_vs_bf16)

    @property
    def speedup_vs_bf16(self) -> Estimate | None:
        """The bf16 reference's mean epoch time over this fp8 configuration's."""
        if not self._comparable(self.bf16_reference):
            return None
        return ratio(self.bf16_reference._each("epoch_time_s"), self._each("epoch_time_s"))

    @property
    def speedup(self) -> Estimate | None:
        """The reference's mean epoch time over this one's."""
        if not self._comparable(self.reference):
            return None
        if self.is_reference:
            return Estimate(1.0)
        return ratio(self.reference._each("epoch_time_s"), self._each("epoch_time_s"))

    @property
    def times_to_target(self) -> list[float | None]:
        return [r.time_to(self.target) for r in self.rows]

    @property
    def time_to_target(self) -> Estimate | None:
        """Mean over seeds, when every seed reached the target."""
        times = self.times_to_target
        return None if self.target is None or not times or None in times else mean(times)

    @property
    def reached(self) -> int:
        return sum(t is not None for t in self.times_to_target)

    @property
    def speedup_at_target(self) -> Estimate | None:
        """The reference's time to the target over this one's: the speedup at equal accuracy."""
        if self.reference is None or None in (self.time_to_target, self.reference.time_to_target):
            return None
        if self.is_reference:
            return Estimate(1.0)
        return ratio(self.reference.times_to_target, self.times_to_target)

    @property
    def mem_ratio(self) -> float | None:
        # CUDA tensor memory and CPU process RSS measure different things: no ratio between them
        if not self._comparable(self.reference) or self.reference.mem_kind != self.mem_kind:
            return None
        return self.peak_mem_mib / self.reference.peak_mem_mib

    def values(self) -> dict[str, Any]:
        """The configuration as plain values: the W&B table's columns, what report.md formats."""
        values: dict[str, Any] = {
            "configuration": self.label,
            "runs": ", ".join(r.folder for r in self.members),
            "precision": self.first.precision,
            "effective_precision": self.first.effective_precision,
            "loss_scaling": self.first.loss_scaling,
            "model": self.first.run.chosen("model"),
            "dataset": self.first.run.chosen("dataset"),
            "n": self.n,
            "diverged": len(self.diverged),
            "parity": self.parity,
            "bf16_reference": self.bf16_reference.label if self.bf16_reference else None,
            "parity_vs_bf16": self.parity_vs_bf16,
            "result_metric": self.spec.metric,
            "target": None if self.target is None else self.spec.scale * self.target,
            "reached_target": None if self.target is None else self.reached,
            "mem_kind": self.mem_kind,
            "peak_mem_mib": self.peak_mem_mib,
            "planned_peak_mib": self.planned_peak_mib,
            "mem_ratio": self.mem_ratio,
            "update_rounding": self.first.rounding,
            **{k: (self.state_bytes or {}).get(k) for k in STATE_BYTES},
            "state_ratio": self.state_ratio,
        }
        estimates = {
            "result": self.result,
            "d_result": self.d_result,
            "d_result_vs_bf16": self.d_result_vs_bf16,
            "val_loss": self.val_loss,
            "d_val_loss": self.d_val_loss,
            "epoch_time_s": self.epoch_time_s,
            "speedup": self.speedup,
            "speedup_vs_bf16": self.speedup_vs_bf16,
            "time_to_target_s": self.time_to_target,
            "speedup_at_target": self.speedup_at_target,
            "samples_per_s": self.samples_per_s,
            "tflops": self.tflops,
            "mfu_pct": self.mfu_pct,
            "data_wait_pct": self.data_wait_pct,
            "updates_lost": self.updates_lost,
        }
        for name, estimate in estimates.items():
            values[name] = None if estimate is None else estimate.value
            values[f"{name}_low"] = None if estimate is None else estimate.low
            values[f"{name}_high"] = None if estimate is None else estimate.high
        return values


def verdict(diff: Estimate, tolerance: float) -> str:
    """The parity verdict on the interval of a difference turned so that positive is better
    (points of accuracy; a loss's negated) at `tolerance`:
    `single seed` (no interval), `worse` (it lies below -tolerance), `better` (above +tolerance),
    `within noise` (above -tolerance: not worse by more than the tolerance) or `too wide` (it
    straddles -tolerance: more seeds would tell)."""
    if diff.low is None:
        return "single seed"
    if diff.high < -tolerance:
        return "worse"
    if diff.low > tolerance:
        return "better"
    if diff.low >= -tolerance:
        return "within noise"
    return "too wide"


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
        "planned_peak_mib": row.planned_peak_mib,
        "skipped_steps": row.skipped_steps,
        "update_rounding": row.rounding,
        "updates_lost": row.updates_lost,
        **{k: (row.state_bytes or {}).get(k) for k in STATE_BYTES},
    }


def group_configs(rows: list[Row], tolerance: float | None) -> list[Config]:
    """Runs whose overrides differ only in the seed, as configurations, in job order; each
    judged at `tolerance`, or its task's own when None (0.5 points of accuracy, 0.02 nats).

    What ran (precision, loss scaling, model, dataset) is part of a configuration too, so that runs
    without a Hydra record of their overrides (trained from Python) are not mixed up.
    """
    groups: dict[tuple[str, ...], list[Row]] = {}
    for row in rows:
        ran = {
            f"precision={row.precision}",
            f"loss_scaling={row.loss_scaling}",
            f"model={row.run.chosen('model')}",
            f"dataset={row.run.chosen('dataset')}",
        }
        given = {o for o in row.run.overrides if not _in(o, NOT_CONFIG)}
        key = tuple(sorted(given | ran))
        groups.setdefault(key, []).append(row)
    common = set.intersection(*(set(k) for k in groups)) if groups else set()
    configs = []
    for key, members in groups.items():
        ordered = [o for o in members[0].run.overrides if o in key and o not in common]
        folders = ", ".join(r.folder for r in members)
        allowed = members[0].spec.tolerance if tolerance is None else tolerance
        configs.append(Config(",".join(ordered) or folders, members, key, allowed))
    return configs


def attach_references(configs: list[Config], target: float | None) -> None:
    """Give each configuration its fp32 reference (an fp8 one also its bf16 reference) and its
    target for the time to target.

    The target is `target` (in the result's unit: percent of accuracy, nats) when given, else
    the reference's mean final result less good by the tolerance: the value at which a 16-bit
    run counts as having matched it.
    """
    for config in configs:
        config.reference = _reference(configs, config, BASELINE)
        if config.first.precision == FP8:
            config.bf16_reference = _reference(configs, config, BF16)
    for config in configs:
        spec = config.spec
        if target is not None:
            config.target = target / spec.scale
        elif config.reference is not None and config.reference.rows:
            slack = config.tolerance if spec.higher_is_better else -config.tolerance
            config.target = (config.reference.result.value - slack) / spec.scale


def _reference(configs: list[Config], config: Config, precision: str) -> Config | None:
    """The `precision` configuration with `config`'s other overrides; in a precision x
    loss-scaling grid, the one without loss scaling."""
    candidates = [c for c in configs if c.first.precision == precision and c.task == config.task]
    candidates.sort(key=lambda c: c.first.loss_scaling != "none")  # stable: first listed wins
    return candidates[0] if candidates else None


def step_paths(config: Config) -> str:
    """The step paths its runs recorded, joined ("" where none did)."""
    return " / ".join(sorted({str(r.run.ran["step_path"]) for r in config.rows
                              if r.run.ran.get("step_path")}))  # fmt: skip


def overlapping(rows: list[Row]) -> list[Row]:
    """Runs that trained while another run trained on the same host: a parallel launcher's jobs
    share the machine, so their timings are not comparable. Runs without times are left out."""
    spans = []
    for row in rows:
        summary = row.run.summary
        if summary.get("started_at") and summary.get("ended_at"):
            start = datetime.fromisoformat(summary["started_at"])
            end = datetime.fromisoformat(summary["ended_at"])
            spans.append((row, row.run.ran.get("host"), start, end))
    return [
        row
        for row, host, start, end in spans
        if any(
            other is not row and other_host == host and start < other_end and other_start < end
            for other, other_host, other_start, other_end in spans
        )
    ]


@dataclass
class Report:
    out_dir: Path
    configs: list[Config]
    not_reported: list[tuple[str, Run]]
    tolerance: float | None  # --tolerance; None: each configuration's task's own
    target: float | None = None  # --target, in the result's unit (percent of accuracy, nats)
    plots: dict[str, Path] = field(default_factory=dict)
    plots_drawn: bool = True  # False: --no-plots

    @property
    def path(self) -> Path:
        return self.out_dir / "report.md"

    @property
    def rows(self) -> list[Row]:
        """Every reported run, diverged ones too."""
        return [r for c in self.configs for r in c.members]

    @property
    def diverged(self) -> list[Row]:
        return [r for c in self.configs for r in c.diverged]

    @property
    def worse(self) -> list[Config]:
        return [c for c in self.configs if c.parity == "worse"]

    @property
    def worse_than_bf16(self) -> list[Config]:
        return [c for c in self.configs if c.parity_vs_bf16 == "worse"]

    @property
    def few_timed_epochs(self) -> list[Row]:
        return [r for r in self.rows if len(r.timed) < MIN_TIMED_EPOCHS]

    @property
    def overlapping(self) -> list[Row]:
        return overlapping(self.rows)

    @property
    def other_step_paths(self) -> list[tuple[Config, str, str]]:
        """Configurations whose step ran another way than their fp32 reference's (fused or
        not, compiled, captured, where the schedule ran): (config, its path, the reference's).
        Runs recorded before mpexp recorded the path are left out."""
        found = []
        for c in self.configs:
            ref = c.reference
            if ref is None or ref is c or not c.rows or not ref.rows:
                continue
            path, ref_path = step_paths(c), step_paths(ref)
            if path and ref_path and path != ref_path:
                found.append((c, path, ref_path))
        return found

    @property
    def data_bound(self) -> list[Row]:
        """Runs that waited on their data for more than DATA_BOUND of their timed epochs."""
        return [r for r in self.rows if (r.data_wait_share or 0.0) > DATA_BOUND]

    def console_lines(self) -> list[str]:
        lines = [
            f"Sweep report: {self.path} (runs reported: {len(self.rows)}, "
            f"configurations: {len(self.configs)})"
        ]
        for c, reference, d in [
            *((c, "fp32", c.d_result) for c in self.worse),
            *((c, "bf16", c.d_result_vs_bf16) for c in self.worse_than_bf16),
        ]:
            unit, n = c.spec.unit, c.spec.decimals
            lines.append(
                f"  worse than {reference} by more than {c.tolerance:g} {unit} of "
                f"{c.spec.metric}: {c.label} ({d.value:+.{n}f} ± {d.half_width:.{n}f} {unit})"
            )
        if self.diverged:
            names = ", ".join(r.label for r in self.diverged)
            lines.append(f"  diverged (final val loss or result not finite): {names}")
        lines += [f"  not reported: {label}: {run.problem}" for label, run in self.not_reported]
        return lines


def build_report(
    paths: list[Path],
    tolerance: float | None = None,
    out_dir: Path | None = None,
    target: float | None = None,
) -> Report:
    """Read every run under `paths` and compute the tables; nothing is written yet.
    `tolerance` (None: each task's own) and `target` are in the result's unit, as on the command
    line: points and percent of accuracy, nats of a language model's loss."""
    runs = [load_run(p) for p in find_run_dirs(paths)]
    out_dir = report_dir(paths, out_dir)
    labels = _labels(runs, out_dir.resolve())
    rows, not_reported = [], []
    for run in runs:
        folder, label = labels[run.path]
        if run.problem is None:
            try:
                rows.append(measure(run, folder, label))
                continue
            except KeyError as missing:
                run.problem = f"metrics.jsonl has no {missing.args[0]} values"
        not_reported.append((label, run))
    configs = group_configs(rows, tolerance)
    _check_target(target, configs)
    attach_references(configs, target)
    return Report(out_dir, configs, not_reported, tolerance, target)


def report_dir(paths: list[Path], out_dir: Path | None = None) -> Path:
    """Where the report on `paths` goes: `out_dir` (--out), else the folder given, or the common
    parent of several."""
    return out_dir or Path(os.path.commonpath([p.resolve() for p in paths]))


def _check_target(target: float | None, configs: list[Config]) -> None:
    """A target that a configuration's result cannot take: an accuracy outside (0, 100] %."""
    if target is None:
        return
    for config in configs:
        spec = config.spec
        if spec.value_unit == "%" and not 0 < target <= 100:
            raise UserError(
                f"--target {target:g} is not a {spec.metric} in percent (0 to 100]: "
                f"`{config.label}` is judged by {spec.metric}."
            )


def _labels(runs: list[Run], out_dir: Path) -> dict[Path, tuple[str, str]]:
    """Each run's folder and label, `<folder> <overrides that differ between the runs>`, e.g.
    `2 precision=fp16`."""
    common = set.intersection(*(set(r.overrides) for r in runs))
    labels = {}
    for run in runs:
        folder = run.path.name if run.path == out_dir else os.path.relpath(run.path, out_dir)
        differing = ",".join(o for o in run.overrides if o not in common)
        labels[run.path] = (folder, f"{folder} {differing}".strip())
    return labels
