"""Pure bf16's step through the compiled update, batch by batch, where a batch allows it; the
eager step (mpexp/precision/pure_step.py) takes the others. The update is one loop over a
batch: on a CPU a C loop (mpexp/precision/pure_native.py), elsewhere torch.compile's
(mpexp/precision/pure_kernels.py), the same arithmetic.

A batch of one piece whose weight and gradient are laid out alike is stepped where it lies, as
flat views: no workspace at all. A batch of several pieces (small tensors) is gathered into two
bf16 buffers, stepped there and its weights copied back; its count of lost updates is counted
by piece in the C loop, or, in torch.compile's, is two masks in the workspace, summed by piece
as the eager step sums its own.

The eager step takes a batch whose states are not one stretch of memory (sharded or laid out
apart) and one whose pieces have stepped different numbers of times or not all for the first
time. The loss scaler's scale and overflow flag, which mpexp hands every fused step, come in as
one small tensor (`scaling`): the gradient unscaled, and a skipped step left as it was, in the
loop.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from mpexp.errors import ConfigError
from mpexp.precision.pure_kernels import (
    INT32_INDEX_BELOW,
    Variant,
    adam_coefficients,
    can_compile,
    compiled,
    draw_keys,
    sgd_coefficients,
    split_is_exact,
)
from mpexp.precision.pure_layout import is_dense, memory_order
from mpexp.precision.pure_native import cannot_build, native
from mpexp.precision.pure_updates import COMPENSATION
from mpexp.precision.pure_workspace import BatchViews
from mpexp.shards import local_shard

log = logging.getLogger(__name__)

# bytes per element that a counting variant's compiled loop allocates for itself
COUNT_TEMPORARY = 2


def compile_setting(
    setting: bool | None, fused: bool, device: torch.device, device_type: str | None = None
) -> bool | None:
    """What `precision.update_compile` (`setting`) makes of the update: True (compiled, as
    asked: a failure stops the run), None (compiled where it pays: a failure falls back to the
    eager step with a warning) or False (eager).

    Where it pays, on its own: on a CPU, at every size and under every rounding. There it is
    the C loop (mpexp/precision/pure_native.py): built in about a tenth of a second a variant
    once per machine, holding no memory of its own, and at every size measured two to five
    times as fast as the eager step under Kahan's and stochastic rounding, and under
    round-to-nearest in the steps that count lost updates (its other steps are torch's fused
    kernel on the bf16 tensors; docs/benchmarks.md). On a GPU only when asked: torch.compile's
    loop there has been measured on a CPU only (scripts/gpu_proof.sh measures it on a GPU)."""
    if setting is False:
        return False
    if setting is True:
        if not fused:
            raise ConfigError(
                "precision.update_compile=true compiles the fused update; it cannot with "
                "optimizer.fused=false (torch's formula op by op). Drop one of the two."
            )
        reason = cannot_compile(device)
        if reason:
            raise ConfigError(
                f"precision.update_compile=true: the update cannot be compiled here ({reason}). "
                "Use precision.update_compile=null to step eagerly where it cannot."
            )
        return True
    # on the device the run steps on (`device_type`: a plan for CUDA builds on fake CPU
    # tensors), whose compiler `cannot_compile` checks where the parameters are
    runs_on = device_type or device.type
    if not (fused and runs_on == "cpu"):
        return False
    reason = cannot_compile(device)
    if reason:
        log.info("Pure bf16's update steps eagerly: %s.", reason)
        return False
    return None


# where the compiled update is the C loop (mpexp/precision/pure_native.py); elsewhere (a GPU)
# torch.compile's, which tests run on a CPU by emptying this
NATIVE_DEVICES = ("cpu",)


def cannot_compile(device: torch.device) -> str | None:
    """Why the update cannot be compiled on `device`, or None."""
    return cannot_build() if device.type in NATIVE_DEVICES else can_compile(device)


@dataclass
class _Layout:
    """A batch's compiled step's reused views: its first piece's parameter (`param`), where the
    piece starts, the elements of its parameter stepped with the first piece (`span`: those
    whose pieces are each alone in a batch, mpexp/precision/pure_layout.py), the batch's states
    and Kahan's buffer as stretches (None: not laid out so, the eager step's), the same for the
    span, and the weight as one flat view where the batch is one piece laid out densely
    (`direct`) or for the span (`whole`)."""

    param: int
    start: int
    span: int
    states: list | None
    carried: torch.Tensor | None
    whole_states: list | None = None
    whole_carried: torch.Tensor | None = None
    direct: torch.Tensor | None = None
    whole: torch.Tensor | None = None
    places: tuple | None = None  # the gathered buffer and the pieces' places in both buffers
    ends: torch.Tensor | None = None  # where each piece ends in the gathered buffer (CPU)

    @classmethod
    def of(cls, o, views: BatchViews, group: dict) -> _Layout:
        piece = views.batch.pieces[0]
        keys = o.keys(group)
        states = [views.stretches.get(k) for k in keys]
        carried = views.stretches.get(COMPENSATION) if o.rounding == "kahan" else None
        if None in states or (o.rounding == "kahan" and carried is None):
            states = None
        weight = local_shard(o.params[piece.param].detach())
        span = views.batch.span
        at = cls(piece.param, piece.start, span, states, carried)
        if len(views.batch.pieces) == 1:
            if piece.how == "flat":
                at.direct = views.weights[0]
            elif piece.how == "whole" and is_dense(weight):
                at.direct = memory_order(weight)
        if span and piece.start == 0:
            state = o.state[o.params[piece.param]]
            at.whole = memory_order(weight)[:span]
            at.whole_states = [memory_order(local_shard(state[k]))[:span] for k in keys]
            if carried is not None:
                at.whole_carried = memory_order(local_shard(state[COMPENSATION]))[:span]
        return at


class CompiledUpdate:
    """The compiled path of a PureOptimizer (see the module's docstring). `required`: the run
    asked for it (`precision.update_compile=true`), so that a failed compilation stops the run
    rather than falling back to the eager step with a warning."""

    def __init__(self, optimizer, required: bool = False) -> None:
        self.optimizer = optimizer
        self.required = required
        self.failed: str | None = None  # why the compilation failed, once it has
        self._gathered: tuple[torch.Tensor, torch.Tensor] | None = None
        self._coefficients: dict = {}
        self._variants: dict = {}
        self._stepped_whole: set[int] = set()  # this step's parameters stepped whole
        self._layouts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @staticmethod
    def scaling(grad_scale, found_inf) -> torch.Tensor:
        """The loss scaler's scale and overflow flag as one float32 tensor on their device."""
        flag = found_inf if found_inf is not None else torch.zeros_like(grad_scale)
        scale = grad_scale if grad_scale is not None else torch.ones_like(found_inf)
        return torch.stack((scale.float(), flag.float()))

    def begin_step(self) -> None:
        self._coefficients.clear()
        self._stepped_whole.clear()

    @staticmethod
    def gather_bytes(extent: int, device_type: str) -> int:
        """What the compiled path holds for a workspace of `extent` on `device_type`: the
        gathered weights and gradients in bf16; under torch.compile's loop (a GPU's) also a
        counting call's kernel's own bf16 value per element, a call taking twice the
        workspace's elements at most (`_free_buffers`; the variants that count nothing hold
        nothing per element, which tests/test_pure_compiled.py reads in the code inductor
        writes). The C loop holds nothing per element."""
        per_element = 4 if device_type in NATIVE_DEVICES else 4 + 2 * COUNT_TEMPORARY
        return per_element * extent + 64

    def step(self, views: BatchViews, index: int, group: dict, fresh: set, counting: bool, scaling):
        """Step the batch `views` of group `index` (`scaling`: the loss scaler's scale and
        overflow flag, or None); False (nothing done) where the eager step must take it."""
        o = self.optimizer
        at = self._layout(views, group)
        if at.param in self._stepped_whole and at.start < at.span:
            return True  # stepped with its parameter's first piece
        if self.failed or at.states is None:
            return False
        owners = views.owners
        if len(owners) > 1 and len({o.host_counts[i] for i in owners}) != 1:
            return False
        first = {i in fresh for i in owners}
        if len(first) != 1 or _get_current_dispatch_mode() is not None:
            return False  # (torch.compile does not run under a dispatch mode: a plan's count)
        # a parameter cut along its memory: the pieces alone in their batches in one call (a
        # counting step of torch.compile's in calls of twice the workspace's elements at most,
        # `_free_buffers`)
        span = at.span if at.start == 0 else 0
        states, carried = (at.whole_states, at.whole_carried) if span else (at.states, at.carried)
        w, g, gathered = self._flat(views, at, span)
        coefficients = self._coefficients_for(index, group, views, first.pop())
        operands = (w, g, states, carried, coefficients)
        native_here = w.device.type in NATIVE_DEVICES
        # the C loop counts by piece as it goes; torch.compile's sums its count where a batch
        # is stepped where it lies, and writes masks to be summed by piece where it is gathered
        count = "masks" if gathered is not None and not native_here else "sums"
        variant = self._variant(group, count if counting else "", scaling is not None)
        try:  # (built or compiled at its first call)
            if native_here:
                self._native(views, at, variant, operands, gathered, scaling)
            else:
                self._compiled(views, variant, operands, gathered, scaling)
        except Exception as error:  # inductor's failures have no common class of their own
            return self._fail(error)
        if gathered is not None:
            torch._foreach_copy_(views.weights, gathered)
        if span:
            self._stepped_whole.add(at.param)
        return True

    def _native(self, views, at: _Layout, variant, operands, gathered, scaling) -> None:
        """The C loop (mpexp/precision/pure_native.py): one call, which counts by piece (a
        parameter of 2^31 elements or more in calls below that, each with keys of its own, so
        that no two of its elements hash alike)."""
        o = self.optimizer
        counting = bool(variant.count)
        w, g, states, carried, coefficients = operands
        if gathered is not None:
            if counting and at.ends is None:
                # (placed one after another from 0: plan_batches)
                at.ends = torch.tensor([p.offset + p.size for p in views.batch.pieces])
            counts = native(variant)(
                w, g, states, carried, coefficients, self._draws(w), scaling, at.ends
            )
            if counting:
                o.lost.add_pieces(views.owner_index, counts[:, 0], counts[:, 1])
            return
        for part in _parts(INT32_INDEX_BELOW, w, g, states, carried):
            counts = native(variant)(*part, coefficients, self._draws(part[0]), scaling)
            if counting:
                o.lost.add(views.owners[0], counts[0, 0], counts[0, 1])

    def _draws(self, w: torch.Tensor) -> torch.Tensor | None:
        """A call's keys for stochastic rounding's hash."""
        o = self.optimizer
        return draw_keys(o.generator, w.device) if o.rounding == "stochastic" else None

    def _compiled(self, views, variant, operands, gathered, scaling) -> None:
        """torch.compile's loop: a batch stepped where it lies sums its count in the loop, in
        calls of twice the workspace's elements at most (`_free_buffers`); a gathered one
        writes its masks, summed by piece afterwards."""
        o = self.optimizer
        w, g, states, carried, coefficients = operands
        count = variant.count
        free = _free_buffers(views.ws) if count else None
        masks = tuple(m[: w.numel()] for m in free) if count == "masks" else None
        calls = [(w, g, states, carried)]
        if count == "sums":
            written = free[0]
            if w.numel() > written.numel():
                calls = _parts(written.numel(), w, g, states, carried)
        update = compiled(variant)
        for w, g, states, carried in calls:
            draws = self._draws(w)
            if count == "sums":
                masks = (written[: w.numel()],)
            counts = update(w, g, states, carried, coefficients, draws, masks, scaling)
            if count == "sums":
                w.copy_(masks[0])
                o.lost.add(views.owners[0], counts[0], counts[1])
        if count == "masks":
            o.lost.add_pieces(views.owner_index, *(views.summed(m) for m in free))

    def _layout(self, views: BatchViews, group: dict) -> _Layout:
        """What the batch's compiled steps reuse, made at its first (a CPU keeps its views from
        step to step, and so this)."""
        at = self._layouts.get(views)
        if at is None:
            at = self._layouts[views] = _Layout.of(self.optimizer, views, group)
        return at

    def _variant(self, group: dict, count: str, scaled: bool) -> Variant:
        decay = group["weight_decay"] != 0
        key = (count, group.get("momentum"), group.get("nesterov"), decay, scaled)
        if key not in self._variants:
            self._variants[key] = self._make_variant(group, count, scaled)
        return self._variants[key]

    def _make_variant(self, group: dict, count: str, scaled: bool) -> Variant:
        o = self.optimizer
        return Variant(
            scaled=scaled,
            algorithm="adam" if o.counted else "sgd",
            rounding=o.rounding,
            count=count,
            decoupled=bool(getattr(o, "decoupled", False)),
            momentum=o.counted is False and group.get("momentum", 0) != 0,
            nesterov=bool(group.get("nesterov", False)),
            decay=group["weight_decay"] != 0,
            sixteen=o.states_dtype != torch.float32,
            exact="split" if o.params[0].device.type == "cpu" and split_is_exact() else "cast",
        )

    def _coefficients_for(self, index: int, group: dict, views: BatchViews, first: bool):
        """The step's coefficients for this group and count of steps, made once a step."""
        o = self.optimizer
        count = o.host_counts[views.owners[0]]
        key = (index, count, first)
        made = self._coefficients.get(key)
        if made is None:
            if o.counted:
                made = adam_coefficients(views.steps[0], group, bool(o.decoupled))
            else:
                made = sgd_coefficients(group, views.weights[0].device, first)
            self._coefficients[key] = made
        return made

    def _flat(self, views: BatchViews, at: _Layout, span: int):
        """The batch's weights and gradients as flat bf16 tensors, and the gathered pieces to
        copy the weights back from (None where the batch is one piece stepped where it lies;
        with `span`, its parameter's first `span` elements). (None, None, None) where a
        gradient is laid out otherwise than its weight is."""
        pieces = views.batch.pieces
        if span or at.direct is not None:
            grad = local_shard(self.optimizer.params[at.param].grad)
            weight = at.whole if span else at.direct
            if pieces[0].how == "whole":
                if grad.stride() != views.weights[0].stride():
                    return self._gather(views, at)
                return weight, memory_order(grad), None
            grad = memory_order(grad)
            return (
                weight,
                (grad[:span] if span else grad[at.start : at.start + weight.numel()]),
                None,
            )
        return self._gather(views, at)

    def _gather(self, views: BatchViews, at: _Layout):
        """The batch's weights and gradients copied into the bf16 buffers, at the pieces'
        places there (made once for the buffers: a view costs about a microsecond, as much as
        a small tensor's whole step)."""
        w16, g16 = self._buffers(views.ws)
        if at.places is None or at.places[0] is not w16:
            pieces = views.batch.pieces
            at.places = (w16, [p.place(w16) for p in pieces], [p.place(g16) for p in pieces])
        _, placed, grads_placed = at.places
        torch._foreach_copy_(placed, views.weights)
        torch._foreach_copy_(grads_placed, views.grads())
        return w16[: views.extent], g16[: views.extent], placed

    def _buffers(self, ws) -> tuple[torch.Tensor, torch.Tensor]:
        """Two bf16 buffers as long as the workspace: a batch's gathered weights and
        gradients, or a counting step's new weights."""
        if self._gathered is None or self._gathered[0].numel() < ws.extent:
            self._gathered = tuple(
                torch.empty(ws.extent, dtype=torch.bfloat16, device=ws.w.device) for _ in "wg"
            )
        return self._gathered

    def _fail(self, error: Exception) -> bool:
        reason = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:300]}"
        if self.required:
            raise RuntimeError(
                f"pure bf16's compiled update could not be built ({reason}), which this run "
                "steps compiled only (precision.update_compile=true, or DDP, whose replicas "
                "must all step alike); set precision.update_compile=false to step it eagerly."
            ) from error
        self.failed = reason
        log.warning(
            "Pure bf16's compiled update failed to build or compile (%s): this run steps eagerly "
            "from here on, as precision.update_compile=false would, and its steps take longer.",
            reason,
        )
        return False

    def after_step(self) -> None:
        """Let the gathered buffers go where the workspace is let go (a GPU's)."""
        if not self.optimizer.batches.kept:
            self._gathered = None


def _free_buffers(ws) -> tuple[torch.Tensor, torch.Tensor]:
    """The workspace's float32 weight and gradient buffers, which the compiled path leaves
    free, viewed as bf16 (twice their elements): where a counting call writes what it hands
    back. A batch stepped where it lies writes its new weights into the first, for the caller
    to copy (`_update`), so that a parameter stepped whole is counted in calls of twice the
    workspace's elements with no buffer of its own (a chunk a call, ResNet-50's shapes' loop
    took 105 calls a step, at about 60 µs a call besides the loop); a gathered batch writes its
    two masks (moved, changed) into both."""
    return (ws.w.view(torch.bfloat16), ws.g.view(torch.bfloat16))


def _parts(size: int, w, g, states, carried):
    """A parameter stepped whole as calls of `size` elements at most: each call's weights,
    gradients, states and Kahan's buffer."""
    if w.numel() <= size:
        yield w, g, states, carried
        return
    for start in range(0, w.numel(), size):
        part = slice(start, start + size)
        rest = carried[part] if carried is not None else None
        yield w[part], g[part], [s[part] for s in states], rest
