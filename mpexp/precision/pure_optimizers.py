"""The optimizers of pure bf16: Adam, AdamW and SGD stepping bfloat16 weights with bfloat16
gradients and 16-bit (or float32) states, the float32 arithmetic done a chunk at a time.

A step never holds a float32 copy of the model. Each parameter is walked in chunks of `chunk`
elements; a chunk of the weight, its gradient and its states is upcast into a workspace that
every chunk of the step reuses, stepped in float32 by torch's own arithmetic (its fused kernel,
`_fused_adam_` and friends, or the op-by-op formula of its single-tensor path with
`optimizer.fused=false`), and rounded back as `precision.update_rounding` says. So the step's
peak is the bytes held between steps plus the workspace: 8 bytes a parameter for Adam (2 each
for the weight, its gradient and the two moments), 10 with Kahan's buffer; with
`precision.optimizer_states=float32`, 12 and 14. Under round-to-nearest with bfloat16 states a
step that counts nothing skips the chunks: torch's fused kernel steps the bf16 tensors whole,
with the same float32 arithmetic and rounding.

The rounding is part of the update, whatever the diagnostics say: `count=False`
(`diagnostics.updates_lost=false`) only skips the count of lost updates, which is otherwise
summed on the device in the same pass (two nonzero counts a chunk), on the last step of each
`count_every`, and read at the metrics flush.

The states keep torch's names (`step`, `exp_avg`, `exp_avg_sq`, `momentum_buffer`) and the
optimizer's state dict torch's layout, plus `kahan_compensation` per parameter under Kahan and
the generator's state under stochastic rounding: a checkpoint of the earlier hook-based update
(torch's optimizer with mpexp's hooks) loads here, and the reverse.
"""

from __future__ import annotations

import logging

import torch

from mpexp.precision.pure_updates import (
    COMPENSATION,
    COUNTS,
    GENERATOR,
    GRAPH_GENERATORS,
    STEPS,
    StochasticScratch,
    UpdatesLost,
    round_stochastic,
)
from mpexp.shards import local_shard

log = logging.getLogger(__name__)

# elements per chunk: few enough that the workspace is small against a model worth pure bf16
# (at most 160 MiB on a CPU), many enough that the chunks' operators, each a parallel region on
# a CPU and a kernel launch on a GPU, do not dominate: on a busy 2-core CPU, 1 Mi-element chunks
# made a 36.8 M-parameter Kahan step wait on its threads for seconds (docs/benchmarks.md)
CPU_CHUNK = 1 << 22
CUDA_CHUNK = 1 << 24
TEMPORARY_BYTES = 40  # per chunk element, at most, that a step's temporaries take


def has_fused_kernel(name: str, device: torch.device) -> bool:
    """Whether torch has the fused update kernel `name` (`_fused_adam_`, ...) for `device`:
    on CUDA since torch 2.0, on a CPU since 2.4; tried once, as torch says so only by raising."""
    kernel = getattr(torch, name, None)
    if kernel is None:
        return False
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


class PureOptimizer(torch.optim.Optimizer):
    """What Adam and SGD share: the chunked walk, the rounding, the count and the state dict.

    `rounding` is nearest, kahan or stochastic; `states` the dtype of the states between steps;
    `fused` whether torch's fused kernel does the float32 arithmetic (it also takes GradScaler's
    overflow flag on the device, so that a skipped step needs no host read)."""

    kernel = ""  # the name of torch's fused kernel for this algorithm
    moments: tuple[str, ...] = ()  # the state keys shaped like their parameter

    def __init__(
        self,
        params,
        defaults: dict,
        rounding: str = "nearest",
        states: torch.dtype = torch.bfloat16,
        fused: bool = True,
        seed: int = 0,
        count: bool = True,
        count_every: int = 1,
        chunk: int | None = None,
    ) -> None:
        super().__init__(params, {**defaults, "fused": fused})
        self.rounding = rounding
        self.states_dtype = states
        self.fused = fused
        # GradScaler hands a fused step its overflow flag instead of reading it on the host
        self._step_supports_amp_scaling = fused
        self.params = [p for group in self.param_groups for p in group["params"]]
        device = self.params[0].device
        self.chunk = chunk or (CUDA_CHUNK if device.type == "cuda" else CPU_CHUNK)
        self.generator = None
        if rounding == "stochastic":
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(seed)
            if device.type == "cuda":
                GRAPH_GENERATORS.add(self.generator)
        self.lost = UpdatesLost(len(self.params), device) if count else None
        # the count's steps: the last of each `count_every` (a log interval's, whose flush reads
        # it); the others need no float32 result, and under round-to-nearest with bfloat16
        # states skip the chunks: torch's fused kernel steps the bf16 tensors themselves, with
        # the same float32 arithmetic and rounding
        self.count_every = count_every
        self.steps_taken = 0  # on the host: which steps count is known without a device read
        # how the diagnostics find the counts (`params`, `lost`): none to find when not counting
        self.pure_updates = self if count else None

    # --- the step ------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None)  # set by GradScaler.step (fused only)
        found_inf = getattr(self, "found_inf", None)
        self.steps_taken += 1
        counting = self.lost is not None and self.steps_taken % self.count_every == 0
        whole = not counting and self.fused and self.rounding == "nearest"
        whole = whole and self.states_dtype == torch.bfloat16
        index = 0
        self._workspace = None if whole else self._make_workspace()
        for group in self.param_groups:
            stepped = []
            for p in group["params"]:
                if p.grad is not None:
                    first = not self.state[p]
                    if first:
                        self._init_state(p, self.state[p], group)
                    if whole:
                        stepped.append(p)
                    else:
                        self._step_param(index, p, group, first, counting, grad_scale, found_inf)
                index += 1
            if stepped:
                self._step_whole(stepped, group, grad_scale, found_inf)
        self._workspace = None  # freed between steps: held bytes are the states' only
        return loss

    def _make_workspace(self) -> Workspace:
        """The buffers every chunk of this step reuses: as large as the largest chunk (a
        parameter whose tensors do not share one contiguous layout is one chunk, whole)."""
        sizes = [1]
        for p in self.params:
            if p.grad is not None:
                local = local_shard(p.detach())
                whole = not (local.is_contiguous() and local_shard(p.grad).is_contiguous())
                sizes.append(local.numel() if whole else min(local.numel(), self.chunk))
        sixteen = self.states_dtype != torch.float32
        return Workspace(
            max(sizes),
            self.params[0].device,
            len(self.moments) if sixteen else 0,
            self.rounding == "kahan",
            self.generator is not None,
        )

    def _step_whole(self, params, group, grad_scale, found_inf) -> None:
        """torch's fused kernel over the group's bf16 weights, gradients and states at once."""
        states = [self.state[p] for p in params]
        steps = [s["step"] for s in states if "step" in s]
        weights = [local_shard(p.detach()) for p in params]
        grads = [local_shard(p.grad) for p in params]
        moments = [[local_shard(s[k]) for s in states if k in s] for k in self.moments]
        if steps:
            torch._foreach_add_(steps, 1)
        self._fused(weights, grads, moments, steps, group, grad_scale, found_inf)
        if steps and found_inf is not None:
            torch._foreach_sub_(steps, [found_inf] * len(steps))  # skipped: as torch's fused

    def _step_param(self, index, p, group, first, counting, grad_scale, found_inf) -> None:
        """One parameter, a chunk at a time, in float32."""
        state = self.state[p]
        step = state.get("step")
        if step is not None:
            step += 1
        weight, grad = local_shard(p.detach()), local_shard(p.grad)
        moments = [local_shard(state[k]) for k in self.moments if k in state]
        compensation = local_shard(state[COMPENSATION]) if self.rounding == "kahan" else None
        scalars = self._scalars(group, step)
        ws = self._workspace
        for chunk in _chunks([weight, grad, *moments, compensation], self.chunk):
            w16, g16, *m16, c16 = chunk
            w, g = ws.take(ws.w, w16), ws.take(ws.g, g16)
            # float32 states are stepped in place; 16-bit ones in the workspace
            m = [t if t.dtype == torch.float32 else ws.take(ws.m[i], t) for i, t in enumerate(m16)]
            self._update(w, g, m, step, group, scalars, first, grad_scale, found_inf)
            if counting:  # before Kahan's rounding, which reuses `w`
                moved = torch.count_nonzero(torch.sub(w, w16, out=ws.view(ws.tmp, w)))
            new = self._round_weight(w, w16, c16, found_inf, ws)
            if counting:
                changed = torch.sub(new, w16, out=ws.view(ws.changed, w16))
                self.lost.add(index, moved, torch.count_nonzero(changed))
            w16.copy_(new)
            for stored, value in zip(m16, m, strict=True):
                if value is not stored:
                    self._round_state(value, stored, ws)
        if step is not None and found_inf is not None:
            step -= found_inf  # a skipped step counts for nothing, as torch's fused step

    def _round_weight(self, w, w16, c16, found_inf, ws: Workspace) -> torch.Tensor:
        """The float32 result `w` as the weight's dtype stores it (in the workspace)."""
        new = ws.view(ws.new, w16)
        if self.rounding == "stochastic":
            return round_stochastic(w, self.generator, new, ws.scratch)
        if self.rounding != "kahan":
            return new.copy_(w)  # round to nearest
        # optimi's order: the update wanted plus what earlier roundings lost, added to the
        # stored weight; what this rounding loses in turn is kept for the next step
        old, carried = ws.take(ws.old, w16), ws.take(ws.carried, c16)
        wanted = w.sub_(old)
        if found_inf is None:
            wanted.add_(carried)
        else:  # a skipped step (the kernel left `w` at `old`) adds nothing, not even the buffer
            wanted.add_(carried * (1 - found_inf))
        total = torch.add(old, wanted, out=ws.view(ws.tmp, w))
        new.copy_(total)
        wanted.sub_(total.copy_(new).sub_(old))  # what the rounding left out
        if found_inf is not None:  # and leaves the buffer as it was
            wanted.add_(carried.mul_(found_inf))
        c16.copy_(wanted)
        return new

    def _round_state(self, value: torch.Tensor, stored: torch.Tensor, ws: Workspace) -> None:
        if self.generator is not None:
            # stochastic states keep moving where round-to-nearest would freeze them
            round_stochastic(value, self.generator, stored, ws.scratch)
        else:
            stored.copy_(value)  # round to nearest

    def _init_state(self, p: torch.Tensor, state: dict, group: dict) -> None:
        raise NotImplementedError

    def _scalars(self, group: dict, step: torch.Tensor | None):
        return None

    def _update(self, w, g, m, step, group, scalars, first, grad_scale, found_inf) -> None:
        raise NotImplementedError

    def _fused(self, ws, gs, moments, steps, group, grad_scale, found_inf) -> None:
        """torch's fused kernel on lists of tensors (`moments`: a list per state key)."""
        raise NotImplementedError

    def step_temporary_bytes(self) -> int:
        """A bound on what a step allocates besides the weights, gradients and states: a dozen
        float32 and bfloat16 temporaries of one chunk, at most 40 bytes an element (28 to 34
        measured: tests/test_pure_update.py)."""
        largest = max(p.numel() for p in self.params)
        return TEMPORARY_BYTES * min(self.chunk, largest)

    # --- the state dict ------------------------------------------------------------------------

    def rank_state(self) -> dict:
        """What is this rank's own besides its states: the generator, the open window's counts,
        the step count. A sharded (FSDP) checkpoint keeps it in each rank's file of random
        generators, as torch's sharded optimizer state dict holds per-parameter states only."""
        state: dict = {STEPS: self.steps_taken}
        if self.generator is not None:
            state[GENERATOR] = self.generator.get_state()
        if self.lost is not None:
            state[COUNTS] = self.lost.counts.clone()
        return state

    def load_rank_state(self, state: dict) -> None:
        self.steps_taken = int(state[STEPS])
        if self.generator is not None and GENERATOR in state:
            self.generator.set_state(state[GENERATOR])
        if self.lost is not None and COUNTS in state:
            self.lost.counts.copy_(state[COUNTS])

    def state_dict(self) -> dict:
        state_dict = super().state_dict()
        if self.generator is not None:
            state_dict[GENERATOR] = self.generator.get_state()
        if self.lost is not None:  # the counts of a window that a stop left open
            state_dict[COUNTS] = self.lost.counts.clone()
        state_dict[STEPS] = self.steps_taken
        return state_dict

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load, which would cast every floating state to its parameter's dtype, then the
        states in the dtype this run keeps them in, the step counts on the parameters' device,
        and the generator where this run has one."""
        state_dict = dict(state_dict)
        saved_generator = state_dict.pop(GENERATOR, None)
        saved_counts = state_dict.pop(COUNTS, None)
        steps_taken = state_dict.pop(STEPS, None)
        super().load_state_dict(state_dict)
        if steps_taken is None:  # the hook-based update's checkpoint: Adam's count says it
            counts = [s["step"] for s in state_dict["state"].values() if "step" in s]
            steps_taken = int(counts[0].item()) if counts else 0  # one read, at the resume
        self.steps_taken = steps_taken
        if self.lost is not None and saved_counts is not None:
            self.lost.counts.copy_(saved_counts)
        for index, p in enumerate(self.params):  # numbered from 0, group after group
            saved = state_dict["state"].get(index, {})
            state = self.state[p]
            for key, value in saved.items():
                if key == "step":
                    state[key] = value.to(device=p.device, dtype=torch.float32)
                elif key == COMPENSATION:
                    state[key] = value.to(device=p.device, dtype=p.dtype)
                elif key in self.moments:
                    state[key] = value.to(device=p.device, dtype=self.states_dtype)
            if self.rounding == "kahan" and state and COMPENSATION not in state:
                state[COMPENSATION] = torch.zeros_like(p)  # from a nearest or stochastic run
        if self.generator is not None and saved_generator is not None:
            self.generator.set_state(saved_generator)


def _zeros(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A state of `p`'s shape and layout in `dtype`, zeroed."""
    return torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)


def _kahan(p: torch.Tensor, state: dict, rounding: str) -> None:
    """Kahan's compensation buffer for `p`, in its dtype, where the rounding keeps one."""
    if rounding == "kahan":
        state[COMPENSATION] = torch.zeros_like(p, memory_format=torch.preserve_format)


class PureAdam(PureOptimizer):
    """Adam (`decoupled=True`: AdamW) on bf16 weights; torch's hyperparameters and state keys."""

    kernel = "_fused_adam_"
    moments = ("exp_avg", "exp_avg_sq")

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

    def _init_state(self, p: torch.Tensor, state: dict, group: dict) -> None:
        state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        state["exp_avg"] = _zeros(p, self.states_dtype)
        state["exp_avg_sq"] = _zeros(p, self.states_dtype)
        _kahan(p, state, self.rounding)

    def _scalars(self, group: dict, step: torch.Tensor | None):
        if self.fused:
            return None
        # torch's single-tensor Adam reads the count on the host and works in Python floats
        beta1, beta2 = group["betas"]
        count = max(step.item(), 1)  # mpexp-plan's fake tensors read as 0
        lr = group["lr"].item() if isinstance(group["lr"], torch.Tensor) else group["lr"]
        step_size = lr / (1 - beta1**count)
        return lr, step_size, (1 - beta2**count) ** 0.5

    def _fused(self, ws, gs, moments, steps, group, grad_scale, found_inf) -> None:
        beta1, beta2 = group["betas"]
        getattr(torch, self.kernel)(
            ws, gs, *moments, [], steps, lr=group["lr"], beta1=beta1, beta2=beta2,
            weight_decay=group["weight_decay"], eps=group["eps"], amsgrad=False, maximize=False,
            grad_scale=grad_scale, found_inf=found_inf,
        )  # fmt: skip

    def _update(self, w, g, m, step, group, scalars, first, grad_scale, found_inf) -> None:
        if self.fused:
            self._fused([w], [g], [[t] for t in m], [step], group, grad_scale, found_inf)
            return
        exp_avg, exp_avg_sq = m
        beta1, beta2 = group["betas"]
        wd, eps = group["weight_decay"], group["eps"]
        lr, step_size, correction2 = scalars
        if wd != 0:
            if self.decoupled:
                w.mul_(1 - lr * wd)
            else:
                g = g.add(w, alpha=wd)
        exp_avg.lerp_(g, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (exp_avg_sq.sqrt() / correction2).add_(eps)
        w.addcdiv_(exp_avg, denom, value=-step_size)


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

    def _init_state(self, p: torch.Tensor, state: dict, group: dict) -> None:
        if group["momentum"] != 0:
            # zeros before the first step, as mpexp gives torch's fused SGD (its first step then
            # stores (1 - dampening) * g); the unfused formula stores g, as torch's does
            state["momentum_buffer"] = _zeros(p, self.states_dtype)
        _kahan(p, state, self.rounding)

    def _fused(self, ws, gs, moments, steps, group, grad_scale, found_inf) -> None:
        (buffers,) = moments if moments else ([],)
        torch._fused_sgd_(
            ws, gs, buffers, weight_decay=group["weight_decay"], momentum=group["momentum"],
            lr=group["lr"], dampening=group["dampening"], nesterov=group["nesterov"],
            maximize=False, is_first_step=False, grad_scale=grad_scale, found_inf=found_inf,
        )  # fmt: skip

    def _update(self, w, g, m, step, group, scalars, first, grad_scale, found_inf) -> None:
        lr, wd, momentum = group["lr"], group["weight_decay"], group["momentum"]
        if self.fused:
            self._fused([w], [g], [[t] for t in m], [], group, grad_scale, found_inf)
            return
        lr = lr.item() if isinstance(lr, torch.Tensor) else lr
        if wd != 0:
            g = g.add(w, alpha=wd)
        if momentum != 0:
            (buf,) = m
            if first:
                buf.copy_(g)
            else:
                buf.mul_(momentum).add_(g, alpha=1 - group["dampening"])
            g = g.add(buf, alpha=momentum) if group["nesterov"] else buf
        w.add_(g, alpha=-lr)


class Workspace:
    """The buffers one step's chunks share, so that no chunk allocates: float32 copies of the
    weight, gradient and 16-bit states, a temporary, the rounded weight and its difference
    (bfloat16), Kahan's two float32 copies, stochastic rounding's integers. Allocated once a
    step: a CPU's allocator would otherwise hand a chunk's megabytes back to the system and
    fault them in again for the next."""

    def __init__(
        self, size: int, device: torch.device, moments: int, kahan: bool, stochastic: bool
    ) -> None:
        def buffer(dtype=torch.float32):
            return torch.empty(size, dtype=dtype, device=device)

        self.w, self.g, self.tmp = buffer(), buffer(), buffer()
        self.m = [buffer() for _ in range(moments)]
        self.new, self.changed = buffer(torch.bfloat16), buffer(torch.bfloat16)
        self.old = self.carried = None
        if kahan:
            self.old, self.carried = buffer(), buffer()
        self.scratch = StochasticScratch(size, device) if stochastic else None

    @staticmethod
    def view(buffer: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """The start of `buffer`, shaped as `like`."""
        return buffer[: like.numel()].view(like.shape)

    def take(self, buffer: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """`source` copied (upcast) into the start of `buffer`."""
        return self.view(buffer, source).copy_(source)


def _chunks(tensors: list[torch.Tensor | None], size: int):
    """Matching pieces of a parameter's tensors (None stays None): flat slices of `size`
    elements where all share one contiguous layout, else each tensor whole."""
    present = [t for t in tensors if t is not None]
    if not all(t.is_contiguous() for t in present):
        yield tensors
        return
    flat = [None if t is None else t.view(-1) for t in tensors]
    numel = present[0].numel()
    for start in range(0, numel, size):
        yield [None if t is None else t[start : start + size] for t in flat]


# torch's optimizers that pure bf16 steps with its own (mpexp/validate.py refuses the
# settings these do not take)
PURE_OPTIMIZERS = {
    "torch.optim.Adam": (PureAdam, {"decoupled": False}),
    "torch.optim.AdamW": (PureAdam, {"decoupled": True}),
    "torch.optim.SGD": (PureSGD, {}),
}


def build_pure(
    target: str, settings: dict, params, cfg, fused: bool, captured: bool = False, chunk: int = 0
) -> PureOptimizer:
    """Pure bf16's optimizer for the `optimizer` group's `target` (torch.optim.Adam, AdamW,
    SGD) with its `settings`, rounding as `cfg.precision` says and counting lost updates unless
    `diagnostics.updates_lost=false` (which changes nothing else): on the last step of each
    `trainer.log_every`, or on every step of one `captured` in a CUDA graph, whose replays all
    run the same kernels. `chunk`: the training device's (0: the parameters' device's)."""
    cls, fixed = PURE_OPTIMIZERS[target]
    p = cfg.precision
    states = torch.float32 if p.optimizer_states == "float32" else torch.bfloat16
    rounding = str(p.update_rounding)
    if fused and not has_fused_kernel(cls.kernel, _device_of(params)):
        log.warning(
            "optimizer.fused=true: this torch (%s) has no fused %s kernel on %s; pure bf16's "
            "update runs the op-by-op formula instead (recorded as fused: false).",
            torch.__version__,
            target.rpartition(".")[2],
            _device_of(params),
        )
        fused = False
    kwargs = dict(settings)
    optimizer = cls(
        params,
        **kwargs,
        **fixed,
        rounding=rounding,
        states=states,
        fused=fused,
        seed=cfg.trainer.seed + _shard_rank(cfg),
        count=cfg.diagnostics.get("updates_lost") is not False,
        count_every=1 if captured else int(cfg.trainer.log_every),
        chunk=chunk,
    )
    if cls is PureAdam:
        warn_frozen_second_moment(rounding, states, float(kwargs.get("betas", (0.9, 0.999))[1]))
    return optimizer


def _shard_rank(cfg) -> int:
    """This rank's number under FSDP, whose ranks round shards of their own and so draw from
    streams of their own; 0 otherwise (DDP's replicas must round alike to stay equal)."""
    if cfg.trainer.strategy != "fsdp" or not torch.distributed.is_initialized():
        return 0
    return torch.distributed.get_rank()


def _device_of(params) -> torch.device:
    first = params[0]
    return (first["params"][0] if isinstance(first, dict) else first).device


def warn_frozen_second_moment(rounding: str, states: torch.dtype, beta2: float) -> None:
    """16-bit states rounded to nearest with beta2 above 0.99: each step multiplies Adam's second
    moment v by beta2, a change of less than half of bfloat16's step (2^-8 of v) once 1 - beta2
    is below 2^-8 (0.0039), so v stays where its first steps put it."""
    if states != torch.bfloat16 or rounding == "stochastic" or beta2 <= 0.99:
        return
    log.warning(
        "precision=bf16_pure with bfloat16 optimizer states rounded to nearest and Adam's "
        "beta2=%g: each step's decay of the second moment (a factor %g) is smaller than "
        "bfloat16's resolution, so the second moment stops moving after its first steps (under a "
        "constant gradient of 1 it stays at 0.25 where float32 reaches 0.63 after 1000 steps) "
        "and Adam's steps keep the size they had then. Use precision.update_rounding=stochastic "
        "(states rounded stochastically too) or precision.optimizer_states=float32.",
        beta2,
        beta2,
    )
