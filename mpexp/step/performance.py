"""Speed switches that do not change the numerics: fused optimizers, memory format, compilation,
the whole step as one CUDA graph.

Each is decided once at setup, in `plan_speed`: on CUDA the defaults take the fast path (compiled
model, channels_last, the step captured as a CUDA graph), on a CPU the plain one; `trainer.eager`
turns compilation and the graph off together. Once the model is built, `for_model` settles the
graph: by default only a model known to be safe to capture is captured (`declares_capturable`).
None of them is allowed to fall back silently: a switch that cannot take effect here says so.
"""

from __future__ import annotations

import functools
import inspect
import logging
import time
from dataclasses import dataclass, replace

import torch
from hydra.utils import get_object, instantiate
from omegaconf import DictConfig
from torch import nn

from mpexp.config import to_dict
from mpexp.errors import ConfigError
from mpexp.precision import pure_optimizers, pure_updates
from mpexp.step.capture_check import graph_blocker
from mpexp.step.schedules import runs_on_device, schedule_factor
from mpexp.tasks.base import Task

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Speed:
    """The speed switches a run takes, each decided once (see `plan_speed`)."""

    compile: bool
    compile_mode: str
    channels_last: bool
    cuda_graph: bool
    fused: bool | None  # None: the optimizer's default (fused on CUDA where it may be)
    graph_off: str | None = None  # why the step is not captured (None: it is)

    def memory_format(self) -> torch.memory_format:
        return memory_format(self.channels_last)

    def without_compile(self) -> Speed:
        return replace(self, compile=False)


def plan_speed(cfg: DictConfig, device: torch.device) -> Speed:
    """The run's switches: those set on the command line as set, the others (null) by device.

    On CUDA the null ones take the fastest path that leaves the numerics unchanged; with
    `trainer.eager=true` compilation and the CUDA graph stay off. A switch asked for explicitly
    that this configuration cannot take is refused with the reason; one that this hardware
    cannot take (a CUDA graph on a CPU) is switched off with a warning. The graph's plan is
    settled by `for_model` once the model is built.
    """
    t = cfg.trainer
    cuda = device.type == "cuda"
    for key in ("compile", "cuda_graph"):
        if t.eager and t[key]:
            raise ConfigError(
                f"trainer.eager=true and trainer.{key}=true contradict each other; drop one."
            )
    compile_on = (cuda and not t.eager) if t.compile is None else bool(t.compile)
    channels_last = cuda if t.channels_last is None else bool(t.channels_last)
    fused = cfg.optimizer.get("fused")
    blocked = _graph_blockers(cfg, fused)
    graph, off = False, None
    if t.cuda_graph is None:
        graph = cuda and not t.eager and not blocked
        if not cuda:
            off = "no CUDA device"
        elif t.eager:
            off = "trainer.eager=true"
        elif blocked:
            off = blocked[0]
            log.info("The training step runs eagerly, not as a CUDA graph: %s.", off)
    elif t.cuda_graph and blocked:
        raise ConfigError(f"trainer.cuda_graph=true cannot be taken: {blocked[0]}.")
    elif t.cuda_graph and not cuda:
        log.warning(
            "trainer.cuda_graph=true on %s: CUDA graphs need a CUDA device; the step runs "
            "eagerly (recorded as cuda_graph: false).",
            device,
        )
        off = "no CUDA device"
    else:
        graph = bool(t.cuda_graph)
        off = None if graph else "trainer.cuda_graph=false"
    if graph and fused is None:
        fused = True  # a captured optimizer step must skip overflowing steps on the device
    return Speed(compile_on, t.compile_mode, channels_last, graph, fused, off)


def schedule_on_device(cfg: DictConfig) -> bool:
    """Whether the configured schedule (if any) can advance on the device (its factor takes a
    tensor count); the optimizer's side is tried once it is built (mpexp.step.schedules)."""
    return runs_on_device(schedule_factor(cfg.scheduler, total_steps=1))


def declares_capturable(model: nn.Module) -> bool:
    """Whether the model says that its step is safe to capture as a CUDA graph: `capturable =
    True` on its own class, or on the instance (a builder function's model).

    A replayed graph runs the step's kernels without the Python around them, so whatever a
    forward pass keeps or draws on the host (Python's `random`, a step counter, a float it
    updates) stays as it was at the capture. Only the model's author knows that it keeps none.
    A subclass declares it again: it may add host-side state that its parent does not have."""
    declared = vars(model).get("capturable", vars(type(model)).get("capturable"))
    return declared is True


def for_model(speed: Speed, cfg: DictConfig, model: nn.Module, task: Task) -> Speed:
    """The plan settled for the built model (the user's own, before fp8, DDP or FSDP wrap it).

    A model whose step cannot be captured (it reads a value on the host, or makes a tensor whose
    size depends on its values: `capture_check.graph_blocker`) runs without the graph, recorded
    in words as `ran.cuda_graph_off`; `trainer.cuda_graph=true` is then refused with the reason.
    With `trainer.cuda_graph=null` the step of a model that does not declare itself capturable
    (`declares_capturable`) is not captured: it runs compiled as planned, without the graph,
    and the log says why and how to opt in. `trainer.cuda_graph=true` captures it anyway,
    with a warning that its Python-side per-step state is frozen."""
    if not speed.cuda_graph:
        return speed
    declared = declares_capturable(model)
    if declared or cfg.trainer.cuda_graph:  # one that is to be captured: what it does, checked
        blocker = graph_blocker(model, task)
        if blocker is not None and cfg.trainer.cuda_graph:
            raise ConfigError(f"trainer.cuda_graph=true cannot be taken: {blocker}.")
        if blocker is not None:
            log.info("The training step runs without a CUDA graph: %s.", blocker)
            fused = cfg.optimizer.get("fused")
            return replace(speed, cuda_graph=False, fused=fused, graph_off=blocker)
    if declared:
        return speed
    name = type(model).__qualname__
    if cfg.trainer.cuda_graph:
        log.warning(
            "trainer.cuda_graph=true captures %s, which does not declare itself capturable: "
            "Python-side per-step state in its forward pass (Python's random, step counters, "
            "host scalars) is frozen at the captured step's values in every replay. Set "
            "`capturable = True` on its class once it keeps none.",
            name,
        )
        return speed
    log.info(
        "The training step of %s is not captured as a CUDA graph: the model does not declare "
        "itself capturable, and a replayed graph would freeze any Python-side per-step state "
        "of its forward pass (Python's random, step counters, host scalars). It runs%s without "
        "the graph. Set `capturable = True` on the model's class if its forward keeps no such "
        "state, or trainer.cuda_graph=true to capture it anyway.",
        name,
        " compiled" if speed.compile else " eagerly",
    )
    off = f"{name} does not declare itself capturable"
    return replace(speed, cuda_graph=False, fused=cfg.optimizer.get("fused"), graph_off=off)


def _graph_blockers(cfg: DictConfig, fused) -> list[str]:
    """Why this configuration's step cannot be captured as one CUDA graph (none: it can)."""
    t = cfg.trainer
    reasons = []
    if t.strategy != "single":
        reasons.append(f"trainer.strategy={t.strategy} runs eagerly (one process per GPU)")
    if not schedule_on_device(cfg):
        # the schedule advances in a Python hook on each real step, which a replay never runs
        reasons.append(
            "the learning-rate schedule's factor takes no tensor, so it advances on the host; "
            "write it with torch functions or use scheduler=none"
        )
    if fused is False:
        reasons.append("optimizer.fused=false: an unfused step reads the overflow flag on the host")
    if t.compile is not False and t.compile_mode == "reduce-overhead":
        reasons.append(
            "trainer.compile_mode=reduce-overhead captures the model's own graphs; use "
            "compile_mode=default to capture the whole step"
        )
    if cfg.diagnostics.overflow_attribution:
        reasons.append("diagnostics.overflow_attribution reads every step's gradients")
    pure = cfg.precision.get("weights") == "bfloat16"
    if not pure and cfg.diagnostics.get("updates_lost"):
        # mpexp/precision/pure_updates.py: a copy of the weights kept in Python around each step
        reasons.append(
            "diagnostics.updates_lost=true with float32 weights counts in Python-side optimizer "
            "hooks"
        )
    stochastic = pure and cfg.precision.get("update_rounding") == "stochastic"
    if stochastic and not hasattr(torch.cuda.CUDAGraph, "register_generator_state"):
        # a replay must draw new numbers from the rounding's own generator each time
        reasons.append(
            f"precision.update_rounding=stochastic draws from a generator of its own, which "
            f"torch {torch.__version__} cannot register with a CUDA graph (torch 2.5 can)"
        )
    return reasons


def configure_backends(device: torch.device, trainer: DictConfig) -> None:
    """cuDNN autotuning: every batch has the same shape (drop_last), so tuning once pays off.

    Not under `trainer.deterministic`: autotuning may pick different algorithms from run to run.
    """
    if trainer.cudnn_benchmark and trainer.deterministic and device.type == "cuda":
        log.warning("trainer.deterministic=true turns trainer.cudnn_benchmark off.")
    torch.backends.cudnn.benchmark = (
        trainer.cudnn_benchmark and device.type == "cuda" and not trainer.deterministic
    )


def build_optimizer(
    cfg: DictConfig, model: nn.Module, device: torch.device, scaler, speed: Speed | None = None
):
    """The `optimizer` group's optimizer, fused on CUDA unless `optimizer.fused` says otherwise.

    Fused Adam/AdamW/SGD skip an overflowing step inside the update kernel, so an fp16 step needs
    no host read of the overflow flag; on the unfused path GradScaler reads it every step. The
    automatic choice stays unfused where that read is needed: under FSDP (overflow flags of
    sharded gradients are combined across ranks first, see mpexp.distributed) and with a learning
    rate schedule that can only advance on the host where training goes on past a skipped step
    (loss scaling, or trainer.on_nonfinite_loss=skip: the schedule counts only steps really
    taken). A schedule on the device (mpexp.step.schedules) keeps the fused step.
    A step captured as a CUDA graph takes the fused optimizer, capturable: its step count and
    learning-rate arithmetic stay on the device.
    """
    if cfg.precision.get("weights") == "bfloat16":
        asked = cfg.optimizer.get("fused") if speed is None else speed.fused
        return _pure_optimizer(cfg, model, asked, speed is not None and speed.cuda_graph, device)
    fused = choose_fused(cfg, device, scaler, speed)
    extra = {}
    if speed is not None and speed.cuda_graph:
        target = get_object(cfg.optimizer._target_)
        if "capturable" in inspect.signature(target).parameters:
            extra["capturable"] = True
    asked = cfg.optimizer.get("fused") if speed is None else speed.fused
    if device.type == "cuda" and not fused and asked is None:
        log.info("Unfused optimizer: GradScaler reads the overflow flag on the host per step.")
    build = instantiate(optimizer_spec(cfg.optimizer), fused=bool(fused), **extra)
    optimizer = build(parameter_groups(model, cfg.optimizer))
    if fused:
        _zero_momentum(optimizer)
    if cfg.diagnostics.get("updates_lost"):  # asked for with float32 weights: the count alone
        pure_updates.CountUpdates(optimizer)
    return optimizer


def choose_fused(cfg: DictConfig, device: torch.device, scaler, speed: Speed | None) -> bool:
    """Whether the optimizer on `device` is fused (see `build_optimizer`): as `optimizer.fused`
    (or the step's speed plan) says, else wherever torch has the fused kernel (CUDA; a CPU
    since torch 2.4) and no host read needs the unfused step. On a CPU as on a GPU it is the
    fastest kernel torch has (docs/benchmarks.md: 4 to 8 times its for-loop Adam at 36.8 M
    parameters), so that mixed precision and pure bf16 (whose update is fused) compare
    precisions, not kernels."""
    fused = cfg.optimizer.get("fused") if speed is None else speed.fused
    if fused is not None:
        return bool(fused)
    # a schedule on the host must see each skipped step: unfused, GradScaler skips on the host
    scheduled = not schedule_on_device(cfg) and scaler.continues_after_skip()
    if cfg.trainer.strategy == "fsdp" or scheduled:
        return False
    return device.type == "cuda" or _fused_on(cfg.optimizer.get("_target_"), device)


# torch's optimizers with a fused kernel, and its name
FUSED_KERNELS = {
    "torch.optim.Adam": "_fused_adam_",
    "torch.optim.AdamW": "_fused_adamw_",
    "torch.optim.SGD": "_fused_sgd_",
}


@functools.cache
def _fused_on(target: str | None, device: torch.device) -> bool:
    """Whether this torch has `target`'s fused kernel on `device` (tried once)."""
    kernel = FUSED_KERNELS.get(target)
    return kernel is not None and pure_optimizers.has_fused_kernel(kernel, device)


def optimizer_kernel(optimizer) -> str:
    """Which of torch's implementations steps the optimizer: "fused" (one kernel over every
    tensor), "foreach" (each operation over lists of tensors) or "for-loop" (tensor by tensor,
    torch's default where neither is chosen and a tensor is off CUDA). Pure bf16's unfused
    update runs torch's formula as foreach operations."""
    defaults = optimizer.defaults
    if defaults.get("fused"):
        return "fused"
    if isinstance(optimizer, pure_optimizers.PureOptimizer) or defaults.get("foreach"):
        return "foreach"
    params = [p for group in optimizer.param_groups for p in group["params"]]
    on_cuda = all(p.device.type == "cuda" for p in params)
    return "foreach" if defaults.get("foreach") is None and on_cuda else "for-loop"


def _pure_optimizer(
    cfg: DictConfig, model: nn.Module, fused: bool | None, captured: bool, device: torch.device
):
    """Pure bf16's own optimizer (mpexp/precision/pure_optimizers.py): fused by default on
    every device, as its update takes no host read then (torch's fused kernel over a batch of
    pieces at a time), and with `optimizer.fused=false` the op-by-op formula of torch's
    unfused step; its workspace sized for `device`, and kept between steps or not as a run
    there does (mpexp-plan builds it on the CPU for a GPU run)."""
    spec = optimizer_spec(cfg.optimizer)
    settings = {k: v for k, v in spec.items() if k not in ("_target_", "_partial_", "fused")}
    params = parameter_groups(model, cfg.optimizer)
    fused = True if fused is None else bool(fused)
    target = spec["_target_"]
    return pure_optimizers.build_pure(target, settings, params, cfg, fused, captured, device.type)


# keys of the optimizer group that are mpexp's own, not arguments of the optimizer
OWN_OPTIMIZER_KEYS = ("decay_norms_and_biases",)


def optimizer_spec(optimizer_cfg) -> dict:
    """The `optimizer` group's config as the optimizer's constructor takes it."""
    return {k: v for k, v in to_dict(optimizer_cfg).items() if k not in OWN_OPTIMIZER_KEYS}


def parameter_groups(model: nn.Module, optimizer_cfg) -> list:
    """The model's parameters, in one group; with `optimizer.decay_norms_and_biases=false`, in
    two: matrices and embeddings with the configured weight decay, and 1-D parameters (biases,
    LayerNorm and BatchNorm gains) without. Transformer practice since GPT-2: decay pulls a
    norm's gain towards 0, which scales a whole layer's output rather than regularising it."""
    params = [p for p in model.parameters() if p.requires_grad]
    if optimizer_cfg.get("decay_norms_and_biases", True):
        return params
    groups = [
        {"params": [p for p in params if p.ndim >= 2]},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def _zero_momentum(optimizer) -> None:
    """Give fused SGD its momentum buffers before the first step.

    Fused SGD makes them with `empty_like` at its first step and its kernel returns early on a
    skipped step, so a first step skipped for an overflow (fp16 from a high initial scale) would
    leave uninitialised memory as the momentum that the next step applies. Zeros give the same
    numbers as torch's own first step (the buffer becomes the gradient) when dampening is 0."""
    if not isinstance(optimizer, torch.optim.SGD):
        return
    for group in optimizer.param_groups:
        if group["momentum"] and not group["dampening"]:
            for p in group["params"]:
                optimizer.state[p].setdefault("momentum_buffer", torch.zeros_like(p))


def memory_format(channels_last: bool) -> torch.memory_format:
    return torch.channels_last if channels_last else torch.contiguous_format


def apply_memory_format(model: nn.Module, speed: Speed) -> None:
    """NHWC weights when asked; done before DDP/FSDP wrap the parameters."""
    if speed.channels_last:
        model.to(memory_format=torch.channels_last)


def compile_model(model: nn.Module, speed: Speed) -> nn.Module:
    """The module the loop should call: `model` itself, or its compiled wrapper.

    Keep using `model` for its weights (state_dict, parameter names), which compilation prefixes.
    Compilation itself happens at the first forward pass (see mpexp.step.step_graph).
    """
    if not speed.compile:
        return model
    # shapes static: a batch of a new shape compiles a graph of its own rather than one for any
    # batch size (validation pads its last batch to the full size, mpexp.step.validation.evaluate)
    return torch.compile(model, mode=speed.compile_mode, dynamic=False)


class UnitCompilation:
    """Modules compiled one by one: under FSDP2 each unit (a GPT's block) is compiled before it is
    sharded, as torchtitan compiles its blocks, since the whole model compiled would break its
    graph at every unit's FSDP hooks. Each unit's forward pass is replaced by its compiled
    version, so the hooks around it stay eager; `undo` puts the eager ones back (a model that
    cannot be compiled trains eagerly)."""

    def __init__(self, speed: Speed):
        self.speed = speed
        # each unit, and the forward pass of its own it had (fp32_modules' wrapper), if any
        self.eager: list[tuple[nn.Module, object]] = []

    def __call__(self, unit: nn.Module) -> None:
        self.eager.append((unit, vars(unit).get("forward")))
        # shapes static, as compile_model's
        unit.forward = torch.compile(unit.forward, mode=self.speed.compile_mode, dynamic=False)

    def undo(self) -> None:
        for unit, own in self.eager:
            if own is None:
                del unit.forward  # the class's forward again
            else:
                unit.forward = own
        self.eager = []


class Compilations:
    """Counts and times what torch.compile compiles while it is entered, wherever that happens:
    a training step, a batch of a new shape, the first validation (a graph of its own, in eval
    mode without gradients), a backward pass compiled at its first call.

    Read on the host from TorchDynamo's compile callbacks, with no synchronisation: the time is
    the compiler's own, which runs on the host."""

    def __init__(self) -> None:
        self.count = 0  # compilations started
        self.seconds = 0.0  # their time, those finished
        self._began = 0.0

    def __enter__(self) -> Compilations:
        # imported by a compiled run only (torch.compile has imported it by then): TorchDynamo
        # takes a second or more to import, which an eager run never pays
        from torch._dynamo.callback import callback_handler

        callback_handler.register_start_callback(self._start)
        callback_handler.register_end_callback(self._end)
        return self

    def __exit__(self, *exc) -> None:
        from torch._dynamo.callback import callback_handler  # imported by __enter__

        callback_handler.remove_start_callback(self._start)
        callback_handler.remove_end_callback(self._end)

    # torch before 2.8 calls these without arguments, later ones with a CallbackArgs
    def _start(self, *_) -> None:
        # TorchDynamo calls these around the outermost compilation only: never nested
        self.count += 1
        self._began = time.perf_counter()

    def _end(self, *_) -> None:
        self.seconds += time.perf_counter() - self._began


def describe(optimizer, speed: Speed) -> dict:
    """The speed settings that ran, for the run record."""
    pure = isinstance(optimizer, pure_optimizers.PureOptimizer)
    return {
        "fused_optimizer": bool(optimizer.defaults.get("fused")),
        "optimizer_kernel": optimizer_kernel(optimizer),
        **({"pure_update": optimizer.update_path} if pure else {}),
        "channels_last": speed.channels_last,
        "compile": speed.compile_mode if speed.compile else False,
        "cuda_graph": speed.cuda_graph,
        "cuda_graph_off": speed.graph_off,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
    }


def step_path(ran: dict) -> str:
    """How the training step ran, in words the sweep report compares across precisions: two
    legs whose paths differ are timing the harness as much as the precision."""
    kernel = ran.get("optimizer_kernel")
    parts = [
        f"{kernel} optimizer" if kernel else "fused" if ran.get("fused_optimizer") else "unfused",
        "compiled" if ran.get("compile") else "eager",
        "captured" if ran.get("cuda_graph") else "not captured",
    ]
    if ran.get("schedule", "none") != "none":
        parts.append(f"schedule on the {ran['schedule']}")
    return ", ".join(parts)


def describe_step(speed: Speed) -> str:
    """How the training step runs, for the run's first line."""
    how = "compiled" if speed.compile else "eager"
    if speed.cuda_graph:
        return f"step {how}, captured as one CUDA graph"
    if speed.graph_off is None or speed.graph_off == "no CUDA device":
        return f"step {how}"  # a CPU's step: never a graph, nothing to explain
    return f"step {how}, no CUDA graph ({speed.graph_off})"
