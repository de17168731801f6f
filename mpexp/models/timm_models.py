"""timm's models (`model=timm model.name=<any timm model>`), built by `timm.create_model` for the
data: its channels (`in_chans`), its classes (`num_classes`) and, where the model's constructor
takes one, its image size (`img_size`: ViTs, Swin, ...; CNNs take none).

The model is timm's own, not wrapped: its module names (`blocks.0.attn.qkv`, `stages.1.blocks.0`)
are the ones `precision.fp8.exclude`, `precision.fp32_modules`, the diagnostics and a checkpoint
use. What mpexp needs to know about it the adapter attaches as it builds it:

- `capturable`: timm's forward passes keep no Python-side state between steps (stochastic depth
  and dropout draw from torch's generators), so the step may be captured as a CUDA graph; a
  model that reads a value on the host is still found out before the capture
  (mpexp/step/capture_check.py).
- `fsdp_units()`: timm's blocks as its own `group_matcher` names them (`blocks.3`,
  `stages.1.blocks.0`, `layer2.1`), each sharded on its own under `trainer.strategy=fsdp`.
- `fp8_left_out`: the Linear layers that fp8 leaves as they are: those outside the blocks, and
  the classifier unless `model.fp8_head=true`.
- `made_anew`: the classifier's modules where `model.pretrained`'s was for another class count
  (new, random weights), which LoRA trains whole (mpexp/finetune/prepare.py).

`model.pretrained=<file>` loads weights through timm's own loading (`pretrained=True` with the
file as `pretrained_cfg_overlay`): a classifier for another number of classes is dropped and made
anew, a first convolution for other channels adapted as timm adapts it, a ViT's position
embeddings resampled to the data's grid. Nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import re
import types
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mpexp.errors import ConfigError, reason

log = logging.getLogger(__name__)

TIMM_INSTALL = 'pip install "timm>=1.0,<1.1"  (or the timm extra: pip install -e ".[timm]")'
# keys mpexp gives timm.create_model itself: from the data, or from model.pretrained
OWN_KWARGS = ("in_chans", "num_classes", "img_size", "pretrained", "pretrained_cfg_overlay")
WEIGHTS_FILES = ".safetensors, .pth or .bin"


def timm_model(
    in_channels: int | None = None,
    num_classes: int | None = None,
    image_size: tuple[int, int] | None = None,
    name: str | None = None,
    pretrained: str | None = None,
    fp8_head: bool = False,
    kwargs: dict[str, Any] | None = None,
    **inputs: Any,
) -> nn.Module:
    """timm's `name` for images of `in_channels` x `image_size` in `num_classes` classes, with
    `kwargs` passed on to its constructor (`drop_path_rate`, `depth`, ...) and the weights of
    the file `pretrained`, where given. `inputs`: what another task builds its model with
    (a language model's vocab_size), refused."""
    if inputs or None in (in_channels, num_classes, image_size):
        raise ConfigError(
            f"model=timm classifies images; this dataset's task builds its model with "
            f"{', '.join(sorted(inputs)) or 'no image shape'}. Train it on an image dataset "
            "(dataset=image_folder, cifar10, ...), or use a model made for this data."
        )
    timm = import_timm()
    check_name(timm, name)
    image_size = tuple(image_size)
    extra = dict(kwargs or {})
    own = sorted(set(extra) & set(OWN_KWARGS))
    if own:
        raise ConfigError(
            f"model.kwargs.{own[0]} is mpexp's to set (from the data's channels, classes and "
            "image size, or from model.pretrained): drop it."
        )
    args = {"in_chans": in_channels, "num_classes": num_classes, **extra}
    # the plan builds on the meta device: the file's shapes are the model's, nothing to load
    weights = Path(pretrained).expanduser() if pretrained else None
    if weights is not None:
        check_file(weights, pretrained)
    on_meta = torch.get_default_device().type == "meta"
    if weights is not None and not on_meta:  # the images checked before the file is read
        with torch.device("meta"):
            check_patches(create(timm, name, args, image_size, None), name, image_size, pretrained)
    model = create(timm, name, args, image_size, None if on_meta else weights)
    check_patches(model, name, image_size, pretrained)
    if weights is not None and on_meta:  # the plan: which head the run makes anew, from shapes
        overlay = pretrained_args(timm, name, weights)["pretrained_cfg_overlay"]
        model.made_anew = made_anew(model, overlay, args)
    declare(model, fp8_head)
    return model


def import_timm():
    """timm, or one message naming the install that brings it."""
    try:
        import timm
    except ImportError as err:
        raise ConfigError(
            f"model=timm needs timm, which is not installed here ({err}).\n"
            f"Install it with: {TIMM_INSTALL}"
        ) from None
    return timm


def check_name(timm, name: str | None) -> None:
    """Refuse a name timm does not know, with the closest ones it does."""
    if not name:
        raise ConfigError(
            "model=timm needs model.name=<a timm model>, e.g. resnet50, convnext_tiny or "
            "vit_small_patch16_224 (`python -c 'import timm; print(timm.list_models())'` lists "
            "them)."
        )
    if name.startswith(("hf-hub:", "hf_hub:", "local-dir:")):
        raise ConfigError(
            f"model.name={name}: mpexp never downloads, and builds timm's models by "
            "architecture name. Give the name (e.g. convnext_tiny) and the weights file as "
            "model.pretrained=<path>."
        )
    arch, _, tag = name.partition(".")
    if timm.is_model(arch) and (not tag or tag in pretrained_tags(timm, arch)):
        return
    if timm.is_model(arch):
        tags = pretrained_tags(timm, arch)
        raise ConfigError(
            f"model.name={name}: timm's {arch} has no weights tagged {tag!r} (it has "
            f"{', '.join(tags) or 'none'}). The tag names timm's pretrained configuration; "
            f"the weights themselves come from model.pretrained=<file>."
        )
    close = difflib.get_close_matches(arch, timm.list_models(), n=5, cutoff=0.6)
    hint = f"closest: {', '.join(close)}" if close else "no name is close to it"
    raise ConfigError(
        f"model.name={name} is not a timm model ({hint}). "
        f"`python -c 'import timm; print(timm.list_models(\"*{arch.split('_')[0]}*\"))'` "
        "lists names by pattern."
    )


def pretrained_tags(timm, arch: str) -> list[str]:
    return [n.partition(".")[2] for n in timm.list_pretrained(f"{arch}.*")]


def check_file(weights: Path, given: str) -> None:
    if not weights.is_file():
        raise ConfigError(
            f"model.pretrained={given}: no such file. Give a weights file on this machine "
            f"({WEIGHTS_FILES}, e.g. timm's model.safetensors): mpexp never downloads."
        )


def create(
    timm, name: str, args: dict[str, Any], image_size: tuple[int, int], weights: Path | None
) -> nn.Module:
    """timm.create_model with the image size where the model's constructor takes one: it raises
    a TypeError at once, before any weight is made, where it takes none (a CNN)."""
    load = {} if weights is None else pretrained_args(timm, name, weights)
    try:
        return create_once(timm, name, {**args, "img_size": image_size}, load)
    except TypeError as err:
        if "'img_size'" not in str(err):
            raise
    return create_once(timm, name, args, load)


def create_once(timm, name: str, args: dict[str, Any], load: dict[str, Any]) -> nn.Module:
    """One timm.create_model; a keyword its constructor does not take (other than img_size,
    which `create` tries without) or a weights file that does not fit, as one message."""
    weights = load.get("pretrained_cfg_overlay", {}).get("file")
    try:
        with loading_log() as said:
            model = timm.create_model(name, **args, **load)
    except TypeError as err:
        if "unexpected keyword" not in str(err) or "'img_size'" in str(err):
            raise
        raise ConfigError(
            f"timm.create_model({name!r}) does not take these arguments ({reason(err)}): "
            "check model.kwargs against the model's constructor."
        ) from None
    except Exception as err:
        if weights is None or isinstance(err, ConfigError):
            raise
        raise ConfigError(
            f"model.pretrained={weights} does not fit timm's {name}: {one_line(err)}.\n"
            f"Give a file saved from {name} ({WEIGHTS_FILES}), or the model.name it was saved "
            "from."
        ) from None
    if weights is not None:
        check_loaded(model, name, weights, said)
        describe_load(name, weights, load["pretrained_cfg_overlay"], args)
        model.made_anew = made_anew(model, load["pretrained_cfg_overlay"], args)
    for record in said:  # timm's warnings, e.g. a first convolution it could not adapt
        if record.levelno >= logging.WARNING:
            logging.getLogger(record.name).handle(record)
    return model


# how much of timm's (or torch's) error a message quotes: load_state_dict's list of missing keys
# is one line of every key
QUOTED = 300


def one_line(err: BaseException) -> str:
    """timm's (or torch's) error in one line: the first two for load_state_dict's list of
    mismatches, with how many more it names, cut at QUOTED characters."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    said = reason(err)
    if len(said) > QUOTED:
        said = said[:QUOTED].rsplit(" ", 1)[0] + " ..."
    more = len(lines) - 2
    return f"{said} (and {more} more)" if lines[0].endswith(":") and more > 0 else said


def pretrained_args(timm, name: str, weights: Path) -> dict[str, Any]:
    """create_model's arguments for loading `weights` through timm's own loading, with the
    classes and channels the file was saved with, so that timm drops the classifier and adapts
    the first convolution only where the data's differ from the file's (timm compares the
    model's against its pretrained configuration, ImageNet's 1000 classes and 3 channels)."""
    overlay: dict[str, Any] = {"file": str(weights)}
    cfg = timm.models.get_pretrained_cfg(name)
    shapes = file_shapes(weights)
    if cfg is not None and shapes:
        head = first(cfg.classifier)
        if head and f"{head}.weight" in shapes:
            overlay["num_classes"] = shapes[f"{head}.weight"][0]
        conv = first(cfg.first_conv)
        conv_weight = shapes.get(f"{conv}.weight") if conv else None
        if conv_weight is not None and len(conv_weight) == 4 and cfg.input_size:
            overlay["input_size"] = (conv_weight[1], *cfg.input_size[1:])
    return {"pretrained": True, "pretrained_cfg_overlay": overlay}


def first(names) -> str | None:
    """A pretrained configuration's module name, or the first of its tuple of them."""
    if isinstance(names, list | tuple):
        return names[0] if names else None
    return names


def file_shapes(weights: Path) -> dict[str, tuple[int, ...]]:
    """The tensor shapes a weights file holds, read without its data (as timm reads it: a
    .safetensors file with safetensors, any other with torch.load(weights_only=True))."""
    try:
        if weights.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(weights), "pt") as f:
                return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
        saved = torch.load(weights, map_location="meta", weights_only=True)
    except Exception as err:
        raise ConfigError(
            f"model.pretrained={weights} is not a weights file that "
            f"{'safetensors' if weights.suffix == '.safetensors' else 'torch.load'} can read "
            f"({type(err).__name__}: {one_line(err)}). Give a {WEIGHTS_FILES} file of "
            "weights (a model's state_dict)."
        ) from None
    if isinstance(saved, dict):  # a training checkpoint: its weights under one key, as timm reads
        for key in ("state_dict_ema", "model_ema", "state_dict", "model"):
            if isinstance(saved.get(key), dict):
                saved = saved[key]
                break
    # DDP's and torch.compile's prefixes, which timm's loading strips too
    wrapped = re.compile(r"^(?:module\.|_orig_mod\.)+")
    return {wrapped.sub("", k): tuple(v.shape) for k, v in saved.items() if torch.is_tensor(v)}


@contextlib.contextmanager
def loading_log():
    """What timm's loading says at INFO (the keys it left out, the convolution it adapted),
    collected rather than shown: `check_loaded` reads it, `describe_load` says what happened in
    one line, and timm's warnings are passed on once the load is known to be good."""
    loggers = [logging.getLogger(f"timm.models.{name}") for name in ("_builder", "_helpers")]
    records: list[logging.LogRecord] = []
    collect = logging.Handler(logging.INFO)
    collect.emit = records.append
    saved = [(logger.level, logger.propagate) for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.INFO)
        logger.propagate = False
        logger.addHandler(collect)
    try:
        yield records
    finally:
        for logger, (level, propagate) in zip(loggers, saved, strict=True):
            logger.removeHandler(collect)
            logger.setLevel(level)
            logger.propagate = propagate


def check_loaded(model: nn.Module, name: str, weights: str, records) -> None:
    """Refuse a file that left weights out, or held weights the model has no place for, beyond
    the classifier timm drops for another number of classes (timm loads with strict=False then,
    and only logs the difference)."""
    said = " ".join(r.getMessage() for r in records)
    head = first(model.pretrained_cfg.get("classifier"))
    missing = [
        k
        for k in keys_in(said, r"Missing keys \((.*?)\) discovered")
        if not (head and k.startswith(f"{head}."))
    ]
    unexpected = keys_in(said, r"Unexpected keys \((.*?)\) found")
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"the file has no {', '.join(missing[:3])} ({len(missing)} tensors)")
        if unexpected:
            parts.append(f"the model has no {', '.join(unexpected[:3])} ({len(unexpected)})")
        raise ConfigError(
            f"model.pretrained={weights} does not fit timm's {name}: {'; '.join(parts)}.\n"
            f"Give a file saved from {name} ({WEIGHTS_FILES}), or the model.name it was saved "
            "from."
        )


def describe_load(name: str, weights: str, overlay: dict[str, Any], args: dict[str, Any]) -> None:
    """The log's line on what timm did with the file: its classifier made anew, its first
    convolution adapted (timm's own log says so at INFO, in its words)."""
    changed = []
    classes = overlay.get("num_classes")
    if classes is not None and classes != args["num_classes"]:
        changed.append(
            f"its classifier for {classes} classes made anew for the data's {args['num_classes']}"
        )
    channels = overlay.get("input_size", (None,))[0]
    if channels is not None and channels != args["in_chans"]:
        changed.append(
            f"its first convolution adapted from {channels} channels to {args['in_chans']}"
        )
    log.info(
        "model.pretrained=%s loaded into timm's %s%s.", weights, name,
        f"; {'; '.join(changed)}" if changed else "",
    )  # fmt: skip


def made_anew(model: nn.Module, overlay: dict[str, Any], args: dict[str, Any]) -> list[str]:
    """The classifier's modules, where timm made them anew for another class count; else []."""
    classes = overlay.get("num_classes")
    if classes is None or classes == args["num_classes"]:
        return []
    heads = model.pretrained_cfg.get("classifier") or ()
    heads = [heads] if isinstance(heads, str) else list(heads)
    modules = dict(model.named_modules())
    return [h for h in heads if h in modules and any(True for _ in modules[h].parameters())]


def keys_in(text: str, pattern: str) -> list[str]:
    found = re.search(pattern, text)
    return [k.strip() for k in found[1].split(",") if k.strip()] if found else []


def check_patches(
    model: nn.Module, name: str, image_size: tuple[int, int], pretrained: str | None
) -> None:
    """A model that cuts images into patches (a ViT) takes images of a whole number of them;
    timm's patch embedding would otherwise drop the rest of each side without a word. Raised as
    a ValueError about the images' size, which mpexp.build turns into a message naming the
    dataset's size keys."""
    embed = getattr(model, "patch_embed", None)
    patch = getattr(embed, "patch_size", None)
    if patch is None or getattr(embed, "dynamic_img_pad", False):
        return
    ph, pw = (patch, patch) if isinstance(patch, int) else tuple(patch)
    height, width = image_size
    if height % ph == 0 and width % pw == 0 and height >= ph and width >= pw:
        return
    made = model.pretrained_cfg.get("input_size") if hasattr(model, "pretrained_cfg") else None
    made_for = f", made for {made[1]}x{made[2]} pixels" if made else ""
    weights = " (model.pretrained's weights too: timm resamples their position embeddings to " \
        "the data's grid of patches, which must be whole)" if pretrained else ""  # fmt: skip
    sides = sorted({max(ph, height // ph * ph), (height // ph + 1) * ph})
    raise ValueError(
        f"timm's {name}{made_for}, cuts images into patches of {ph}x{pw} pixels{weights}; "
        f"{height}x{width} pixels are not a whole number of them "
        f"({' or '.join(str(s) for s in sides)} pixels a side would be)"
    )


def timm_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's blocks as timm's `group_matcher` names them (its layer-decay groups: a ViT's
    `blocks.N`, a ConvNeXt's `stages.S.blocks.N` and downsamplings, a ResNet's `layerS.N`),
    outermost first; or the children of a `blocks` or `stages` container where the model has
    no matcher. Only blocks with parameters count."""
    return [module for _, module in named_blocks(model) if any(True for _ in module.parameters())]


def named_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    patterns = block_patterns(model)
    if patterns is None:
        for attr in ("blocks", "stages"):
            container = getattr(model, attr, None)
            if isinstance(container, nn.Sequential | nn.ModuleList):
                return [(f"{attr}.{n}", m) for n, m in container.named_children()]
        return []
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if any(inside(name, taken) for taken, _ in found):
            continue
        if name and any(re.match(p, name) for p in patterns):
            found.append((name, module))
    return found


def block_patterns(model: nn.Module) -> list[str] | None:
    """The regular expressions of timm's fine-grained `blocks` group, None without one."""
    matcher = getattr(model, "group_matcher", None)
    if matcher is None:
        return None
    try:
        blocks = matcher(coarse=False).get("blocks")
    except (NotImplementedError, TypeError, AttributeError):
        return None
    if not blocks:
        return None
    if isinstance(blocks, str):
        return [blocks]
    return [entry[0] if isinstance(entry, list | tuple) else entry for entry in blocks]


def inside(name: str, module: str) -> bool:
    return name == module or name.startswith(module + ".")


def declare(model: nn.Module, fp8_head: bool) -> None:
    """What mpexp reads from a model, attached to timm's (see the module's docstring)."""
    # no Python-side per-step state in timm's forward passes (mpexp.step.performance)
    model.capturable = True
    blocks = [name for name, _ in named_blocks(model)]
    if blocks:
        # bound to the model: a copy of it (deepcopy) gets one bound to the copy
        model.fsdp_units = types.MethodType(timm_blocks, model)
    head = first(getattr(model, "pretrained_cfg", {}).get("classifier"))
    left_out = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        if head and inside(name, head):
            if not fp8_head:
                left_out[name] = "the classifier, as it is (model.fp8_head=true converts it)"
        elif blocks and not any(inside(name, block) for block in blocks):
            left_out[name] = "outside timm's blocks (its group_matcher), as it is"
    model.fp8_left_out = left_out
