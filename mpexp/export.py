"""`mpexp-export RUN_DIR OUT_DIR` / `python -m mpexp.export RUN_DIR OUT_DIR`: a model=hf run's best
checkpoint written back as a Hugging Face folder, so that users leave with their model in their
format: `AutoModelForCausalLM.from_pretrained(OUT_DIR)` (or AutoModelForImageClassification)
loads it, with its tokenizer where the run had one (`AutoTokenizer.from_pretrained(OUT_DIR)`).

The model is rebuilt from the run's recorded config as the run built it (mpexp/models/hf.py),
given the checkpoint's weights (the best kept by val/loss, which the run keeps beside its newest
and mpexp-sample picks too; else the newest) and written by transformers' own `save_pretrained`:
config.json and safetensors, in the dtype the run held its weights in (float32; bfloat16 for
pure bf16). The tokenizer is the pretrained folder's own where the text was tokenized with it,
else the run's tokenizer.json (a learned BPE, a file given) as a fast tokenizer; a byte-level
run has none to write.

A LoRA run's adapters are written apart by default, as peft writes them, into OUT_DIR/adapter over
the base model in OUT_DIR (`PeftModel.from_pretrained(base, OUT_DIR/adapter)`); `--merge` adds
them into the weights they adapt instead, for a plain model. A run without adapters writes its
weights either way.

    mpexp-export outputs/2026-12-01/10-00-00 ~/models/my-llama-tuned
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from mpexp.errors import UserError

HF_TARGET = "mpexp.models.hf.hf_model"
ADAPTER_DIR = "adapter"  # where --merge's absence writes LoRA's adapters, inside OUT_DIR


def export(run_dir: Path, out_dir: Path, merge: bool = False) -> list[str]:
    """Write the run's best checkpoint to `out_dir` as a transformers folder; what was written,
    in words, a line each."""
    import torch

    from mpexp.build import rebuilt
    from mpexp.checkpoints.files import load
    from mpexp.sample import best_checkpoint

    summary = run_summary(run_dir)
    ran = summary["ran"]
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise UserError(f"{out_dir} exists and is not empty: give a new folder to export into.")
    path, why = best_checkpoint(run_dir)
    state = load(path)
    if state.get("sharded"):
        raise UserError(
            f"{path} is an FSDP run's sharded checkpoint; mpexp-export reads single-file "
            "checkpoints (trainer.strategy=single or ddp)."
        )
    target = state["config"]["model"].get("_target_")
    if target != HF_TARGET:
        raise UserError(
            f"{run_dir} trained {target}, not a transformers model: "
            "mpexp-export writes model=hf runs as Hugging Face folders."
        )
    # built as the run built it: its frozen weights again (from its pretrained folder or its
    # seed, checked against the run's fingerprint of them), the rest from the checkpoint
    model, tuning = rebuilt(state, **model_kwargs(ran["task"]))
    pure = state["config"]["precision"].get("weights") == "bfloat16"
    dtype = torch.bfloat16 if pure else torch.float32  # pure bf16 held its weights in bf16
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        written = save_model(model, tuning.adapters, out_dir, merge, dtype)
        written[0] = f"{written[0]} from {path.name} ({why})"
        if ran["task"].get("name") == "language_model":
            pretrained = state["config"]["model"].get("pretrained")
            written.append(save_tokenizer(ran.get("data") or {}, pretrained, out_dir))
    except BaseException:
        shutil.rmtree(out_dir, ignore_errors=True)  # nothing half-written left behind
        raise
    return written


def save_model(model, adapters, out_dir: Path, merge: bool, dtype) -> list[str]:
    """The model into `out_dir` by transformers' save_pretrained, in `dtype`. LoRA's adapters
    (`adapters`, peft's model around it) are merged into the weights they adapt (`merge`), or
    written apart into out_dir/adapter as peft writes them, over the base model in out_dir."""
    from mpexp.finetune.export import merged, save_adapters

    if adapters is None:
        model.to(dtype).save_pretrained(out_dir)
        return [f"{type(model).__name__}, {dtype}: {out_dir}"]
    if merge:
        plain = merged(adapters)
        plain.to(dtype).save_pretrained(out_dir)
        return [f"{type(plain).__name__} with its LoRA adapters merged, {dtype}: {out_dir}"]
    # the base's config.json first: peft reads it from the path the adapters record as their base
    adapters.get_base_model().config.save_pretrained(out_dir)
    save_adapters(adapters, out_dir / ADAPTER_DIR, base=str(out_dir.resolve()))
    base = adapters.unload()  # the adapted layers as they were, the adapters taken out
    base.to(dtype).save_pretrained(out_dir)
    return [
        f"{type(base).__name__}, {dtype}: {out_dir}",
        f"its LoRA adapters apart (PeftModel.from_pretrained over it): {out_dir / ADAPTER_DIR}",
    ]


def run_summary(run_dir: Path) -> dict:
    import json

    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        raise UserError(f"{run_dir} is no mpexp run directory: it has no summary.json.") from None
    if "ran" not in summary:
        raise UserError(f"{run_dir} stopped before its first step: it has nothing to export.")
    return summary


def model_kwargs(task: dict) -> dict:
    """What the run built its model with, from its recorded task (`ran.task`)."""
    from mpexp.tasks.classification import Classification
    from mpexp.tasks.language_model import LanguageModelling

    if task.get("name") == LanguageModelling.name:
        return LanguageModelling(task["vocab_size"], task["block_size"]).model_kwargs()
    sizes = (task["channels"], task["height"], task["width"], task["num_classes"])
    return Classification(*sizes).model_kwargs()


def save_tokenizer(data: dict, pretrained: str | None, out_dir: Path) -> str:
    """The run's tokenizer into `out_dir`, and what was written."""
    file = data.get("tokenizer_file")
    if not file:
        return "no tokenizer: the run's text was bytes (ids 0 to 255 are the bytes themselves)"
    from mpexp.models.hf_config import transformers

    auto = transformers()
    own = pretrained is not None and Path(file).parent == Path(pretrained).expanduser().resolve()
    if own:  # the pretrained model's tokenizer, with its settings (special tokens)
        tokenizer = auto.AutoTokenizer.from_pretrained(Path(file).parent, local_files_only=True)
    else:
        tokenizer = auto.PreTrainedTokenizerFast(tokenizer_file=file)
    tokenizer.save_pretrained(out_dir)
    return f"its tokenizer ({file})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="mpexp-export",
        description="Write a model=hf run's best checkpoint as a Hugging Face folder "
        "(save_pretrained), with its tokenizer.",
    )
    parser.add_argument("run_dir", type=Path, help="the run's directory")
    parser.add_argument("out_dir", type=Path, help="a new folder to write")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="merge fine-tuning adapters (LoRA) into the weights instead of saving them apart",
    )
    args = parser.parse_args(argv)
    try:
        lines = export(args.run_dir, args.out_dir.expanduser(), args.merge)
    except UserError as err:
        print(f"mpexp-export: {err}", file=sys.stderr)
        return 2
    print("Written: " + "\n  ".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
