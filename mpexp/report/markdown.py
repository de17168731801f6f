"""report.md: the table, the parity verdicts and the plots, as Markdown."""

from __future__ import annotations

from mpexp.report.table import Report

# report.md columns: (header, key in Row.values, format)
COLUMNS = [
    ("run", "run", "{}"),
    ("precision", "precision", "{}"),
    ("loss scaling", "loss_scaling", "{}"),
    ("model", "model", "{}"),
    ("dataset", "dataset", "{}"),
    ("epoch time (s)", "epoch_time_s", "{:.2f}"),
    ("speedup", "speedup", "{:.2f}x"),
    ("samples/s", "samples_per_s", "{:.0f}"),
    ("peak memory (MiB)", "peak_mem_mib", "{:.1f}"),
    ("memory vs fp32", "mem_ratio", "{:.2f}x"),
    ("val loss", "val_loss", "{:.4f}"),
    ("Δ val loss", "d_val_loss", "{:+.4f}"),
    ("val acc (%)", "val_acc_pct", "{:.2f}"),
    ("Δ val acc (points)", "d_val_acc_pts", "{:+.2f}"),
    ("skipped steps", "skipped_steps", "{}"),
]


def render_markdown(report: Report) -> str:
    rows = report.rows
    lines = [f"# Sweep report: {report.out_dir.parent.name}/{report.out_dir.name}", ""]
    lines.append(
        f"Runs under `{report.out_dir}`: {len(rows)} reported, "
        f"{len(report.not_reported)} not reported."
    )
    machines = sorted({f"{r.run.ran.get('device_name')} ({r.run.ran.get('device')})" for r in rows})
    torches = sorted({str(r.run.ran.get("torch_version")) for r in rows})
    if rows:
        lines.append(f"Ran on {', '.join(machines)} with torch {', '.join(torches)}.")
    lines.append("")

    if rows:
        lines += _table(report)
        lines += ["", *_notes(report), ""]
        lines += _parity_section(report)
    if report.not_reported:
        lines += ["## Not reported", ""]
        lines += [f"- `{label}`: {run.problem}" for label, run in report.not_reported]
        lines.append("")
    if rows:
        lines += _plots_section(report)
    return "\n".join(lines)


def _table(report: Report) -> list[str]:
    headers = [h for h, _, _ in COLUMNS]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for row in report.rows:
        values = row.values(report.tolerance)
        cells = {
            key: "n/a" if values[key] is None else fmt.format(values[key])
            for _, key, fmt in COLUMNS
        }
        if row.effective_precision != row.precision:
            cells["precision"] += f" (ran as {row.effective_precision})"
        if values["parity"] == "flagged":
            cells["d_val_acc_pts"] = f"**{cells['d_val_acc_pts']}**"
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells.values()) + " |")
    return lines


def _notes(report: Report) -> list[str]:
    notes = [
        "Epoch time and samples/s: median over the epochs after the first, which pays one-off "
        "warm-up costs. Speedup: the fp32 run's epoch time over this run's. Δ columns: this run "
        "minus the fp32 run of the same model and dataset; accuracy in percentage points.",
    ]
    kinds = {r.mem_kind for r in report.rows}
    if "cuda" in kinds:
        notes.append("Peak memory on a GPU: the largest per-epoch peak of CUDA tensor memory.")
    if "rss" in kinds:
        notes.append(
            "Peak memory on CPU: the process's resident set size, which counts the whole Python "
            "process, not only tensors; it is not comparable with GPU memory."
        )
    single = [r.label for r in report.rows if len(r.run.epochs) == 1]
    if single:
        notes.append(f"One-epoch runs (their time includes warm-up): {', '.join(single)}.")
    return [" ".join(notes)]


def _parity_section(report: Report) -> list[str]:
    lines = [
        "## Parity with fp32",
        "",
        f"A run is flagged when its final val accuracy is more than {report.tolerance:g} "
        "points below the fp32 run's (`--tolerance`): mixed precision should match fp32 "
        "accuracy, as the ApX Machine Learning article on mixed precision training advises "
        "checking.",
        "",
    ]
    for row in report.rows:
        verdict = row.parity(report.tolerance)
        acc = f"{100 * row.val_acc:.2f} %"
        if verdict == "baseline":
            lines.append(f"- `{row.label}`: the fp32 reference, {acc}")
        elif verdict == "no fp32 run":
            lines.append(
                f"- `{row.label}`: {acc}, no fp32 run of {row.run.chosen('model')} on "
                f"{row.run.chosen('dataset')} to compare with; add precision=fp32 to the sweep"
            )
        else:
            shown = "**flagged**" if verdict == "flagged" else "ok"
            base = f"{100 * row.baseline.val_acc:.2f} %"
            lines.append(
                f"- {shown} `{row.label}`: {acc} against fp32's {base} "
                f"({row.d_val_acc_pts:+.2f} points)"
            )
    return [*lines, ""]


def _plots_section(report: Report) -> list[str]:
    lines = ["## Plots", ""]
    titles = {
        "loss_curves": "Loss curves",
        "epoch_time": "Epoch time",
        "peak_memory": "Peak memory",
        "loss_scale": "Loss scale (skipped steps marked x)",
    }
    for name, title in titles.items():
        if name in report.plots:
            lines += [f"![{title}]({report.plots[name].name})", ""]
    if "loss_scale" not in report.plots:
        lines += ["No run used loss scaling, so there is no loss-scale plot.", ""]
    return lines
