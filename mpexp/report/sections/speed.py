"""report.md's Speed: epoch times, speedups, time to target, throughput, data wait, MFU and peak
memory per configuration, with what each column means."""

from __future__ import annotations

from mpexp.report.configuration import Config
from mpexp.report.sections.cells import estimate, n_text, number, ratio, table, value_format
from mpexp.report.table import DATA_BOUND, Report

EMULATED_MARK = "†"


def _emulated(config: Config) -> bool:
    """Whether a run of the configuration ran its precision emulated (mpexp.precision.modes)."""
    return any(r.run.ran.get("emulated") for r in config.rows)


def section(report: Report) -> list[str]:
    # a GPU run's reserved peak beside its allocated one; a CPU report has no such column
    reserved = any(c.peak_reserved_mib is not None for c in report.configs)

    def cells(c: Config) -> list[str]:
        return [
            f"{c.label} {EMULATED_MARK}" if _emulated(c) else c.label,
            n_text(c),
            estimate(c.epoch_time_s, ".3f"),
            ratio(c.speedup),
            estimate(c.compile_s, ".1f"),
            _time_to_target(c),
            ratio(c.speedup_at_target),
            estimate(c.samples_per_s, ".0f"),
            estimate(c.data_wait_pct, ".1f"),
            estimate(c.tflops, ".3g"),
            estimate(c.mfu_pct, ".1f"),
            number(c.peak_mem_mib, ".1f"),
            *([number(c.peak_reserved_mib, ".1f")] if reserved else []),
            number(c.planned_peak_mib, ".1f"),
            number(c.mem_ratio, ".2f") + ("x" if c.mem_ratio is not None else ""),
        ]

    headers = ["configuration", "n", "epoch time (s)", "speedup", "compile (s)",
               "time to target (s)", "speedup at target", "samples/s", "data wait (%)",
               "TFLOP/s", "MFU (%)", "peak memory (MiB)",
               *(["reserved peak (MiB)"] if reserved else []), "planned peak (MiB)",
               "memory vs fp32"]  # fmt: skip
    lines = ["## Speed", "", *table(headers, report.configs, cells), ""]
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
    if reserved:
        notes.append(
            "Reserved peak: the caching allocator's reserved memory at its peak over the timed "
            "epochs (`mem/peak_reserved_mib`), what must fit the device: it holds the pool of a "
            "step captured as a CUDA graph, whose replays the allocated peak does not see, so a "
            "captured run's planned peak is read against it."
        )
    if any(c.planned_peak_mib is not None for c in report.configs):
        notes.append(
            "Planned peak: the need of the run's own plan (`ran.plan.need_bytes`, logged as "
            "`mem/planned_peak_mib`; `trainer.plan`, on by default on a GPU; docs/plan.md), made "
            "on fake tensors before its first step: the larger of the step's and validation's "
            "peaks, or for a step captured as a CUDA graph the step's peak and validation's "
            "extra beside its pool. Beside the measured peak it shows the plan's error. A CPU "
            "run's plan counts tensors only, its measured peak the whole process."
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
        spec, value = r.spec, value_format(r.spec)
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


def _time_to_target(config: Config) -> str:
    if config.target is None or not config.rows:
        return "n/a"
    if config.reached == config.n:
        return estimate(config.time_to_target, ".1f")
    if config.reached == 0:
        return "not reached"
    return f"reached by {config.reached} of {config.n}"
