"""Benchmark mpexp's training loop against the World4AI tutorial's loop, per precision.

In one process on one device, after a warm-up epoch, for each precision mode it times:
  tutorial  the loop as the World4AI "Mixed Precision Training" tutorial writes it: a DataLoader
            over the MNIST files with ToTensor and 2 workers, `loss.item()` every step, GradScaler
            for fp16;
  mpexp     `python -m mpexp.train` itself, in a process of its own per precision, exactly as a
            user's command runs (W&B off): the same switches give the same epoch times;
  bare      (CPU only, or with --bare) the same model, optimizer, device-resident batches and
            speed switches (memory format, compilation, cuDNN autotuning) as mpexp, in a loop
            with no metrics at all: mpexp's overhead is measured against it.
All loops use the same model, data (MNIST's on-disk format), batch size and precision switches.

It also measures what a step pays so that a skipped step can leave BatchNorm's statistics as they
were (mpexp/step/rollback.py): saving DeepCNN's 42 buffers and selecting them back, with
multi-tensor ops as mpexp does and, for comparison, with a copy and a select per buffer. Operators
dispatched (each at least one kernel launch on a GPU) and wall time per step, on the device
benchmarked.

    python scripts/bench.py                       # CUDA: DeepCNN on MNIST-sized data
    python scripts/bench.py --device cpu          # a small model, under two minutes on 2 cores
    python scripts/bench.py --json bench.json     # the same numbers as JSON
    python scripts/bench.py --model vit --precisions bf16,fp8 trainer.compile=true
                                                  # fp8 against bf16 on a ViT (a GPU of sm89+)

Under precision=fp8 every loop trains the model as mpexp converts it (torchao's fp8 Linear
layers); with bf16 among the precisions each row also gets its speedup over bf16.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader
from torchvision import datasets
from torchvision import transforms as T

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mpexp import config  # noqa: E402
from mpexp.build import build  # noqa: E402
from mpexp.data.mnist import MNISTData, write_mnist_files  # noqa: E402
from mpexp.data.synthetic import SyntheticData  # noqa: E402
from mpexp.models.deepcnn import DeepCNN  # noqa: E402
from mpexp.precision.fp8 import convert_to_fp8  # noqa: E402
from mpexp.precision.modes import setup_precision  # noqa: E402
from mpexp.precision.scaling import build_scaler  # noqa: E402
from mpexp.step import performance  # noqa: E402
from mpexp.step.flops import device_peak_tflops, flops_per_sample  # noqa: E402
from mpexp.step.objective import Objective  # noqa: E402
from mpexp.step.rollback import BufferRollback  # noqa: E402
from mpexp.stopping import Preempted  # noqa: E402
from mpexp.system import resolve_device, synchronize  # noqa: E402
from mpexp.tasks.classification import Classification  # noqa: E402

PRECISIONS = ("fp32", "tf32", "fp16", "bf16")
MNIST_TASK = Classification(channels=1, height=28, width=28, num_classes=10)

# Per device: what a run of a few minutes (CUDA) or under two (CPU) can afford. On CPU the point
# is mpexp's per-step overhead, measured in fp32: CPUs without bf16/fp16 matrix units run 16-bit
# autocast several times slower than fp32 (5x on the 2-core AMD EPYC this was written on).
DEFAULTS = {
    "cuda": {
        "model": "deepcnn",
        "train_size": 60_000,
        "batch_size": 256,
        "epochs": 3,
        "precisions": ",".join(PRECISIONS),
        "overrides": [],
    },
    "cpu": {
        "model": "simplecnn",
        "train_size": 4096,
        "batch_size": 128,
        "epochs": 6,
        "precisions": "fp32",
        "overrides": ["model.width=16"],
    },
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--precisions", help="comma-separated; default: all on CUDA, fp32 on CPU")
    p.add_argument(
        "--model", help="deepcnn | simplecnn | resnet18_cifar | vit (default: per device)"
    )
    p.add_argument("--train-size", type=int, help="training samples per epoch")
    p.add_argument("--batch-size", type=int)
    p.add_argument("--epochs", type=int, help="timed epochs; one more runs first as warm-up")
    p.add_argument("--data-root", help="a folder with MNIST/raw files; default: generated ones")
    p.add_argument("--bare", action="store_true", help="also time the bare loop on CUDA")
    p.add_argument(
        "--no-tutorial",
        action="store_true",
        help="skip the tutorial's loop (it takes no compile or memory-format switch anyway)",
    )
    p.add_argument("--peak-tflops", type=float, help="the device's peak, for unlisted GPUs")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument(
        "--expect-cuda-graph",
        choices=["true", "false"],
        help="exit 1 unless every mpexp run's ran.cuda_graph is this (what the run's command "
        "got, not what it asked for)",
    )
    p.add_argument(
        "--process-repeats",
        type=int,
        help="CPU: how often to time the whole quickstart process against a bare script "
        "(default 3; 0 skips it)",
    )
    p.add_argument(
        "--process-size",
        type=int,
        nargs=2,
        metavar=("EPOCHS", "TRAIN_SIZE"),
        default=(5, 8192),
        help="the quickstart's epochs and training samples for the process comparison",
    )
    p.add_argument(
        "overrides", nargs="*", help="mpexp overrides for every loop, e.g. trainer.compile=true"
    )
    args = p.parse_args(argv)
    args.device = resolve_device(args.device)
    if args.process_repeats is None:
        args.process_repeats = 3 if args.device.type == "cpu" else 0
    for key, value in DEFAULTS[args.device.type].items():
        if not getattr(args, key):
            setattr(args, key, value)
    args.precisions = args.precisions.split(",")
    return args


def write_data(root: Path, train_size: int, seed: int = 0) -> Path:
    """MNIST-shaped learnable images as MNIST's own IDX files, for machines without the dataset."""
    data = SyntheticData(train_size=train_size, val_size=1000, noise=0.6, seed=seed, batch_size=1)
    (train_x, train_y), (val_x, val_y), _ = data.load()

    def as_uint8(images):
        return (images[:, 0] * 255).round().to(torch.uint8).numpy()

    splits = {
        "train": (as_uint8(train_x), train_y.numpy().astype(np.uint8)),
        "t10k": (as_uint8(val_x), val_y.numpy().astype(np.uint8)),
    }
    write_mnist_files(root, splits)
    return root


def mpexp_overrides(args, root: Path, precision: str, epochs: int) -> list[str]:
    """The command line of a run of `precision` on the benchmark's data."""
    return [
        "dataset=mnist",
        f"dataset.root={root}",
        "dataset.download=false",
        f"dataset.batch_size={args.batch_size}",
        f"model={args.model}",
        f"precision={precision}",
        f"trainer.epochs={epochs}",
        f"trainer.device={args.device.type}",
        "trainer.progress=false",
        "wandb.mode=disabled",
        *args.overrides,
    ]


def mpexp_config(args, root: Path, precision: str, epochs: int):
    overrides = mpexp_overrides(args, root, precision, epochs)
    config.register()
    with initialize_config_dir(config_dir=str(config.config_dir()), version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


def time_mpexp(args, root: Path, precision: str) -> dict:
    """`python -m mpexp.train` in a process of its own, as a user runs it (nothing compiled or
    captured for another precision shares its process); epoch times, peak memory and compile
    time from the run's metrics.jsonl, and how its step ran from its summary."""
    with tempfile.TemporaryDirectory() as run_dir:
        overrides = mpexp_overrides(args, root, precision, args.epochs + 1)
        subprocess.run(
            [sys.executable, "-m", "mpexp.train", *overrides, f"hydra.run.dir={run_dir}"],
            check=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.DEVNULL,
        )
        rows = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
        ran = json.loads((Path(run_dir) / "summary.json").read_text())["ran"]
    epochs = [r for r in rows if "epoch" in r]
    compile_s = sum(r.get("perf/compile_s", 0.0) for r in epochs)
    epochs = epochs[1:]  # the first epoch is the warm-up
    memory = [v for r in epochs for k, v in r.items() if k.startswith("mem/")]
    times = [r["perf/epoch_time_s"] for r in epochs]
    how = {key: ran.get(key) for key in ("step_path", "cuda_graph", "compile")}
    return {**_summarise(times), "mem": max(memory), "compile_s": compile_s, **how}


def fresh_model(args, device):
    torch.manual_seed(0)
    cfg = mpexp_config(args, Path("."), "fp32", 1)  # the model group with the same overrides
    return build(cfg.model, in_channels=1, num_classes=10, image_size=(28, 28)).to(device)


def model_for(args, mode):
    """A fresh model as a run of this precision trains it: under fp8, converted as mpexp does."""
    model, _ = convert_to_fp8(fresh_model(args, args.device), mode, [], compiled=False)
    return model


def time_tutorial(args, root: Path, precision: str) -> dict:
    """The tutorial's loop, with the precision mode's autocast and TF32 switches."""
    device = args.device
    mode = setup_precision(mpexp_config(args, root, precision, 1).precision, device)
    dataset = datasets.MNIST(str(root), train=True, download=False, transform=T.ToTensor())
    loader = DataLoader(
        dataset, batch_size=args.batch_size, shuffle=True, num_workers=2, drop_last=True
    )
    model = model_for(args, mode)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    times = []
    _reset_peak(device)
    for _ in range(args.epochs + 1):
        synchronize(device)
        start = time.perf_counter()
        losses = []
        for img, label in loader:
            img, label = img.to(device), label.to(device)
            with mode.autocast():
                loss = F.cross_entropy(model(img), label)
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            losses.append(loss.item())
        synchronize(device)
        times.append(time.perf_counter() - start)
    return {**_summarise(times[1:]), "mem": _peak_mib(device)}


def bare_parts(args, precision: str, root: Path = Path("."), graph: bool = True):
    """What a run of `precision` builds for its steps, without the run around them: its config,
    precision mode, model (converted, in the memory format as the config says), the model with
    its loss as the loop calls it (an Objective, compiled as the config says: the loss inside the
    model's graph, as a run compiles them), loss scaler, optimizer and speed switches, with cuDNN
    set as a run sets it (`graph=False`: for an eager loop of its own). Also
    scripts/profile_step.py's."""
    device = args.device
    cfg = mpexp_config(args, root, precision, 1)
    performance.configure_backends(device, cfg.trainer)
    mode = setup_precision(cfg.precision, device)
    weights = model_for(args, mode)
    mnist = Classification(channels=1, height=28, width=28, num_classes=10)  # fresh_model's
    speed = performance.for_model(performance.plan_speed(cfg, device), cfg, weights, mnist)
    if not graph:
        speed = performance.replace(speed, cuda_graph=False)
    performance.apply_memory_format(weights, speed)
    scaler = build_scaler(cfg.loss_scaling, mode, device)
    optimizer = performance.build_optimizer(cfg, weights, device, scaler, speed)
    forward = performance.compile_model(Objective(weights, MNIST_TASK), speed)
    return cfg, mode, weights, forward, scaler, optimizer, speed


def time_bare(args, root: Path, precision: str) -> dict:
    """mpexp's model, optimizer, scaler and device-resident batches with no metrics at all."""
    device = args.device
    _, mode, _, forward, scaler, optimizer, speed = bare_parts(args, precision, root, graph=False)
    data = MNISTData(root=str(root), download=False, batch_size=args.batch_size)
    data.setup(device, speed.memory_format())
    times = []
    for epoch in range(args.epochs + 1):
        synchronize(device)
        start = time.perf_counter()
        for images, labels in data.train_batches(epoch, 0, device):
            with mode.autocast():
                loss = forward(images, labels).sum()  # the loss's terms: one, cross-entropy's
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return _summarise(times[1:])


class _OpCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _per_buffer_rollback(buffers: list[torch.Tensor]):
    """The straightforward rollback, for comparison: a copy to save and a select per buffer."""
    saved = [torch.empty_like(b) for b in buffers]

    def step(skipped: torch.Tensor) -> None:
        for keep, b in zip(saved, buffers, strict=True):
            keep.copy_(b)
        skip = skipped.to(torch.bool)
        for keep, b in zip(saved, buffers, strict=True):
            b.copy_(torch.where(skip, keep, b))

    return step


def time_rollback(device: torch.device, steps: int = 2000) -> dict:
    """Per step: operators dispatched and microseconds to save DeepCNN's buffers and select them
    back (a step that was not skipped, the usual case: the same work either way)."""
    model = DeepCNN().to(device)
    rollback = BufferRollback.for_step(model, can_skip=True)

    def foreach(skipped: torch.Tensor) -> None:
        rollback.save()
        rollback.restore_if(skipped)

    skipped = torch.zeros((), device=device)
    result = {"buffers": len(list(model.buffers()))}
    for name, step in (
        ("foreach", foreach),
        ("per_buffer", _per_buffer_rollback(list(model.buffers()))),
    ):
        with _OpCount() as count:
            step(skipped)
        for _ in range(50):  # warm-up
            step(skipped)
        synchronize(device)
        start = time.perf_counter()
        for _ in range(steps):
            step(skipped)
        synchronize(device)
        result[name] = {"ops": count.ops, "us": 1e6 * (time.perf_counter() - start) / steps}
    return result


def _summarise(times: list[float]) -> dict:
    # the median for epoch times; the best epoch for overhead, since interference from other
    # processes only ever adds time and would otherwise swamp a difference of a few per cent
    return {"s": statistics.median(times), "best": min(times)}


def _reset_peak(device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_mib(device):
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None


def device_peak(args, name: str, precision: str) -> float | None:
    """--peak-tflops, else the listed peak of the GPU (mpexp/step/flops.py); unlisted ones: none."""
    return args.peak_tflops or device_peak_tflops(name, precision)


def run(args) -> dict:
    from mpexp.system import device_name

    name = device_name(args.device)
    root = Path(args.data_root) if args.data_root else None
    with tempfile.TemporaryDirectory() as tmp:
        root = root or write_data(Path(tmp), args.train_size)
        samples = (args.train_size // args.batch_size) * args.batch_size
        # as mpexp counts it for perf/tflops: one batch at the run's shapes, forward and backward
        flops = flops_per_sample(fresh_model(args, args.device), MNIST_TASK, args.batch_size)
        with_bare = args.device.type == "cpu" or args.bare
        rows = []
        for precision in args.precisions:
            row = {
                "precision": precision,
                "tutorial": None if args.no_tutorial else time_tutorial(args, root, precision),
                "mpexp": time_mpexp(args, root, precision),
            }
            if with_bare:
                row["bare"] = time_bare(args, root, precision)
            rows.append(row)
            # a line per precision as it is measured: a benchmark stopped at a time limit
            # still leaves what it measured in its log
            m = row["mpexp"]
            print(
                f"  measured {precision}: mpexp {m['s']:.3f} s/epoch, compile "
                f"{m['compile_s']:.1f} s, step {m['step_path']}"
                + (f"; bare {row['bare']['s']:.3f} s/epoch" if "bare" in row else ""),
                file=sys.stderr,
                flush=True,
            )

    base = next((r for r in rows if r["precision"] == "fp32"), None)
    bf16 = next((r for r in rows if r["precision"] == "bf16"), None)
    results = []
    for r in rows:
        mpexp_s = r["mpexp"]["s"]
        tutorial = r["tutorial"] or {"s": None, "mem": None}
        tflops = flops * samples / mpexp_s / 1e12
        peak = device_peak(args, name, r["precision"])
        out = {
            "precision": r["precision"],
            "tutorial_s_per_epoch": tutorial["s"],
            "mpexp_s_per_epoch": mpexp_s,
            "speedup_vs_tutorial": tutorial["s"] and tutorial["s"] / mpexp_s,
            "speedup_vs_fp32": base["mpexp"]["s"] / mpexp_s if base else None,
            "speedup_vs_bf16": bf16["mpexp"]["s"] / mpexp_s if bf16 else None,
            "tflops": tflops,
            "peak_fraction": tflops / peak if peak else None,
            "peak_mem_mib": r["mpexp"]["mem"],
            "mem_vs_fp32": r["mpexp"]["mem"] / base["mpexp"]["mem"] if base else None,
            "tutorial_peak_mem_mib": tutorial["mem"],
            "compile_s": r["mpexp"]["compile_s"],
            "step_path": r["mpexp"]["step_path"],
            "cuda_graph": r["mpexp"]["cuda_graph"],
        }
        if "bare" in r:
            out["bare_s_per_epoch"] = r["bare"]["s"]
            out["overhead_vs_bare"] = r["mpexp"]["best"] / r["bare"]["best"] - 1
        results.append(out)
    return {
        "date": date.today().isoformat(),
        "command": "python scripts/bench.py " + " ".join(sys.argv[1:]),
        "device": str(args.device),
        "device_name": name,
        "torch_version": torch.__version__,
        "model": args.model,
        "train_size": samples,
        "batch_size": args.batch_size,
        "timed_epochs": args.epochs,
        "gflop_per_sample": flops / 1e9,
        "rows": results,
        "rollback": time_rollback(args.device),
        "process": time_processes(args) if args.process_repeats else None,
    }


def time_processes(args) -> dict:
    """The whole `python -m mpexp.train experiment=quickstart` process (imports, config, data,
    W&B offline, training, validation, files), the same with W&B disabled, and
    scripts/bare_quickstart.py doing the same training with nothing else, run in turn; wall-clock
    seconds."""
    epochs, size = args.process_size
    mpexp = [sys.executable, "-m", "mpexp.train", "experiment=quickstart",
             f"trainer.epochs={epochs}", f"dataset.train_size={size}", "trainer.device=cpu",
             "trainer.progress=false"]  # fmt: skip
    commands = {
        "mpexp": mpexp,
        "mpexp_no_wandb": [*mpexp, "wandb.mode=disabled"],
        "bare": [sys.executable, str(ROOT / "scripts" / "bare_quickstart.py"), "--epochs",
                 str(epochs), "--train-size", str(size)],
    }  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "offline"}
    times: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(args.process_repeats):
        for name, command in commands.items():
            with tempfile.TemporaryDirectory() as cwd:
                start = time.perf_counter()
                subprocess.run(command, cwd=cwd, env=env, check=True, capture_output=True)
                times[name].append(time.perf_counter() - start)
    result = {"epochs": epochs, "train_size": size}
    for name, seconds in times.items():
        result[f"{name}_s"] = seconds
    for name, key in (("mpexp", "ratio"), ("mpexp_no_wandb", "ratio_no_wandb")):
        result[f"{key}_median"] = statistics.median(times[name]) / statistics.median(times["bare"])
        result[f"{key}_best"] = min(times[name]) / min(times["bare"])
    return result


def table(result: dict) -> str:
    def fmt(value, spec):
        return "n/a" if value is None else format(value, spec)

    def times(value):  # a speedup; none where its baseline was not measured
        return "n/a" if value is None else f"{value:.2f}x"

    bare = "overhead_vs_bare" in result["rows"][0]
    with_bf16 = any(r["precision"] == "bf16" for r in result["rows"])
    head = ["precision", "tutorial s/ep", "mpexp s/ep", "vs tutorial", "vs fp32", "TFLOP/s",
            "% peak", "peak MiB", "mem vs fp32"]  # fmt: skip
    if with_bf16:
        head.insert(5, "vs bf16")
    if bare:
        head += ["bare s/ep", "overhead"]
    lines = [
        f"{result['model']} on {result['device_name']} ({result['device']}), torch "
        f"{result['torch_version']}, {result['train_size']} samples/epoch, batch "
        f"{result['batch_size']}, {result['gflop_per_sample']:.3f} GFLOP/sample, median of "
        f"{result['timed_epochs']} epochs after a warm-up",
        " | ".join(head),
        " | ".join("---" for _ in head),
    ]
    for r in result["rows"]:
        cells = [
            r["precision"],
            fmt(r["tutorial_s_per_epoch"], ".3f"),
            fmt(r["mpexp_s_per_epoch"], ".3f"),
            times(r["speedup_vs_tutorial"]),
            times(r["speedup_vs_fp32"]),
            fmt(r["tflops"], ".2f"),
            fmt(r["peak_fraction"] and 100 * r["peak_fraction"], ".1f"),
            fmt(r["peak_mem_mib"], ".0f"),
            fmt(r["mem_vs_fp32"], ".2f"),
        ]
        if with_bf16:
            cells.insert(5, times(r["speedup_vs_bf16"]))
        if bare:
            cells += [
                fmt(r["bare_s_per_epoch"], ".3f"),
                fmt(100 * r["overhead_vs_bare"], "+.1f") + "%",
            ]
        lines.append(" | ".join(cells))
    rollback = result["rollback"]
    lines += [
        "",
        f"skipped-step buffer rollback, DeepCNN's {rollback['buffers']} buffers, per step:",
        "rollback | operators | us/step",
        "--- | --- | ---",
        *(f"{name} | {rollback[name]['ops']} | {rollback[name]['us']:.1f}"
          for name in ("foreach", "per_buffer")),
    ]  # fmt: skip
    process = result.get("process")
    if process:
        lines += [
            "",
            f"whole process, experiment=quickstart ({process['epochs']} epochs of "
            f"{process['train_size']} samples, W&B offline) against scripts/bare_quickstart.py, "
            f"{len(process['mpexp_s'])} runs each:",
            "process | median s | best s | vs bare (median) | vs bare (best)",
            "--- | --- | --- | --- | ---",
        ]
        bare = process["bare_s"]
        for name, said in (("mpexp", "mpexp"), ("mpexp_no_wandb", "mpexp, W&B disabled"),
                           ("bare", "bare")):  # fmt: skip
            seconds = process[f"{name}_s"]
            median, best = statistics.median(seconds), min(seconds)
            versus = f"{median / statistics.median(bare):.2f}x | {best / min(bare):.2f}x"
            lines.append(f"{said} | {median:.2f} | {best:.2f} | {versus}")
    return "\n".join(lines)


def main(argv=None) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    try:
        result = run(args)
    except (Preempted, KeyboardInterrupt) as stopped:
        # mpexp's loop answers a stop signal with a checkpoint in a temporary run dir that the
        # benchmark deletes: nothing to resume, so no resume command and no traceback
        signum = getattr(stopped, "signum", signal.SIGINT)
        print(f"bench.py: stopped by {signal.Signals(signum).name}; nothing was measured.")
        raise SystemExit(128 + signum) from None
    print(table(result), flush=True)
    # on an H100 (2026-11-26) the process outlived its results by more than its time limit
    # left: should its exit hang, say where, every thread
    faulthandler.dump_traceback_later(30)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.expect_cuda_graph:
        wanted = args.expect_cuda_graph == "true"
        off = [r["precision"] for r in result["rows"] if r["cuda_graph"] is not wanted]
        if off:
            print(f"bench.py: ran.cuda_graph is not {args.expect_cuda_graph} for {', '.join(off)}")
            raise SystemExit(1)


if __name__ == "__main__":
    main()
