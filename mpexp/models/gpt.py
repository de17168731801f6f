"""A decoder-only transformer (GPT) for language modelling, written for mpexp.

Pre-LayerNorm blocks (LayerNorm before attention and before the MLP, on the residual branch), causal
self-attention through `F.scaled_dot_product_attention` (a fused kernel where the device has one),
a GELU MLP four times the width, learned position embeddings, and an output layer that shares the
token embedding's weights (tied: the logits are the final states times the embedding matrix).

Its matrix products are nn.Linear layers whose sizes are multiples of 16 when `n_embd` is (the
presets' are), so `precision=fp8` converts every one of them; the tied output product is no
Linear layer and stays in bf16, as language models usually keep their head.

Three switches that language-model precision studies ablate: `qk_norm` normalises each head's
queries and keys (a LayerNorm over the head's width) before their product, which bounds the
attention logits' growth; `bias=false` drops the biases of every Linear and LayerNorm, as recent
GPTs do; and the task's z-loss (`trainer.z_loss`, mpexp/tasks/language_model.py) keeps the output
logits' normaliser near 1.

Each attention layer can measure its largest attention logit (|q.k| / sqrt(head width)) when
`measure_logits` is set, in float32 from its own q and k (mpexp/step/diagnostics.py sets it for an
extra forward pass of its own and reads `logit_absmax`). That measures the logits' growth, which
unchecked collapses attention onto single positions; it is no fp16 overflow site, since fused
attention kernels accumulate q.k in float32.

Sampling (mpexp/sample.py) passes a `KVCache`: each attention layer keeps the keys and values of
the tokens it has seen, so that each new token costs one position's forward pass instead of the
whole context's.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mpexp.errors import ConfigError

INIT_STD = 0.02  # GPT-2's initialisation of weights and embeddings


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which a position sees itself and the positions before it."""

    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool, qk_norm: bool):
        super().__init__()
        self.n_head = n_head
        self.dropout = dropout
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.resid_dropout = nn.Dropout(dropout)
        head = n_embd // n_head
        self.q_norm = nn.LayerNorm(head, bias=bias) if qk_norm else nn.Identity()
        self.k_norm = nn.LayerNorm(head, bias=bias) if qk_norm else nn.Identity()
        self.measure_logits = False  # set by the diagnostics for the steps they inspect
        self.logit_absmax: torch.Tensor | None = None  # that step's largest |logit|, on device

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        n, length, width = x.shape
        # (n, length, 3 * width) -> q, k, v, each (n, heads, length, width / heads)
        qkv = self.qkv(x).view(n, length, 3, self.n_head, width // self.n_head)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.measure_logits:  # the diagnostics' own forward pass, never a compiled one
            value = causal_logit_absmax(q, k)
            before = self.logit_absmax
            self.logit_absmax = value if before is None else torch.maximum(before, value)
        mask = None
        if cache is not None:
            k, v = cache.extend(k, v)
            # the new positions see every cached one, and each other causally
            if length < k.shape[-2]:
                mask = torch.ones(length, k.shape[-2], dtype=torch.bool, device=q.device)
                mask = mask.tril(k.shape[-2] - length)
        y = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=mask is None,
        )
        return self.resid_dropout(self.proj(y.transpose(1, 2).reshape(n, length, width)))


class LayerCache:
    """One attention layer's keys and values of the positions seen so far, in buffers of the
    model's context length, allocated at the first call in the keys' dtype and device."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.length = 0

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new positions' keys and values; all of them so far."""
        if self.keys is None:
            shape = (*k.shape[:2], self.block_size, k.shape[-1])
            self.keys = k.new_empty(shape)
            self.values = v.new_empty(shape)
        end = self.length + k.shape[-2]
        self.keys[:, :, self.length : end] = k
        self.values[:, :, self.length : end] = v
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]


class KVCache:
    """The keys and values of every attention layer of a GPT for the positions it has seen: pass
    it to `GPT.decode` with the tokens that follow them."""

    def __init__(self, model: GPT):
        self.layers = [LayerCache(model.block_size) for _ in model.blocks]

    @property
    def length(self) -> int:
        """The positions seen so far."""
        return self.layers[0].length


def causal_logit_absmax(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The largest |q.k| / sqrt(head width) over the pairs a causal mask keeps, in float32 (the
    true value, whatever the autocast dtype would have made of it). A 0-d tensor, detached.

    One head at a time: all heads' logits at once are (n, heads, length, length) floats, 2.4 GB
    per layer for GPT-2 small at batch 16, a spike the epoch's peak memory would show."""
    length = q.shape[-2]
    future = torch.ones(length, length, dtype=torch.bool, device=q.device).triu(1)
    largest = torch.zeros((), device=q.device)
    for head in range(q.shape[1]):
        qh, kh = q[:, head].detach().float(), k[:, head].detach().float()
        logits = (qh @ kh.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        largest = torch.maximum(largest, logits.masked_fill_(future, 0.0).abs_().amax())
    return largest


class Block(nn.Module):
    """x + attention(LayerNorm(x)), then x + MLP(LayerNorm(x))."""

    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool, qk_norm: bool):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias, qk_norm)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd, bias=bias),
            nn.GELU(),
            nn.Linear(4 * n_embd, n_embd, bias=bias),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), cache)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token windows (n, length) in, next-token logits (n, length, vocab_size) out."""

    # its step may be captured as a CUDA graph (mpexp.step.performance.declares_capturable):
    # dropout draws from the device's generator, which a replay advances, and the attention
    # layers' `measure_logits` is set only on the steps the diagnostics inspect, which run eagerly
    capturable = True

    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 64,
        n_layer: int = 2,
        n_head: int = 4,
        n_embd: int = 64,
        dropout: float = 0.0,
        bias: bool = True,
        qk_norm: bool = False,
    ):
        super().__init__()
        for key, value in (("n_layer", n_layer), ("n_head", n_head), ("n_embd", n_embd),
                           ("block_size", block_size), ("vocab_size", vocab_size)):  # fmt: skip
            if value < 1:
                raise ConfigError(f"model.{key}={value} must be at least 1.")
        if not 0 <= dropout < 1:
            raise ConfigError(f"model.dropout={dropout} must lie in [0, 1), e.g. 0.1.")
        if n_embd % n_head:
            raise ConfigError(
                f"model.n_embd={n_embd} must be a multiple of model.n_head={n_head}: each head "
                "takes n_embd / n_head channels."
            )
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(
            Block(n_embd, n_head, dropout, bias, qk_norm) for _ in range(n_layer)
        )
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self._init_weights(n_layer)

    def _init_weights(self, n_layer: int) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, std=INIT_STD)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        # the layers that write into the residual stream: their outputs add up over 2 x n_layer
        # branches, so GPT-2 scales their initial weights down to keep the stream's variance
        for block in self.blocks:
            for layer in (block.attn.proj, block.mlp[2]):
                nn.init.normal_(layer.weight, std=INIT_STD / math.sqrt(2 * n_layer))

    def fsdp_units(self) -> list[nn.Module]:
        """What FSDP shards one by one: the blocks, which hold nearly all of the weights. The
        embeddings and the final LayerNorm stay with the root: the output layer reuses the token
        embedding after its own forward pass, when a unit of its own would have freed it."""
        return list(self.blocks)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self._head(self._hidden(tokens))

    def last_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """The next-token logits (n, vocab_size) after windows `tokens` (n, length): the whole
        window's forward pass, the output layer on its last position alone, as nanoGPT's
        sampling runs it (over every position, GPT-2's head of 50,304 rows would cost about
        a third of the pass)."""
        return self._head(self._hidden(tokens)[:, -1])

    def _hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        if length > self.block_size:
            raise ValueError(
                f"a window of {length} tokens is longer than model.block_size={self.block_size}"
            )
        positions = torch.arange(length, device=tokens.device)
        x = self.drop(self.wte(tokens) + self.wpe(positions))
        for block in self.blocks:
            x = block(x)
        return x

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.ln_f(x), self.wte.weight)  # tied: the embedding's weights

    def kv_cache(self) -> KVCache:
        """An empty cache for `decode` (mpexp/sample.py)."""
        return KVCache(self)

    def decode(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """The next-token logits (n, vocab_size) after `tokens` (n, length), which continue the
        positions `cache` holds; the cache takes theirs. What sampling calls: the forward pass
        of the new positions alone, the earlier ones' keys and values read from the cache."""
        start, end = cache.length, cache.length + tokens.shape[1]
        if end > self.block_size:
            raise ValueError(f"{end} positions are more than model.block_size={self.block_size}")
        x = self.wte(tokens) + self.wpe(torch.arange(start, end, device=tokens.device))
        for block, layer in zip(self.blocks, cache.layers, strict=True):
            x = block(x, layer)
        return self._head(x[:, -1])
