"""mpexp's language-model step against nanoGPT's, side by side in one process.

scripts/bench_lm.py times whole runs, one process after the other; on a shared machine their
speeds drift apart by tens of per cent between processes. This times the two steps alone, in
turn within one process, on the same batches of the same GPT (mpexp/models/gpt.py, same
initial weights), so that the ratio says what mpexp's step costs:

  mpexp  the loop's Stepper: the model and its task's loss as one Objective (the chunked
         cross-entropy when eager; compiled together with --compile), the loss scaler, the
         step history on the device, the same code every precision runs;
  plain  nanoGPT's step: forward and F.cross_entropy under autocast (compiled together with
         --compile), backward, AdamW's step, zero_grad.

Each round times `--steps` steps of one, then of the other (the order alternating), after
`--warmup` untimed steps of each; the ratio mpexp / plain is the median over the rounds.

    python scripts/bench_lm_step.py                        # CPU: the tiny GPT, fp32 and bf16
    python scripts/bench_lm_step.py --vocab 50257 --n-embd 128 --block-size 128
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mpexp.models.gpt import GPT
from mpexp.precision.modes import setup_precision
from mpexp.precision.scaling import build_scaler
from mpexp.step.diagnostics import Diagnostics
from mpexp.step.history import StepHistory
from mpexp.step.objective import Objective
from mpexp.step.stepper import Stepper
from mpexp.tasks.language_model import LanguageModelling
from mpexp.tracking.null_tracker import NullTracker

CONF = Path(__file__).resolve().parents[1] / "conf"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def mpexp_step(args, model, task, mode: str):
    device = torch.device("cpu")
    precision = setup_precision(OmegaConf.load(CONF / "precision" / f"{mode}.yaml"), device)
    scaler = build_scaler(OmegaConf.create({"_target_": None}), precision, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    off = OmegaConf.create({"grad_stats_every": 0, "overflow_attribution": False, "max_names": 8})
    diagnostics = Diagnostics(off, model, scaler, NullTracker("."))
    objective = Objective(model, task)
    forward = torch.compile(objective) if args.compile else objective
    history = StepHistory(capacity=args.steps + args.warmup, device=device)
    stepper = Stepper(forward, optimizer, scaler, precision, history, diagnostics, loss_fn=None)
    count = 0

    def step(x, y):
        nonlocal count
        count += 1
        stepper.step(count, x, y)
        if count % args.steps == 0:
            history.flush(wait=True)  # once a round, as the loop reads it once per log_every

    return step


def plain_step(args, model, task, mode: str, logits_of=None):
    """A user's own step: `logits_of(x)` (the model called on the tokens by default), the
    cross-entropy under autocast, backward, AdamW's step, zero_grad."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    vocab = task.model_vocab_size
    dtype = DTYPES.get(mode)
    logits_of = logits_of or model

    def loss_of(x, y):  # nanoGPT's model computes its loss in its forward pass
        return F.cross_entropy(logits_of(x).reshape(-1, vocab), y.reshape(-1))

    forward = torch.compile(loss_of) if args.compile else loss_of

    def step(x, y):
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            loss = forward(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--n-embd", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--threads", type=int, default=1, help="torch's intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)  # one: a shared machine's second core comes and goes
    torch.manual_seed(0)
    task = LanguageModelling(vocab_size=args.vocab, block_size=args.block_size)
    sizes = {"n_embd": args.n_embd, "block_size": args.block_size}
    base = GPT(vocab_size=task.model_vocab_size, **sizes)
    tokens = torch.randint(args.vocab, (args.steps, args.batch_size, args.block_size + 1))
    batches = [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]
    for mode in args.precisions.split(","):
        steps = {
            "mpexp": mpexp_step(args, copy.deepcopy(base), task, mode),
            "plain": plain_step(args, copy.deepcopy(base), task, mode),
        }
        for step in steps.values():
            for x, y in batches[: args.warmup]:
                step(x, y)
        rates = {name: [] for name in steps}
        for round_ in range(args.rounds):
            order = list(steps) if round_ % 2 == 0 else list(reversed(steps))
            for name in order:
                began = time.perf_counter()
                for x, y in batches:
                    steps[name](x, y)
                seconds = time.perf_counter() - began
                rates[name].append(args.steps * args.batch_size * args.block_size / seconds)
        ratios = [m / p for m, p in zip(rates["mpexp"], rates["plain"], strict=True)]
        print(
            f"{mode:5s} mpexp {statistics.median(rates['mpexp']):10,.0f} tok/s | plain "
            f"{statistics.median(rates['plain']):10,.0f} tok/s | mpexp/plain "
            f"{statistics.median(ratios):.3f} (rounds {min(ratios):.3f} to {max(ratios):.3f})",
            flush=True,
        )


if __name__ == "__main__":
    main()
