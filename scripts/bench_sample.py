"""Sampling's speed with and without the KV cache (mpexp/sample.py's `generate`), at GPT-2 small's
size (12 blocks, width 768, 12 heads, context 1,024, GPT-2's 50,257 tokens padded to 50,304)
with random weights: what `mpexp-sample` costs per token, whatever the weights.

It draws `--compare` tokens with and without the cache, alternately, `--repeats` times each,
then `--tokens` tokens with the cache from the end-of-text id (the time a user waits for a
500-token sample), all in this one process on `--threads` intra-op threads; it prints tokens/s
for each and the ratio of the medians. One token of one sample is a matrix-vector product per
layer, bound by reading the weights: on a shared CPU a second thread mostly waits for the first
(`mpexp-sample --threads`).

    python scripts/bench_sample.py --threads 1 --compare 48 --repeats 2 --tokens 500
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from mpexp.models.gpt import GPT
from mpexp.sample import Draw, generate

VOCAB = 50257  # GPT-2's tokens
END_OF_TEXT = 50256  # its <|endoftext|>


def timed(model: GPT, tokens: int, cached: bool, device: str) -> float:
    """Seconds to draw `tokens` tokens after end-of-text."""
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = generate(model, [END_OF_TEXT], VOCAB, Draw(tokens=tokens, seed=0), cached=cached)
    assert len(out[0]) == tokens
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=500, help="tokens of the cached sample")
    parser.add_argument("--compare", type=int, default=100, help="tokens of each comparison")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = GPT(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768)
    model.to(args.device).eval()
    params = sum(p.numel() for p in model.parameters())
    print(f"GPT-2 small: {params / 1e6:.1f} M parameters, {torch.get_num_threads()} threads")
    print(f"load average before: {os.getloadavg()[0]:.1f}", flush=True)
    timed(model, 5, True, args.device)  # warm-up: the allocator, the kernels' first calls
    seconds = timed(model, args.tokens, True, args.device)
    print(
        f"{args.tokens} tokens with the cache: {seconds:.1f} s, {args.tokens / seconds:.1f} tok/s"
    )
    rates: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.repeats):
        for cached in (True, False):
            rates[cached].append(args.compare / timed(model, args.compare, cached, args.device))
    for cached in (True, False):
        shown = ", ".join(f"{r:.1f}" for r in rates[cached])
        name = "with the cache" if cached else "without it"
        print(f"{args.compare} tokens {name}: {shown} tok/s", flush=True)
    ratio = statistics.median(rates[True]) / statistics.median(rates[False])
    print(f"the cache draws {ratio:.1f} x as many tokens per second over {args.compare} tokens")
    seconds = timed(model, args.tokens, True, args.device)
    print(
        f"{args.tokens} tokens with the cache: {seconds:.1f} s, {args.tokens / seconds:.1f} tok/s"
    )


if __name__ == "__main__":
    main()
