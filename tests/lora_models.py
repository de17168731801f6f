"""transformers models for the fine-tuning tests, each wrapped as mpexp's models are called:
token windows in, bare logits out. A stand-in for model=hf's adapter (branch hf), so that LoRA,
freezing and the plan are tested on a library's own module names before that adapter exists."""

from __future__ import annotations

import torch
from torch import nn

# Llama-3-8B's shape (its config.json): the model an 8B LoRA row plans
LLAMA_3_8B = {
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
}


class CausalLM(nn.Module):
    """A transformers LlamaForCausalLM from a LlamaConfig of `sizes`, as `model`."""

    def __init__(self, vocab_size: int, **sizes):
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(vocab_size=vocab_size, **sizes)
        config._attn_implementation = "sdpa"
        self.model = LlamaForCausalLM(config)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=tokens, use_cache=False).logits


def llama_8b(vocab_size: int, layers: int = 32) -> CausalLM:
    """Llama-3-8B's shape (the data's vocabulary must be its 128,256 tokens)."""
    sizes = {k: v for k, v in LLAMA_3_8B.items() if k != "vocab_size"}
    return CausalLM(vocab_size, **{**sizes, "num_hidden_layers": layers})


def llama_8b_widths_2_layers(vocab_size: int) -> CausalLM:
    """Llama-3-8B's widths and vocabulary in 2 of its 32 layers: its arithmetic, in seconds."""
    return llama_8b(vocab_size, layers=2)
