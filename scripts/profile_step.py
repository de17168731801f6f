"""Where a training step's time goes: PyTorch's profiler over mpexp's own step, per precision.

For each precision it builds what a run builds (model, memory format, compiled or not, optimizer,
loss scaler, cuDNN settings), trains `--warmup` steps on device-resident random batches of the
dataset's shape, then times `--steps` steps by the wall clock (synchronised once at the end;
every precision before any profiling) and again under the profiler. It prints, per step, the
wall time, the time the GPU spent in kernels and how many kernels ran, then the kernels that took
the most time (on CPU: the operators, by their own CPU time). The step is mpexp's own (its
Stepper: forward, backward, loss scaling, optimizer, rollback and history row), with the run's
defaults: on CUDA compiled, channels_last and captured as one CUDA graph after its warm-up steps;
a run's epoch adds its batch gathers and metric flushes around it.

When the GPU is busy for most of the wall time the step is bound by its kernels (look at the
top kernels); when it is busy for a small part, by the host launching them.

    python scripts/profile_step.py --precisions bf16,fp16
    python scripts/profile_step.py --precisions bf16 trainer.eager=true     # the eager step
    python scripts/profile_step.py --device cpu --model simplecnn --precisions fp32 --steps 5
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import bare_parts  # noqa: E402  (scripts/bench.py: what a run builds for its steps)

from mpexp.step.diagnostics import Diagnostics  # noqa: E402
from mpexp.step.history import StepHistory  # noqa: E402
from mpexp.step.stepper import Stepper  # noqa: E402
from mpexp.system import resolve_device, synchronize  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--precisions", default="fp32,bf16,fp16", help="comma-separated")
    p.add_argument("--model", default="deepcnn")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--warmup", type=int, default=15, help="steps before timing (compile, autotune)")
    p.add_argument("--steps", type=int, default=20, help="steps timed, and profiled")
    p.add_argument("--top", type=int, default=12, help="operators listed per precision")
    p.add_argument("--json", type=Path, help="also write the per-step figures here")
    p.add_argument("overrides", nargs="*", help="mpexp overrides, e.g. trainer.compile=true")
    args = p.parse_args(argv)
    args.device = resolve_device(args.device)
    args.precisions = args.precisions.split(",")
    return args


def build_step(args, precision: str):
    """One training step as mpexp's loop runs it: its Stepper, captured as a CUDA graph and
    replayed where a run would do so (after its warm-up steps), eager otherwise."""
    cfg, mode, net, forward, scaler, optimizer, speed = bare_parts(args, precision)
    device = args.device
    images = torch.randn(args.batch_size, 1, 28, 28, device=device)
    images = images.to(memory_format=speed.memory_format())
    labels = torch.randint(0, 10, (args.batch_size,), device=device)
    history = StepHistory(capacity=64, device=device)
    diagnostics = Diagnostics(cfg.diagnostics, net, scaler, None, mode)
    make = Stepper.with_graph if speed.cuda_graph else Stepper
    # the model with its loss, compiled together as a run compiles them
    stepper = make(forward, optimizer, scaler, mode, history, diagnostics, loss_fn=None)
    count = 0

    def step() -> None:
        nonlocal count
        count += 1
        stepper.step(count, images, labels)
        if count % 64 == 0:
            history.flush()

    return step


def time_wall(args, step) -> float:
    """Milliseconds per step by the wall clock, after the warm-up, synchronised once."""
    for _ in range(args.warmup):
        step()
    synchronize(args.device)
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    synchronize(args.device)
    return 1e3 * (time.perf_counter() - start) / args.steps


def profile_steps(args, step) -> dict:
    """Under the profiler: the time the GPU spent in kernels and the costliest kernels (on CPU,
    the costliest operators by their own CPU time)."""
    activities = [ProfilerActivity.CPU]
    if args.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            step()
        synchronize(args.device)
    # kernels (and copies) only: not the CPU-side operators that launched them, nor the ranges
    # that record_function marks on the GPU's timeline (user annotations)
    kernels = [
        e
        for e in prof.events()
        if e.device_type.name == "CUDA" and not getattr(e, "is_user_annotation", False)
    ]
    if kernels:
        by_name: dict[str, list[float]] = {}
        for e in kernels:
            by_name.setdefault(e.name, []).append(e.time_range.elapsed_us())
        top = [(name, sum(us), len(us)) for name, us in by_name.items()]
    else:
        top = [(e.key, e.self_cpu_time_total, e.count) for e in prof.key_averages()]
    top = sorted(top, key=lambda t: t[1], reverse=True)[: args.top]
    per_step = args.steps
    return {
        # one stream: kernels run one after another, so their times add up
        "device_busy_ms_per_step": (
            sum(e.time_range.elapsed_us() for e in kernels) / 1e3 / per_step if kernels else None
        ),
        "kernels_per_step": len(kernels) / per_step if kernels else None,
        "top": [
            {"op": name, "ms_per_step": us / 1e3 / per_step, "calls_per_step": n / per_step}
            for name, us, n in top
        ],
    }


def report(result: dict) -> str:
    busy = result["device_busy_ms_per_step"]
    lines = [
        f"{result['precision']}: {result['wall_ms_per_step']:.2f} ms/step wall"
        + (f", device busy {busy:.2f} ms ({100 * busy / result['wall_ms_per_step']:.0f} %)"
           f" in {result['kernels_per_step']:.0f} kernels" if busy else ""),
        "  ms/step | calls | " + ("kernel" if busy else "operator (self CPU time)"),
        *(f"  {t['ms_per_step']:7.3f} | {t['calls_per_step']:5.1f} | {t['op'][:90]}"
          for t in result["top"]),
    ]  # fmt: skip
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    print(f"{args.model}, batch {args.batch_size}, on {args.device}, torch {torch.__version__}, "
          f"overrides: {' '.join(args.overrides) or 'none'}")  # fmt: skip
    # every wall-clock timing first: on an H100, fp16 with channels_last timed after bf16's
    # profiler session took 16.5 ms a step, where bench.py's whole loop takes 10.3 ms
    steps = {p: build_step(args, p) for p in args.precisions}
    walls = {p: time_wall(args, step) for p, step in steps.items()}
    results = []
    for precision, step in steps.items():
        results.append(
            {"precision": precision, "wall_ms_per_step": walls[precision],
             **profile_steps(args, step)}
        )  # fmt: skip
        print(report(results[-1]), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"overrides": args.overrides, "rows": results}, indent=2))


if __name__ == "__main__":
    main()
