"""`mpexp-plan` (or `python -m mpexp.plan`): what a run needs in memory and compute, per precision,
before it runs.

    mpexp-plan experiment=gpt2_small precision=fp32,bf16,fp16,fp8,bf16_pure_kahan
    mpexp-plan model=resnet50 dataset=image_folder dataset.path=~/data/imagenet \\
        dataset.batch_size=256 --device-memory h100 --json plan.json

It takes `mpexp-train`'s overrides, before, after or between its options; a comma list gives one
row per value, as a sweep would run one job per value, and so do the values a preset sweeps (its
`hydra.sweeper.params`, seeds aside: a seed changes no byte). Each row is rehearsed on fake
tensors (mpexp/plan/rehearsal.py): seconds on a CPU, no GPU and no data needed beyond the shapes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import re
import sys
from pathlib import Path

from mpexp.command_log import messages_on_stderr
from mpexp.errors import UserError

log = logging.getLogger("mpexp")

UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12}
UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})


def at_least(minimum: int):
    """An argparse type: a whole number of at least `minimum`."""

    def whole(text: str) -> int:
        if not text.isdigit() or int(text) < minimum:
            raise argparse.ArgumentTypeError(f"{text!r}: give a whole number of {minimum} or more")
        return int(text)

    return whole


def micro_batches(text: str) -> int | None:
    """An argparse type: `all` (None), or a whole number of 2 or more."""
    return None if text == "all" else at_least(2)(text)


def parse_device(text: str):
    """`80GiB`, `80GB`, `81920MiB`, `8e10` as a device of that many bytes, or a device's name
    (`h100`, `a100-40gb`: its memory, and its peaks for the time estimate)."""
    from mpexp.plan.devices import Device, named, names

    known = named(text)
    if known is not None:
        return known
    match = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if match is None or match[2].lower() not in UNITS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither a size (80GiB, 40GB, 24000MiB) nor a device mpexp knows "
            f"({names()})"
        )
    return Device(int(float(match[1]) * UNITS[match[2].lower()]))


def arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="mpexp-plan",
        description="What a run needs in memory and compute, per precision, before it runs: "
        "each configuration rehearsed on fake tensors (no GPU, no data beyond its shapes).",
        epilog="Overrides are mpexp-train's (group=option, key=value); a comma list gives a row "
        "per value. docs/plan.md says what each number means.",
    )
    parser.add_argument("overrides", nargs="*", help="as mpexp-train takes them")
    parser.add_argument(
        "--device-memory",
        type=parse_device,
        default=None,
        help="the device's memory (80GiB, 40GB) or its name (h100, h200, a100-40gb, a100-80gb, "
        "l4, rtx4090: its memory, and its peak for the time estimate); default: the visible "
        "GPU's",
    )
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default=None,
        help="the device the run trains on; default: cpu where trainer.device=cpu, else cuda",
    )
    parser.add_argument(
        "--micro-batches",
        type=micro_batches,
        default=2,
        help="rehearse this many of a step's micro-batches, or all (at least 2: the peak is "
        "reached by the second); default: 2",
    )
    parser.add_argument(
        "--nproc",
        type=at_least(1),
        default=1,
        help="processes the run is shared among (torchrun's --nproc_per_node x nodes): each "
        "takes its share of the batch, and the plan is one process's",
    )
    parser.add_argument(
        "--mfu",
        type=share,
        default=None,
        help="the share of the device's peak a step reaches, for the time estimate (a run's "
        "perf/mfu); default: 0.33, GPT-2 small's in bf16 on an H100",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    # options and overrides in any order: mpexp-plan experiment=x --device-memory 8GiB key=1
    return parser.parse_intermixed_args(argv)


def share(text: str) -> float:
    """An argparse type: a fraction above 0 and at most 1."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a fraction, above 0 and at most 1")
    return value


def main(argv: list[str] | None = None) -> None:
    """The `mpexp-plan` command."""
    args = arguments(sys.argv[1:] if argv is None else argv)
    try:
        # torch: once the arguments are known to be good
        from mpexp.plan.rows import Target, plan_rows

        device = args.device_memory
        target = Target(
            device=args.device,
            memory=device.memory if device else None,
            name=device.name if device else None,
            processes=args.nproc,
            micro_batches=args.micro_batches,
        )
        if args.mfu is not None:
            target = dataclasses.replace(target, mfu=args.mfu)
        with messages_on_stderr():
            rows = plan_rows(args.overrides, target)
    except UserError as err:
        sys.stderr.write(f"{err}\n")
        raise SystemExit(2) from None
    except Exception as err:
        from mpexp.composition import mistyped_message
        from mpexp.plan.rows import composition_error

        unknown = mistyped_message(err)  # mpexp-train's one message for a mistyped key or option
        if unknown is not None:
            sys.stderr.write(f"{unknown}\n")
            raise SystemExit(2) from None
        message = composition_error(err)
        if message is None:
            raise
        sys.stderr.write(f"{message}\n")
        raise SystemExit(1) from None
    from mpexp.plan.table import table

    print(table(rows))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"rows": rows}, indent=2) + "\n")
        print(f"Written: {args.json}")
    if any(row["fits"] is False for row in rows):
        raise SystemExit(3)  # scripts can tell a plan that does not fit


if __name__ == "__main__":
    main()
