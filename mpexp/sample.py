"""`mpexp-sample RUN_DIR` / `python -m mpexp.sample RUN_DIR`: text from a language-model run, as
nanoGPT's sample.py draws it.

The model is rebuilt from the run's recorded config and loaded from its best checkpoint (the
kept checkpoint whose step has the lowest val/loss in metrics.jsonl, which the run keeps beside
the newest; the newest where none was validated). It continues `--prompt` (text, or `FILE:<path>`
for a file's text; without one, the tokenizer's end-of-text token where it has one, else a newline)
for `--tokens` tokens, `--num-samples` times, under the run's autocast dtype: each token drawn
from the softmax of the `--top-k` likeliest at `--temperature` (0: the likeliest token), with a
generator seeded by `--seed`. Each attention layer keeps its keys and values (a KV cache), so a
token costs one position's forward pass until the context is full; past the model's context, the
last `block_size` tokens are run whole for each token, as without a cache (the output layer on the
last position alone, as nanoGPT's sampling runs it).

Byte-level runs are decoded as UTF-8; BPE runs with the run's own tokenizer file; dataset=tokens
runs with nanoGPT's meta.pkl beside their files (a character-level run) with its characters, and
otherwise, since token files do not say their tokenizer, with `--tokenizer <tokenizer.json>`
(GPT-2's for nanoGPT's openwebtext), else as ids.

    mpexp-sample outputs/2026-12-01/10-00-00 --num-samples 3 --top-k 200 --prompt FILE:prompt.txt
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from mpexp.errors import UserError

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
FILE_PROMPT = "FILE:"  # nanoGPT's: --prompt FILE:<path> continues the file's text
SEPARATOR = "\n---------------\n"  # between samples, as nanoGPT prints them


@dataclass(frozen=True)
class Draw:
    """How tokens are drawn: how many per sample, how many samples, and from what."""

    tokens: int = 200
    temperature: float = 0.8  # 0: the likeliest token each time
    top_k: int | None = 200  # only the k likeliest tokens are drawn from; None: all of them
    samples: int = 1
    seed: int = 0


def read_run(run_dir: Path) -> dict:
    """The run's summary, which records what ran (its task, data and precision)."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        raise UserError(f"{run_dir} is no mpexp run directory: it has no summary.json.") from None
    if "ran" not in summary:
        raise UserError(
            f"{run_dir} has no checkpoint yet: the run stopped before its first step. Resume it "
            "(trainer.resume) or train again, and sample once a checkpoint is written."
        )
    task = summary["ran"].get("task", {})
    if task.get("name") != "language_model":
        kind = task.get("name") or "an image classifier"
        raise UserError(
            f"{run_dir} is not a language-model run ({kind}): mpexp-sample continues text with a "
            "model=gpt or model=hf run on dataset=text or dataset=tokens."
        )
    return summary


def best_checkpoint(run_dir: Path) -> tuple[Path, str]:
    """The kept checkpoint with the lowest val/loss at its step, else the newest; and why."""
    from mpexp.rundir import best_validated, checkpoint_files, checkpoint_step, validated_losses

    files = [p for p in checkpoint_files(run_dir) if p.is_file()]
    if not files:
        raise UserError(
            f"{run_dir} has no checkpoint to sample from: train with trainer.keep_checkpoints>=1 "
            "(the default) until an epoch ends, or with trainer.checkpoint_every_steps=<N>."
        )
    losses = validated_losses(run_dir)
    best = best_validated(files, losses)
    if best is not None:
        return best, f"the best kept by val/loss ({losses[checkpoint_step(best)]:.4f})"
    return files[-1], "the newest (none of the kept ones was validated)"


class Codec:
    """Text to token ids and back, as the run's data made them: bytes, the run's tokenizer, the
    one given (`given`), a meta.pkl's characters, or none (a dataset=tokens run: ids in, ids
    out)."""

    def __init__(self, data: dict, given: Path | None = None):
        from mpexp.data import tokenizer

        self.tokenizer = None
        self.meta = None
        if given is not None:
            self.tokenizer = tokenizer.load(given)
        elif data.get("meta"):
            self.meta = _run_meta(Path(data["meta"]))
        elif data.get("tokenizer", "byte") not in ("byte", None):
            path = Path(data["tokenizer_file"])
            if not path.is_file() or tokenizer.file_digest(path) != data["tokenizer_digest"]:
                raise UserError(
                    f"The run's tokenizer {path} is gone or changed since the run: put it back "
                    "(train once more with the same dataset.tokenizer to learn it again)."
                )
            self.tokenizer = tokenizer.load(path)
        self.ids_only = self.tokenizer is None and not self._has_characters(data)

    def _has_characters(self, data: dict) -> bool:
        """Whether text maps to the run's ids without a tokenizer: bytes, or meta.pkl's."""
        if self.meta is not None:
            return self.meta.itos is not None and self.meta.stoi is not None
        return data.get("tokenizer", "byte") is not None  # bytes

    def start(self) -> tuple[list[int], str]:
        """What a sample starts from without a prompt, and what it is called."""
        from mpexp.data.tokenizer import end_of_text

        if self.tokenizer is not None and (eot := end_of_text(self.tokenizer)) is not None:
            return [eot], "end-of-text"
        if self.ids_only or (self.meta is not None and "\n" not in self.meta.stoi):
            return [0], "token 0"
        return self.encode("\n"), "a newline"

    def encode(self, text: str) -> list[int]:
        if self.ids_only:
            try:
                return [int(i) for i in text.split()]
            except ValueError:
                raise UserError(
                    "The run trained on token files, which do not say their tokenizer: give "
                    "--tokenizer <tokenizer.json> to prompt with text, or --prompt as token ids."
                ) from None
        if self.meta is not None:
            unknown = sorted(set(text) - self.meta.stoi.keys())
            if unknown:
                raise UserError(
                    f"The prompt holds characters that {self.meta.path} has no id for: "
                    f"{''.join(unknown)!r}. Prompt with the characters the run trained on."
                )
            return [self.meta.stoi[c] for c in text]
        if self.tokenizer is None:
            return list(text.encode("utf-8"))
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        if self.ids_only:
            return "".join(f" {i}" for i in ids)
        if self.meta is not None:
            return "".join(self.meta.itos.get(i, "\ufffd") for i in ids)
        if self.tokenizer is None:
            return bytes(ids).decode("utf-8", errors="replace")
        return self.tokenizer.decode(ids, skip_special_tokens=False)  # end-of-text shown


def _run_meta(path: Path):
    """The meta.pkl a dataset=tokens run trained with, read again (without running code)."""
    from mpexp.data.meta_pkl import read_meta

    if not path.is_file():
        raise UserError(
            f"The run's meta.pkl {path} is gone: put it back to decode the run's ids as its "
            "characters."
        )
    return read_meta(path)


def check_prompt(ids: list[int], vocab_size: int) -> None:
    """Refuse ids the model never learned to read: below 0, or at or above the data's
    vocabulary (the model's rows past it only pad the head)."""
    for at, token in enumerate(ids):
        if not 0 <= token < vocab_size:
            raise UserError(
                f"The prompt's token id {token} (position {at}) is outside the run's vocabulary "
                f"of {vocab_size:,} tokens (ids 0 to {vocab_size - 1:,}): the model never trained "
                "on it. Prompt with ids of the run's tokenizer."
            )


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompt: list[int],
    vocab_size: int,
    draw: Draw,
    autocast: torch.dtype | None = None,
    cached: bool = True,
) -> list[list[int]]:
    """`draw.tokens` more ids after `prompt`, for each of `draw.samples` samples; only real ids,
    never the model's padding ones. `cached`: through the model's KV cache (`kv_cache()`, which
    `decode` fills: mpexp's GPT's own, a transformers model's), the same tokens, sooner."""
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(draw.seed)
    ids = torch.tensor([prompt] * draw.samples, dtype=torch.long, device=device)
    cache = model.kv_cache() if cached else None
    unseen = ids  # the positions the cache holds nothing of yet
    for _ in range(draw.tokens):
        with torch.autocast(device.type, dtype=autocast or torch.float32, enabled=bool(autocast)):
            if cache is not None and ids.shape[1] <= model.block_size:
                logits = model.decode(unseen, cache)
            else:  # the context is full: its last block_size tokens, whole, for every token,
                # the output layer on the last position alone
                logits = model.last_logits(ids[:, -model.block_size :])
        token = _draw(logits[:, :vocab_size].float(), draw, generator).to(device)
        ids = torch.cat([ids, token], dim=1)
        unseen = token
    return ids[:, len(prompt) :].tolist()


def _draw(logits: torch.Tensor, draw: Draw, generator: torch.Generator) -> torch.Tensor:
    """One token per row of `logits` (n, vocab): the likeliest at temperature 0, else drawn
    from the softmax of the `top_k` likeliest, on the host, from `generator`."""
    if draw.temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / draw.temperature
    if draw.top_k is not None and draw.top_k < logits.shape[-1]:
        kth = torch.topk(logits, draw.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1).cpu()
    return torch.multinomial(probs, 1, generator=generator)


def sample(
    run_dir: Path,
    draw: Draw,
    prompt: str = "",
    device: str = "cpu",
    tokenizer: Path | None = None,
) -> tuple[list[str], str]:
    """(the samples, from which checkpoint and how), for the run at `run_dir`."""
    from mpexp.build import rebuilt
    from mpexp.checkpoints.files import load

    summary = read_run(run_dir)
    ran = summary["ran"]
    path, why = best_checkpoint(run_dir)
    vocab = ran["task"]["vocab_size"]
    codec = Codec(ran.get("data") or {}, tokenizer)
    ids, start = (codec.encode(prompt), "the prompt") if prompt else codec.start()
    if not ids:
        ids, start = codec.start()
    check_prompt(ids, vocab)
    state = load(path)
    model, _ = rebuilt(state, **model_kwargs(ran["task"], state["model"]))
    model.to(device).eval()
    autocast_name = ran.get("autocast_dtype") or "off"
    autocast = DTYPES.get(autocast_name)
    out = generate(model, ids, vocab, draw, autocast)
    note = (
        f"{path.name}, {why}; {ran.get('precision')} (autocast {autocast_name}) on {device}; "
        f"from {start}, top-k {draw.top_k or 'off'}"
    )
    if ran.get("precision", "").startswith("fp8"):
        note += "; its float8 layers run as ordinary Linear layers here"
    return [prompt + codec.decode(sampled) for sampled in out], note


def model_kwargs(task: dict, weights: dict) -> dict:
    """What the run built its model with for its task (`weights`: its checkpoint's): the GPT's
    vocabulary is its embedding's rows; any other model's, the task's (a transformers model from
    a pretrained folder keeps its own)."""
    from mpexp.tasks.language_model import LanguageModelling

    embedding = next((v for k, v in weights.items() if k.endswith("wte.weight")), None)
    if embedding is not None:
        return {"vocab_size": embedding.shape[0]}
    # a frozen embedding, which checkpoints leave out: the data's vocabulary padded as the task
    # pads it, as the run built it
    return LanguageModelling(task["vocab_size"], task["block_size"]).model_kwargs()


def read_prompt(prompt: str) -> str:
    """The prompt's text: itself, or the text of the file that `FILE:<path>` names."""
    if not prompt.startswith(FILE_PROMPT):
        return prompt
    path = Path(prompt.removeprefix(FILE_PROMPT)).expanduser()
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        why = err.strerror if isinstance(err, OSError) else "it is not UTF-8 text"
        raise UserError(f"--prompt {prompt}: {path} cannot be read ({why}).") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="mpexp-sample",
        description="Print text from a language-model run's best (or last) checkpoint.",
    )
    parser.add_argument("run_dir", type=Path, help="the run's directory")
    parser.add_argument(
        "--tokens", "--max-new-tokens", type=int, default=200, help="tokens per sample (200)"
    )
    parser.add_argument(
        "--prompt",
        default="",
        help="the text to continue, or FILE:<path> for a file's (default: end-of-text where the "
        "tokenizer has it, else a newline)",
    )
    parser.add_argument("--num-samples", type=int, default=1, help="samples to draw (1)")
    parser.add_argument(
        "--temperature", type=float, default=0.8, help="softmax temperature; 0: greedy (0.8)"
    )
    parser.add_argument(
        "--top-k", type=int, default=200, help="draw from the k likeliest tokens; 0: all (200)"
    )
    parser.add_argument("--seed", type=int, default=0, help="the sampling generator's seed (0)")
    parser.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda or cpu"
    )
    parser.add_argument(
        "--threads",
        type=int,
        help="intra-op threads on a CPU (default: torch's, one per core); on a busy machine 1 is "
        "faster, as a token is a matrix-vector product per layer and a second thread waits",
    )
    parser.add_argument(
        "--tokenizer",
        type=Path,
        help="a tokenizer.json to decode with: for a dataset=tokens run, whose files do not say "
        "(GPT-2's for nanoGPT's openwebtext; without it, token ids are printed)",
    )
    args = parser.parse_args(argv)
    if args.tokens < 1 or args.num_samples < 1 or args.temperature < 0 or args.top_k < 0:
        parser.error(
            "--tokens and --num-samples must be at least 1, --temperature and --top-k at least 0"
        )
    if args.threads is not None:
        torch.set_num_threads(max(1, args.threads))
    draw = Draw(args.tokens, args.temperature, args.top_k or None, args.num_samples, args.seed)
    try:
        texts, note = sample(
            args.run_dir, draw, read_prompt(args.prompt), args.device, args.tokenizer
        )
    except UserError as err:
        print(f"mpexp-sample: {err}", file=sys.stderr)
        return 2
    print(f"# {note}", file=sys.stderr)
    print(SEPARATOR.join(texts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
