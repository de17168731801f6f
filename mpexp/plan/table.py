"""The plan printed: one line per row; then, per row, what it holds, what its peaks are made of
and what would make it fit; then what `fits` and the time mean, and what they leave out."""

from __future__ import annotations

from mpexp.plan.devices import names
from mpexp.plan.held import DATA_NAMES, HELD, gib
from mpexp.plan.rows import MARGIN_LEAVES_OUT, USABLE

# what each kind of held bytes is, where its name does not say (docs/plan.md has them all)
KIND_NOTES = {
    **DATA_NAMES,
    "optimizer": "the optimizer's states",
    "buffers": "BatchNorm's statistics and other buffers",
    "fp8_scales": "kept between steps (torchao's dynamic scaling keeps none)",
    "weight_average": "trainer.ema_decay's float32 copy",
    "ddp_buckets": "the gradients, in DDP's buckets for the whole run (gradient_as_bucket_view)",
    "fsdp_gathered": "units gathered whole, and one unit's gradients before they are reduced",
}


def count(value: int) -> str:
    return f"{value / 1e6:,.1f} M" if value >= 1e5 else f"{value:,}"


def seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"~{value:.2g}" if value < 10 else f"~{value:,.0f}"


def table(rows: list[dict]) -> str:
    """The rows as a table a terminal shows, each row's details below it, and the notes."""
    varying = _varying(rows)
    head = (
        "run", "precision", "params", "weights", "grads", "optim", "B/param", "step peak",
        "val peak", "need", "TFLOP/step", "s/step", "fits",
    )  # fmt: skip
    lines = [head]
    for row in rows:
        b, peak = row["bytes"], row["peak_bytes"]
        flops, per = row["flops_per_step"], row["bytes_per_parameter"]
        memory = row["device_memory"]
        fits = {True: "yes", False: "NO", None: "?"}[row["fits"]]
        if memory is not None:
            fits += f" ({gib(int(memory))})"
        lines.append((
            " ".join(o for o in row["overrides"] if o.split("=")[0] in varying) or "-",
            row["precision"], count(row["parameters"]), gib(b["weights"]),
            gib(b["gradients"] + b["ddp_buckets"]), gib(b["optimizer"]),
            "-" if per is None else f"{per:g}", gib(peak["train_step"]), gib(peak["validation"]),
            gib(row["need_bytes"]) + (" *" if row["captured"] else ""),
            "-" if flops is None else f"{flops / 1e12:,.1f}", seconds(row["seconds_per_step"]),
            fits,
        ))  # fmt: skip
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(head))]
    text = ["  ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)) for line in lines]
    text.insert(1, "  ".join("-" * w for w in widths))
    for row in rows:
        text.extend(["", *details(row)])
    text.extend(["", *notes(rows)])
    return "\n".join(text)


def details(row: dict) -> list[str]:
    """A row's batch, what it holds by kind, the largest tensors at its peaks, its host reads,
    what could not be planned and the keys that would make it fit."""
    name = " ".join(row["overrides"]) or "(defaults)"
    text = [
        f"{name}: {row['samples_per_step']} samples a step in micro-batches of "
        f"{row['micro_batch']}"
        + (f", {row['tokens_per_step']:,} tokens" if row["tokens_per_step"] else "")
        + f"; validation in the same micro-batches; planned for {row['device']}"
        + (f" ({row['device_name']})" if row.get("device_name") else "")
        + (f", one of {row['processes']} processes" if row["processes"] > 1 else "")
    ]
    b = row["bytes"]
    fp8 = row["precision"].startswith("fp8")
    shown = [k for k in HELD if b.get(k) or (k == "fp8_scales" and fp8)]
    if shown:
        text.append("  held from step to step:")
        for kind in shown:
            note = KIND_NOTES.get(kind, "")
            text.append(f"    {kind.replace('_', ' '):<15} {gib(b[kind]):>10}  {note}".rstrip())
    if row["captured"] and row["need_bytes"] is not None:
        text.append(
            f"  * the step runs as a CUDA graph: its memory pool (the step's peak, "
            f"{gib(row['peak_bytes']['train_step'])}) stays reserved while validation allocates "
            f"{gib(row['need_bytes'] - row['peak_bytes']['train_step'])} beside it"
        )
    if "fsdp" in row["estimated"]:
        text.append(
            "  FSDP: one rank's shares of the weights, gradients and states, and its units "
            "gathered whole, estimated from the unsharded rehearsal (leaning high)"
        )
    for phase, largest in row["largest"].items():
        text.append(f"  largest at the {phase.replace('_', ' ')} peak:")
        text.extend(
            f"    {gib(t['bytes']):>10}  {t['dtype']:>8} {tuple(t['shape'])}  {t['what']}"
            for t in largest[:3]
        )
    if row["host_reads_per_step"]:
        wait = "a wait for the GPU" if row["device"] == "cuda" else "a read of a tensor's value"
        text.append(
            f"  the step reads {row['host_reads_per_step']} values on the host (each {wait}; "
            "a fake has no value, so each was taken as 0)"
        )
    workspace = row.get("optimizer_workspace")
    if workspace:
        text.append(
            f"  pure bf16's update workspace: {gib(workspace['bytes'])} at most "
            f"(precision.update_chunk={workspace['elements']:,} elements)"
        )
    for what, why in row["missing"].items():
        text.append(f"  {what}: not planned ({why})")
    if row["advice"]:
        text.append("  does not fit; any one of these would (each planned again):")
        text.extend(f"    {a}" for a in row["advice"])
    return text


def notes(rows: list[dict]) -> list[str]:
    """What the columns leave to be said: the margin behind `fits`, the time's estimate."""
    text = [
        "Weights, grads and optim are held from step to step, the peaks inside two optimizer "
        "steps (every micro-batch) and one validation batch; need is what the device must hold."
    ]
    if any(r["device_memory"] is None for r in rows):
        text.append(
            "fits ?: no device's memory is known here; give --device-memory (80GiB, or a "
            f"device's name: {names()})."
        )
    if any(r["device_memory"] is not None for r in rows):
        text.append(
            f"fits: the need is at most {USABLE:.0%} of the device's memory; the other "
            f"{1 - USABLE:.0%} is for what the plan leaves out: {', '.join(MARGIN_LEAVES_OUT)}. "
            "The data's worker processes take host memory, not the device's."
        )
    timed = [r for r in rows if r.get("seconds_per_step") is not None]
    if timed:
        text.append(
            f"s/step is an estimate: the step's FLOPs at {timed[0]['mfu_assumed']:.0%} of "
            f"the {timed[0]['device_name']}'s dense peak for the row's precision (--mfu sets "
            "the share; a run's perf/mfu measures it)."
        )
    else:
        text.append(
            "s/step: give --device-memory a device's name (h100, a100-80gb, ...) for an "
            "estimate of a step's time."
        )
    return text


def _varying(rows: list[dict]) -> set[str]:
    """The override keys whose value differs between rows (all of them for one row)."""
    values: dict[str, set[str]] = {}
    for row in rows:
        for o in row["overrides"]:
            key, _, value = o.partition("=")
            values.setdefault(key, set()).add(value)
    if len(rows) == 1:
        return set(values)
    return {
        k for k, v in values.items() if len(v) > 1 or sum(k in str(r) for r in rows) < len(rows)
    }
