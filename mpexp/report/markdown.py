"""report.md: warnings, the result and speed tables by configuration (fp8 also against bf16),
the runs, the plots. The result is each task's own metric (val accuracy, a language model's val
loss), shown in its unit."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable

from mpexp.report import pure_advice
from mpexp.report.axes import Curve, Panel, SweepAxis, kept_up_to, sweep_axis
from mpexp.report.configuration import FP8, PURE, Config
from mpexp.report.row import STATE_BYTES, Row, run_values
from mpexp.report.sensitivity import curve_sensitivity
from mpexp.report.stats import Estimate
from mpexp.report.table import DATA_BOUND, MIN_TIMED_EPOCHS, Report
from mpexp.tasks.base import Result

PLOT_TITLES = {
    "result": "The result per epoch and over training time",
    "loss_curves": "Loss curves",
    "epoch_time": "Epoch time and its spread",
    "peak_memory": "Peak memory",
    "loss_scale": "Loss scale per scaled run (skipped steps marked x)",
    "underflow": "fp16 underflow per layer",
}


def render_markdown(report: Report) -> str:
    lines = [f"# Sweep report: {report.out_dir.parent.name}/{report.out_dir.name}", ""]
    rows = report.rows
    lines.append(
        f"Runs under `{report.out_dir}`: {len(rows)} reported in {len(report.configs)} "
        f"configurations, {len(report.not_reported)} not reported."
    )
    if rows:
        machines = sorted(
            {f"{r.run.ran.get('device_name')} ({r.run.ran.get('device')})" for r in rows}
        )
        torches = sorted({str(r.run.ran.get("torch_version")) for r in rows})
        lines.append(f"Ran on {', '.join(machines)} with torch {', '.join(torches)}.")
    lines.append("")
    if rows:
        lines += _warnings(report)
        for spec, configs in _by_result(report.configs).items():
            lines += _result_section(spec, configs)
        lines += _sweep_section(report)
        lines += _fp8_section(report)
        lines += _state_section(report)
        lines += _speed_section(report)
        lines += _runs_section(report)
    if report.not_reported:
        lines += ["## Not reported", ""]
        lines += [f"- `{label}`: {run.problem}" for label, run in report.not_reported]
        lines.append("")
    if rows:
        lines += _plots_section(report)
    return "\n".join(lines)


# --- cells ---------------------------------------------------------------------------------------


def _number(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _estimate(e: Estimate | None, spec: str) -> str:
    """`mean ± half-width` of the 95 % interval, or the value alone without an interval."""
    if e is None:
        return "n/a"
    if e.low is None:
        return format(e.value, spec)
    return f"{e.value:{spec}} ± {e.half_width:{spec.lstrip('+')}}"


def _ratio(e: Estimate | None) -> str:
    """`1.52x (1.40 to 1.65)`: a ratio's interval is not symmetric."""
    if e is None:
        return "n/a"
    if e.low is None:
        return f"{e.value:.2f}x"
    return f"{e.value:.2f}x ({e.low:.2f} to {e.high:.2f})"


VERDICTS = {
    "diverged": "**diverged**",
    "reference": "fp32 reference",
    "no reference": "no fp32 reference",
    "reference diverged": "fp32 reference diverged",
    "single seed": "inconclusive: single seed",
    "within noise": "within noise",
    "too wide": "inconclusive: interval too wide",
}


def parity_text(config: Config) -> str:
    """The verdict on the result; a difference beyond the tolerance comes with its size."""
    return _verdict_text(config, config.parity, config.d_result, VERDICTS)


def _verdict_text(config: Config, verdict: str, d: Estimate | None, names: dict[str, str]) -> str:
    gain, unit, value = config.gain(d), config.spec.unit, _value_format(config.spec)
    if verdict == "worse":
        return f"**worse by {-gain.value:{value}} ± {gain.half_width:{value}} {unit}**"
    if verdict == "better":
        return f"better by {gain.value:{value}} ± {gain.half_width:{value}} {unit}"
    return names[verdict]


def _by_result(configs: list[Config]) -> dict[Result, list[Config]]:
    """The configurations by the result they are judged by (one table each)."""
    groups: dict[Result, list[Config]] = {}
    for config in configs:
        groups.setdefault(config.spec, []).append(config)
    return groups


def _value_header(spec: Result) -> str:
    return f"{spec.name} ({spec.shown_in})"


def _value_format(spec: Result) -> str:
    return f".{spec.decimals}f"


def _precision(row: Row) -> str:
    if row.precision.startswith(FP8):  # the recipe, and whether the fp8 matmuls were emulated
        ran = row.run.ran
        details = [ran.get("fp8_recipe"), "emulated" if ran.get("emulated") else None]
        shown = ", ".join(d for d in details if d)
        return f"{row.precision} ({shown})" if shown else row.precision
    if row.effective_precision != row.precision:
        return f"{row.precision} (ran as {row.effective_precision})"
    return row.precision


def _time_to_target(config: Config) -> str:
    if config.target is None or not config.rows:
        return "n/a"
    if config.reached == config.n:
        return _estimate(config.time_to_target, ".1f")
    if config.reached == 0:
        return "not reached"
    return f"reached by {config.reached} of {config.n}"


def _table(headers: list[str], items: list, cells: Callable[[object], list[str]]) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for item in items:
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells(item)) + " |")
    return lines


# --- sections ------------------------------------------------------------------------------------


def _warnings(report: Report) -> list[str]:
    warnings = []
    few = report.few_timed_epochs
    if few:
        one_epoch = [r for r in few if len(r.run.epochs) == 1]
        warnings.append(
            f"**Few timed epochs.** {_names(few)} timed fewer than {MIN_TIMED_EPOCHS} epochs (the "
            "first epoch is not timed: it pays warm-up): an epoch time from one or two epochs is "
            f"as much noise as measurement. Train for at least {MIN_TIMED_EPOCHS + 1} epochs to "
            "compare speed."
            + (
                f" {_names(one_epoch)} trained one epoch: its time includes the warm-up."
                if one_epoch
                else ""
            )
        )
    overlapping = report.overlapping
    if overlapping:
        warnings.append(
            f"**Jobs overlapped in time.** {_names(overlapping)} trained while other jobs of "
            "these runs trained on the same machine (a parallel launcher): they competed for it, "
            "so their epoch times, speedups and times to target are not comparable. Run the jobs "
            "one after another (Hydra's default launcher) to compare speed."
        )
    for config, path, reference in report.other_step_paths:
        warnings.append(
            f"**Another step path.** `{config.label}` ran its step {path}; its fp32 reference "
            f"ran {reference}. Its speed against fp32 measures that difference as much as the "
            "precision's."
        )
    data_bound = report.data_bound
    if data_bound:
        warnings.append(
            f"**Waiting on data.** {_names(data_bound)} waited for their batches more than "
            f"{DATA_BOUND:.0%} of their epochs' time (`perf/data_wait_share`): their epoch times "
            "and speedups time the data loading, not the precision. Feed them faster before "
            f"comparing speed (docs/speed.md): {_faster_data(data_bound)}."
        )
    cut = [r for r in report.rows if r.run.cut_off]
    if cut:
        warnings.append(
            f"**Cut-off metrics.** {_names(cut)}: the last line of metrics.jsonl was cut off "
            "mid-write (a crash) and is left out."
        )
    diverged = report.diverged
    if diverged:
        warnings.append(
            f"**Diverged.** {_names(diverged)}: the final val loss or result is not finite "
            "(NaN or inf). They are marked in the tables and left out of their configurations' "
            "means and comparisons, which the other runs make as usual."
        )
    single = [c for c in report.configs if c.n == 1]
    if single:
        which = ", ".join(f"`{c.label}`" for c in single)
        warnings.append(
            f"**Single seed.** {which}: one run each, so their result has no interval and "
            "their parity is inconclusive. Repeat them with seeds, e.g. `trainer.seed=0,1,2`."
        )
    if not warnings:
        return []
    return ["## Warnings", "", *[f"- {w}" for w in warnings], ""]


def _names(rows: list[Row]) -> str:
    return ", ".join(f"`{r.label}`" for r in rows)


def _faster_data(rows: list[Row]) -> str:
    """What feeds each run's data faster: the keys its dataset named (`ran.faster_data`), runs
    with the same keys together; runs recorded before the keys were get the general advice."""
    by_keys: dict[tuple[str, ...] | None, list[Row]] = {}
    for row in rows:
        keys = row.run.ran.get("faster_data")
        by_keys.setdefault(None if keys is None else tuple(keys), []).append(row)
    said = []
    for keys, group in by_keys.items():
        if keys is None:
            advice = (
                "more `dataset.num_workers`, or keep in-memory data on the device "
                "(`dataset.loader=device`), or for an image folder `dataset.cache=resized` or "
                "`dataset.decode=gpu`"
            )
        elif not keys:
            advice = "their data has no loading setting that feeds it faster"
        else:
            advice = ", or ".join(f"`{key}`" if "=" in key else f"a higher `{key}`" for key in keys)
        said.append(f"{_names(group)}: {advice}" if len(by_keys) > 1 else advice)
    return "; ".join(said)


def _result_section(spec: Result, configs: list[Config]) -> list[str]:
    tolerance = configs[0].tolerance
    worse, better = ("below", "above") if spec.higher_is_better else ("above", "below")
    lines = [
        f"## {spec.title} against fp32",
        "",
        "One row per configuration: runs that differ only in `trainer.seed`, n of them. Values are "
        "means over the seeds ± the half-width of their 95 % interval (Student's t; none for "
        "n = 1). Δ columns: this configuration minus its fp32 reference (the fp32 configuration "
        "with the same other overrides; in a precision x loss-scaling grid the one without loss "
        "scaling), with its 95 % interval: that of the per-seed differences when both ran the "
        "same seeds (paired), else Welch's. The result is the task's final "
        f"`{spec.metric}` in {spec.shown_in} ({'higher' if spec.higher_is_better else 'lower'} "
        f"is better), Δ in {spec.unit}.",
        "",
        f"Parity judges the interval of Δ {spec.name} against the tolerance of {tolerance:g} "
        f"{spec.unit} (`--tolerance`): *within noise* when the whole interval lies {better} "
        f"{-tolerance if spec.higher_is_better else tolerance:+g} (not worse than fp32 by more "
        f"than the tolerance), *worse by X ± Y* when it lies {worse} "
        f"{-tolerance if spec.higher_is_better else tolerance:+g}, *better by X ± Y* when it lies "
        f"{better} {tolerance if spec.higher_is_better else -tolerance:+g}, *inconclusive* when "
        "one side has a single seed or the interval is too wide to tell (it straddles the "
        "tolerance; more seeds narrow it).",
        "",
    ]
    value = _value_format(spec)
    with_loss = spec.metric != "val/loss"

    def cells(c: Config) -> list[str]:
        return [
            c.label,
            c.values()["runs"],
            _precision(c.first),
            c.first.loss_scaling,
            c.first.run.chosen("model"),
            c.first.run.chosen("dataset"),
            _n(c),
            _estimate(c.result, value),
            _estimate(c.d_result, "+" + value),
            parity_text(c),
            *([_estimate(c.val_loss, ".4f"), _estimate(c.d_val_loss, "+.4f")] if with_loss else []),
        ]

    headers = ["configuration", "runs", "precision", "loss scaling", "model", "dataset", "n",
               _value_header(spec), f"Δ {spec.name} ({spec.unit})", "parity",
               *(["val loss", "Δ val loss"] if with_loss else [])]  # fmt: skip
    return [*lines, *_table(headers, configs, cells), ""]


def _n(config: Config) -> str:
    """How many runs its numbers come from, and how many more diverged."""
    diverged = len(config.diverged)
    return f"{config.n} (+{diverged} **diverged**)" if diverged else str(config.n)


def _sweep_section(report: Report) -> list[str]:
    """The result against the numeric key swept beside the precision (axes.py), a row per
    precision and panel; under a learning-rate sweep also each row's LR sensitivity; then, per
    precision, up to which value it keeps fp32's result."""
    axis = sweep_axis(report.configs)
    if axis is None:
        return []
    spec = axis.panels[0].curves[0].points[0].config.spec
    value, unit = _value_format(spec), spec.unit
    tolerance = axis.panels[0].curves[0].points[0].config.tolerance
    others = f", and {_keys(axis.panel_keys)} (a panel per value)" if axis.panel_keys else ""
    lines = [
        f"## {spec.title} against {axis.key}",
        "",
        f"The sweep varied `{axis.key}` beside the precision{others}. A row per precision"
        f"{' and panel' if axis.panel_keys else ''}: its final {spec.name} at each value, the "
        "mean over seeds ± the half-width of its 95 % interval; **bold** where it is worse than "
        "fp32 at the same values of every other key (its parity verdict above), *diverged* where "
        "every seed diverged.",
        "",
    ]
    sensitive = axis.is_lr and not spec.higher_is_better
    if sensitive:
        lines += [
            "LR sensitivity (Wortsman et al. 2023): over the swept rates, the mean of "
            f"min({spec.name}, initial loss) minus the best {spec.name}, per seed over that "
            "seed's runs at every rate, then mean ± its 95 % interval over seeds. The initial "
            "loss is each run's first logged training loss, the loss of its initial weights "
            "(near ln(vocabulary) for a language model): a run that diverged counts as one that "
            f"learned nothing. Best rate: the lowest mean {spec.name}; within {tolerance:g} "
            f"{unit}: the widest range of neighbouring rates around it whose mean is no more "
            "than that above the best.",
            "",
        ]
    headers = [
        *(["panel"] if axis.panel_keys else []),
        "precision",
        *(f"{axis.key}={axis.shown(x)}" for x in axis.values),
        *(["LR sensitivity", "best rate", f"within {tolerance:g} {unit} of the best"]
          if sensitive else []),
    ]  # fmt: skip
    items = [(panel, curve) for panel in axis.panels for curve in panel.curves]

    def cells(item) -> list[str]:
        panel, curve = item
        at = {p.x: p.config for p in curve.points}
        row = [*([panel.label] if axis.panel_keys else []), curve.precision]
        row += [_sweep_cell(at.get(x), value) for x in axis.values]
        if sensitive:
            found = curve_sensitivity(curve)
            row += ["n/a"] * 3 if found is None else [
                _estimate(found.value, value),
                found.best.shown,
                f"{found.within[0].shown} to {found.within[1].shown}",
            ]  # fmt: skip
        return row

    lines += [*_table(headers, items, cells), ""]
    kept = [k for k in (_kept_text(axis, p, c, tolerance) for p, c in items) if k]
    lines += [*(f"- {k}" for k in kept), *([""] if kept else [])]
    if "sweep" in report.plots:
        lines += [f"![{spec.title} against {axis.key}]({report.plots['sweep'].name})", ""]
    return lines


def _keys(keys: list[str]) -> str:
    return ", ".join(f"`{k}`" for k in keys)


def _sweep_cell(config: Config | None, value: str) -> str:
    if config is None:
        return ""
    if not config.rows:
        return "*diverged*"
    shown = _estimate(config.result, value)
    return f"**{shown}**" if config.parity == "worse" else shown


def _kept_text(axis: SweepAxis, panel: Panel, curve: Curve, tolerance: float) -> str | None:
    """`bf16 keeps fp32's val loss (within 0.02 nats) up to optimizer.lr=3e-3; above it, Δ
    +0.151 nats on average (at most +0.190)`; None for fp32."""
    kept = kept_up_to(curve)
    if kept is None:
        return None
    spec = curve.points[0].config.spec
    where = f"**{panel.label}**: " if panel.label else ""
    keeps = f"{where}{curve.precision} keeps fp32's {spec.name} (within {tolerance:g} {spec.unit})"
    if not kept.above:
        return f"{keeps} at every {axis.key} swept, up to {curve.points[-1].shown}."
    sign = 1 if not spec.higher_is_better else -1
    finite = [sign * behind for _, behind in kept.above if math.isfinite(behind)]
    diverged = [p.shown for p, behind in kept.above if not math.isfinite(behind)]
    value = "+" + _value_format(spec)
    parts = []
    if len(finite) == 1:
        parts.append(f"Δ {finite[0]:{value}} {spec.unit}")
    elif finite:
        worst = max(finite) if sign > 0 else min(finite)
        parts.append(f"Δ {statistics.fmean(finite):{value}} {spec.unit} on average (at most "
                     f"{worst:{value}})")  # fmt: skip
    if diverged:
        parts.append(f"every seed diverged at {axis.key}={', '.join(diverged)}")
    if kept.up_to is None:
        return (f"{where}{curve.precision} falls behind fp32 from the smallest {axis.key}, "
                f"{curve.points[0].shown}: {'; '.join(parts)}.")  # fmt: skip
    return f"{keeps} up to {axis.key}={kept.up_to.shown}; above it, {'; '.join(parts)}."


def _fp8_section(report: Report) -> list[str]:
    fp8 = [c for c in report.configs if c.first.precision == FP8]
    if not fp8:
        return []
    lines = [
        "## fp8 against bf16",
        "",
        "Each fp8 configuration against its bf16 reference: the bf16 configuration with the same "
        "other overrides, the mode fp8 would replace (its unconverted layers run in bf16 too). "
        "Δ and parity as against fp32 above, at the same tolerance; speedup: the bf16 "
        "reference's mean epoch time over the fp8 configuration's. Converted layers: the Linear "
        "layers that computed in fp8, of all Linear layers.",
        "",
    ]
    names = {**VERDICTS, "no reference": "no bf16 reference"}

    def cells(c: Config) -> list[str]:
        ran = c.first.run.ran
        converted = ran.get("fp8_converted_count")
        total = None if converted is None else converted + len(ran.get("fp8_unconverted", {}))
        value = _value_format(c.spec)
        return [
            c.label,
            _precision(c.first),
            c.bf16_reference.label if c.bf16_reference else "none",
            _n(c),
            _estimate(c.result, value),
            _estimate(c.d_result_vs_bf16, "+" + value),
            _verdict_text(c, c.parity_vs_bf16, c.d_result_vs_bf16, names),
            _estimate(c.epoch_time_s, ".3f"),
            _ratio(c.speedup_vs_bf16),
            "n/a" if converted is None else f"{converted} of {total}",
        ]

    lines += _fp8_table(fp8, cells)
    if any(r.run.ran.get("emulated") for c in fp8 for r in c.rows):
        lines += [
            "Emulated fp8 (on a CPU) has fp8's numerics but not its speed: its epoch times and "
            "speedups say nothing about fp8 on a GPU with fp8 tensor cores.",
            "",
        ]
    return lines


def _state_section(report: Report) -> list[str]:
    """Pure bf16's legs: the bytes each holds in weights, gradients and optimizer states beside
    its parity verdict against fp32 and its share of updates lost."""
    if not any(r.precision == PURE for r in report.rows):
        return []
    lines = [
        "## Training state against parity",
        "",
        "What each configuration holds between steps (weights, their gradients, the optimizer's "
        "states: `ran.bytes_*`), the most its optimizer step holds at once (those and the "
        "step's temporaries, where known: `ran.bytes_step_peak`), the held total against its "
        "fp32 reference's, and its parity verdict "
        "from above. Updates lost: the mean of `opt/updates_lost` over the run, the share of "
        "nonzero updates that left a weight unchanged (computed under bf16_pure only). Under "
        "kahan and stochastic rounding an unchanged weight keeps its update (in the "
        "compensation buffer; in expectation), so there it says how often rounding acted, not "
        "what was lost.",
        "",
    ]

    def cells(c: Config) -> list[str]:
        sizes = c.state_bytes or {}
        return [
            c.label,
            _precision(c.first),
            c.first.rounding or "",
            *(_bytes(sizes.get(k)) for k in STATE_BYTES),
            _bytes(c.first.step_peak_bytes),
            _number(c.state_ratio, ".2f") + ("x" if c.state_ratio is not None else ""),
            _estimate(c.updates_lost, ".3f"),
            parity_text(c),
        ]

    headers = ["configuration", "precision", "update rounding", "weights", "gradients",
               "optimizer states", "step peak", "vs fp32", "updates lost", "parity"]  # fmt: skip
    advised = [(c.label, pure_advice.advice(c)) for c in report.configs]
    advice = [f"- {label}: {text}." for label, text in advised if text]
    return [*lines, *_table(headers, report.configs, cells), "", *advice, *([""] if advice else [])]


def _bytes(value: int | None) -> str:
    if value is None:
        return "n/a"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= size:
            return f"{value / size:.1f} {unit}"
    return f"{value} B"


def _fp8_table(fp8: list[Config], cells: Callable[[Config], list[str]]) -> list[str]:
    """A table per result metric (one, unless the report holds several tasks)."""
    lines = []
    for spec, configs in _by_result(fp8).items():
        headers = ["configuration", "precision", "bf16 reference", "n", _value_header(spec),
                   f"Δ {spec.name} vs bf16 ({spec.unit})", "parity vs bf16", "epoch time (s)",
                   "speedup vs bf16", "converted layers"]  # fmt: skip
        lines += [*_table(headers, configs, cells), ""]
    return lines


EMULATED_MARK = "†"


def _emulated(config: Config) -> bool:
    """Whether a run of the configuration ran its precision emulated (mpexp.precision.modes)."""
    return any(r.run.ran.get("emulated") for r in config.rows)


def _speed_section(report: Report) -> list[str]:
    def cells(c: Config) -> list[str]:
        return [
            f"{c.label} {EMULATED_MARK}" if _emulated(c) else c.label,
            _n(c),
            _estimate(c.epoch_time_s, ".3f"),
            _ratio(c.speedup),
            _estimate(c.compile_s, ".1f"),
            _time_to_target(c),
            _ratio(c.speedup_at_target),
            _estimate(c.samples_per_s, ".0f"),
            _estimate(c.data_wait_pct, ".1f"),
            _estimate(c.tflops, ".3g"),
            _estimate(c.mfu_pct, ".1f"),
            _number(c.peak_mem_mib, ".1f"),
            _number(c.planned_peak_mib, ".1f"),
            _number(c.mem_ratio, ".2f") + ("x" if c.mem_ratio is not None else ""),
        ]

    headers = ["configuration", "n", "epoch time (s)", "speedup", "compile (s)",
               "time to target (s)", "speedup at target", "samples/s", "data wait (%)",
               "TFLOP/s", "MFU (%)", "peak memory (MiB)", "planned peak (MiB)",
               "memory vs fp32"]  # fmt: skip
    lines = ["## Speed", "", *_table(headers, report.configs, cells), ""]
    notes = []
    if any(_emulated(c) for c in report.configs):
        notes.append(
            f"{EMULATED_MARK} Emulated: the device could not run this precision at its native "
            "speed, so PyTorch (or torchao, for fp8) emulated it: a CPU without instructions for "
            "the 16-bit format (AVX-512 BF16 or AMX for bf16, AVX-512 FP16 or AMX-FP16 for fp16), "
            "fp16 convolutions on any CPU (their backward pass takes a slow generic path), fp8 on "
            "any CPU. The numerics are real; the epoch times and speedups measure the emulation, "
            "not the format (`ran.emulated` in the run's summary.json)."
        )
    notes += [
        "Epoch time: each run's median over its timed epochs (those after the first, which pays "
        "one-off warm-up), then the mean over seeds ± its 95 % interval. Speedup: the fp32 "
        "reference's mean epoch time over this configuration's, with a 95 % interval (Welch, on "
        "the log scale) when both have two seeds or more.",
        "Compile: set-up time kept out of the epoch times, compilation and the CUDA graph's "
        "warm-up and capture (0 for an eager run).",
        "Time to target: training time (the epochs' times, warm-up and compilation included, "
        "validation not) until the result first reached the target, to the epoch; speedup at "
        "target is the reference's time over this configuration's, the speedup at an equal "
        "result. " + _targets(report),
        "Data wait: the share of the epochs' time the step waited for its next batch "
        "(`perf/data_wait_share`), mean over seeds; n/a for runs that did not log it. Above "
        f"{DATA_BOUND:.0%} the epoch times measure the data loading as much as the precision.",
        "TFLOP/s: the training FLOPs per sample (counted once at start with PyTorch's FLOP "
        "counter) x samples/s. MFU: TFLOP/s as a share of the device's dense peak for the "
        "precision that ran; n/a where the peak is not known (a CPU, an unlisted GPU: "
        "`trainer.peak_tflops` sets it).",
    ]
    kinds = {c.mem_kind for c in report.configs}
    if "cuda" in kinds:
        notes.append(
            "Peak memory on a GPU: the largest per-epoch peak of CUDA tensor memory over the "
            "timed epochs (the first epoch's also holds cuDNN's autotuning workspaces)."
        )
    if any(c.planned_peak_mib is not None for c in report.configs):
        notes.append(
            "Planned peak: the larger of the step's and validation's peaks in the run's own plan "
            "(`trainer.plan`, on by default on a GPU; docs/plan.md), made on fake tensors before "
            "its first step: beside the measured peak it shows the plan's error. A CPU run's "
            "plan counts tensors only, its measured peak the whole process."
        )
    if "rss" in kinds:
        notes.append(
            "Peak memory on CPU: the process's resident set size, which counts the whole Python "
            "process, not only tensors; it is not comparable with GPU memory."
        )
    return [*lines, *[f"{n}\n" for n in notes]]


def _targets(report: Report) -> str:
    if report.target is not None:
        units = sorted({f"{c.spec.shown_in} of {c.spec.metric}" for c in report.configs})
        return f"Target: {report.target:g} {' / '.join(units)} (`--target`)."
    references = list(
        dict.fromkeys(c.reference for c in report.configs if c.reference and c.reference.rows)
    )
    if not references:
        return "No target: no fp32 reference to take it from; set one with `--target`."
    shown = []
    for r in references:
        spec, value = r.spec, _value_format(r.spec)
        shown.append(
            f"{spec.scale * r.target:{value}} {spec.shown_in} of {spec.metric} for `{r.label}` "
            f"and the configurations compared with it (its {r.result.value:{value}} "
            f"{'minus' if spec.higher_is_better else 'plus'} {r.tolerance:g} {spec.unit})"
        )
    return (
        "Target, by default the fp32 reference's final result less good by the tolerance: "
        + "; ".join(shown)
        + "."
    )


def _runs_section(report: Report) -> list[str]:
    # a column per result metric besides the val loss every run has (one, but for mixed tasks)
    specs = [spec for spec in _by_result(report.configs) if spec.metric != "val/loss"]

    def cells(item: tuple[Config, Row]) -> list[str]:
        config, row = item
        v = run_values(row, config.target)
        reached = v["time_to_target_s"]
        if config.target is None:
            to_target = "n/a"
        elif reached is None:
            to_target = "not reached"
        else:
            to_target = f"{reached:.1f}"
        spread = f"{v['epoch_time_min_s']:.3f} to {v['epoch_time_max_s']:.3f}"
        results = [
            f"{v['result']:{_value_format(spec)}}" if spec == row.spec else "n/a" for spec in specs
        ]
        return [
            f"{v['run']} **(diverged)**" if v["diverged"] else v["run"],
            str(v["seed"]),
            *results,
            f"{v['val_loss']:.4f}",
            f"{v['epoch_time_s']:.3f} [{spread}]",
            str(v["timed_epochs"]),
            f"{v['samples_per_s']:.0f}",
            _number(v["data_wait_pct"], ".1f"),
            _number(v["tflops"], ".3g"),
            _number(v["mfu_pct"], ".1f"),
            to_target,
            f"{v['peak_mem_mib']:.1f}",
            str(v["skipped_steps"]),
        ]

    headers = ["run", "seed", *(_value_header(spec) for spec in specs), "val loss",
               "epoch time (s): median [min to max]", "timed epochs", "samples/s",
               "data wait (%)", "TFLOP/s", "MFU (%)", "time to target (s)", "peak memory (MiB)",
               "skipped steps"]  # fmt: skip
    items = [(c, r) for c in report.configs for r in c.members]
    return ["## Runs", "", *_table(headers, items, cells), ""]


def _plots_section(report: Report) -> list[str]:
    lines = ["## Plots", ""]
    if not report.plots_drawn:
        return [*lines, "This report drew none (`--no-plots`); a PNG beside it is an earlier "
                "report's. The report without `--no-plots` draws them anew.", ""]  # fmt: skip
    for name, title in PLOT_TITLES.items():
        if name in report.plots:
            lines += [f"![{title}]({report.plots[name].name})", ""]
    if "result" not in report.plots:
        lines += [
            "Each run validated once, at its end: its result is a point per run, which the "
            "tables above hold, so there is no result plot.",
            "",
        ]
    if "loss_scale" not in report.plots:
        lines += ["No run used loss scaling, so there is no loss-scale plot.", ""]
    if "underflow" not in report.plots:
        lines += [
            "No run recorded gradient statistics, so there is no underflow plot "
            "(`diagnostics.grad_stats_every=N` records them).",
            "",
        ]
    return lines
