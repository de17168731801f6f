"""Pure bf16's memory and speed against bf16 mixed precision, on a CPU, through mpexp's own loop.

Each case trains an MLP (784 -> W -> W -> W -> 10, Adam; at W=4096 36.8 M parameters) on the
synthetic MNIST-shaped set (`--steps` batches of 128 an epoch) for 2 epochs in a fresh process,
once at W=4096 and once at W=64 (a tiny run: the interpreter, torch and the data), and reports:
  growth   the growth of peak resident memory (ru_maxrss) of the big run over the tiny one: what
           the model's weights, gradients, states and the step's temporaries cost;
  epoch    the second epoch's time (the first warms up), from the run's own perf/epoch_time_s.
The cases alternate, repeated `--repeats` times, so that a shared machine's load falls on all
of them alike; the table gives each case's median and its ratios to bf16 mixed's.

    python scripts/bench_pure.py                 # bf16, bf16_pure, bf16_pure_kahan, 2 repeats
    python scripts/bench_pure.py --cases bf16,bf16_pure_stochastic --repeats 1
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
        f"precision={case}",
        "trainer.epochs=2",
        "trainer.log_every=4",  # pure bf16's lost-update count (and its workspace) every 4 steps
        "trainer.progress=false",
        "wandb.mode=disabled",
    ]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides)
    train(cfg, RunContext(Path(run_dir)))
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    epochs = [r["perf/epoch_time_s"] for r in rows if "perf/epoch_time_s" in r]
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    params = sum(p.numel() for p in MLP(1, 10, (28, 28), width).parameters())
    return {"peak_mib": peak_kib / 1024, "epochs_s": epochs, "params": params}


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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="bf16,bf16_pure,bf16_pure_kahan")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--child")
    parser.add_argument("--width", type=int, default=BIG)
    parser.add_argument("--dir")
    parser.add_argument("--steps", type=int, default=4, help="steps an epoch (batches of 128)")
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.width, args.dir, args.steps)))
        return 0

    cases = args.cases.split(",")
    growth: dict[str, list[float]] = {c: [] for c in cases}
    epoch: dict[str, list[float]] = {c: [] for c in cases}
    params = 0
    for repeat in range(args.repeats):
        for case in cases:
            big, tiny = run_child(case, BIG, args.steps), run_child(case, TINY, args.steps)
            params = big["params"]
            growth[case].append(big["peak_mib"] - tiny["peak_mib"])
            epoch[case].append(big["epochs_s"][-1])
            print(
                f"repeat {repeat + 1} {case}: growth {growth[case][-1]:.0f} MiB, "
                f"epoch 2 {epoch[case][-1]:.2f} s",
                flush=True,
            )
    base = cases[0]
    print(f"\n{params / 1e6:.1f} M parameters, torch {torch.__version__}, {args.repeats} repeats")
    print(f"| precision | peak RSS growth | vs {base} | epoch 2 | vs {base} |")
    print("|---|---|---|---|---|")
    for case in cases:
        g, e = statistics.median(growth[case]), statistics.median(epoch[case])
        g0, e0 = statistics.median(growth[base]), statistics.median(epoch[base])
        print(f"| {case} | {g:.0f} MiB | {g / g0:.2f}x | {e:.2f} s | {e / e0:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
