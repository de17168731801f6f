"""What a config builds on one rank, in the order it must be built: the data, the model (tried on
one image, its FLOPs counted, fp8-converted, fp32 modules wrapped, sharded by FSDP), the precision
and the loss scaler (`build_parts`); then, once the run's tracker has started W&B in the
background, the optimizer, the schedule and the compiled forward pass, which DDP wraps
(`build_training`)."""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, fields, replace

import torch
from hydra.utils import get_object
from omegaconf import DictConfig, OmegaConf

from mpexp import config
from mpexp.batches import BatchSplit
from mpexp.checkpoints.frozen import fingerprint, first_difference, load_trained
from mpexp.data.base import TrainingData
from mpexp.distributed import World
from mpexp.errors import ConfigError, UserError, reason
from mpexp.finetune.prepare import FineTuning, fine_tune
from mpexp.precision.fp8 import check_fp8_rows, convert_to_fp8, linear_rows
from mpexp.precision.fp32_modules import run_in_float32
from mpexp.precision.loss_scaler import LossScaler
from mpexp.precision.modes import Precision, check_fp16_convolutions_on_cpu, setup_precision
from mpexp.precision.pure_updates import hold_in_bf16
from mpexp.precision.scaling import build_scaler
from mpexp.step import flops, performance
from mpexp.step.flops import Throughput
from mpexp.step.objective import Objective
from mpexp.step.performance import Speed
from mpexp.step.schedules import build_schedule
from mpexp.system import device_name
from mpexp.tasks.base import Task


def build(node: DictConfig, **extra):
    """Instantiate a group's `_target_` with its other keys (and `extra`). A model's fine-tuning
    keys (config.FINETUNE_KEYS) are mpexp's (mpexp/finetune/), never its constructor's: left
    out, also from a config read back untyped (a checkpoint's)."""
    kwargs = {k: v for k, v in config.to_dict(node).items() if k not in config.FINETUNE_KEYS}
    return get_object(kwargs.pop("_target_"))(**kwargs, **extra)


def rebuilt(state: dict, **extra) -> tuple[torch.nn.Module, FineTuning]:
    """The model of a run's checkpoint (`state`, a whole file's, on the CPU), for sampling and
    export: built from the run's config with `extra` (the task's model_kwargs) and fine-tuned
    as the run was, its frozen weights built again from `trainer.seed` (or read again from a
    pretrained directory) and checked against the run's fingerprint of them, its other weights
    loaded from the checkpoint. Its `adapters` (LoRA's PeftModel) serve the export."""
    cfg = OmegaConf.create(state["config"])
    pure = cfg.precision.get("weights") == "bfloat16"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.trainer.seed)  # as the run built it, after seed_everything
        model = build(cfg.model, **extra)
        tuning = fine_tune(model, cfg.model, pure=pure)
    problem = first_difference(state.get("frozen"), fingerprint(model))
    if problem is not None:
        raise UserError(
            f"The run's frozen weights cannot be built again: {problem}. Its checkpoints hold "
            "only the weights that train; the frozen ones come from its config (a pretrained "
            "directory that has changed since, or an initialisation that does not repeat from "
            "trainer.seed). Put them back as the run had them."
        )
    if pure:  # pure bf16 held its frozen weights in bf16: rounded as the run rounded them
        for p in model.parameters():
            if not p.requires_grad and p.is_floating_point():
                p.data = p.data.to(torch.bfloat16).to(p.dtype)
    weights = {}
    for key, value in state["model"].items():
        for prefix in WRAPPER_PREFIXES:
            key = key.removeprefix(prefix)
        weights[key] = value
    load_trained(model, weights)
    return model, tuning


WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # DDP's and torch.compile's wrappers' names


def build_model(
    node: DictConfig, task: Task, what: str, data_keys: str = "", model_keys: str = ""
) -> torch.nn.Module:
    """The model, built for the task's inputs and tried on one example of them, so that a model
    that cannot take the data stops the run now with one message, not a traceback mid-step.
    `what` names the model and the dataset in that message; `data_keys` and `model_keys` are the
    settings it names as the ones to change (`dataset.height=2`), the data's shape's and the
    model's size's."""
    with model_trial(task, what, data_keys, model_keys):
        model = build(node, **task.model_kwargs())
        shape = output_shape(model, task)
    return checked(model, shape, task, what)


def output_shape(model: torch.nn.Module, task: Task) -> tuple[int, ...]:
    """The model's output shape for one example of the task's inputs."""
    model.eval()  # no BatchNorm statistics change, no dropout draws from the RNG
    inputs, _ = task.example(1, "cpu")
    with torch.no_grad():
        shape = tuple(model(inputs).shape)
    model.train()
    return shape


def checked(model: torch.nn.Module, shape: tuple[int, ...], task: Task, what: str):
    problem = task.check_output(shape)
    if problem is not None:
        raise ConfigError(f"{what} {problem}.")
    return model


@contextlib.contextmanager
def model_trial(task: Task, what: str, data_keys: str = "", model_keys: str = ""):
    """Building or trying a model: what it raises becomes one message (see `build_model`)."""
    try:
        yield
    except (ValueError, RuntimeError, TypeError, MemoryError) as err:
        if fake_tensor_limit(err):  # mpexp-plan's rehearsal: the plan names what it cannot run
            raise
        if out_of_memory(err):
            smaller = f"a smaller model ({model_keys} now)" if model_keys else "a smaller model"
            raise ConfigError(
                f"{what}: the model does not fit in this machine's memory "
                f"({allocation(err)}).\nUse {smaller}."
            ) from None
        if not shape_mismatch(err):  # the model's own fault: its words, no advice on shapes
            raise ConfigError(
                f"{what} failed when tried on one example of the dataset's "
                f"{task.describe_inputs()}: {type(err).__name__}: {reason(err)}.\n"
                "Fix the model's code (the error above is its own), or use another model."
            ) from None
        data = f"the images' size ({data_keys} now)" if data_keys else "the data"
        raise ConfigError(
            f"{what} cannot take the dataset's {task.describe_inputs()}: {reason(err)}.\n"
            f"Change {data}, or use a model made for this data."
        ) from None


# words of PyTorch's and of models' own errors about an input that does not fit the model
SHAPE_WORDS = re.compile(
    r"shape|size|dimension|mat1|expected .*input|input .*expected|pixels|channels", re.IGNORECASE
)


def shape_mismatch(err: BaseException) -> bool:
    """Whether `err` says the input's shape does not suit the model (advice on the data's shape
    helps), rather than that the model is broken (its own words are the help)."""
    return bool(SHAPE_WORDS.search(str(err)))


def fake_tensor_limit(err: BaseException) -> bool:
    """Whether `err` is fake tensors' own limit (an operator without a shape rule, a value read
    from a tensor), met when `mpexp-plan` rehearses a model: not the model's fault."""
    from torch._subclasses import fake_tensor

    limits = (
        fake_tensor.UnsupportedOperatorException,
        fake_tensor.DataDependentOutputException,
        fake_tensor.DynamicOutputShapeException,
    )
    # a custom operator registered without a shape rule ("no fake impl registered for ..."), or
    # a tensor's data asked for (`.numpy()` is "not supported for tensor subclasses")
    return isinstance(err, limits) or bool(NO_SHAPE_RULE.search(str(err)))


NO_SHAPE_RULE = re.compile(
    r"no (fake|abstract|meta) (impl|kernel)|not supported for tensor subclasses", re.IGNORECASE
)


def out_of_memory(err: BaseException) -> bool:
    """Whether `err` is an allocation that failed: the CPU allocator's, a GPU's, Python's."""
    if isinstance(err, MemoryError | torch.cuda.OutOfMemoryError):
        return True
    return "can't allocate memory" in str(err) or "out of memory" in str(err).lower()


def allocation(err: BaseException) -> str:
    """What a failed allocation asked for, in GiB where the allocator says, else its message."""
    asked = re.search(r"allocate (\d+) bytes", str(err))
    return f"one of its tensors needs {int(asked[1]) / 2**30:,.0f} GiB" if asked else reason(err)


def settings(node: DictConfig, group: str, keys: tuple[str, ...] | None = None) -> str:
    """A group's integer settings as `group.key=value` (only `keys`, where given): those that
    size a model, or shape a dataset's inputs."""
    values = config.to_dict(node)
    return ", ".join(
        f"{group}.{key}={value}"
        for key, value in values.items()
        if (keys is None or key in keys) and isinstance(value, int) and not isinstance(value, bool)
    )


# the dataset keys that decide an image's shape (synthetic data: channels, height, width; an
# image folder: image_size)
IMAGE_KEYS = ("channels", "height", "width", "image_size")


def with_objective(task: Task, trainer: DictConfig) -> Task:
    """The task with the training objective's own terms (`trainer.z_loss`,
    `trainer.label_smoothing`), which only a task that has them takes."""
    terms = {
        "z_loss": (
            "a loss on the log-normaliser of their output logits",
            "language models",
            "train model=gpt on dataset=text",
        ),
        "label_smoothing": (
            "a share of each target spread over all classes",
            "classifiers",
            "train on an image dataset",
        ),
    }
    own = {f.name for f in fields(task)}
    taken = {}
    for key, (what, applies_to, fix) in terms.items():
        value = trainer.get(key, 0.0)
        if not value:
            continue
        if key not in own:
            raise ConfigError(
                f"trainer.{key}={value} applies to {applies_to} ({what}); this run's task is "
                f"{task.name}. Drop it or {fix}."
            )
        taken[key] = value
    return replace(task, **taken) if taken else task


@dataclass
class Built:
    """The parts a config built before training, and the facts about them a run records."""

    data: TrainingData
    task: Task  # what the data's batches mean: the loss, validation, the run's result
    model: torch.nn.Module  # whose weights train: fp8-converted, sharded by FSDP (not DDP's)
    precision: Precision
    scaler: LossScaler
    speed: Speed
    throughput: Throughput  # the FLOP count, finished in the background
    fp32_modules: list[str]  # those that run in float32 (none where nothing is autocast)
    parameters: int
    device_name: str
    split: BatchSplit  # the optimizer step's batch in micro-batches and among processes
    tuning: FineTuning  # LoRA and frozen weights: what trains, for the record and the export
    frozen: dict | None  # the frozen weights' fingerprint, which checkpoints keep instead
    world: World  # this process's place among the run's
    units: performance.UnitCompilation | None = None  # FSDP2's units, compiled one by one


def build_parts(cfg: DictConfig, world: World, choices: dict[str, str | None]) -> Built:
    """The data, model, precision and loss scaler on this rank; `choices` (the option per config
    group) names them in messages."""
    device = world.device
    precision = setup_precision(cfg.precision, device)

    speed = performance.plan_speed(cfg, device)
    # dataset.batch_size is the optimizer step's, over all processes: each takes its share
    split = BatchSplit(cfg.dataset.batch_size, cfg.trainer.accumulate, world.size)
    data: TrainingData = build(cfg.dataset)
    data.batch_size = split.per_process
    # before setup: work that setup splits among the ranks (a scan of every token id) knows
    # this rank's share
    data.shard(world.rank, world.size)
    task = data.task = with_objective(data.setup(device, speed.memory_format()), cfg.trainer)
    dataset = f"dataset={choices.get('dataset') or cfg.dataset._target_}"
    declared = getattr(data, "task_type", None)
    if declared is not None and not isinstance(task, declared):
        raise ConfigError(  # Optuna's direction is read from the declaration before any run
            f"{dataset}'s class declares task_type {declared.__name__} but its setup() returned "
            f"a {type(task).__name__}: make the two agree."
        )
    if world.is_main:  # the same data on every rank: one warning
        data.check_values(dataset)
    what = f"model={choices['model']}" if choices.get("model") else cfg.model._target_
    model = build_model(
        cfg.model,
        task,
        f"{what} on {dataset}",
        settings(cfg.dataset, "dataset", IMAGE_KEYS),
        settings(cfg.model, "model"),
    )
    # LoRA and frozen weights, on the CPU as the model was built: the adapters' random start is
    # the same on every device
    tuning = fine_tune(model, cfg.model, pure=precision.pure is not None)
    model = model.to(device)
    frozen = fingerprint(model)  # the frozen weights as built, which checkpoints leave out
    if precision.pure is not None:  # before the FLOP count's background pass runs the model
        model = hold_in_bf16(model, not task.takes_16_bit_output)
    # the user's model as built, before anything wraps it: whether it declares itself capturable
    speed = performance.for_model(speed, cfg, model, task)
    parameters = sum(p.numel() for p in model.parameters())
    # counted once, on the plain model at the run's shapes, before anything wraps it
    name = device_name(device)
    throughput = flops.throughput(
        model,
        task,
        data.batch_size,
        cfg.trainer.peak_tflops or flops.device_peak_tflops(name, precision.effective),
        world.size,
    )
    precision = check_fp16_convolutions_on_cpu(model, precision)
    # fp8's weight gradients sum over a micro-batch's rows: counted per sample on the plain model
    rows = linear_rows(model, task.example(1, device)[0]) if precision.fp8 else {}
    # fp8 swaps Linear layers: before fp32_modules wraps forwards and DDP/FSDP/compile take them
    model, precision = convert_to_fp8(
        model, precision, list(cfg.precision.fp32_modules), speed.compile
    )
    last = data.samples_per_epoch() % data.batch_size  # a last, smaller batch (0: none)
    check_fp8_rows(precision, rows, data.batch_size, split.accumulate_per_process, last)
    fp32_modules = run_in_float32(model, list(cfg.precision.fp32_modules), precision)
    tuning.hold_frozen(model, precision.autocast_dtype, fp32_modules, world.strategy == "fsdp")
    performance.apply_memory_format(model, speed)  # before FSDP takes the parameters
    # FSDP2's units compiled one by one before each is sharded (DDP wraps the compiled model
    # with its loss, in build_training)
    fsdp_compiled = speed.compile and world.strategy == "fsdp"
    units = performance.UnitCompilation(speed) if fsdp_compiled else None
    model = world.shard(model, precision, units)
    skip_nonfinite = cfg.trainer.on_nonfinite_loss == "skip"
    scaler = build_scaler(cfg.loss_scaling, precision, device, skip_nonfinite_loss=skip_nonfinite)
    world.prepare_scaler(scaler)
    return Built(
        data=data,
        task=task,
        model=model,
        precision=precision,
        scaler=scaler,
        speed=speed,
        throughput=throughput,
        fp32_modules=fp32_modules,
        parameters=parameters,
        device_name=name,
        split=split,
        tuning=tuning,
        frozen=frozen,
        world=world,
        units=units,
    )


def build_training(
    cfg: DictConfig, built: Built, device: torch.device
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler, torch.nn.Module]:
    """The optimizer, the learning-rate schedule and what the loop calls: the model with its
    task's loss (an Objective), compiled where asked, the loss inside the compiled graph; under
    DDP, DDP around the compiled graph, as nanoGPT wraps its compiled model, so that DDP's own
    code runs before the graph instead of breaking it in two. Under FSDP2 the units are
    compiled already (`build_parts`) and the loss is compiled apart."""
    optimizer = performance.build_optimizer(cfg, built.model, device, built.scaler, built.speed)
    _, total_steps = config.run_length(cfg.trainer, built.data.steps_per_epoch())
    schedule = build_schedule(cfg.scheduler, optimizer, built.scaler, total_steps)
    performance.configure_backends(device, cfg.trainer)
    objective = Objective(built.model, built.task)
    if built.units is not None:
        forward = objective.compile_apart(built.units, built.speed)
    else:
        forward = performance.compile_model(objective, built.speed)
    return optimizer, schedule, built.world.replicate(forward)
