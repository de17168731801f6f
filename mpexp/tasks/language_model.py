"""Language modelling: a window of tokens in, a distribution over the next token at every
position out, judged by the validation loss in nats per token (lower is better)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import torch

from mpexp.tasks.base import Result, Task
from mpexp.tasks.cross_entropy import cross_entropy, validation_sums

VOCAB_MULTIPLE = 64


@dataclass(frozen=True)
class LanguageModelling(Task):
    vocab_size: int
    block_size: int  # tokens per window the model sees
    # bytes of the original text per token, for val/bpb: 1 for byte-level tokens (bits per byte
    # = bits per token); None where the data does not know it (no val/bpb then)
    bytes_per_token: float | None = 1.0
    # trainer.z_loss: the weight of an auxiliary loss on the square of the logits' log-normaliser
    # (log of the softmax's denominator), which keeps it near 0 so that the logits cannot drift
    # upwards together; the training loss only, validation reports the cross-entropy
    z_loss: float = 0.0
    # each token id's length in bytes of text, on the device validation runs on: val/bpb then
    # counts exactly the bytes of the targets it scored, summed there, rather than taking
    # `bytes_per_token`, an average over the whole split (1.5 % off at 32 windows of GPT-2's BPE)
    token_bytes: torch.Tensor | None = field(default=None, compare=False, repr=False)

    name = "language_model"
    takes_16_bit_output = True  # mpexp/tasks/cross_entropy.py: float32 a chunk at a time
    # 0.02 nats per token: about 2 % in perplexity, finer than seed-to-seed noise of short runs
    result = Result(
        "val/loss", higher_is_better=False, tolerance=0.02, unit="nats", title="Validation loss"
    )
    summaries: ClassVar[dict[str, str]] = {
        "val/loss": "min,last",
        "val/ppl": "min,last",
        "val/bpb": "min,last",
        "val/token_acc": "max,last",
    }

    @property
    def model_vocab_size(self) -> int:
        """The model's vocabulary: the data's, padded up to a multiple of 64 (as nanoGPT pads
        GPT-2's 50,257 to 50,304) for the tensor cores' tiles. No target is a padding id."""
        return -(-self.vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE

    def model_kwargs(self) -> dict[str, Any]:
        return {"vocab_size": self.model_vocab_size}

    def describe_inputs(self) -> str:
        return f"windows of {self.block_size} tokens (vocabulary {self.vocab_size})"

    def example(self, batch: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.zeros(batch, self.block_size, dtype=torch.long, device=device)
        return tokens, tokens.clone()

    def check_output(self, shape: tuple[int, ...]) -> str | None:
        # a model of its own vocabulary (a pretrained one) may have more rows than the data's
        # padded vocabulary, or fewer padding rows; never fewer than the data has ids
        if len(shape) == 3 and shape[:2] == (1, self.block_size):
            if shape[2] >= self.vocab_size:
                return None
            return (
                f"has {shape[2]:,} vocabulary entries, and the data's token ids run to "
                f"{self.vocab_size - 1:,} (vocabulary {self.vocab_size:,}): token id "
                f"{shape[2]:,} and those above have no row in its embedding. Use a tokenizer "
                "of the model's own vocabulary (dataset.tokenizer, dataset.vocab_size)"
            )
        expected = (1, self.block_size, self.model_vocab_size)
        return (
            f"gives outputs of shape {shape} for one window; the loss needs {expected}, "
            "one logit per vocabulary entry at every position"
        )

    @property
    def term_names(self) -> tuple[str, ...]:
        # the z-loss's weighted term, logged beside the cross-entropy (train/loss) it is added to
        return ("train/z_loss",) if self.z_loss else ()

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.loss_terms(output, targets).sum()

    def loss_terms(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # chunked, never a float32 copy of all the logits, and the z-loss from the same
        # logsumexp as the cross-entropy (mpexp/tasks/cross_entropy.py)
        ce, z = cross_entropy(output.reshape(-1, output.shape[-1]), targets.reshape(-1))
        return torch.stack((ce, self.z_loss * z)) if self.z_loss else ce.reshape(1)

    def val_sums(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits, flat = output.reshape(-1, output.shape[-1]), targets.reshape(-1)
        return validation_sums(logits, flat, self.token_bytes)

    def val_count(self, targets: torch.Tensor) -> int:
        return targets.numel()

    def val_metrics(self, sums: list[float], count: int) -> dict[str, float]:
        loss_sum, correct, *scored_bytes = sums
        loss = loss_sum / count
        metrics = {
            "val/loss": loss,
            # overflows to inf only for a loss above ~709 nats, far past any model that learns
            "val/ppl": math.exp(min(loss, 709.0)),
            "val/token_acc": correct / count,
        }
        if scored_bytes:  # the targets' own bytes (token_bytes)
            metrics["val/bpb"] = loss_sum / math.log(2) / max(scored_bytes[0], 1.0)
        elif self.bytes_per_token is not None:
            metrics["val/bpb"] = loss / math.log(2) / self.bytes_per_token
        return metrics

    def epoch_text(self, row: dict[str, Any]) -> str:
        text = f"Val Loss: {row['val/loss']:.4f}, Val PPL: {row['val/ppl']:.2f}"
        return text + (f", Val BPB: {row['val/bpb']:.3f}" if "val/bpb" in row else "")

    def throughput(self, samples_per_s: float) -> dict[str, float]:
        return {"perf/tokens_per_s": samples_per_s * self.block_size}

    def progress(self, samples: int) -> dict[str, int]:
        return {"tokens": samples * self.block_size}  # trained on, over all ranks

    def record(self) -> dict[str, Any]:
        # a length per token id is no fact to record (50 k numbers); whether val/bpb used them is
        plain = self if self.token_bytes is None else replace(self, token_bytes=None)
        record = Task.record(plain)
        del record["token_bytes"]
        return {**record, "exact_bpb": self.token_bytes is not None}
