"""Checks of config values that the schema (mpexp/config/) cannot express: ranges, and values
that depend on each other. Run before any work starts; each names the key and the fix."""

from __future__ import annotations

import difflib
import math
import shlex
from collections.abc import Mapping
from dataclasses import fields, is_dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError

from mpexp.batches import accumulate_advice, accumulate_choices
from mpexp.config import HFConfig, TimmConfig, TrainConfig, run_length
from mpexp.errors import ConfigError
from mpexp.launch import launched_processes
from mpexp.rundir import train_command

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")
MAX_SEED = 2**32 - 1


def _number(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{key}={value!r} is not a number; set it like `{key}=0.001`.")
    if not math.isfinite(value):
        raise ConfigError(f"{key}={value!r} must be finite.")
    return float(value)


def _integer(value: Any, key: str, minimum: int, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{key}={value!r} must be an integer >= {minimum}.")
    if maximum is not None and value > maximum:
        raise ConfigError(f"{key}={value!r} must be an integer in [{minimum}, {maximum}].")
    return value


def _choice(value: Any, key: str, options: tuple[str, ...]) -> str:
    if value not in options:
        raise ConfigError(f"{key}={value!r} is not valid; choose one of: {', '.join(options)}.")
    return value


def check_schema(cfg: DictConfig) -> None:
    """Refuse keys that no schema declares (Hydra's `+key=value` adds them past the schema), and
    model=hf's keys that its model type's config does not have."""
    unknown = unknown_keys(cfg, schema=TrainConfig)
    if unknown:
        raise unknown_keys_error(unknown)
    if OmegaConf.get_type(cfg.model) is HFConfig:  # an open node: transformers' keys
        from mpexp.models.hf_config import check_keys  # imports transformers: only for model=hf

        check_keys(cfg.model)


def unknown_keys_error(unknown: list[str]) -> ConfigError:
    """The one message for keys no schema declares, each with its suggestion (`trainer.epoch
    (did you mean trainer.epochs?)`): here, and for a mistyped override (mpexp/composition.py)."""
    return ConfigError(
        f"Unknown config key{'s' if len(unknown) > 1 else ''}: {', '.join(unknown)}. "
        f"`{shlex.join([*train_command(), '--cfg', 'job'])}` lists every key."
    )


def unknown_keys(cfg: DictConfig, prefix: str = "", schema: type | None = None) -> list[str]:
    """Keys that a node's schema (its own, or `schema`) does not declare: added with Hydra's `+`
    prefix, which bypasses the schema. Each comes with the closest declared key, if one is close."""
    found = []
    schema = schema or OmegaConf.get_type(cfg)
    declared = {f.name for f in fields(schema)} if is_dataclass(schema) else None
    if getattr(schema, "OPEN", False):  # its other keys are checked by what it builds
        declared = None
    for key in cfg:
        name = f"{prefix}{key}"
        if declared is not None and key not in declared and not accepts_key(schema, str(key)):
            close = difflib.get_close_matches(str(key), sorted(declared), n=1)
            found.append(f"{name} (did you mean {prefix}{close[0]}?)" if close else name)
            continue
        node = cfg._get_node(key)
        if isinstance(node, DictConfig) and not node._is_missing() and not node._is_none():
            found += unknown_keys(node, f"{name}.")
    return found


def accepts_key(schema: type | None, key: str) -> bool:
    """Whether a schema takes `key` beyond its fields: a schema class says so with a classmethod
    `accepts_key(key) -> bool` (a model option whose keys go on to another library's config);
    none does by default. `model.<key>=value` is then added as `++model.<key>=value` would be
    (mpexp/composition.py), and no check calls it unknown."""
    accepts = getattr(schema, "accepts_key", None)
    return bool(accepts is not None and accepts(key))


def validate(cfg: DictConfig) -> None:
    """Raise ConfigError naming the first value that cannot work, and the fix; a value computed
    by a resolver that cannot be (mpexp/resolvers.py) is named with the resolver's own words."""
    try:
        _validate(cfg)
    except InterpolationResolutionError as err:
        said = str(err).splitlines()[0].split("while resolving interpolation: ", 1)[-1]
        raise ConfigError(f"{err.full_key} cannot be worked out: {said}") from None


def _validate(cfg: DictConfig) -> None:
    check_schema(cfg)
    trainer, data, opt = cfg.trainer, cfg.dataset, cfg.optimizer

    if trainer.epochs is None and trainer.max_steps is None:
        raise ConfigError(
            "trainer.epochs=null needs trainer.max_steps=<steps>: the run must know its length."
        )
    for key in ("epochs", "max_steps", "eval_every_steps"):
        if trainer[key] is not None:
            _integer(trainer[key], f"trainer.{key}", 1)
    _integer(trainer.log_every, "trainer.log_every", 1)
    # NumPy's global generator takes seeds of 32 bits (and the synthetic set's seed follows it)
    _integer(trainer.seed, "trainer.seed", 0, MAX_SEED)
    if trainer.strategy == "fsdp":
        _validate_fsdp(cfg)
    _choice(trainer.compile_mode, "trainer.compile_mode", COMPILE_MODES)
    _integer(trainer.keep_checkpoints, "trainer.keep_checkpoints", 1)
    if trainer.checkpoint_every_steps is not None:
        _integer(trainer.checkpoint_every_steps, "trainer.checkpoint_every_steps", 1)
    _integer(cfg.wandb.samples, "wandb.samples", 0)
    if _number(cfg.wandb.init_timeout, "wandb.init_timeout") <= 0:
        raise ConfigError(f"wandb.init_timeout={cfg.wandb.init_timeout} must be positive seconds.")

    # the model's first: a dataset may take a value from it (text windows: model.block_size)
    for key in ("width", "n_layer", "n_head", "n_embd", "block_size"):
        if key in cfg.model:
            _integer(cfg.model[key], f"model.{key}", 1)
    if "dropout" in cfg.model and not 0 <= _number(cfg.model.dropout, "model.dropout") < 1:
        raise ConfigError(f"model.dropout={cfg.model.dropout} must lie in [0, 1), e.g. 0.1.")
    if cfg.model.get("lora") is not None:
        _validate_lora(cfg.model.lora, cfg.precision.get("weights") == "bfloat16")

    _integer(data.batch_size, "dataset.batch_size", 1)
    _integer(data.get("num_workers", 0), "dataset.num_workers", 0)
    for key in ("train_size", "val_size", "channels", "height", "width"):
        if key in data:
            _integer(data[key], f"dataset.{key}", 1)
    if "num_classes" in data:
        _integer(data.num_classes, "dataset.num_classes", 2)  # one class leaves nothing to learn
    if "noise" in data and not 0 <= _number(data.noise, "dataset.noise") < 1:
        raise ConfigError(
            f"dataset.noise={data.noise} must lie in [0, 1): at 1 the images are noise alone and "
            "hold nothing to learn. 0.8 is the default."
        )
    if "augment" in data:
        _integer(data.augment.crop_padding, "dataset.augment.crop_padding", 0)
    if "val_fraction" in data and not 0 < _number(data.val_fraction, "dataset.val_fraction") < 1:
        raise ConfigError(
            f"dataset.val_fraction={data.val_fraction} must lie in (0, 1): the share of the data "
            "held out for validation, e.g. 0.1."
        )
    if data.get("block_size") is not None:
        _integer(data.block_size, "dataset.block_size", 1)
        _validate_windows(cfg)
    if "block_size" in data and OmegaConf.get_type(cfg.model) is TimmConfig:
        raise ConfigError(
            "model=timm classifies images; this dataset cuts text into token windows, a "
            "language model's task. Train it on an image dataset (dataset=image_folder, "
            "cifar10, ...), or a language model on this data (model=gpt, model=hf)."
        )
    if data.get("tokenizer") is not None:  # a pretrained folder's tokenizer.json, there
        from mpexp.data.tokenizer import tokenizer_spec  # imports NumPy: only for text

        tokenizer_spec(data.tokenizer)
    if "image_size" in data:  # dataset=image_folder
        _validate_image_folder(data)

    _validate_optimizer(opt)
    _validate_pure_bf16(cfg)
    _validate_fp8_filter(cfg.precision.fp8)

    _validate_scaling(cfg.loss_scaling)
    _validate_training_loop(cfg)
    _validate_scheduler(cfg.scheduler)


def _validate_windows(cfg: DictConfig) -> None:
    """A model=hf language model's context against the windows the data cuts (the key that sets
    them named: dataset.block_size, or model.block_size where the data takes it from there)."""
    if OmegaConf.get_type(cfg.model) is not HFConfig:
        return
    from mpexp.models.hf_config import check_context  # imports transformers: only for model=hf

    follows = OmegaConf.is_interpolation(cfg.dataset, "block_size") and "block_size" in cfg.model
    key = "model.block_size" if follows and cfg.model.block_size == cfg.dataset.block_size else ""
    check_context(cfg.model, cfg.dataset.block_size, key or "dataset.block_size")


def _validate_lora(lora: Mapping[str, Any], pure: bool) -> None:
    """model.lora's ranges and dtype (mpexp/finetune/lora.py), before a model is built (a large
    one takes minutes); its target modules are checked against the built model."""
    if lora.r is None:
        return
    _integer(lora.r, "model.lora.r", 0)
    if pure and lora.get("dtype") == "float32":
        raise ConfigError(
            "model.lora.dtype=float32 under precision=bf16_pure, which holds every trained "
            "weight in bf16: drop model.lora.dtype (the adapters are then bf16), or use "
            "precision=bf16 for float32 adapters over a bf16 forward pass."
        )
    if lora.alpha is not None and _number(lora.alpha, "model.lora.alpha") <= 0:
        raise ConfigError(
            f"model.lora.alpha={lora.alpha} must be positive: the adapters' update is scaled by "
            "alpha / r (null: 2 r)."
        )
    if not 0 <= _number(lora.dropout, "model.lora.dropout") < 1:
        raise ConfigError(f"model.lora.dropout={lora.dropout} must lie in [0, 1), e.g. 0.05.")


def _validate_image_folder(data: Mapping[str, Any]) -> None:
    """dataset=image_folder's keys; its files are checked as it loads them."""
    if data["path"] is None:
        raise ConfigError(
            "dataset=image_folder needs dataset.path=<folder>: one holding train/<class>/ and "
            "val/<class>/ folders of images, or one folder per class to split."
        )
    _integer(data["split_seed"], "dataset.split_seed", 0, MAX_SEED)
    size = _integer(data["image_size"], "dataset.image_size", 1)
    if data["resize_size"] is not None:
        _integer(data["resize_size"], "dataset.resize_size", size)
    if data.get("cache_side") is not None:
        _integer(data["cache_side"], "dataset.cache_side", size)
    _integer(data["stats_images"], "dataset.stats_images", 1)
    given = [key for key in ("mean", "std") if data[key] is not None]
    if len(given) == 1:
        raise ConfigError(
            f"dataset.{given[0]} is given without dataset.{({'mean', 'std'} - set(given)).pop()}:"
            " give both (three numbers each, RGB), or neither to have them computed."
        )
    for key in given:
        values = [_number(v, f"dataset.{key}") for v in data[key]]
        low = 0 if key == "mean" else 1e-6  # a deviation divides
        if len(values) != 3 or not all(low <= v <= 1 for v in values):
            raise ConfigError(
                f"dataset.{key}={values} must be three numbers in [{low:g}, 1], one per channel "
                "(RGB) of images in [0, 1], e.g. dataset.mean=[0.485,0.456,0.406] "
                "dataset.std=[0.229,0.224,0.225]."
            )
    scale = data["augment"]["crop_scale"]
    if scale is not None:
        values = [_number(v, "dataset.augment.crop_scale") for v in scale]
        if len(values) != 2 or not 0 < values[0] <= values[1] <= 1:
            raise ConfigError(
                f"dataset.augment.crop_scale={values} must be two numbers 0 < low <= high <= 1, "
                "the range of the random crop's share of the image's area, e.g. [0.08,1.0]; "
                "null for no random crop."
            )


def _validate_optimizer(opt: Mapping[str, Any]) -> None:
    if _number(opt["lr"], "optimizer.lr") <= 0:
        raise ConfigError(f"optimizer.lr={opt['lr']} must be positive, e.g. optimizer.lr=1e-4.")
    if _number(opt.get("weight_decay", 0.0), "optimizer.weight_decay") < 0:
        raise ConfigError(f"optimizer.weight_decay={opt['weight_decay']} must be >= 0.")
    if "betas" in opt:
        betas = list(opt["betas"])
        if len(betas) != 2 or not all(0 <= _number(b, "optimizer.betas") < 1 for b in betas):
            raise ConfigError(
                f"optimizer.betas={betas} must be two numbers in [0, 1), the decay rates of the "
                "gradient's mean and square, e.g. optimizer.betas=[0.9,0.999]."
            )
    if "momentum" in opt and not 0 <= _number(opt["momentum"], "optimizer.momentum") < 1:
        raise ConfigError(
            f"optimizer.momentum={opt['momentum']} must lie in [0, 1): at 1 or above the velocity "
            "never decays and training diverges. 0.9 is usual."
        )


def _validate_fp8_filter(fp8: Mapping[str, Any]) -> None:
    _integer(fp8.get("min_size", 0), "precision.fp8.min_size", 0)
    if fp8.get("recipe") is None and (fp8.get("exclude") or fp8.get("min_size")):
        key = "exclude" if fp8.get("exclude") else "min_size"
        raise ConfigError(
            f"precision.fp8.{key} chooses the layers fp8 converts, and this run has no fp8; use "
            f"precision=fp8 precision.fp8.{key}=..., or drop it."
        )


# the optimizers pure bf16 steps with its own (mpexp/precision/pure_optimizers.py), and the
# settings of each that its update honours
ADAM_SETTINGS = ("lr", "betas", "eps", "weight_decay")
PURE_OPTIMIZERS = {
    "torch.optim.Adam": ADAM_SETTINGS,
    "torch.optim.AdamW": ADAM_SETTINGS,
    "torch.optim.SGD": ("lr", "momentum", "dampening", "weight_decay", "nesterov"),
}
# the optimizer group's keys that are mpexp's, not the optimizer's settings
OWN_KEYS = ("_target_", "_partial_", "fused", "decay_norms_and_biases")


def _validate_pure_bf16(cfg: DictConfig) -> None:
    """precision=bf16_pure's keys: its own keys only there, nothing that needs fp32 weights."""
    p = cfg.precision
    pure = p.get("weights") == "bfloat16"
    if not pure:
        for key in ("update_rounding", "optimizer_states", "update_chunk", "update_compile"):
            if p.get(key) is not None:
                value = str(p[key]).lower() if isinstance(p[key], bool) else p[key]
                raise ConfigError(
                    f"precision.{key}={value} applies to pure bf16 weights only; use "
                    f"precision=bf16_pure precision.{key}={value}, or drop it."
                )
        return
    if p.get("update_chunk") is not None:
        # at least one padded piece; at most 2^24 elements, which float32 sums count exactly
        _integer(p.update_chunk, "precision.update_chunk", 64, 1 << 24)
    if p.get("autocast") is not None or p.fp8.recipe is not None or p.get("fp32_modules"):
        what = (
            "precision.autocast"
            if p.get("autocast") is not None
            else "precision.fp8"
            if p.fp8.recipe is not None
            else "precision.fp32_modules"
        )
        raise ConfigError(
            f"precision.weights=bfloat16 (pure bf16) with {what}: pure bf16 runs every layer on "
            "its bf16 weights, with nothing autocast; use precision=bf16_pure as it is, or "
            "precision=bf16 for mixed precision with fp32 weights."
        )
    ls = cfg.loss_scaling
    if ls.get("_target_") is not None and not ls.get("only_under_fp16"):
        raise ConfigError(
            "precision=bf16_pure with loss scaling: bfloat16 has float32's range, so gradients "
            "do not underflow and a scale only costs a pass; use loss_scaling=none (or auto)."
        )
    target = cfg.optimizer.get("_target_")
    if target not in PURE_OPTIMIZERS:
        raise ConfigError(
            f"precision=bf16_pure cannot hold the states of optimizer {target} in bfloat16: it "
            "knows those of Adam, AdamW and SGD (optimizer=adam, adamw or sgd); use one of them, "
            "or precision=bf16."
        )
    # pure bf16 steps with its own Adam and SGD: a setting they would not honour is refused
    unknown = [k for k in cfg.optimizer if k not in (*PURE_OPTIMIZERS[target], *OWN_KEYS)]
    if unknown:
        keys = ", ".join(f"optimizer.{k}" for k in unknown)
        raise ConfigError(
            f"precision=bf16_pure does not implement {keys} (its update knows lr, betas, eps, "
            "weight_decay for Adam and AdamW; lr, momentum, dampening, weight_decay, nesterov "
            "for SGD); drop it, or use precision=bf16."
        )


def _validate_scaling(ls: Mapping[str, Any]) -> None:
    if "scale" in ls and _number(ls["scale"], "loss_scaling.scale") <= 0:
        raise ConfigError(
            f"loss_scaling.scale={ls['scale']} must be positive; powers of two such as 1024 "
            "scale without rounding error."
        )
    if "backoff_factor" in ls:  # dynamic, hysteresis (and auto, which is dynamic under fp16)
        if _number(ls["init_scale"], "loss_scaling.init_scale") <= 0:
            raise ConfigError(f"loss_scaling.init_scale={ls['init_scale']} must be positive.")
        if _number(ls["growth_factor"], "loss_scaling.growth_factor") <= 1:
            raise ConfigError(
                f"loss_scaling.growth_factor={ls['growth_factor']} must be > 1 "
                "(the scale grows after clean steps), e.g. 2.0."
            )
        backoff = _number(ls["backoff_factor"], "loss_scaling.backoff_factor")
        if not 0 < backoff < 1:
            raise ConfigError(
                f"loss_scaling.backoff_factor={backoff} must lie in (0, 1) "
                "(the scale shrinks on overflow), e.g. 0.5."
            )
        _integer(ls["growth_interval"], "loss_scaling.growth_interval", 1)
        min_scale = _number(ls.get("min_scale", 0.0), "loss_scaling.min_scale")
        if not 0 <= min_scale <= ls["init_scale"]:
            raise ConfigError(
                f"loss_scaling.min_scale={min_scale:g} must lie in [0, init_scale="
                f"{ls['init_scale']:g}] (0: no floor), e.g. loss_scaling.min_scale=1."
            )
    if "hysteresis" in ls:
        _integer(ls["hysteresis"], "loss_scaling.hysteresis", 1)
    if "calibration_steps" in ls:
        _integer(ls["calibration_steps"], "loss_scaling.calibration_steps", 1)
        if _number(ls["margin"], "loss_scaling.margin") < 1:
            raise ConfigError(
                f"loss_scaling.margin={ls['margin']} must be >= 1: below 1 the calibrated scale "
                "would put the largest gradient above fp16's maximum (65504). 8 leaves 3 bits."
            )


def _validate_training_loop(cfg: DictConfig) -> None:
    trainer, diag = cfg.trainer, cfg.diagnostics
    accumulate = _integer(trainer.accumulate, "trainer.accumulate", 1)
    batch = cfg.dataset.batch_size  # the optimizer step's, over all processes
    if batch % accumulate:
        # a batch splits into `accumulate` micro-batches of one size only when k divides it;
        # otherwise torch's chunk() makes fewer, and the run would not do what it records.
        # Among several processes only multiples of their count are dealt out equally: the
        # divisors named are those this run takes (mpexp/batches.py)
        processes = launched_processes()
        choices = accumulate_choices(batch, processes)
        refused = (
            f"trainer.accumulate={accumulate} does not divide dataset.batch_size={batch} "
            f"into {accumulate} equal micro-batches"
        )
        if not choices:  # the processes cannot share the batch itself
            raise ConfigError(f"{refused}. {accumulate_advice(batch, accumulate, processes)}")
        shown = ", ".join(map(str, choices[:12])) + (", ..." if len(choices) > 12 else "")
        among = "" if processes == 1 else f" that {processes} processes can share"
        raise ConfigError(f"{refused}; use a divisor of {batch}{among}: {shown}.")
    clip = trainer.clip_grad_norm
    if clip is not None and _number(clip, "trainer.clip_grad_norm") <= 0:
        raise ConfigError(
            f"trainer.clip_grad_norm={clip} must be positive (null turns clipping off), e.g. 1.0."
        )
    peak = trainer.peak_tflops
    if peak is not None and _number(peak, "trainer.peak_tflops") <= 0:
        raise ConfigError(
            f"trainer.peak_tflops={peak} must be positive: the device's dense peak TFLOP/s for "
            "the run's precision, e.g. 989.4 for bf16 on an H100 SXM (null looks it up)."
        )
    _validate_recipe(trainer)
    _integer(diag.grad_stats_every, "diagnostics.grad_stats_every", 0)
    _integer(diag.max_names, "diagnostics.max_names", 1)


def _validate_recipe(trainer: Mapping[str, Any]) -> None:
    """The objective's terms and a classifier's recipe: label smoothing, mixup, CutMix, EMA."""
    if _number(trainer.z_loss, "trainer.z_loss") < 0:
        raise ConfigError(f"trainer.z_loss={trainer.z_loss} must be 0 or more, e.g. 1e-4.")
    smoothing = _number(trainer.label_smoothing, "trainer.label_smoothing")
    if not 0 <= smoothing < 1:
        raise ConfigError(
            f"trainer.label_smoothing={smoothing} must be in [0, 1): the share of each target "
            "spread over all classes, e.g. 0.1."
        )
    for key in ("mixup_alpha", "cutmix_alpha"):
        if _number(trainer[key], f"trainer.{key}") < 0:
            raise ConfigError(
                f"trainer.{key}={trainer[key]} must be 0 (off) or positive: the Beta "
                "distribution's parameter, e.g. 0.2 for mixup, 1.0 for CutMix."
            )
    decay = trainer.ema_decay
    if decay is not None and not 0 < _number(decay, "trainer.ema_decay") < 1:
        raise ConfigError(
            f"trainer.ema_decay={decay} must be in (0, 1), e.g. 0.999 (null: no average)."
        )
    _integer(trainer.ema_every, "trainer.ema_every", 1)
    _integer(trainer.ema_warmup_steps, "trainer.ema_warmup_steps", 0)
    _integer(trainer.compute_only_steps, "trainer.compute_only_steps", 0)
    if decay is not None and trainer.strategy == "fsdp":
        raise ConfigError(
            "trainer.ema_decay under trainer.strategy=fsdp: each rank holds a shard of the "
            "weights, so the average would be of shards that validation cannot put together. "
            "Use trainer.strategy=ddp, or ema_decay=null."
        )


def _validate_scheduler(sched: Mapping[str, Any]) -> None:
    if "warmup_steps" in sched:
        _integer(sched["warmup_steps"], "scheduler.warmup_steps", 0)
    if "min_lr_ratio" in sched:
        ratio = _number(sched["min_lr_ratio"], "scheduler.min_lr_ratio")
        if not 0 <= ratio <= 1:
            raise ConfigError(f"scheduler.min_lr_ratio={ratio} must lie in [0, 1], e.g. 0.1.")
    if "step_size" in sched:
        _integer(sched["step_size"], "scheduler.step_size", 1)
    if "gamma" in sched:
        gamma = _number(sched["gamma"], "scheduler.gamma")
        if not 0 < gamma <= 1:
            raise ConfigError(f"scheduler.gamma={gamma} must lie in (0, 1], e.g. 0.1.")


def validate_run_length(cfg: DictConfig, steps_per_epoch: int, samples: int) -> None:
    """Checks that need the run's number of optimizer steps (known once the data is loaded);
    `samples` is the training set's size (the batch is over all processes too)."""
    if steps_per_epoch == 0:
        raise ConfigError(
            f"dataset.batch_size={cfg.dataset.batch_size} is larger than the training set "
            f"({samples} samples) "
            "and dataset.drop_last=true drops the partial batch: the run would take no step. "
            "Lower dataset.batch_size, set dataset.drop_last=false, or train on more data."
        )
    trainer = cfg.trainer
    epochs, max_steps = trainer.epochs, trainer.max_steps
    if max_steps is not None and epochs is not None and epochs * steps_per_epoch < max_steps:
        raise ConfigError(
            f"trainer.max_steps={max_steps} and trainer.epochs={epochs} disagree: {epochs} "
            f"epochs of {steps_per_epoch} steps end at step {epochs * steps_per_epoch}. Set "
            "trainer.epochs=null to train max_steps steps, or drop trainer.max_steps."
        )
    _, total_steps = run_length(trainer, steps_per_epoch)
    steps = cfg.loss_scaling.get("calibration_steps")
    if steps is not None and steps >= total_steps:
        raise ConfigError(
            f"loss_scaling.calibration_steps={steps} leaves no step to train at the "
            f"calibrated scale: the run has {total_steps} steps. Lower it or train longer."
        )
    warmup = cfg.scheduler.get("warmup_steps")
    if warmup is not None and warmup >= total_steps:
        raise ConfigError(
            f"scheduler.warmup_steps={warmup} is not shorter than the run "
            f"({total_steps} steps); lower it."
        )


def _validate_fsdp(cfg: DictConfig) -> None:
    """Combinations FSDP cannot run correctly yet."""
    if cfg.optimizer.get("fused"):
        raise ConfigError(
            "optimizer.fused=true with trainer.strategy=fsdp: sharded gradients need their "
            "overflow flags combined across ranks before the step. Leave optimizer.fused=null."
        )
    if cfg.precision.fp8.recipe is not None and cfg.diagnostics.grad_stats_every:
        raise ConfigError(
            "diagnostics.grad_stats_every under precision=fp8 with trainer.strategy=fsdp: the "
            "fp8 range statistics need each weight's amax over all its shards, which they do not "
            "gather yet. Use trainer.strategy=ddp or single for them."
        )
    if cfg.precision.get("fp32_modules") and cfg.precision.get("autocast") is not None:
        raise ConfigError(
            "precision.fp32_modules with trainer.strategy=fsdp: FSDP gathers those modules' "
            f"weights in {cfg.precision.autocast}, so they cannot run in float32. Use "
            "trainer.strategy=ddp, or drop precision.fp32_modules."
        )
