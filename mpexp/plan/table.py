"""The plan printed: one line per row, then what each row's peaks are made of."""

from __future__ import annotations

GiB = 2**30


def gib(value: int | None) -> str:
    """Bytes in GiB, or in MiB below one GiB (with the unit)."""
    if value is None:
        return "-"
    return f"{value / GiB:.2f} GiB" if value >= GiB else f"{value / 2**20:.1f} MiB"


def count(value: int) -> str:
    return f"{value / 1e6:,.1f} M" if value >= 1e5 else f"{value:,}"


def table(rows: list[dict]) -> str:
    """The rows as a table a terminal shows, and below it each row's largest tensors at its
    peaks and the advice for a row that does not fit."""
    varying = _varying(rows)
    head = (
        "run", "precision", "params", "weights", "grads", "optim", "B/param",
        "step peak", "val peak", "TFLOP/step", "fits",
    )  # fmt: skip
    lines = [head]
    for row in rows:
        b, peak = row["bytes"], row["peak_bytes"]
        flops = row["flops_per_step"]
        memory = row["device_memory"]
        fits = {True: "yes", False: "NO", None: "?"}[row["fits"]]
        if memory is not None:
            fits += f" ({gib(int(memory))})"
        lines.append((
            " ".join(o for o in row["overrides"] if o.split("=")[0] in varying) or "-",
            row["precision"], count(row["parameters"]), gib(b["weights"]),
            gib(b["gradients"]), gib(b["optimizer"]), f"{row['bytes_per_parameter']:g}",
            gib(peak["train_step"]), gib(peak["validation"]),
            "-" if flops is None else f"{flops / 1e12:,.1f}", fits,
        ))  # fmt: skip
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(head))]
    text = ["  ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)) for line in lines]
    text.insert(1, "  ".join("-" * w for w in widths))
    text.append("Weights, grads and optim are held between steps, the peaks inside "
                "one optimizer step (every micro-batch) and one validation batch.")  # fmt: skip
    for row in rows:
        text.append("")
        name = " ".join(row["overrides"]) or "(defaults)"
        text.append(
            f"{name}: {row['samples_per_step']} samples a step in micro-batches of "
            f"{row['micro_batch']}"
            + (f", {row['tokens_per_step']:,} tokens" if row["tokens_per_step"] else "")
            + f"; validation in the same micro-batches; planned for {row['device']}"
            + (f", one of {row['processes']} processes" if row["processes"] > 1 else "")
        )
        for phase, largest in row["largest"].items():
            text.append(f"  largest at the {phase.replace('_', ' ')} peak:")
            text.extend(
                f"    {gib(t['bytes']):>10}  {t['dtype']:>8} {tuple(t['shape'])}  {t['what']}"
                for t in largest[:3]
            )
        if row["host_reads_per_step"]:
            text.append(
                f"  the step reads {row['host_reads_per_step']} values on the host (each a wait "
                "for the GPU; a fake has no value, so each was taken as 0)"
            )
        for what, why in row["missing"].items():
            text.append(f"  {what}: not planned ({why})")
        if row["advice"]:
            text.append("  does not fit; any one of these would:")
            text.extend(f"    {a}" for a in row["advice"])
    return "\n".join(text)


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
