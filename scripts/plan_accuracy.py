"""The plan against real runs on this CPU, at the sizes issue 56 measured: a GPT of 38.8 M
parameters in bf16 and in pure bf16, and torchvision's ResNet-18 at 224 px in bf16, each run for
three optimizer steps and its validation (pure bf16 counting its lost updates on the second).

The measure is PyTorch's own count of what its CPU allocator holds (the profiler's memory
records), as torch.cuda.max_memory_allocated is on a GPU; the resident set overstates it by what
the C library keeps of freed pages. tests/test_plan_accuracy.py checks the same at smaller sizes.

    python scripts/plan_accuracy.py              # all three cases, in a temporary folder
    python scripts/plan_accuracy.py resnet18_bf16
"""

from __future__ import annotations

import contextlib
import io
import sys
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

STEPS = [
    "trainer.epochs=null", "trainer.max_steps=3", "trainer.log_every=2", "trainer.device=cpu",
    "dataset.batch_size=2", "dataset.train_size=8", "dataset.val_size=2",
    "wandb.mode=disabled", "trainer.progress=false",
]  # fmt: skip
GPT = ["model=gpt", "dataset=text", "model.block_size=32", "model.n_layer=4", "model.n_embd=896",
       "model.n_head=14"]  # fmt: skip
CASES = {
    "gpt_bf16": [*GPT, "precision=bf16"],
    "gpt_bf16_pure": [*GPT, "precision=bf16_pure"],
    "resnet18_bf16": ["model=resnet18", "dataset=synthetic", "dataset.channels=3",
                      "dataset.height=224", "dataset.width=224", "precision=bf16"],
}  # fmt: skip


def allocator_peak(overrides: list[str]) -> int:
    """The most bytes the CPU allocator held at once while mpexp-train ran with `overrides` (of
    what it allocated)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiled:
        train(overrides)
    records = [e for e in profiled.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = most = 0
    for record in sorted(records, key=lambda e: e.start_ns()):
        live += record.nbytes()
        most = max(most, live)
    return most


def train(overrides: list[str]) -> None:
    """mpexp-train in this process, its output kept out of the way."""
    import mpexp.train

    sys.argv = ["mpexp-train", *overrides]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            mpexp.train.cli()
        except SystemExit as ended:
            if ended.code:
                raise
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()


def main(names: list[str]) -> None:
    from mpexp.plan.rows import Target, plan_rows

    torch.set_num_threads(1)
    folder = Path(tempfile.mkdtemp(prefix="plan-accuracy-"))
    text = folder / "book.txt"
    text.write_text("the quick brown fox jumps over the lazy dog, naive cafe. " * 2000)
    print(f"{'case':<16} {'parameters':>11} {'planned MiB':>12} {'measured MiB':>13} {'error':>7}")
    for name in names or CASES:
        own = [*CASES[name], *STEPS]
        if "dataset=text" in own:
            own += [f"dataset.path={text}", f"dataset.cache_dir={folder / 'cache'}"]
        (row,) = plan_rows(own, Target("cpu"))
        measured = allocator_peak([*own, f"hydra.run.dir={folder / name}"])
        planned = row["need_bytes"]
        print(f"{name:<16} {row['parameters']:>11,} {planned / 2**20:>12.1f} "
              f"{measured / 2**20:>13.1f} {planned / measured - 1:>+7.1%}")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
