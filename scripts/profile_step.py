"""Where a training step's time goes: PyTorch's profiler over mpexp's own step, per precision.

For each precision it builds what a run builds (model, memory format, compiled or not, optimizer,
loss scaler, cuDNN settings), trains `--warmup` steps on device-resident random batches of the
dataset's shape, then times `--steps` steps twice: by the wall clock (synchronised once at the
end) and under the profiler. It prints, per step, the wall time, the time the GPU spent in
kernels and how many kernels ran, then the operators that took the most device time.

When the GPU is busy for most of the wall time the step is bound by its kernels (look at the
top operators); when it is busy for a small part, by the host launching them (fewer, fused
kernels help: trainer.compile=true; CUDA graphs: trainer.compile_mode=reduce-overhead).

    python scripts/profile_step.py --precisions bf16,fp16
    python scripts/profile_step.py --precisions bf16 trainer.compile=true trainer.channels_last=true
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

from bench import mpexp_config  # noqa: E402  (scripts/bench.py: the same config as a run)

from mpexp import performance  # noqa: E402
from mpexp.loop import train_step  # noqa: E402
from mpexp.precision import convert_to_fp8, setup_precision  # noqa: E402
from mpexp.runner import build  # noqa: E402
from mpexp.scaling import build_scaler  # noqa: E402
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
    """One training step as mpexp's loop runs it (mpexp.loop.train_step, then the scale update)."""
    cfg = mpexp_config(args, Path("."), precision, 1)
    device = args.device
    performance.configure_backends(device, cfg.trainer)
    mode = setup_precision(cfg.precision, device)
    torch.manual_seed(0)
    model = build(cfg.model, in_channels=1, num_classes=10, image_size=(28, 28)).to(device)
    model, mode = convert_to_fp8(model, mode, [], cfg.trainer.compile)  # as a run converts it
    performance.apply_memory_format(model, cfg.trainer)
    scaler = build_scaler(cfg.loss_scaling, mode, device)
    optimizer = performance.build_optimizer(cfg, model, device, scaler)
    net = performance.compile_model(model, cfg.trainer)
    fmt = performance.memory_format(cfg.trainer.channels_last)
    images = torch.randn(args.batch_size, 1, 28, 28, device=device).to(memory_format=fmt)
    labels = torch.randint(0, 10, (args.batch_size,), device=device)

    def step() -> None:
        train_step(net, images, labels, optimizer, scaler, mode)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

    return step


def measure(args, precision: str) -> dict:
    step = build_step(args, precision)
    for _ in range(args.warmup):
        step()
    synchronize(args.device)
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    synchronize(args.device)
    wall_ms = 1e3 * (time.perf_counter() - start) / args.steps
    activities = [ProfilerActivity.CPU]
    if args.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            step()
        synchronize(args.device)
    events = prof.key_averages()
    on_device = "cuda" if args.device.type == "cuda" else "cpu"
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    busy_us = sum(e.time_range.elapsed_us() for e in kernels)
    busy_ms = busy_us / 1e3 / args.steps if kernels else None
    top = sorted(events, key=lambda e: _self_device_us(e, on_device), reverse=True)[: args.top]
    return {
        "precision": precision,
        "wall_ms_per_step": wall_ms,
        "device_busy_ms_per_step": busy_ms,
        "kernels_per_step": len(kernels) / args.steps if kernels else None,
        "top": [_op_row(e, on_device, args.steps) for e in top],
    }


def _op_row(event, device: str, steps: int) -> dict:
    ms = _self_device_us(event, device) / 1e3 / steps
    return {"op": event.key, "ms_per_step": ms, "calls_per_step": event.count / steps}


def _self_device_us(event, device: str) -> float:
    """Self time on the device, under either attribute name (renamed in torch 2.4's successors)."""
    if device == "cpu":
        return event.self_cpu_time_total
    for name in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(event, name):
            return getattr(event, name)
    return 0.0


def report(result: dict) -> str:
    busy = result["device_busy_ms_per_step"]
    lines = [
        f"{result['precision']}: {result['wall_ms_per_step']:.2f} ms/step wall"
        + (f", device busy {busy:.2f} ms ({100 * busy / result['wall_ms_per_step']:.0f} %)"
           f" in {result['kernels_per_step']:.0f} kernels" if busy else ""),
        "  ms/step | calls | operator",
        *(f"  {t['ms_per_step']:7.3f} | {t['calls_per_step']:5.1f} | {t['op'][:90]}"
          for t in result["top"]),
    ]  # fmt: skip
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    print(f"{args.model}, batch {args.batch_size}, on {args.device}, torch {torch.__version__}, "
          f"overrides: {' '.join(args.overrides) or 'none'}")  # fmt: skip
    results = []
    for precision in args.precisions:
        results.append(measure(args, precision))
        print(report(results[-1]), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"overrides": args.overrides, "rows": results}, indent=2))


if __name__ == "__main__":
    main()
