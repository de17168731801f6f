"""A language model's cross-entropy without a float32 copy of all its logits.

GPT-2's head gives 50,304 logits per token: a micro-batch of 12 windows of 1,024 tokens holds
1.2 GB of them in bf16. `F.cross_entropy` on them under autocast first copies them to float32
(2.5 GB), keeps its log-softmax (2.5 GB more) for the backward pass and builds a float32 gradient
there: bytes that the step moves and, at validation's batch sizes, holds at once.

Here every reduction works on chunks of rows (`CHUNK_BYTES` of float32 each) and keeps only one
number per row, the log-normaliser (logsumexp) of the row's logits. The backward pass recomputes
each chunk's softmax from the logits the forward pass was given and writes the gradient in their
dtype. The z-loss (the squared log-normaliser) reuses the same logsumexp, so the z-loss costs no
second pass over the logits.

Inside `torch.compile` (the model and its loss compiled together, mpexp/step/objective.py) the
loss is written out once over all rows, as nanoGPT writes it: the compiler fuses the float32
cast, the reduction and the backward pass's softmax into its kernels and materialises none of
them, and its graph is then the one nanoGPT's compiled loop runs.
"""

from __future__ import annotations

import torch

from mpexp.tasks.base import IGNORE_INDEX

# float32 bytes of one chunk of rows: GPT-2's 50,304-token head takes 1,334 rows a chunk
CHUNK_BYTES = 256 * 2**20


def rows_per_chunk(vocab: int) -> int:
    return max(1, CHUNK_BYTES // (4 * vocab))


def _compiling() -> bool:
    """Whether torch.compile is tracing this call (torch.compiler.is_compiling from 2.3 on)."""
    is_compiling = getattr(torch.compiler, "is_compiling", None)
    if is_compiling is None:
        return torch._dynamo.is_compiling()
    return is_compiling()


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean cross-entropy of (rows, vocab) logits against (rows,) target ids, and the mean
    squared log-normaliser (the z-loss before its weight), both float32 scalars, over the rows
    whose target is not IGNORE_INDEX, as `F.cross_entropy` leaves those out (a user's data may
    mark padding so)."""
    if _compiling():
        kept = targets != IGNORE_INDEX
        lse = torch.logsumexp(logits.float(), dim=-1)
        picked = logits.gather(1, targets.clamp(min=0)[:, None]).squeeze(1).float()
        count = kept.sum()
        return (
            torch.where(kept, lse - picked, 0.0).sum() / count,
            torch.where(kept, lse.square(), 0.0).sum() / count,
        )
    return _ChunkedCrossEntropy.apply(logits, targets)


class _ChunkedCrossEntropy(torch.autograd.Function):
    """The eager cross-entropy and z-loss, chunk by chunk (see the module's docstring)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor):
        lse, picked = _lse_and_picked(logits, targets)
        # each row's share of the means: 1 / (rows kept), 0 for an ignored row (no host read)
        share = (targets != IGNORE_INDEX).float()
        share /= share.sum()
        ctx.save_for_backward(logits, targets, lse, share)
        return ((lse - picked) * share).sum(), (lse.square() * share).sum()

    @staticmethod
    def backward(ctx, grad_ce: torch.Tensor, grad_z: torch.Tensor):
        logits, targets, lse, share = ctx.saved_tensors
        rows = logits.shape[0]
        # d(mean ce)/dx = (softmax - onehot) x share; d(mean lse^2)/dx = 2 lse softmax x share
        softmax_weight = ((grad_ce + 2 * grad_z * lse) * share)[:, None]
        onehot_weight = (-grad_ce * share)[:, None]
        targets = targets.clamp(min=0)  # an ignored row's weights are 0: any column will do
        step = rows_per_chunk(logits.shape[1])
        grad = None
        for start in range(0, rows, step):
            end = start + step
            # softmax's own kernel (fused, in float32 whatever the logits' dtype) recomputes
            # the chunk's probabilities faster than exp(x - lse) would
            chunk = torch.softmax(logits[start:end], dim=-1, dtype=torch.float32)
            chunk.mul_(softmax_weight[start:end])
            chunk.scatter_add_(1, targets[start:end, None], onehot_weight[start:end])
            if end >= rows and start == 0:  # one chunk: it is the gradient
                return chunk.to(logits.dtype), None
            if grad is None:
                grad = torch.empty_like(logits)
            grad[start:end] = chunk
        return grad, None


def _lse_and_picked(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each row's log-normaliser and its target's logit, float32, a chunk of rows at a time
    (a target of IGNORE_INDEX picks entry 0: its row is left out by the caller)."""
    rows = logits.shape[0]
    lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
    picked = torch.empty_like(lse)
    safe = targets.clamp(min=0)[:, None]
    step = rows_per_chunk(logits.shape[1])
    with torch.no_grad():
        for start in range(0, rows, step):
            chunk = logits[start : start + step].float()
            lse[start : start + step] = torch.logsumexp(chunk, dim=-1)
            picked[start : start + step] = chunk.gather(1, safe[start : start + step]).squeeze(1)
    return lse, picked


@torch.no_grad()
def validation_sums(
    logits: torch.Tensor, targets: torch.Tensor, token_bytes: torch.Tensor | None = None
) -> torch.Tensor:
    """Over the rows whose target is not IGNORE_INDEX: the summed cross-entropy, the number of
    targets that are the top logit, and (with `token_bytes`, each id's length in bytes) the
    bytes of the text those targets are. A 1-D float32 tensor, left on the device."""
    kept = targets != IGNORE_INDEX
    lse, picked = _lse_and_picked(logits, targets)
    correct = torch.zeros((), dtype=torch.float32, device=logits.device)
    step = rows_per_chunk(logits.shape[1])
    for start in range(0, logits.shape[0], step):
        top = logits[start : start + step].argmax(1)
        correct += (top == targets[start : start + step]).sum()  # an ignored target is no id
    sums = [torch.where(kept, lse - picked, 0.0).sum(), correct]
    if token_bytes is not None:
        sums.append(torch.where(kept, token_bytes[targets.clamp(min=0)], 0).sum().float())
    return torch.stack(sums)
