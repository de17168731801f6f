"""What pure bf16's Adam and SGD share (mpexp/precision/pure_optimizers.py): the step, the
states and the state dict.

A step never holds a float32 copy of the model. The parameters are stepped in batches of pieces
(mpexp/precision/pure_layout.py) of at most `precision.update_chunk` elements: a batch's pieces
of the weights, gradients and 16-bit states are upcast into one float32 workspace
(mpexp/precision/pure_workspace.py), stepped by torch's own arithmetic over the lists of pieces
(its fused multi-tensor kernel, `_fused_adam_` and friends, or the op-by-op formula of its
single-tensor step with `optimizer.fused=false`, as `_foreach_*` operations), and rounded back as
`precision.update_rounding` says (mpexp/precision/pure_rounding.py). So the step's peak is the
bytes held between steps plus the workspace: 8 bytes a parameter for Adam (2 each for the
weight, its gradient and the two moments), 10 with Kahan's buffer; with
`precision.optimizer_states=float32`, 12 and 14; the workspace adds 8 to 24 bytes per chunk
element. Under round-to-nearest with bfloat16 states a step that counts nothing skips the
workspace: torch's fused kernel steps the bf16 tensors whole, with the same float32 arithmetic
and rounding.

The rounding is part of the update, whatever the diagnostics say: `count=False`
(`diagnostics.updates_lost=false`) only skips the count of lost updates, which is otherwise
summed on the device in the same pass, on the last step of each `count_every`, and read at the
metrics flush.

The states keep torch's names (`step`, `exp_avg`, `exp_avg_sq`, `momentum_buffer`) and the
optimizer's state dict torch's layout, plus `kahan_compensation` per parameter under Kahan and
the generator's state under stochastic rounding: a checkpoint of the earlier hook-based update
(torch's optimizer with mpexp's hooks) loads here, and the reverse. No step reads a value on the
host: the unfused formula's bias corrections come from the steps counted on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import is_fake

from mpexp.precision import pure_state
from mpexp.precision.pure_batches import Batches
from mpexp.precision.pure_compiled import CompiledUpdate
from mpexp.precision.pure_layout import side_by_side
from mpexp.precision.pure_rounding import load_states, store_states, store_weights
from mpexp.precision.pure_updates import (
    COUNTS,
    GENERATOR,
    GRAPH_GENERATORS,
    HOST_COUNTS,
    MADE,
    STEPS,
    UpdatesLost,
)
from mpexp.precision.pure_workspace import BatchViews
from mpexp.shards import local_shard

# elements a batch holds, by default: on a CPU, few enough that a batch's buffers stay in the
# caches between its dozen passes (larger batches made a 36.8 M-parameter Kahan step slower),
# many enough that the per-batch operators do not dominate; on a GPU, a few MiB against the
# hundreds a model worth pure bf16 holds (GPT-2 small: 0.4 bytes a parameter at most)
CPU_CHUNK = 1 << 18
CUDA_CHUNK = 1 << 21


def default_chunk(device_type: str) -> int:
    """`precision.update_chunk`'s default on a device of this type."""
    return CUDA_CHUNK if device_type == "cuda" else CPU_CHUNK


@dataclass
class Lists:
    """What one call of the arithmetic steps, as lists (one entry per tensor or piece): the
    weights, their gradients, each state key's tensors, Adam's step counts, whether each is
    stepped for the first time, and each one's steps counted on the host."""

    w: list[torch.Tensor]
    g: list[torch.Tensor]
    m: list[list[torch.Tensor]]
    steps: list[torch.Tensor]
    first: list[bool]
    counts: list[int]


class _Counts:
    """Step counts that do not lie side by side: the in-place add and subtract of one tensor
    through torch's foreach operations."""

    def __init__(self, counts: list[torch.Tensor]) -> None:
        self.counts = counts

    def add_(self, value) -> None:
        torch._foreach_add_(self.counts, value)

    def sub_(self, value: torch.Tensor) -> None:
        torch._foreach_sub_(self.counts, [value] * len(self.counts))


class PureOptimizer(torch.optim.Optimizer):
    """What Adam and SGD share (see the module's docstring).

    `rounding` is nearest, kahan or stochastic; `states` the dtype of the states between steps;
    `fused` whether torch's fused kernel does the float32 arithmetic (it also takes GradScaler's
    overflow flag on the device, so that a skipped step needs no host read); `chunk` the
    elements a batch holds (default: by the parameters' device, or `device_type`'s)."""

    kernel = ""  # the name of torch's fused kernel for this algorithm
    moments: tuple[str, ...] = ()  # every state key shaped like its parameter
    counted = False  # whether the states hold a step count (Adam's `step`)

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
        device_type: str | None = None,
        compiled: bool | None = False,
    ) -> None:
        super().__init__(params, {**defaults, "fused": fused})
        self.rounding = rounding
        self.states_dtype = states
        self.fused = fused
        # GradScaler hands a fused step its overflow flag instead of reading it on the host
        self._step_supports_amp_scaling = fused
        self.params = [p for group in self.param_groups for p in group["params"]]
        self._indices, first = [], 0
        for group in self.param_groups:
            self._indices.append(range(first, first + len(group["params"])))
            first += len(group["params"])
        device = self.params[0].device
        self.device_type = device_type or device.type  # what the workspace is sized and kept for
        self.chunk = int(chunk or default_chunk(self.device_type))
        self.generator = None
        if rounding == "stochastic":
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(seed)
            if device.type == "cuda":
                GRAPH_GENERATORS.add(self.generator)
        self.lost = UpdatesLost(len(self.params), device) if count else None
        # the count's steps: the last of each `count_every` (a log interval's, whose flush reads
        # it); the others need no float32 result, and under round-to-nearest with bfloat16
        # states skip the workspace: torch's fused kernel steps the bf16 tensors themselves
        self.count_every = count_every
        self.steps_taken = 0  # on the host: which steps count is known without a device read
        self.host_counts = [0] * len(self.params)  # each parameter's steps, for the formula
        self.made = [0] * len(self.params)  # the step (1 on) that made each one's states, or 0
        # how the diagnostics find the counts (`params`, `lost`): none to find when not counting
        self.pure_updates = self if count else None
        self.batches = Batches(self)
        self._step_counts: dict[int, tuple] = {}  # per group: its stepped, their counts (`_counts`)
        # the compiled update (mpexp/precision/pure_compiled.py): with `compiled` True the run
        # asked for it, None lets it be; never on fake tensors (a plan rehearses the eager step)
        self.compiles = compiled is not False and fused  # its bytes in the bound even so
        self.compiled_update = None
        if self.compiles and not is_fake(self.params[0]):
            self.compiled_update = CompiledUpdate(self, required=compiled is True)

    def keys(self, group: dict) -> tuple[str, ...]:
        """The state keys shaped like the parameter that this group's step keeps."""
        raise NotImplementedError

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
        fast, scaling = self.compiled_update, None
        if fast is not None:
            fast.begin_step()
            if grad_scale is not None or found_inf is not None:
                scaling = fast.scaling(grad_scale, found_inf)
        for index, group in enumerate(self.param_groups):
            stepped = [i for i in self._indices[index] if self.params[i].grad is not None]
            if not stepped:
                continue
            fresh = {i for i in stepped if not self.state[self.params[i]]}
            if fresh:
                self.init_states([self.params[i] for i in sorted(fresh)], group)
                self.forget_layouts()
                for i in fresh:
                    self.made[i] = self.steps_taken
            for i in stepped:
                self.host_counts[i] += 1
            steps = self._counts(index, stepped) if self.counted else None
            if steps is not None:
                steps.add_(1)
            if whole:
                self.arithmetic(self._whole(stepped, group, fresh), group, grad_scale, found_inf)
                if self.lost is not None and self.batches.kept and self.batches.workspace is None:
                    # made now rather than at the first count: a CPU's step holds it from its
                    # first on, as a plan rehearsing the first steps sees
                    self.batches.of(index, stepped, group)
            else:
                for views in self.batches.of(index, stepped, group):
                    taken = fast is not None and fast.step(
                        views, index, group, fresh, counting, scaling
                    )
                    if not taken:
                        self._step_batch(views, group, fresh, counting, grad_scale, found_inf)
            if steps is not None and found_inf is not None:
                steps.sub_(found_inf)  # a skipped step is not counted, as torch's fused step
        self.batches.after_step()
        if self.compiled_update is not None:
            self.compiled_update.after_step()
        return loss

    def forget_layouts(self) -> None:
        """Forget what was made of where the states lie (they were made or loaded anew)."""
        self.batches.clear()
        self._step_counts.clear()

    def _counts(self, index: int, stepped: list[int]):
        """Group `index`'s step counts of the parameters `stepped`, as something one in-place
        add or subtract updates: one flat tensor where they lie side by side (as
        `init_states` makes them), else their list through torch's foreach operations."""
        cached = self._step_counts.get(index)
        if cached is None or cached[0] != stepped:
            counts = [self.state[self.params[i]]["step"] for i in stepped]
            run = side_by_side(counts)
            cached = (list(stepped), run if run is not None else _Counts(counts))
            self._step_counts[index] = cached
        return cached[1]

    def _whole(self, stepped: list[int], group: dict, fresh: set[int]) -> Lists:
        """The group's bf16 tensors themselves, for torch's fused kernel."""
        params = [self.params[i] for i in stepped]
        states = [self.state[p] for p in params]
        return Lists(
            w=[local_shard(p.detach()) for p in params],
            g=[local_shard(p.grad) for p in params],
            m=[[local_shard(s[k]) for s in states] for k in self.keys(group)],
            steps=[s["step"] for s in states] if self.counted else [],
            first=[i in fresh for i in stepped],
            counts=[self.host_counts[i] for i in stepped],
        )

    def _step_batch(self, views: BatchViews, group, fresh, counting, grad_scale, found_inf):
        """One batch: upcast, torch's arithmetic in float32, rounded back."""
        ws = self.batches.workspace
        keys = self.keys(group)
        sixteen = self.states_dtype != torch.float32
        torch._foreach_copy_(views.w, views.weights)
        torch._foreach_copy_(views.g, views.grads())
        if sixteen:
            load_states(views, ws, keys)
        if self.rounding == "kahan" or counting:
            views.flat(ws.old).copy_(views.flat(ws.w))
        lists = Lists(
            w=views.w,
            g=views.g,
            m=[views.m[k] for k in keys],
            steps=views.steps,
            first=[i in fresh for i in views.owners],
            counts=[self.host_counts[i] for i in views.owners],
        )
        self.arithmetic(lists, group, grad_scale, found_inf)
        if sixteen:
            store_states(views, ws, keys, self.generator)
        lost = self.lost if counting else None
        store_weights(self.rounding, views, ws, self.generator, lost, found_inf)

    def arithmetic(self, t: Lists, group: dict, grad_scale, found_inf) -> None:
        """torch's float32 arithmetic over the lists, in place."""
        raise NotImplementedError

    def init_states(self, params: list[torch.Tensor], group: dict) -> None:
        """The states of `params`, stepped for the first time: zeros, in shared buffers
        (`zeroed_like`), as torch's own step makes them."""
        raise NotImplementedError

    @property
    def update_path(self) -> str:
        """How the update runs, for the run record: "compiled" (one compiled loop a batch,
        mpexp/precision/pure_compiled.py) or "eager"."""
        fast = self.compiled_update
        return "compiled" if fast is not None and not fast.failed else "eager"

    def step_temporary_bytes(self) -> int:
        """A bound on what a step holds besides the weights, gradients and states (the
        workspace, `Batches.bound`); nothing where every step is torch's fused kernel on the
        bf16 tensors themselves."""
        whole = self.fused and self.rounding == "nearest" and self.states_dtype == torch.bfloat16
        return 0 if whole and self.lost is None else self.batches.bound()

    def workspace_plan(self) -> dict:
        """What a plan says of the workspace: the elements a batch holds and the step's bytes
        beyond the held ones at most (`step_temporary_bytes`)."""
        return {"elements": self.chunk, "bytes": self.step_temporary_bytes()}

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
        state_dict[HOST_COUNTS] = list(self.host_counts)
        state_dict[MADE] = list(self.made)
        return state_dict

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load, then the states as this run keeps them (mpexp/precision/
        pure_state.py)."""
        pure_state.load(self, super().load_state_dict, state_dict)
