"""Pure bf16's memory and speed against bf16 mixed precision, on a CPU, through mpexp's own loop.

Each case trains an MLP (784 -> W -> W -> W -> 10, Adam; at W=4096 36.8 M parameters) on the
synthetic MNIST-shaped set (`--steps` batches of 128 an epoch) for 2 epochs in a fresh process,
once at W=4096 and once at W=64 (a tiny run: the interpreter, torch and the data), and reports:
  growth   the growth of peak resident memory (ru_maxrss) of the big run over the tiny one: what
           the model's weights, gradients, states and the step's temporaries cost;
  epoch    the second epoch's time (the first warms up), from the run's own perf/epoch_time_s;
  CPU      the big run's CPU time (user and system, both epochs) over the tiny run's: on a
           loaded machine, where the epoch's wall time measures the load, the steadier figure.
The cases alternate, repeated `--repeats` times, so that a shared machine's load falls on all
of them alike; the table gives each case's median and its ratios to bf16 mixed's.

    python scripts/bench_pure.py                 # bf16, bf16_pure, bf16_pure_kahan, 2 repeats
    python scripts/bench_pure.py --cases bf16,bf16_pure_stochastic --repeats 1
A case `<precision>@<setting>` sets `precision.update_compile` too (`bf16_pure_stochastic@false`:
the eager update, where `null` compiles it on a CPU).

With `--step-times`, the optimizer step alone instead, on one thread: torch's fused AdamW on
bf16 weights against pure bf16's AdamW with each rounding (and nearest's counting steps), on
three sets of parameter shapes: 160 small tensors, ResNet-50's, the 36.8 M MLP's; the median
step of `--repeats` rounds of `--steps` steps each, the cases alternating within a round. Wall
time and the thread's CPU time: on a shared machine the second is the steadier.

    OMP_NUM_THREADS=1 python scripts/bench_pure.py --step-times --repeats 5 --steps 5

With `--kernels`, torch's for-loop, foreach and fused Adam, AdamW and SGD on float32 weights (mixed
precision's), on the same shapes: which kernel a CPU's default should be.

    OMP_NUM_THREADS=1 python scripts/bench_pure.py --kernels --repeats 3

With `--bitcasts`, what a compiled loop on a CPU pays to see a float32 value's bits, as
stochastic rounding must: one loop over 4 Mi elements that casts a weight update to bfloat16,
against the same loop through int32 and back (`view(torch.int32)`, the low 16 bits dropped), and
torch's fused AdamW step on as many bf16 weights; one thread.

    OMP_NUM_THREADS=1 python scripts/bench_pure.py --bitcasts --repeats 7
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BIG, TINY = 4096, 64


class MLP(nn.Module):
    """Three hidden layers of `width` units over the flattened image (a user's model: `width`
    is the key mpexp's model group already has)."""

    def __init__(self, in_channels: int, num_classes: int, image_size, width: int = BIG):
        super().__init__()
        height, breadth = image_size
        self.layers = nn.Sequential(
            nn.Flatten(),
            nn.Linear(in_channels * height * breadth, width),
            nn.ReLU(),
            nn.Linear(width, width),
            nn.ReLU(),
            nn.Linear(width, width),
            nn.ReLU(),
            nn.Linear(width, num_classes),
        )

    def forward(self, x):
        return self.layers(x)


def _precision(case: str) -> list[str]:
    """A case's precision overrides: `bf16_pure_kahan`, or `bf16_pure_kahan@false` with its
    `precision.update_compile`."""
    precision, _, compile_setting = case.partition("@")
    overrides = [f"precision={precision}"]
    if compile_setting:
        overrides.append(f"precision.update_compile={compile_setting}")
    return overrides


def child(case: str, width: int, run_dir: str, steps: int) -> dict:
    """One run, in this process: its peak resident memory and its epochs' times."""
    from hydra import compose, initialize_config_dir

    from mpexp import config
    from mpexp.run.runner import train
    from mpexp.tracking.run_context import RunContext

    config.register()

    overrides = [
        "dataset=synthetic",
        f"dataset.train_size={128 * steps}",
        "dataset.val_size=128",
        "dataset.batch_size=128",
        "model=simplecnn",
        "model._target_=bench_pure.MLP",
        f"model.width={width}",
        "optimizer=adam",
        *_precision(case),
        "trainer.epochs=2",
        "trainer.log_every=4",  # pure bf16's lost-update count (and its workspace) every 4 steps
        "trainer.progress=false",
        "wandb.mode=disabled",
    ]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides)
    summary = train(cfg, RunContext(Path(run_dir)))
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    epochs = [r["perf/epoch_time_s"] for r in rows if "perf/epoch_time_s" in r]
    usage = resource.getrusage(resource.RUSAGE_SELF)
    params = sum(p.numel() for p in MLP(1, 10, (28, 28), width).parameters())
    return {
        "peak_mib": usage.ru_maxrss / 1024,  # KiB on Linux
        "epochs_s": epochs,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "params": params,
        "update": summary["ran"].get("pure_update", "torch's"),  # pure bf16's: compiled or not
    }


def run_child(case: str, width: int, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as run_dir:
        env = {**os.environ, "PYTHONPATH": f"{ROOT / 'scripts'}{os.pathsep}{ROOT}"}
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--child",
                case,
                "--width",
                str(width),
                "--dir",
                run_dir,
                "--steps",
                str(steps),
            ],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        if out.returncode != 0:
            raise SystemExit(f"{case} at width {width} failed:\n{out.stderr[-3000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])


def shape_sets() -> dict[str, list[tuple[int, ...]]]:
    """The parameter shapes `--step-times` steps: 160 small tensors (a 64x64 matrix and its
    bias, 80 times), ResNet-50's (torchvision's, on the meta device) and the big MLP's."""
    import torchvision

    with torch.device("meta"):
        resnet = torchvision.models.resnet50()
        mlp = MLP(1, 10, (28, 28))
    return {
        "160 small tensors": [(64, 64), (64,)] * 80,
        "ResNet-50's shapes": [tuple(p.shape) for p in resnet.parameters()],
        "36.8 M MLP": [tuple(p.shape) for p in mlp.parameters()],
    }


def step_times(repeats: int, steps: int, only: set | None = None) -> None:
    """The optimizer step's median time per case and shape set (see the module's docstring)."""
    from mpexp.precision.pure_optimizers import PureAdam

    torch.set_num_threads(1)
    cases = {"torch fused AdamW": None, "nearest": {"rounding": "nearest", "count": False}}
    for how, compiled in (("eager", False), ("compiled", True)):
        cases[f"nearest counting {how}"] = {"rounding": "nearest", "compiled": compiled}
        for rounding in ("kahan", "stochastic"):
            settings = {"rounding": rounding, "count": False, "compiled": compiled}
            cases[f"{rounding} {how}"] = settings
    cases = {k: v for k, v in cases.items() if not only or k in only or v is None}
    print(f"torch {torch.__version__}, 1 thread, median of {repeats} x {steps} steps: CPU ms")
    sets = shape_sets()
    cells: dict[str, list[str]] = {case: [] for case in cases}
    for shapes in sets.values():
        built = {case: _optimizer(shapes, pure, PureAdam) for case, pure in cases.items()}
        cpu: dict[str, list[float]] = {case: [] for case in cases}
        for _ in range(repeats):
            for case, optimizer in built.items():
                began = time.thread_time()
                for _ in range(steps):
                    optimizer.step()
                cpu[case].append((time.thread_time() - began) / steps * 1e3)
        base = statistics.median(cpu["torch fused AdamW"])
        for case in cases:
            c = statistics.median(cpu[case])
            cells[case].append(f"{c:.1f} ({c / base:.2f}x)")
    print(f"| step | {' | '.join(sets)} |")
    print("|---|" + "---|" * len(sets))
    for case, row in cells.items():
        print(f"| {case} | {' | '.join(row)} |", flush=True)


def kernels(repeats: int) -> None:
    """torch's three implementations of Adam, AdamW and SGD (momentum 0.9) on float32 weights,
    mixed precision's master copy: the thread's CPU time of a step (ms), median of `repeats`,
    on `--step-times`' shape sets, one thread."""
    torch.set_num_threads(1)
    algorithms = [
        (torch.optim.Adam, {}),
        (torch.optim.AdamW, {}),
        (torch.optim.SGD, {"momentum": 0.9}),
    ]
    print(
        f"torch {torch.__version__}, 1 thread, CPU time of a step (ms): for-loop / foreach / fused"
    )
    print("| shapes | " + " | ".join(cls.__name__ for cls, _ in algorithms) + " |")
    print("|---|---|---|---|")
    for name, shapes in shape_sets().items():
        cells = []
        for cls, settings in algorithms:
            times = []
            for impl in ("for-loop", "foreach", "fused"):
                params = [nn.Parameter(torch.randn(s) * 0.1) for s in shapes]
                for p in params:
                    p.grad = torch.randn(p.shape) * 1e-2
                flags = {"foreach": impl == "foreach", "fused": impl == "fused"}
                optimizer = cls(params, lr=1e-3, **settings, **flags)
                optimizer.step()
                runs = []
                for _ in range(repeats):
                    began = time.thread_time()
                    optimizer.step()
                    runs.append((time.thread_time() - began) * 1e3)
                times.append(f"{statistics.median(runs):.1f}")
            cells.append(" / ".join(times))
        print(f"| {name} | {' | '.join(cells)} |", flush=True)


def bitcasts(repeats: int) -> None:
    """The `--bitcasts` measurement (see the module's docstring): CPU ms, median of `repeats`."""
    torch.set_num_threads(1)
    size = 1 << 22
    w = (torch.randn(size) * 0.1).bfloat16()
    g = (torch.randn(size) * 1e-2).bfloat16()

    def cast(w, g):
        w.copy_((w.float() - 1e-3 * g.float()).to(torch.bfloat16))

    def through_int32(w, g):
        bits = (w.float() - 1e-3 * g.float()).view(torch.int32) & -65536
        w.copy_(bits.view(torch.float32).to(torch.bfloat16))

    param = nn.Parameter(w.clone())
    param.grad = g.clone()
    fused = torch.optim.AdamW([param], lr=1e-3, fused=True)
    cases = {
        "torch fused AdamW": fused.step,
        "compiled cast": lambda: loops["cast"](w, g),
        "compiled cast through int32": lambda: loops["through_int32"](w, g),
    }
    loops = {f.__name__: torch.compile(f, dynamic=True) for f in (cast, through_int32)}
    print(f"torch {torch.__version__}, 1 thread, {size} elements, CPU ms (ns an element)")
    for name, run in cases.items():
        run()
        times = []
        for _ in range(repeats):
            began = time.thread_time()
            run()
            times.append(time.thread_time() - began)
        ms = statistics.median(times) * 1e3
        print(f"| {name} | {ms:.2f} ({ms * 1e6 / size:.2f}) |", flush=True)


def _optimizer(shapes, pure: dict | None, cls):
    """An AdamW over bf16 weights of `shapes` with gradients, one step taken (its states made):
    torch's fused one (`pure` None) or pure bf16's with `pure`'s settings."""
    g = torch.Generator().manual_seed(0)
    params = [nn.Parameter((torch.randn(s, generator=g) * 0.1).bfloat16()) for s in shapes]
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g) * 1e-2).bfloat16()
    if pure is None:
        optimizer = torch.optim.AdamW(params, lr=1e-3, fused=True)
    else:
        optimizer = cls(params, lr=1e-3, weight_decay=0.01, decoupled=True, **pure)
    optimizer.step()
    return optimizer


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="bf16,bf16_pure,bf16_pure_kahan")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--child")
    parser.add_argument("--width", type=int, default=BIG)
    parser.add_argument("--dir")
    parser.add_argument("--steps", type=int, default=4, help="steps an epoch (batches of 128)")
    parser.add_argument("--step-times", action="store_true", help="time the optimizer step alone")
    parser.add_argument("--only", default="", help="--step-times: these cases (comma-separated)")
    parser.add_argument("--kernels", action="store_true", help="time torch's optimizer kernels")
    parser.add_argument("--bitcasts", action="store_true", help="time a compiled loop's bitcasts")
    args = parser.parse_args(argv)
    if args.bitcasts:
        bitcasts(args.repeats)
        return 0
    if args.step_times:
        step_times(args.repeats, args.steps, set(filter(None, args.only.split(","))))
        return 0
    if args.kernels:
        kernels(args.repeats)
        return 0
    if args.child:
        print(json.dumps(child(args.child, args.width, args.dir, args.steps)))
        return 0

    cases = args.cases.split(",")
    growth: dict[str, list[float]] = {c: [] for c in cases}
    epoch: dict[str, list[float]] = {c: [] for c in cases}
    cpu: dict[str, list[float]] = {c: [] for c in cases}
    params = 0
    for repeat in range(args.repeats):
        for case in cases:
            big, tiny = run_child(case, BIG, args.steps), run_child(case, TINY, args.steps)
            params = big["params"]
            growth[case].append(big["peak_mib"] - tiny["peak_mib"])
            epoch[case].append(big["epochs_s"][-1])
            cpu[case].append(big["cpu_s"] - tiny["cpu_s"])
            print(
                f"repeat {repeat + 1} {case}: growth {growth[case][-1]:.0f} MiB, "
                f"epoch 2 {epoch[case][-1]:.2f} s, CPU {cpu[case][-1]:.1f} s, "
                f"update {big['update']}",
                flush=True,
            )
    base = cases[0]
    print(f"\n{params / 1e6:.1f} M parameters, torch {torch.__version__}, {args.repeats} repeats")
    print(
        f"| precision | peak RSS growth | vs {base} | epoch 2 | vs {base} | CPU time | vs {base} |"
    )
    print("|---|---|---|---|---|---|---|")
    for case in cases:
        g, e, c = (statistics.median(d[case]) for d in (growth, epoch, cpu))
        g0, e0, c0 = (statistics.median(d[base]) for d in (growth, epoch, cpu))
        print(
            f"| {case} | {g:.0f} MiB | {g / g0:.2f}x | {e:.2f} s | {e / e0:.2f}x "
            f"| {c:.1f} s | {c / c0:.2f}x |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
