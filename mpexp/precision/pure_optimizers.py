"""The optimizers of pure bf16: Adam, AdamW and SGD stepping bfloat16 weights with bfloat16
gradients and 16-bit (or float32) states, in float32 (mpexp/precision/pure_step.py says how),
each with torch's own arithmetic: its fused kernel, or with `optimizer.fused=false` the formula
of its single-tensor step, bit for bit; and `build_pure`, which builds one from a run's config.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from mpexp.precision.pure_compiled import compile_setting
from mpexp.precision.pure_layout import zeroed_counts, zeroed_like
from mpexp.precision.pure_step import Lists, PureOptimizer, default_chunk
from mpexp.precision.pure_updates import COMPENSATION
from mpexp.precision.pure_warnings import warn_stalled_states

log = logging.getLogger(__name__)


def has_fused_kernel(name: str, device: torch.device) -> bool:
    """Whether torch has the fused update kernel `name` (`_fused_adam_`, ...) for `device`:
    on CUDA since torch 2.0, on a CPU since 2.4; tried once, as torch says so only by raising."""
    kernel = getattr(torch, name, None)
    if kernel is None:
        return False
    with _real_tensors():  # a fake tensor's kernel would run wherever a shape rule exists
        return _runs(kernel, name, device)


def _real_tensors():
    """Real tensors even inside a plan's FakeTensorMode (torch 2.4 and later say how)."""
    try:
        from torch._subclasses.fake_tensor import unset_fake_temporarily
    except ImportError:
        return contextlib.nullcontext()
    return unset_fake_temporarily()


def _runs(kernel, name: str, device: torch.device) -> bool:
    one = torch.zeros(1, device=device)
    try:
        if name == "_fused_sgd_":
            kernel([one], [one.clone()], [], weight_decay=0.0, momentum=0.0, lr=0.0,
                   dampening=0.0, nesterov=False, maximize=False, is_first_step=False)  # fmt: skip
        else:
            kernel([one], [one.clone()], [one.clone()], [one.clone()], [], [one.clone()],
                   lr=0.0, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8,
                   amsgrad=False, maximize=False)  # fmt: skip
    except (RuntimeError, NotImplementedError):
        return False
    return True


def _float_lr(group: dict) -> float:
    """The unfused formula's learning rate: a float, as torch's single-tensor step needs one on
    the host; a tensor (a schedule on the device) would be a read every step, so it is refused
    and the schedule runs on the host instead (mpexp.step.schedules.takes_tensor_lr)."""
    lr = group["lr"]
    if isinstance(lr, torch.Tensor):
        raise TypeError("pure bf16's unfused update takes a float learning rate")
    return float(lr)


def _zeros(params: list[torch.Tensor], states: torch.dtype, rounding: str, keys, chunk: int):
    """Each parameter's zeroed states for `keys`, and Kahan's buffer where the rounding keeps
    one, in shared buffers (`zeroed_like`)."""
    made = [{} for _ in params]
    for key in keys:
        for state, zeros in zip(made, zeroed_like(params, states, chunk), strict=True):
            state[key] = zeros
    if rounding == "kahan":
        for state, zeros in zip(made, zeroed_like(params, params[0].dtype, chunk), strict=True):
            state[COMPENSATION] = zeros
    return made


class PureAdam(PureOptimizer):
    """Adam (`decoupled=True`: AdamW) on bf16 weights; torch's hyperparameters and state keys."""

    kernel = "_fused_adam_"
    moments = ("exp_avg", "exp_avg_sq")
    counted = True

    def __init__(
        self,
        params,
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        decoupled: bool = False,
        **pure,
    ) -> None:
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults, **pure)
        self.decoupled = decoupled
        if decoupled:
            self.kernel = "_fused_adamw_"

    def keys(self, group: dict) -> tuple[str, ...]:
        return self.moments

    def init_states(self, params: list[torch.Tensor], group: dict) -> None:
        made = _zeros(params, self.states_dtype, self.rounding, self.moments, self.chunk)
        counts = zeroed_counts(len(params), params[0].device)
        for p, state, count in zip(params, made, counts, strict=True):
            self.state[p] = {"step": count, **state}

    def arithmetic(self, t: Lists, group: dict, grad_scale, found_inf) -> None:
        beta1, beta2 = group["betas"]
        wd, eps = group["weight_decay"], group["eps"]
        exp_avg, exp_avg_sq = t.m
        if self.fused:
            getattr(torch, self.kernel)(
                t.w, t.g, exp_avg, exp_avg_sq, [], t.steps, lr=group["lr"], beta1=beta1,
                beta2=beta2, weight_decay=wd, eps=eps, amsgrad=False, maximize=False,
                grad_scale=grad_scale, found_inf=found_inf,
            )  # fmt: skip
            return
        # torch's single-tensor Adam, each operation over the lists; its bias corrections in
        # Python floats from each parameter's count of steps
        lr = _float_lr(group)
        if wd != 0:
            if self.decoupled:
                torch._foreach_mul_(t.w, 1 - lr * wd)
            else:
                torch._foreach_add_(t.g, t.w, alpha=wd)  # the gradient's buffer is a copy
        torch._foreach_lerp_(exp_avg, t.g, 1 - beta1)
        torch._foreach_mul_(exp_avg_sq, beta2)
        torch._foreach_addcmul_(exp_avg_sq, t.g, t.g, value=1 - beta2)
        denom = t.g  # read: its buffer takes the denominator
        torch._foreach_copy_(denom, exp_avg_sq)
        torch._foreach_sqrt_(denom)
        torch._foreach_div_(denom, [(1 - beta2 ** float(c)) ** 0.5 for c in t.counts])
        torch._foreach_add_(denom, eps)
        sizes = [-lr / (1 - beta1 ** float(c)) for c in t.counts]
        torch._foreach_addcdiv_(t.w, exp_avg, denom, sizes)


class PureSGD(PureOptimizer):
    """SGD (with momentum, dampening, Nesterov) on bf16 weights; torch's state key."""

    kernel = "_fused_sgd_"
    moments = ("momentum_buffer",)

    def __init__(
        self,
        params,
        lr: float | torch.Tensor = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        **pure,
    ) -> None:
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "dampening": dampening,
            "weight_decay": weight_decay,
            "nesterov": nesterov,
        }
        super().__init__(params, defaults, **pure)

    def keys(self, group: dict) -> tuple[str, ...]:
        return self.moments if group["momentum"] != 0 else ()

    def init_states(self, params: list[torch.Tensor], group: dict) -> None:
        # zeros before the first step, which then stores the gradient in them, as torch's
        # first step does (`is_first_step` of its fused kernel), whatever the dampening
        made = _zeros(params, self.states_dtype, self.rounding, self.keys(group), self.chunk)
        for p, state in zip(params, made, strict=True):
            self.state[p] = state

    def arithmetic(self, t: Lists, group: dict, grad_scale, found_inf) -> None:
        lr, wd, momentum = group["lr"], group["weight_decay"], group["momentum"]
        (buffers,) = t.m if t.m else ([],)
        if self.fused:
            for first, take in _by_first(t.first):
                torch._fused_sgd_(
                    take(t.w), take(t.g), take(buffers), weight_decay=wd, momentum=momentum,
                    lr=lr, dampening=group["dampening"], nesterov=group["nesterov"],
                    maximize=False, is_first_step=first and momentum != 0,
                    grad_scale=grad_scale, found_inf=found_inf,
                )  # fmt: skip
            return
        lr = _float_lr(group)
        if wd != 0:
            torch._foreach_add_(t.g, t.w, alpha=wd)  # the gradient's buffer is a copy
        update = t.g
        if momentum != 0:
            for first, take in _by_first(t.first):
                if first:
                    torch._foreach_copy_(take(buffers), take(t.g))
                else:
                    torch._foreach_mul_(take(buffers), momentum)
                    torch._foreach_add_(take(buffers), take(t.g), alpha=1 - group["dampening"])
            if group["nesterov"]:
                torch._foreach_add_(t.g, buffers, alpha=momentum)
            else:
                update = buffers
        torch._foreach_add_(t.w, update, alpha=-lr)


def _by_first(first: list[bool]):
    """(whether first, a function taking those entries of a list) for the entries stepped for
    the first time and the others; one pair when all are alike."""
    if all(f == first[0] for f in first):
        return [(bool(first and first[0]), lambda xs: xs)]
    split = []
    for flag in (True, False):
        chosen = [i for i, f in enumerate(first) if f == flag]
        split.append((flag, lambda xs, chosen=chosen: [xs[i] for i in chosen] if xs else xs))
    return split


# torch's optimizers that pure bf16 steps with its own (mpexp/validate.py refuses the
# settings these do not take)
PURE_OPTIMIZERS = {
    "torch.optim.Adam": (PureAdam, {"decoupled": False}),
    "torch.optim.AdamW": (PureAdam, {"decoupled": True}),
    "torch.optim.SGD": (PureSGD, {}),
}


def build_pure(
    target: str,
    settings: dict,
    params,
    cfg,
    fused: bool,
    captured: bool = False,
    device_type: str | None = None,
) -> PureOptimizer:
    """Pure bf16's optimizer for the `optimizer` group's `target` (torch.optim.Adam, AdamW,
    SGD) with its `settings`, rounding as `cfg.precision` says and counting lost updates unless
    `diagnostics.updates_lost=false` (which changes nothing else): on the last step of each
    `trainer.log_every`, or on every step of one `captured` in a CUDA graph, whose replays all
    run the same kernels. Its batches hold `precision.update_chunk` elements, by default as
    many as suit `device_type`, whose run it steps as (the parameters' device unless given: a
    plan for CUDA builds its optimizer on fake CPU tensors)."""
    cls, fixed = PURE_OPTIMIZERS[target]
    p = cfg.precision
    states = torch.float32 if p.optimizer_states == "float32" else torch.bfloat16
    rounding = str(p.update_rounding)
    device = _device_of(params)
    if fused and not has_fused_kernel(cls.kernel, device):
        log.warning(
            "optimizer.fused=true: this torch (%s) has no fused %s kernel on %s; pure bf16's "
            "update runs the op-by-op formula instead (recorded as fused: false).",
            torch.__version__,
            target.rpartition(".")[2],
            device,
        )
        fused = False
    device_type = device_type or device.type
    chunk = p.get("update_chunk") or default_chunk(device_type)
    compiled = compile_setting(p.get("update_compile"), fused, device, device_type)
    if compiled is None and cfg.trainer.strategy == "ddp":
        # DDP's replicas must step alike: a rank whose compilation failed would step eagerly,
        # rounding otherwise (stochastic rounding from another stream), and drift from the
        # others unseen; a failure stops the run instead, with the key that steps it eagerly
        compiled = True
    optimizer = cls(
        params,
        **settings,
        **fixed,
        rounding=rounding,
        states=states,
        fused=fused,
        seed=cfg.trainer.seed + _shard_rank(cfg),
        count=cfg.diagnostics.get("updates_lost") is not False,
        count_every=1 if captured else int(cfg.trainer.log_every),
        chunk=int(chunk),
        device_type=device_type,
        compiled=compiled,
    )
    warn_stalled_states(rounding, str(p.optimizer_states), _averages(cls, settings))
    return optimizer


def _averages(cls, settings: dict) -> list[tuple[str, str, float, float]]:
    """The optimizer's running averages: what each is, its beta's setting, beta, and its input
    under a constant gradient of 1 (mpexp/precision/pure_warnings.py)."""
    if cls is PureAdam:
        beta1, beta2 = (float(b) for b in settings.get("betas", (0.9, 0.999)))
        return [
            ("Adam's first moment", "beta1", beta1, 1.0),
            ("Adam's second moment", "beta2", beta2, 1.0),
        ]
    momentum = float(settings.get("momentum", 0.0))
    if momentum == 0:
        return []
    damped = 1 - float(settings.get("dampening", 0.0))
    return [("SGD's momentum buffer", "momentum", momentum, damped / (1 - momentum))]


def _shard_rank(cfg) -> int:
    """This rank's number under FSDP, whose ranks round shards of their own and so draw from
    streams of their own; 0 otherwise (DDP's replicas must round alike to stay equal)."""
    if cfg.trainer.strategy != "fsdp" or not torch.distributed.is_initialized():
        return 0
    return torch.distributed.get_rank()


def _device_of(params) -> torch.device:
    return _tensors(params)[0].device


def _tensors(params) -> list[torch.Tensor]:
    """The parameters, whether given as tensors or as groups."""
    if isinstance(params[0], dict):
        return [t for group in params for t in group["params"]]
    return list(params)
