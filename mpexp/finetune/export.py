"""A LoRA run's adapters, for an export to the ecosystem's formats: merged into the model's
weights, or saved apart as a peft adapter directory that `PeftModel.from_pretrained` loads over
the base model.

Meant for the export command (`save_pretrained` of an HF run's best checkpoint): it rebuilds the
run's model from the checkpoint (`mpexp.build.rebuilt`, which gives the model and its
FineTuning), then either

    model = merged(tuning.adapters)  # each update added into its frozen layer: a plain model
    model.<the library's model>.save_pretrained(directory)

or, keeping the base as it is on disk,

    save_adapters(tuning.adapters, directory, within="<the library's model's attribute>")

A model that wraps the library's own (mpexp's adapter around a transformers model, which takes
the batch and gives logits) names the wrapped model's attribute as `within`, so that the
adapters' names are the library model's own, as peft would have named them had it wrapped that
model directly.
"""

from __future__ import annotations

import copy
from pathlib import Path

from torch import nn

ADAPTER = "default"  # the name peft gives the one adapter mpexp trains


def merged(adapters) -> nn.Module:
    """The model with each LoRA update (alpha / r * B A) added into its layer's weight and
    peft's layers taken out: the plain model, computing what the adapted one computed (to the
    rounding of one addition per weight), whose state dict has the base's names. The adapted
    model is changed in place: build it again to train on."""
    return adapters.merge_and_unload()


def save_adapters(adapters, directory: Path, within: str = "", base: str | None = None) -> None:
    """Write the adapters as peft writes them (adapter_config.json, adapter_model.safetensors)
    into `directory`, named inside the model's attribute `within` (the whole model: "");
    `base`, where given, is recorded as the base model's path (base_model_name_or_path). The
    layers the build made anew and LoRA trained whole (the model's `made_anew`: a classifier's
    new head) go with them as peft's `modules_to_save`, which peft loads over the base's."""
    import peft
    from safetensors.torch import save_file

    directory = Path(directory)
    config = copy.deepcopy(adapters.peft_config[ADAPTER])
    if base is not None:
        config.base_model_name_or_path = base
    model = adapters.get_base_model()
    whole = list(getattr(model, "made_anew", None) or [])
    if not within and not whole:
        adapters.peft_config[ADAPTER] = config
        adapters.save_pretrained(directory)
        return
    root = "base_model.model."
    inner = f"{root}{within}." if within else root
    weights = peft.get_peft_model_state_dict(adapters, adapter_name=ADAPTER)
    outside = sorted(k for k in weights if not k.startswith(inner))
    if outside:
        raise ValueError(f"adapters outside {within!r}: {', '.join(outside[:3])}")
    weights = {root + k.removeprefix(inner): v.contiguous() for k, v in weights.items()}
    modules = dict(model.named_modules())
    for name in whole:
        for key, value in modules[name].state_dict().items():
            weights[root + f"{name}.{key}".removeprefix(f"{within}.")] = value.contiguous()
    if whole:
        config.modules_to_save = [name.removeprefix(f"{within}.") for name in whole]
    config.target_modules = {t.removeprefix(f"{within}.") for t in config.target_modules}
    directory.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(directory))
    save_file(weights, str(directory / peft.utils.SAFETENSORS_WEIGHTS_NAME))
