"""`mpexp-sample RUN_DIR` / `python -m mpexp.sample RUN_DIR`: text from a language-model run.

The model is rebuilt from the run's recorded config and loaded from its best checkpoint (the kept
checkpoint whose step has the lowest val/loss in metrics.jsonl; the newest where none was
validated), then continues `--prompt` for `--tokens` tokens, under the run's autocast dtype, drawing
from the softmax at `--temperature` (0: the likeliest token) with a generator seeded by `--seed`.
Byte-level runs are decoded as UTF-8; BPE runs with the run's own tokenizer file; dataset=tokens
runs, whose files do not say their tokenizer, with `--tokenizer <tokenizer.json>`, else as ids.

    mpexp-sample outputs/2026-12-01/10-00-00 --tokens 200 --prompt "def "
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch

from mpexp.errors import UserError

PREFIXES = ("module.", "_orig_mod.")  # DDP's and torch.compile's wrappers' names
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def read_run(run_dir: Path) -> dict:
    """The run's summary, which records what ran (its task, data and precision)."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        raise UserError(f"{run_dir} is no mpexp run directory: it has no summary.json.") from None
    task = summary.get("ran", {}).get("task", {})
    if task.get("name") != "language_model":
        kind = task.get("name") or "an image classifier"
        raise UserError(
            f"{run_dir} is not a language-model run ({kind}): mpexp-sample continues text with a "
            "model=gpt run on dataset=text or dataset=tokens."
        )
    return summary


def best_checkpoint(run_dir: Path) -> tuple[Path, str]:
    """The kept checkpoint with the lowest val/loss at its step, else the newest; and why."""
    from mpexp.rundir import checkpoint_files, checkpoint_step

    files = [p for p in checkpoint_files(run_dir) if p.is_file()]
    if not files:
        raise UserError(
            f"{run_dir} has no checkpoint to sample from: train with trainer.keep_checkpoints>=1 "
            "(the default) until an epoch ends, or with trainer.checkpoint_every_steps=<N>."
        )
    losses = {}
    with contextlib.suppress(OSError):
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            row = json.loads(line)
            if "val/loss" in row:
                losses[row["step"]] = row["val/loss"]
    validated = [p for p in files if checkpoint_step(p) in losses]
    if validated:
        best = min(validated, key=lambda p: losses[checkpoint_step(p)])
        return best, f"the best kept by val/loss ({losses[checkpoint_step(best)]:.4f})"
    return files[-1], "the newest (none of the kept ones was validated)"


class Codec:
    """Text to token ids and back, as the run's data made them: bytes, the run's tokenizer, the
    one given (`given`), or none (a dataset=tokens run: ids in, ids out)."""

    def __init__(self, data: dict, given: Path | None = None):
        from mpexp.data import tokenizer

        self.tokenizer = None
        self.ids_only = given is None and data.get("tokenizer", "byte") is None
        if given is not None:
            self.tokenizer = tokenizer.load(given)
        elif data.get("tokenizer", "byte") not in ("byte", None):
            path = Path(data["tokenizer_file"])
            if not path.is_file() or tokenizer.file_digest(path) != data["tokenizer_digest"]:
                raise UserError(
                    f"The run's tokenizer {path} is gone or changed since the run: put it back "
                    "(train once more with the same dataset.tokenizer to learn it again)."
                )
            self.tokenizer = tokenizer.load(path)

    def encode(self, text: str) -> list[int]:
        if self.ids_only:
            try:
                return [int(i) for i in text.split()]
            except ValueError:
                raise UserError(
                    "The run trained on token files, which do not say their tokenizer: give "
                    "--tokenizer <tokenizer.json> to prompt with text, or --prompt as token ids."
                ) from None
        if self.tokenizer is None:
            return list(text.encode("utf-8"))
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        if self.ids_only:
            return "".join(f" {i}" for i in ids)
        if self.tokenizer is None:
            return bytes(ids).decode("utf-8", errors="replace")
        return self.tokenizer.decode(ids)


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompt: list[int],
    tokens: int,
    vocab_size: int,
    temperature: float,
    generator: torch.Generator,
    autocast: torch.dtype | None,
) -> list[int]:
    """`tokens` more ids after `prompt`; only real ids, never the model's padding ones."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt], dtype=torch.long, device=device)
    for _ in range(tokens):
        context = ids[:, -model.block_size :]
        with torch.autocast(device.type, dtype=autocast or torch.float32, enabled=bool(autocast)):
            logits = model(context)[0, -1, :vocab_size].float()
        if temperature == 0:
            token = logits.argmax().view(1, 1)
        else:
            probs = torch.softmax(logits / temperature, dim=-1).cpu()
            token = torch.multinomial(probs, 1, generator=generator).to(device).view(1, 1)
        ids = torch.cat([ids, token], dim=1)
    return ids[0, len(prompt) :].tolist()


def sample(
    run_dir: Path,
    tokens: int,
    prompt: str,
    temperature: float,
    seed: int,
    device: str,
    tokenizer: Path | None = None,
) -> tuple[str, str]:
    """(what was sampled, from which checkpoint and how), for the run at `run_dir`."""
    from omegaconf import OmegaConf

    from mpexp.checkpoints import checkpoint
    from mpexp.run.build import build

    summary = read_run(run_dir)
    ran = summary["ran"]
    path, why = best_checkpoint(run_dir)
    state = checkpoint.load(path)
    cfg = OmegaConf.create(state["config"])
    vocab = ran["task"]["vocab_size"]
    codec = Codec(ran.get("data") or {}, tokenizer)
    weights = {}
    for key, value in state["model"].items():
        for prefix in PREFIXES:
            key = key.removeprefix(prefix)
        weights[key] = value
    model = build(cfg.model, vocab_size=weights["wte.weight"].shape[0])
    model.load_state_dict(weights)
    model.to(device).eval()
    autocast_name = ran.get("autocast_dtype") or "off"
    autocast = DTYPES.get(autocast_name)
    ids = codec.encode(prompt) or ([0] if codec.ids_only else codec.encode("\n"))
    generator = torch.Generator().manual_seed(seed)
    out = generate(model, ids, tokens, vocab, temperature, generator, autocast)
    note = f"{path.name}, {why}; {ran.get('precision')} (autocast {autocast_name}) on {device}"
    if ran.get("precision", "").startswith("fp8"):
        note += "; its float8 layers run as ordinary Linear layers here"
    return prompt + codec.decode(out), note


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="mpexp-sample",
        description="Print text from a language-model run's best (or last) checkpoint.",
    )
    parser.add_argument("run_dir", type=Path, help="the run's directory")
    parser.add_argument("--tokens", type=int, default=200, help="tokens to generate (200)")
    parser.add_argument("--prompt", default="", help="the text to continue (default: a newline)")
    parser.add_argument(
        "--temperature", type=float, default=0.8, help="softmax temperature; 0: greedy (0.8)"
    )
    parser.add_argument("--seed", type=int, default=0, help="the sampling generator's seed (0)")
    parser.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda or cpu"
    )
    parser.add_argument(
        "--tokenizer",
        type=Path,
        help="a tokenizer.json to decode with: for a dataset=tokens run, whose files do not say "
        "(without it, token ids are printed)",
    )
    args = parser.parse_args(argv)
    if args.tokens < 1 or args.temperature < 0:
        parser.error("--tokens must be at least 1 and --temperature at least 0")
    try:
        text, note = sample(
            args.run_dir,
            args.tokens,
            args.prompt,
            args.temperature,
            args.seed,
            args.device,
            args.tokenizer,
        )
    except UserError as err:
        print(f"mpexp-sample: {err}", file=sys.stderr)
        return 2
    print(f"# {note}", file=sys.stderr)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
