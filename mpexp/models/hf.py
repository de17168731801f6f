"""model=hf: a Hugging Face transformers model through transformers' own entry points
(`AutoConfig.for_model`, `AutoModelForCausalLM` and `AutoModelForImageClassification`'s
`from_config` and `from_pretrained`), and an adapter that gives it a task's calling convention.

The model is built for the task the data serves: a causal language model (Llama, GPT-2, Qwen2,
Mistral, ...) for token windows, an image classifier (ViT, ConvNeXt, ...) for images. Built from
a config (`model.config=<type>` with any of its keys as `model.<key>`), it is sized to the data:
`vocab_size` to the data's vocabulary (padded to a multiple of 64, as mpexp's GPT), the context
(`max_position_embeddings`, GPT-2's `n_positions`) to `model.block_size` unless given, and an
image model's `num_channels`, `image_size` and `num_labels` to the images. Loaded from a folder
(`model.pretrained=<dir>`, local files only, safetensors), it is checked against the data
instead: its context must hold a window, a classifier's channels must match (its head alone is
made anew for another class count, as transformers does with `ignore_mismatched_sizes`); the
task refuses a vocabulary smaller than the data's ids, and the model's trial on one example
images of a size a pretrained ViT cannot take. Weights load in float32: the mixed-precision
modes keep float32 master weights, and pure bf16 casts them itself (mpexp/precision/
pure_updates.py).

The adapter is no wrapper: the model's class is swapped for a subclass that only changes what
`forward` returns (the logits alone, with `use_cache=False` for a language model) and adds what
mpexp asks of a model (`fsdp_units`, `kv_cache` and `decode` for sampling, `fp8_left_out`). Its
modules and parameters keep transformers' names (`model.layers.0.self_attn.q_proj`,
`lm_head`), so precision.fp8.exclude, precision.fp32_modules, the diagnostics, FSDP, checkpoints
and LoRA's target modules all read them as transformers writes them, and `save_pretrained` writes
the same class name into config.json.

Under the meta device (mpexp-plan builds there), a pretrained model is built from its config
alone: the plan needs its shapes, not its weights.
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mpexp.errors import ConfigError, reason
from mpexp.models import hf_config

log = logging.getLogger(__name__)


def hf_model(
    config: str | None = None,
    pretrained: str | None = None,
    block_size: int = 64,
    fp8_head: bool = False,
    attn_implementation: str | None = None,
    vocab_size: int | None = None,
    in_channels: int | None = None,
    num_classes: int | None = None,
    image_size: tuple[int, int] | None = None,
    **keys: Any,
) -> nn.Module:
    """The model for the task whose sizes come as `vocab_size` (a language model) or
    `in_channels`, `num_classes` and `image_size` (an image classifier); `keys` are the model
    type's own config keys (see the module's docstring)."""
    model_type = hf_config.check_keys({"config": config, "pretrained": pretrained, **keys})
    recipe = Recipe(model_type, pretrained, keys, attn_implementation)
    if vocab_size is not None:
        model = causal_lm(recipe, block_size, vocab_size)
    elif num_classes is not None:
        model = image_classifier(recipe, in_channels, num_classes, image_size)
    else:
        raise ConfigError(
            "model=hf trains language models on token windows (dataset=text, dataset=tokens) and "
            "image classifiers on images; this dataset serves neither."
        )
    keep = "the output layer: model.fp8_head=true converts it"
    model.fp8_left_out = {} if fp8_head else dict.fromkeys(head_names(model), keep)
    return model


@dataclass
class Recipe:
    """What a model is built from: its type, its pretrained folder (or none), its config keys
    and the attention implementation asked for (None: mpexp's choice)."""

    model_type: str
    pretrained: str | None
    keys: dict[str, Any]
    attention: str | None

    def config(self):
        """The model's config: the type's defaults or the folder's config.json, with `keys`."""
        auto = hf_config.transformers().AutoConfig
        try:
            if self.pretrained is None:
                return auto.for_model(self.model_type, **self.keys)
            folder = hf_config.pretrained_folder(self.pretrained)
            return auto.from_pretrained(folder, local_files_only=True, **self.keys)
        except (ValueError, TypeError) as err:
            raise ConfigError(
                f"model=hf cannot make a {self.model_type} config: {reason(err)}."
            ) from None

    def describe(self, model: nn.Module) -> None:
        """Say what was built: the class, where its weights came from, its attention."""
        weights = f"weights of {self.pretrained}" if self.pretrained else "new weights"
        log.info(
            "model=hf: %s (%s), %s, attention %s",
            type(model).__name__,
            self.model_type,
            weights,
            model.config._attn_implementation,
        )

    def model(self, auto, config, kind: str, new_head: bool = False) -> nn.Module:
        """The model of `config` from `auto` (an Auto class): new weights, or the folder's (all
        of them but a classifier's head, with `new_head`)."""
        types = auto._model_mapping._model_mapping  # model type -> class name, nothing imported
        if type(config) not in auto._model_mapping:
            known = [t for t in WELL_KNOWN if t in types]
            raise ConfigError(
                f"transformers has no {kind} class for a {self.model_type} model "
                f"({auto.__name__}); {len(types)} model types have one, among them "
                f"{', '.join(known)}."
            )
        attention = {"attn_implementation": self.attention} if self.attention else {}
        if self.pretrained is None or on_meta_device():
            return auto.from_config(config, **attention)
        return auto.from_pretrained(
            hf_config.pretrained_folder(self.pretrained),
            config=config,
            local_files_only=True,
            use_safetensors=True,
            dtype=torch.float32,
            ignore_mismatched_sizes=new_head,
            **attention,
        )


def causal_lm(recipe: Recipe, block_size: int, vocab: int) -> nn.Module:
    auto = hf_config.transformers().AutoModelForCausalLM
    config = recipe.config()
    # BERT-like: causal attention only as a decoder, a pretrained encoder's too (its folder says
    # is_decoder=false: each position would see the tokens it is to predict)
    if hasattr(config, "is_decoder"):
        config.is_decoder = True
    if recipe.pretrained is None:
        config.vocab_size = vocab
        if config.is_encoder_decoder:
            raise ConfigError(
                f"model.config={recipe.model_type} is an encoder-decoder model; model=hf trains "
                "decoder-only language models (llama, gpt2, qwen2, mistral, ...)."
            )
        positions = config.attribute_map.get("max_position_embeddings", "max_position_embeddings")
        given = {"max_position_embeddings", positions} & recipe.keys.keys()
        if hasattr(config, "max_position_embeddings") and not given:
            config.max_position_embeddings = block_size
    if recipe.attention is None:
        recipe.attention = causal_attention(auto, config, block_size)
    model = recipe.model(auto, config, "causal language model")
    context = getattr(model.config, "max_position_embeddings", None)
    if context is not None and block_size > context:
        raise ConfigError(
            f"model.block_size={block_size} is longer than the model's context "
            f"({context} positions, max_position_embeddings): use model.block_size<={context}."
        )
    model.__class__ = adapted(type(model), CausalLM)
    model.block_size = block_size
    recipe.describe(model)
    return model


def causal_attention(auto, config, block_size: int) -> str | None:
    """The attention a causal language model runs when the config names none: transformers' own
    SDPA function under a name of mpexp's (`MASK_FREE`), for which transformers builds no mask,
    where that is exact; else None (transformers' default, which builds its mask each forward).

    mpexp's windows are never padded, so each position attends to all before it: SDPA's
    `is_causal`, which transformers' SDPA function asks for itself when it is given no mask.
    transformers' default path reaches the same kernel, but decides so each forward from the
    position ids it made (a check for packed sequences), which reads a value on the host: a
    synchronisation with the GPU every micro-batch. Not exact where a layer sees only a window
    shorter than the training window (sliding-window attention), and not for a model whose
    attention takes no pluggable function."""
    cls = auto._model_mapping.get(type(config), None)
    if cls is None or not getattr(cls, "_supports_attention_backend", False):
        return None
    layers = getattr(config, "layer_types", None) or ()
    window = getattr(config, "sliding_window", None)
    if not getattr(config, "use_sliding_window", True):
        window = None
    if any(kind != "full_attention" for kind in layers) or (window or block_size) < block_size:
        return None
    transformers = hf_config.transformers()
    if MASK_FREE not in transformers.AttentionInterface._global_mapping:
        sdpa = transformers.AttentionInterface._global_mapping["sdpa"]
        transformers.AttentionInterface.register(MASK_FREE, sdpa)
    return MASK_FREE


# transformers' SDPA attention under mpexp's name: no mask made for it (see causal_attention)
MASK_FREE = "mpexp_causal_sdpa"


def image_classifier(
    recipe: Recipe, channels: int, classes: int, size: tuple[int, int]
) -> nn.Module:
    auto = hf_config.transformers().AutoModelForImageClassification
    config = recipe.config()
    if recipe.pretrained is None:
        config.num_labels, config.num_channels = classes, channels
        if hasattr(config, "image_size"):
            config.image_size = size[0] if size[0] == size[1] else list(size)
    elif getattr(config, "num_channels", channels) != channels:
        raise ConfigError(
            f"model.pretrained={recipe.pretrained} takes images of {config.num_channels} channels; "
            f"the data's have {channels}. Use images of {config.num_channels} channels (e.g. "
            "dataset.channels), or a model made for them."
        )
    new_head = recipe.pretrained is not None and config.num_labels != classes
    if new_head:
        log.info(
            "The pretrained head of %d classes is replaced by a new one of %d (the rest loads).",
            config.num_labels,
            classes,
        )
        config.num_labels = classes
    model = recipe.model(auto, config, "image classification", new_head)
    model.__class__ = adapted(type(model), ImageClassifier)
    model.made_anew = head_names(model) if new_head else []  # LoRA trains it whole
    recipe.describe(model)
    return model


# the model types named first when a type has no class for the task
WELL_KNOWN = ("llama", "gpt2", "qwen2", "mistral", "gemma", "phi3", "vit", "deit", "convnext",
              "swin", "resnet", "efficientnet")  # fmt: skip


def on_meta_device() -> bool:
    """Whether modules are being made on the meta device (mpexp-plan's rehearsal)."""
    get = getattr(torch, "get_default_device", None)  # torch >= 2.3
    return get is not None and get().type == "meta"


def head_names(model: nn.Module) -> list[str]:
    """The output layer's module names: a language model's output embedding (lm_head), an image
    classifier's `classifier`."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head = head if head is not None else getattr(model, "classifier", None)
    return [name for name, module in model.named_modules() if module is head and head is not None]


class Adapter:
    """What mpexp asks of a model, given to a transformers model by `adapted`."""

    def fsdp_units(self) -> list[nn.Module]:
        """The blocks transformers itself keeps whole when it splits a model
        (`_no_split_modules`: Llama's decoder layers, ViT's layers); the embeddings and the
        output layer stay with the root, where a tied output layer finds its embedding."""
        blocks = set(self._no_split_modules or ())
        units = [m for m in self.modules() if m is not self and type(m).__name__ in blocks]
        return units or list(self.children())


class CausalLM(Adapter):
    """Token windows (n, length) in, next-token logits (n, length, vocab) out."""

    def forward(self, input_ids=None, *args, **kwargs):
        kwargs.setdefault("use_cache", False)  # training builds no cache
        return super().forward(input_ids, *args, **kwargs).logits

    def kv_cache(self):
        """An empty cache of keys and values, transformers' own, for `decode`."""
        return hf_config.transformers().DynamicCache(config=self.config)

    def last_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """The next-token logits (n, vocab) after windows `tokens` (n, length), the output layer
        on the last position alone where the model takes `logits_to_keep` (transformers' own
        way of sparing the rest; older versions: every position's, the last kept)."""
        keep = {"logits_to_keep": 1} if keeps_logits(type(self)) else {}
        return super().forward(tokens, use_cache=False, **keep).logits[:, -1]

    def decode(self, tokens: torch.Tensor, cache) -> torch.Tensor:
        """The next-token logits (n, vocab) after `tokens` (n, length), which continue the
        positions `cache` holds; the cache takes theirs (mpexp/sample.py)."""
        name = cache_keyword(type(self))
        out = super().forward(tokens, use_cache=True, **{name: cache})
        return out.logits[:, -1]


class ImageClassifier(Adapter):
    """Images (n, channels, height, width) in, class logits (n, classes) out."""

    def forward(self, pixel_values=None, *args, **kwargs):
        return super().forward(pixel_values, *args, **kwargs).logits


@functools.cache
def adapted(cls: type, adapter: type) -> type:
    """`cls` with `adapter`'s methods first: the class a built model is switched to. It keeps
    `cls`'s name, which save_pretrained records as the model's architecture."""
    names = {"__module__": __name__, "__qualname__": cls.__name__}
    return type(cls.__name__, (adapter, cls), names)


def cache_keyword(cls: type) -> str:
    """What the transformers model under `cls` calls its KV cache in `forward`: `cache` in
    recent transformers, `past_key_values` before."""
    return "cache" if "cache" in forward_keywords(cls) else "past_key_values"


def keeps_logits(cls: type) -> bool:
    """Whether the transformers model under `cls` takes `logits_to_keep` in `forward`."""
    return "logits_to_keep" in forward_keywords(cls)


@functools.cache
def forward_keywords(cls: type) -> frozenset[str]:
    """The keywords of the transformers model's own `forward` under the adapted class `cls`."""
    return frozenset(inspect.signature(super(CausalLM, cls).forward).parameters)
