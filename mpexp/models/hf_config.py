"""model=hf's questions to transformers before anything is built: whether it is installed, which
model type a config names, which keys that type's config class has, and whether a pretrained
folder holds what `from_pretrained` loads. Each answer that is no is one message (ConfigError),
given while the config is checked, before a run writes anything (mpexp/validate.py).

The node `model` of model=hf is open (mpexp/config/, `HFConfig`): Hydra takes any key there,
and `check_keys` refuses those that neither mpexp's schema nor the model type's config class has,
listing the class's own keys, the closest first.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

from mpexp.errors import ConfigError

INSTALL = "pip install 'mpexp[hf]'"
WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
# config keys that the data decides: the model is sized to it, or checked against it
DATA_KEYS = {
    "vocab_size": "the vocabulary is the data's (dataset.tokenizer, dataset.vocab_size)",
    "num_labels": "the classes are the data's (its class folders, dataset.num_classes)",
    "num_channels": "the images' channels are the data's (dataset.channels)",
    "image_size": "the images' size is the data's (dataset.image_size, dataset.height, width)",
}
# a config's own keys that mpexp decides, or that describe the file rather than the model
DECIDED = {
    "dtype", "torch_dtype", "return_dict", "output_attentions", "output_hidden_states",
    "use_cache", "model_type", "architectures", "transformers_version", "id2label", "label2id",
}  # fmt: skip


def transformers():
    """The transformers package, or one message naming the install that brings it."""
    try:
        import transformers
    except ImportError:
        raise ConfigError(
            f"model=hf needs Hugging Face transformers, which is not installed: {INSTALL} "
            "(transformers, safetensors and peft, at the versions mpexp is tested with)."
        ) from None
    # its loading and saving bars would interleave with the run's log, which says what loaded
    transformers.utils.logging.disable_progress_bar()
    return transformers


def model_types() -> list[str]:
    """Every model type transformers knows (its CONFIG_MAPPING's keys)."""
    return list(transformers().CONFIG_MAPPING.keys())


def config_class(model_type: str) -> type:
    """The config class of `model_type`, or one message with the closest types."""
    mapping = transformers().CONFIG_MAPPING
    if model_type not in mapping:
        close = difflib.get_close_matches(model_type, model_types(), n=6, cutoff=0.5)
        hint = f" The closest: {', '.join(close)}." if close else ""
        raise ConfigError(
            f"model.config={model_type} is no model type transformers "
            f"{transformers().__version__} knows.{hint} Any model_type of a config.json is one "
            "(llama, gpt2, qwen2, mistral, vit, convnext, ...)."
        )
    return mapping[model_type]


def config_keys(model_type: str) -> list[str]:
    """The keys of `model_type`'s config: those its default instance holds, and the other names
    it takes for them (GPT-2's `hidden_size` for `n_embd`)."""
    cls = config_class(model_type)
    keys = set(cls().to_dict()) | set(getattr(cls, "attribute_map", {}))
    return sorted(k for k in keys if k not in DECIDED and not k.startswith("_"))


def pretrained_folder(path: str) -> Path:
    """A folder that `from_pretrained` can load without the network, or one message."""
    folder = Path(path).expanduser()
    fetch = (
        "mpexp never downloads: fetch a Hub model into a folder first "
        "(`hf download <name> --local-dir <folder>`), or write one with save_pretrained."
    )
    if not folder.is_dir():
        raise ConfigError(f"model.pretrained={path} is no folder. {fetch}")
    if not (folder / "config.json").is_file():
        raise ConfigError(
            f"model.pretrained={path} has no config.json: it is not a folder written by "
            f"save_pretrained. {fetch}"
        )
    if not any((folder / name).is_file() for name in WEIGHTS):
        raise ConfigError(
            f"model.pretrained={path} holds no weights: no {' or '.join(WEIGHTS)}. Write them "
            "with the model's save_pretrained (safetensors, its default), or use model.config="
            "<type> for new weights."
        )
    return folder


def pretrained_type(folder: Path) -> str:
    """The model type a pretrained folder's config.json names."""
    try:
        model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError) as err:
        raise ConfigError(f"{folder / 'config.json'} cannot be read as JSON ({err}).") from None
    if not model_type:
        raise ConfigError(f"{folder / 'config.json'} names no model_type.")
    return model_type


def model_type_of(node: Mapping[str, Any]) -> str:
    """The model type of an `HFConfig` node: `config`, or its pretrained folder's, which must
    agree where both are given."""
    given, pretrained = node.get("config"), node.get("pretrained")
    if pretrained is None:
        if given is None:
            raise ConfigError(
                "model=hf needs model.config=<a model type> (llama, gpt2, vit, ...) for new "
                "weights, or model.pretrained=<a save_pretrained folder>."
            )
        config_class(given)
        return given
    found = pretrained_type(pretrained_folder(pretrained))
    if given is not None and given != found:
        raise ConfigError(
            f"model.config={given} does not match model.pretrained={pretrained}, whose "
            f"config.json is a {found} model: drop model.config, or give a {given} folder."
        )
    return found


def extra_keys(node: Mapping[str, Any]) -> dict[str, Any]:
    """The node's keys that mpexp's schema does not declare: the transformers config's."""
    from mpexp.config import HFConfig

    declared = {f.name for f in fields(HFConfig)}
    return {key: value for key, value in node.items() if key not in declared}


def check_keys(node: Mapping[str, Any]) -> str:
    """The node's model type, after refusing a key of model=hf that neither mpexp nor the model
    type's config has (the config's own keys listed, the closest first), and keys that the data
    or mpexp decide."""
    model_type = model_type_of(node)
    extra = extra_keys(node)
    for key in extra:
        if key in DECIDED:
            raise ConfigError(
                f"model.{key} is decided by mpexp on model=hf (the weights' dtype by the "
                "precision mode, the outputs by the adapter, which takes the logits alone, "
                "with no cache in training): drop it."
            )
        if key in DATA_KEYS:
            raise ConfigError(
                f"model.{key} is not set by hand on model=hf: {DATA_KEYS[key]}, and the model is "
                "built (or checked) to fit it. Drop it."
            )
    own = config_keys(model_type) if extra else []
    for key in extra:
        if key not in own:
            closest = sorted(own, key=lambda k: -difflib.SequenceMatcher(None, key, k).ratio())
            raise ConfigError(
                f"model.{key} is no key of a {model_type} model's config "
                f"({config_class(model_type).__name__}). Its keys, the closest first: "
                f"{', '.join(closest)}."
            )
    return model_type


def context(node: Mapping[str, Any]) -> tuple[int, str] | None:
    """The positions a causal language model of the node takes, with the config key that says
    so (Llama's `max_position_embeddings`, GPT-2's `n_positions`): a folder's config.json, or a
    new model's own key, else `model.block_size`, which sizes it (mpexp/models/hf.py). None for
    a model with no such limit (rotary positions alone, say)."""
    auto = transformers().AutoConfig
    keys = extra_keys(node)
    model_type = model_type_of(node)
    try:
        if node.get("pretrained") is None:
            config = auto.for_model(model_type, **keys)
        else:
            folder = pretrained_folder(node["pretrained"])
            config = auto.from_pretrained(folder, local_files_only=True, **keys)
    except (ValueError, TypeError):
        return None  # the build says why, in its own message
    if not hasattr(config, "max_position_embeddings"):
        return None
    name = getattr(config, "attribute_map", {}).get("max_position_embeddings")
    name = name or "max_position_embeddings"
    if node.get("pretrained") is None and not {"max_position_embeddings", name} & keys.keys():
        return node["block_size"], f"{name}, from model.block_size"
    return config.max_position_embeddings, name


def check_context(node: Mapping[str, Any], window: int, key: str) -> None:
    """Refuse windows of `window` tokens (`key` sets them) longer than the model's context,
    before anything is built: past it, GPT-2's position table has no row (an IndexError
    mid-build), and rotary models train on positions they were never made for, without a word."""
    found = context(node)
    if found is None or window <= found[0]:
        return
    positions, name = found
    model = (
        f"model.pretrained={node['pretrained']}"
        if node.get("pretrained") is not None
        else f"model.config={node['config']}"
    )
    sized = node.get("pretrained") is None and key != "model.block_size"
    grow = f", or model.block_size={window}, which sizes a new model's context" if sized else ""
    raise ConfigError(
        f"{key}={window}: the model is fed windows of {window} tokens, longer than its context "
        f"of {positions} positions ({model}, {name}). Use {key}={positions} (or fewer){grow}."
    )
