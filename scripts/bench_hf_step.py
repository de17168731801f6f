"""mpexp's step on a Hugging Face transformers model against a plain PyTorch loop over the same
model and data, side by side in one process (as scripts/bench_lm_step.py does for mpexp's GPT).

  mpexp  the model as model=hf builds it (mpexp/models/hf.py: transformers' own SDPA attention,
         no mask built) through the loop's Stepper: the Objective with the chunked
         cross-entropy, the loss scaler, the step history on the device;
  plain  the same weights in the model as transformers builds it (its default attention, which
         makes its mask each forward), `model(input_ids=x, use_cache=False).logits`,
         F.cross_entropy under autocast, backward, AdamW's step, zero_grad: a user's own loop.

Each round times `--steps` steps of one, then of the other (the order alternating), after
`--warmup` untimed steps of each; the ratio mpexp / plain is the median over the rounds.

    python scripts/bench_hf_step.py                         # CPU: a small Llama, fp32 and bf16
    python scripts/bench_hf_step.py --config gpt2 --hidden 128 --layers 4
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_lm_step import mpexp_step  # the same mpexp step as for the GPT
from bench_lm_step import plain_step as lm_plain_step

from mpexp.models.hf import hf_model
from mpexp.models.hf_config import transformers
from mpexp.tasks.language_model import LanguageModelling


def plain_step(args, model, task, mode: str):
    """bench_lm_step's plain step, calling the model as a transformers user does."""
    return lm_plain_step(
        args, model, task, mode, lambda x: model(input_ids=x, use_cache=False).logits
    )


def models(args, task: LanguageModelling):
    """The model as mpexp builds it, and the same weights as transformers builds the model."""
    sizes = {
        "llama": {"hidden_size": args.hidden, "num_hidden_layers": args.layers,
                  "num_attention_heads": args.heads, "intermediate_size": 4 * args.hidden},
        "gpt2": {"n_embd": args.hidden, "n_layer": args.layers, "n_head": args.heads},
    }[args.config]  # fmt: skip
    torch.manual_seed(0)
    ours = hf_model(args.config, None, args.block_size, vocab_size=task.model_vocab_size, **sizes)
    auto = transformers().AutoModelForCausalLM
    theirs = auto.from_config(ours.config, attn_implementation="sdpa")
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="llama", choices=["llama", "gpt2"])
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--threads", type=int, default=1, help="torch's intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    task = LanguageModelling(vocab_size=args.vocab, block_size=args.block_size)
    tokens = torch.randint(args.vocab, (args.steps, args.batch_size, args.block_size + 1))
    batches = [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]
    for mode in args.precisions.split(","):
        ours, theirs = models(args, task)
        steps = {
            "mpexp": mpexp_step(args, ours, task, mode),
            "plain": plain_step(args, theirs, task, mode),
        }
        for step in steps.values():
            for x, y in batches[: args.warmup]:
                step(x, y)
        seconds = {name: [] for name in steps}
        for round_ in range(args.rounds):
            for name in list(steps) if round_ % 2 == 0 else list(reversed(steps)):
                began = time.perf_counter()
                for x, y in batches:
                    steps[name](x, y)
                seconds[name].append((time.perf_counter() - began) / args.steps)
        ratios = [p / m for m, p in zip(seconds["mpexp"], seconds["plain"], strict=True)]
        print(
            f"{mode:5s} step mpexp {1e3 * statistics.median(seconds['mpexp']):7.1f} ms | plain "
            f"{1e3 * statistics.median(seconds['plain']):7.1f} ms | speed mpexp/plain "
            f"{statistics.median(ratios):.3f} (rounds {min(ratios):.3f} to {max(ratios):.3f})",
            flush=True,
        )


if __name__ == "__main__":
    main()
