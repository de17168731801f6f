"""Sampling's speed with and without the KV cache (mpexp/sample.py's `generate`), at GPT-2 small's
size (12 blocks, width 768, 12 heads, context 1,024, GPT-2's 50,257 tokens padded to 50,304)
with random weights: what `mpexp-sample` costs per token, whatever the weights.

For each of `--threads` (intra-op thread counts), one token at a context of `--context` tokens:
through the cache (the earlier positions' keys and values kept) and without it (the whole context
run again, as a loop without a cache does for every token), alternately, `--repeats` times each.
Then, on the first thread count, a whole sample of `--tokens` tokens from the end-of-text id
through the cache: the time a user waits. One process; medians.

    python scripts/bench_sample.py --threads 1 2 --context 500 --repeats 3 --tokens 500
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from mpexp.models.gpt import GPT, KVCache
from mpexp.sample import Draw, generate

VOCAB = 50257  # GPT-2's tokens
END_OF_TEXT = 50256  # its <|endoftext|>


def one_token(model: GPT, ids: torch.Tensor, cached: bool) -> float:
    """Seconds for the next-token logits after `ids` (1, n): with the cache, from a cache that
    already holds the first n - 1 positions (filled untimed), else from the whole context."""
    with torch.no_grad():
        if not cached:
            start = time.perf_counter()
            model.last_logits(ids)  # as generate runs a full context: the head on one position
            return time.perf_counter() - start
        cache = KVCache(model)
        model.decode(ids[:, :-1], cache)
        start = time.perf_counter()
        model.decode(ids[:, -1:], cache)
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[torch.get_num_threads()])
    parser.add_argument("--context", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=500, help="tokens of the cached sample")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = GPT(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768).eval()
    params = sum(p.numel() for p in model.parameters())
    print(f"GPT-2 small: {params / 1e6:.1f} M parameters; load average {os.getloadavg()[0]:.1f}")
    ids = torch.randint(VOCAB, (1, args.context))
    for threads in args.threads:
        torch.set_num_threads(threads)
        one_token(model, ids[:, :16], True)  # warm-up: the allocator, the kernels' first calls
        seconds: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(args.repeats):
            for cached in (True, False):
                seconds[cached].append(one_token(model, ids, cached))
        with_cache, without = (statistics.median(seconds[c]) for c in (True, False))
        print(
            f"{threads} threads, one token at a context of {args.context}: "
            f"{1e3 * with_cache:.0f} ms with the cache, {1e3 * without:.0f} ms without it "
            f"({without / with_cache:.0f} x); load average {os.getloadavg()[0]:.1f}",
            flush=True,
        )
    torch.set_num_threads(args.threads[0])
    start = time.perf_counter()
    generate(model, [END_OF_TEXT], VOCAB, Draw(tokens=args.tokens, seed=0))
    took = time.perf_counter() - start
    print(
        f"{args.threads[0]} threads, {args.tokens} tokens from end-of-text with the cache: "
        f"{took:.1f} s, {args.tokens / took:.1f} tok/s; load average {os.getloadavg()[0]:.1f}"
    )


if __name__ == "__main__":
    main()
