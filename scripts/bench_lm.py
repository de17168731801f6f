"""Benchmark mpexp on a language model against a plain loop that trains the same GPT on the same
windows, per precision.

For each precision, one after the other on one device:
  mpexp  `python -m mpexp.train model=<model> dataset=text precision=<p> ...` (or dataset=tokens on
         nanoGPT's train.bin / val.bin, with --dataset tokens) in a process of its own, exactly as
         a user's command runs (W&B off); tokens/s from its metrics.jsonl;
  plain  in a process of its own too, the same model (mpexp/models/gpt.py, built from the same
         config and seed), the same optimizer and learning rate, the same windows of the same
         token file (the offsets drawn as mpexp draws them), the same autocast dtype and, where
         mpexp compiled, torch.compile of the model and its loss together, as nanoGPT compiles
         its model whose forward pass computes the loss: a loop with nothing else (no metrics,
         no loss scaling but fp16's GradScaler, no checkpoints), validating between epochs as
         mpexp does.
Both time each epoch's training steps (validation and compilation left out) and take the median
tokens/s over the epochs after the first. They run in turn, `--repeats` times each (a shared
machine's speed drifts by tens of per cent over minutes); the ratio mpexp / plain of each pair,
and its median over the pairs, says what mpexp costs. On a GPU the plain loop compiles where mpexp
did but does not capture the step as a CUDA graph: there the ratio also says what the graph gains.
The validation loss each mpexp run reached in its fixed number of steps is reported beside it.

    python scripts/bench_lm.py                                  # CPU: the tiny GPT, fp32 and bf16
    python scripts/bench_lm.py --json bench_lm.json
    python scripts/bench_lm.py --dataset tokens --precisions fp32   # uint16 token files
    python scripts/bench_lm.py --device cuda --model gpt2_small --precisions bf16,fp16,fp8 \\
        --batch-size 16 --train-size 2048 --epochs 3 trainer.compile=true
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch.nn.functional as F  # noqa: E402
from hydra.utils import instantiate  # noqa: E402

from mpexp.config import FINETUNE_KEYS  # noqa: E402
from mpexp.data.base import epoch_seed  # noqa: E402
from mpexp.data.text import TextData, TokenCache, path_source, stdlib_source  # noqa: E402
from mpexp.models.gpt import GPT  # noqa: E402
from mpexp.step.performance import optimizer_spec, parameter_groups  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.bfloat16}


def overrides(args, precision: str, run_dir: Path) -> list[str]:
    if args.dataset == "tokens":
        data = ["dataset=tokens", f"dataset.path={args.tokens_dir}",
                f"dataset.vocab_size={args.vocab_size}"]  # fmt: skip
    else:
        data = ["dataset=text", f"dataset.cache_dir={args.cache_dir}"]
    return [
        f"model={args.model}",
        *data,
        f"precision={precision}",
        f"trainer.device={args.device}",
        f"trainer.epochs={args.epochs}",
        f"dataset.train_size={args.train_size}",
        f"dataset.batch_size={args.batch_size}",
        f"trainer.seed={args.seed}",
        "trainer.progress=false",
        "wandb.mode=disabled",
        f"hydra.run.dir={run_dir}",
        *args.extra,
    ]


def run_mpexp(args, precision: str, tmp: Path) -> dict:
    """The user's command in a process of its own; its timed epochs and what ran."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"mpexp-{precision}-", dir=tmp)) / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "mpexp.train", *overrides(args, precision, run_dir)]
    done = subprocess.run(command, env=env, cwd=tmp, capture_output=True, text=True)
    failed(done, f"mpexp's {precision} run")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in rows if "epoch" in r]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "tokens_per_s": statistics.median(e["perf/tokens_per_s"] for e in epochs[1:]),
        "epoch_time_s": statistics.median(e["perf/epoch_time_s"] for e in epochs[1:]),
        "val_loss": epochs[-1]["val/loss"],
        "steps": epochs[-1]["step"],
        "tflops": statistics.median(e.get("perf/tflops", 0.0) for e in epochs[1:]),
        "compile_s": sum(e.get("perf/compile_s", 0.0) for e in epochs),
        "mfu": statistics.median(e.get("perf/mfu", 0.0) for e in epochs[1:]),
        "ran": summary["ran"],
        "cfg": summary["config"],
    }


def run_plain(args, precision: str, mpexp: dict) -> dict:
    """The plain loop, with what mpexp's run used: config, token file, compile switch."""
    cfg = mpexp["cfg"]
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    # the GPT's own arguments: not the target, nor mpexp's fine-tuning keys (model.lora, ...)
    model_cfg = {k: v for k, v in cfg["model"].items() if k not in ("_target_", *FINETUNE_KEYS)}
    train_tokens, val_tokens, vocab = token_parts(args, cfg["dataset"])
    padded = -(-vocab // 64) * 64  # the model's vocabulary, as mpexp pads it
    model = GPT(vocab_size=padded, **model_cfg).to(device)
    if precision == "fp8":  # every Linear layer of the GPT is fp8-convertible, as in mpexp
        import torchao.float8 as float8

        recipe = float8.Float8LinearConfig.from_recipe_name(cfg["precision"]["fp8"]["recipe"])
        recipe = dataclasses.replace(recipe, emulate=device.type == "cpu")
        model = float8.convert_to_float8_training(model, config=recipe)
    optimizer_cfg = {**optimizer_spec(cfg["optimizer"]), "fused": device.type == "cuda"}
    optimizer = instantiate(optimizer_cfg)(parameter_groups(model, cfg["optimizer"]))

    def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # the loss beside the model's forward pass, as nanoGPT's model computes it, so that
        # compiling one compiles both into one graph
        return F.cross_entropy(model(x).reshape(-1, padded), y.reshape(-1))

    step_loss = torch.compile(loss_of) if mpexp["ran"].get("compile") else loss_of
    dtype = DTYPES.get(precision)
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    block, batch, n = model_cfg["block_size"], args.batch_size, args.train_size
    val_offsets = np.linspace(0, len(val_tokens) - block - 1, cfg["dataset"]["val_size"])

    def windows(tokens: np.ndarray, offsets: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        index = offsets.round().astype(np.int64)[:, None] + np.arange(block + 1)
        tokens_in = torch.from_numpy(tokens[index].astype(np.int64))
        if device.type == "cuda":
            tokens_in = tokens_in.pin_memory().to(device, non_blocking=True)
        return tokens_in[:, :-1], tokens_in[:, 1:]

    rates = []
    for epoch in range(1, args.epochs + 1):
        generator = torch.Generator().manual_seed(epoch_seed(args.seed, epoch))
        offsets = torch.randint(len(train_tokens) - block, (n,), generator=generator).numpy()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for first in range(0, n - n % batch, batch):
            x, y = windows(train_tokens, offsets[first : first + batch])
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                loss = step_loss(x, y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        rates.append((n - n % batch) * block / (time.perf_counter() - start))
        model.eval()
        with torch.no_grad(), torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            for first in range(0, len(val_offsets), batch):  # validated, untimed, as mpexp does
                step_loss(*windows(val_tokens, val_offsets[first : first + batch]))
        model.train()
    return {"tokens_per_s": statistics.median(rates[1:])}


def token_parts(args, data: dict) -> tuple[np.ndarray, np.ndarray, int]:
    """The training and validation tokens mpexp's run read, and their vocabulary."""
    if args.dataset == "tokens":
        dtype = np.uint16 if args.vocab_size <= 1 << 16 else np.uint32
        folder = Path(args.tokens_dir)
        train, val = (np.memmap(folder / f"{p}.bin", dtype, mode="r") for p in ("train", "val"))
        return train, val, args.vocab_size
    source = stdlib_source() if data["path"] is None else path_source(data["path"])
    # the token file mpexp's run wrote (and checked against its source) for this corpus
    tokens = np.memmap(TokenCache(source, Path(args.cache_dir)).tokens_path, np.uint8, mode="r")
    split = round(len(tokens) * (1 - data["val_fraction"]))
    return tokens[:split], tokens[split:], 256


def write_token_files(args, folder: Path) -> None:
    """The standard library's bytes as nanoGPT's train.bin and val.bin (uint16, its tail 10 %
    validating), for --dataset tokens without --tokens-dir."""
    data = TextData(None, block_size=64, cache_dir=args.cache_dir)
    data.setup(torch.device("cpu"))
    folder.mkdir(parents=True, exist_ok=True)
    for name, part in (("train", data.train_tokens), ("val", data.val_tokens)):
        np.asarray(part).astype(np.uint16).tofile(folder / f"{name}.bin")


def plain_process(args, precision: str, mpexp: dict, tmp: Path) -> dict:
    """run_plain in a fresh process, as the mpexp run had one: both pay a new process's costs
    (memory mapped and allocated afresh), and neither inherits the other's warm state."""
    given = Path(tempfile.mkstemp(suffix=".json", dir=tmp)[1])
    given.write_text(json.dumps({"args": vars(args) | {"json": None}, "precision": precision,
                                 "mpexp": {"cfg": mpexp["cfg"], "ran": mpexp["ran"]}}))  # fmt: skip
    command = [sys.executable, __file__, "--plain-from", str(given)]
    done = subprocess.run(command, capture_output=True, text=True)
    failed(done, f"the plain {precision} loop")
    return json.loads(done.stdout.splitlines()[-1])


def failed(done: subprocess.CompletedProcess, what: str) -> None:
    """Stop the benchmark with the end of a failed process's output, which says why."""
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-40:])
        raise SystemExit(f"{what} failed (exit {done.returncode}):\n{tail}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default="gpt")
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--train-size", type=int, default=4096, help="windows per epoch")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="mpexp and plain runs, in turn")
    parser.add_argument("--cache-dir", default=None, help="token cache (default: a temp dir)")
    parser.add_argument("--dataset", choices=("text", "tokens"), default="text")
    parser.add_argument(
        "--tokens-dir",
        help="--dataset tokens: a folder with train.bin and val.bin (default: the standard "
        "library's bytes written there as uint16)",
    )
    parser.add_argument("--vocab-size", type=int, default=256, help="--dataset tokens: its ids'")
    parser.add_argument(
        "--no-plain", action="store_true", help="time mpexp's runs only, with no plain loop"
    )
    parser.add_argument("--json", type=Path, help="write the results here too")
    parser.add_argument("--plain-from", type=Path, help=argparse.SUPPRESS)  # plain_process's
    parser.add_argument("extra", nargs="*", help="more overrides for the mpexp runs")
    args = parser.parse_args()
    if args.plain_from:
        given = json.loads(args.plain_from.read_text())
        plain_args = argparse.Namespace(**given["args"])
        print(json.dumps(run_plain(plain_args, given["precision"], given["mpexp"])))
        return
    results = []
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        args.cache_dir = args.cache_dir or str(tmp / "cache")
        if args.dataset == "tokens" and args.tokens_dir is None:
            args.tokens_dir = str(tmp / "tokens")
            write_token_files(args, Path(args.tokens_dir))
        for precision in args.precisions.split(","):
            pairs = []
            for _ in range(args.repeats):
                mpexp = run_mpexp(args, precision, tmp)
                plain = None if args.no_plain else plain_process(args, precision, mpexp, tmp)
                pairs.append((mpexp, plain))
            ratios = [m["tokens_per_s"] / p["tokens_per_s"] for m, p in pairs if p]
            ratio = statistics.median(ratios) if ratios else None
            row = {
                "precision": precision,
                "mpexp_tokens_per_s": statistics.median(m["tokens_per_s"] for m, _ in pairs),
                "plain_tokens_per_s": statistics.median(p["tokens_per_s"] for _, p in pairs if p)
                if ratios
                else None,
                "mpexp_over_plain": ratio,
                "ratios": ratios,
                "val_loss": mpexp["val_loss"],
                "steps": mpexp["steps"],
                "tflops": mpexp["tflops"],
                "mfu": mpexp["mfu"],
                "device_name": mpexp["ran"]["device_name"],
                "compile": mpexp["ran"].get("compile"),
                "emulated": mpexp["ran"].get("emulated"),
                "step_path": mpexp["ran"].get("step_path"),
                "cuda_graph_off": mpexp["ran"].get("cuda_graph_off"),  # why not, where it was not
                "compile_s": mpexp["compile_s"],
            }
            results.append(row)
            plain = (
                f"plain {row['plain_tokens_per_s']:10,.0f} tok/s | ratio {ratio:.3f} "
                f"({', '.join(f'{r:.3f}' for r in ratios)})"
                if ratios
                else "no plain loop"
            )
            print(
                f"{precision:5s} mpexp {row['mpexp_tokens_per_s']:10,.0f} tok/s | {plain} | "
                f"val loss {row['val_loss']:.4f} after {row['steps']} steps | "
                f"{row['tflops']:.3g} TFLOP/s"
                + (f", MFU {100 * row['mfu']:.1f} %" if row["mfu"] else "")
                + f" | compile {row['compile_s']:.0f} s | step {row['step_path']}"
                + (f" ({row['cuda_graph_off']})" if row["cuda_graph_off"] else ""),
                flush=True,
            )
    summary = {"args": {k: v for k, v in vars(args).items() if k != "json"}, "results": results}
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2, default=str))


if __name__ == "__main__":
    main()
