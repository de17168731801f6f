"""Numerics instruments, off by default and free when off.

- Gradient statistics (`diagnostics.grad_stats_every=N`): every N steps, per layer and in total,
  what the step's gradients g (true units, after unscale_ and before clipping) become in fp16 at the
  scale S that step used: the fraction of elements that underflow (g != 0 but S*g is zero or
  subnormal in fp16), that overflow (S*g is not finite in fp16), that were exactly zero already,
  and a histogram of log2 of what fp16 holds of S*g, one bin per power of two. On that axis fp16's
  range is fixed: bins -24..-15 are its subnormals, -14..15 its normal numbers, 16 its overflows
  (S*g rounded to inf); elements that fp16 rounds to zero are binned by |S*g| itself, which puts
  them at -25 and below ("lost"; the end bin -40 also holds everything smaller). Each value is
  binned after fp16's rounding: 65520 rounds to inf (bin 16), 1.5 * 2^-25 to 2^-24 (bin -24).
  Under fp16 the gradients have already passed through fp16 once, so what was lost shows up as
  exact zeros; under fp32 the statistics are a what-if for fp16 at that scale.
- fp8 range (the same `diagnostics.grad_stats_every=N`, under precision=fp8, in place of the fp16
  statistics): every N steps, for each Linear layer that fp8 converted and over all of them, the
  fraction of the weight's elements, and of its gradient's, that fp8 cannot hold at the scales
  the run's recipe (`precision.fp8.recipe`, recorded as `ran.fp8_recipe`) gives them. Each scale
  is torchao's dynamic one, S = largest finite value of the format / amax (max |x|), over the part
  of the tensor the recipe scales as one: under `tensorwise` the whole tensor, in e4m3 and e5m2
  (`weight_e4m3_*`, ...); under `rowwise` each row of the weight (one scale per output feature,
  as the forward pass casts it: `weight_rows_e4m3_*`), each column (one per input feature, as the
  backward pass casts it for the input's gradient: `weight_columns_e4m3_*`) and each row of the
  gradient (`grad_rows_e4m3_*`), in e4m3 only, which is all that recipe uses, with S rounded
  down to a power of two as torchao rounds it there. Underflow: x != 0 but S*x rounds to zero in
  the format (|S*x| at most half its smallest subnormal, 2^-10 for e4m3, 2^-17 for e5m2);
  overflow: S*x rounds past the format's largest value (|S*x| from 464 for e4m3, 448 its largest;
  from 61440 for e5m2, 57344), or is not finite. At the amax scale nothing finite overflows: a
  non-zero overflow fraction means a non-finite tensor. The weights are what torchao casts to
  e4m3; the weight gradients are not cast by torchao (the gradients flowing between layers are),
  so theirs say how much of their range each format would keep.
- Attention-logit growth (the same `diagnostics.grad_stats_every=N`, on models whose attention
  layers can measure it, such as model=gpt): every N steps, per attention layer and over all of
  them (`total`), the largest |q.k| / sqrt(head width) on the step's batch, in float32
  (`attn_logit_max`). Logits that keep growing with the weights' norms collapse attention onto
  single positions and precede loss spikes; `model.qk_norm=true` bounds them. They are no fp16
  overflow site: fused attention kernels accumulate q.k in float32. The measurement is an extra
  forward pass of its own, eager, without gradients and in eval mode, before the step: the
  (compiled) training forward never changes, so a diagnostics step compiles nothing, and no
  dropout draw moves the run's random stream. A layer offers it by an attribute
  `measure_logits`, which the diagnostics set for that pass, and `logit_absmax`, the 0-d tensor
  the pass leaves there.
- Overflow attribution (`diagnostics.overflow_attribution=true`): the names of the parameters whose
  gradients were not finite, on each step where any was (a skipped step, under loss scaling).
- Updates lost (`opt/updates_lost`, on under precision=bf16_pure, elsewhere with
  `diagnostics.updates_lost=true`): the share of the elements whose update was nonzero but left
  the stored weight unchanged (rounded away), in total and per layer
  (`diag/<layer>/updates_lost`): under bf16_pure counted by its own update on the last step of
  each log interval (mpexp/precision/pure_optimizers.py), elsewhere on every step in the
  optimizer's step hooks (mpexp/precision/pure_updates.py).
- The loss-scale floor of dynamic and hysteresis scaling, checked here because it is read back the
  same way: a back-off due at `loss_scaling.min_scale` stops the run or warns.

Values are gathered on the device during the step and read back at the metrics flush, with the step
history, never per step. Under FSDP each rank holds a shard of every gradient: it counts its own
shard, and the counts (and flags) are summed over the ranks at the flush, so the figures are those
of the whole gradients, as in a single process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Sequence
from functools import partial

import torch
from omegaconf import DictConfig
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from mpexp.precision.loss_scaler import LossScaler
from mpexp.precision.modes import Precision
from mpexp.shards import all_reduce, local_shard, shard_group
from mpexp.step.history import DeviceRows
from mpexp.tracking.histogram import Histogram
from mpexp.tracking.tracker import Tracker

log = logging.getLogger(__name__)

FP16_SMALLEST_NORMAL = 2.0**-14
# log2 bins, one per power of two; the first and last also hold everything beyond them
HIST_LOW, HIST_HIGH = -40, 16
HIST_BINS = HIST_HIGH - HIST_LOW + 1
HIST_EDGES = [float(e) for e in range(HIST_LOW, HIST_HIGH + 2)]
COUNTS = ("zero", "underflow", "overflow")

# fp8's formats: the dtype, the largest finite value, and the magnitude from which rounding goes
# past it (halfway to the next step: 448 + 32 / 2 for e4m3, 57344 + 8192 / 2 for e5m2)
FP8_FORMATS = {
    "e4m3": (torch.float8_e4m3fn, 448.0, 464.0),
    "e5m2": (torch.float8_e5m2, 57344.0, 61440.0),
}
FP8_AMAX_EPS = 1e-12  # torchao's floor under amax, so that an all-zero tensor gets a finite scale
FP8_KINDS = ("underflow", "overflow")


@dataclasses.dataclass(frozen=True)
class Fp8Cast:
    """One cast of a converted layer's tensor as a recipe makes it: which tensor, the dimension
    its amax is taken over (None: the whole tensor, one scale), whether the scale is rounded down
    to a power of two, and the formats whose range is counted."""

    name: str  # the key's first part
    tensor: str  # "weight" or "grad" (the weight's gradient)
    dim: int | None
    power_of_two: bool
    formats: tuple[str, ...]

    def names(self) -> list[str]:
        return [f"{self.name}_{fmt}_{kind}" for fmt in self.formats for kind in FP8_KINDS]


# torchao 0.18's recipes (Float8LinearConfig.from_recipe_name). Tensorwise scales each tensor as
# one, weights to e4m3; e5m2 is counted beside it, as the format of the gradients between layers.
# Rowwise casts the weight twice, e4m3 with power-of-two scales: for the forward product with one
# scale per output feature (amax over a row of the (out, in) weight, dim 1), for the input's
# gradient with one per input feature (over a column, dim 0); the weight gradient, not cast, is
# counted per row as that recipe would scale it.
FP8_CASTS = {
    "tensorwise": (
        Fp8Cast("weight", "weight", None, False, ("e4m3", "e5m2")),
        Fp8Cast("grad", "grad", None, False, ("e4m3", "e5m2")),
    ),
    "rowwise": (
        Fp8Cast("weight_rows", "weight", 1, True, ("e4m3",)),
        Fp8Cast("weight_columns", "weight", 0, True, ("e4m3",)),
        Fp8Cast("grad_rows", "grad", 1, True, ("e4m3",)),
    ),
    # rowwise_with_gw_hp: the forward product's weight as rowwise's; for the input's gradient
    # one scale for the whole weight (still a power of two); the weight gradient is computed in
    # high precision, never cast, so it is not counted
    "rowwise_with_gw_hp": (
        Fp8Cast("weight_rows", "weight", 1, True, ("e4m3",)),
        Fp8Cast("weight", "weight", None, True, ("e4m3",)),
    ),
}


def fp8_count_keys(recipe: str) -> list[str]:
    """The fp8 range keys a run of this recipe logs per layer, in the order of fp8_layer_counts."""
    return [key for cast in FP8_CASTS[recipe] for key in cast.names()]


def fp16_counts(grad: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[zero, underflow, overflow, *histogram] element counts of one gradient at a loss scale.

    All on the device; int64 so large layers count exactly.
    """
    g = grad.detach().float()
    scaled = g * scale
    held = scaled.to(torch.float16).float().abs()  # what fp16 makes of it
    zero = g == 0
    lost = ~zero & (held == 0)
    underflow = ~zero & (held < FP16_SMALLEST_NORMAL)
    overflow = ~torch.isfinite(held)
    # the value fp16 holds; for what it rounds to zero (|S*g| <= 2^-25), how small it was
    magnitude = torch.where(lost, scaled.abs(), held)
    # the exponent read from the float's bits: float32 log2 rounds a value just below a power of
    # two up to it (2^-26 * (1 - 2^-24) would land in -26); frexp's mantissa lies in [0.5, 1)
    exponent = torch.frexp(magnitude).exponent - 1
    bins = torch.where(torch.isinf(magnitude), HIST_HIGH, exponent).clamp(HIST_LOW, HIST_HIGH)
    bins = bins - HIST_LOW
    # zeros and non-finite gradients go to an extra bin that is dropped (masking would sync)
    bins = torch.where(~zero & torch.isfinite(g), bins, HIST_BINS).long().flatten()
    hist = torch.zeros(HIST_BINS + 1, dtype=torch.int64, device=g.device)
    hist.scatter_add_(0, bins, torch.ones_like(bins))
    totals = torch.stack((zero.sum(), underflow.sum(), overflow.sum()))
    return torch.cat((totals, hist[:HIST_BINS]))


def fp8_scale(
    x: torch.Tensor, fmt: str, dim: int | None = None, power_of_two: bool = False
) -> torch.Tensor:
    """torchao's dynamic scale for `x` in format `fmt` ("e4m3" or "e5m2"): the format's largest
    value over amax, in float64 and then float32, as torchao computes it. `dim` None: one scale
    for the tensor; else one per slice, amax taken over `dim` (kept, so that it broadcasts);
    `power_of_two`: rounded down to a power of two, as torchao's rowwise recipe does."""
    magnitude = x.detach().abs()
    amax = magnitude.max() if dim is None else magnitude.amax(dim=dim, keepdim=True)
    scale = (FP8_FORMATS[fmt][1] / torch.clamp(amax.double(), min=FP8_AMAX_EPS)).float()
    return torch.exp2(torch.floor(torch.log2(scale))) if power_of_two else scale


def fp8_counts(x: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """[underflow, overflow] element counts of `x` cast to `fmt` at `scale` (int64, on the device).

    Underflow: non-zero, but the format rounds `scale * x` to zero; overflow: `scale * x` rounds
    past the format's largest value, or is not finite.
    """
    dtype, largest, rounds_past = FP8_FORMATS[fmt]
    scaled = x.detach().float() * scale  # in float32, as torchao scales before its cast
    magnitude = scaled.abs()
    # clamped first: casts to fp8 saturate in some torch versions and give inf/NaN in others
    held = magnitude.clamp(max=largest).to(dtype).float()
    underflow = (x != 0) & torch.isfinite(magnitude) & (held == 0)
    overflow = ~torch.isfinite(magnitude) | (magnitude >= rounds_past)
    return torch.stack((underflow.sum(), overflow.sum()))


def fp8_layer_counts(weight: torch.Tensor, grad: torch.Tensor, recipe: str) -> torch.Tensor:
    """The counts behind fp8_count_keys(recipe) for one fp8 layer: its weight and gradient cast
    as the recipe casts them, each at its own amax scales."""
    tensors = {"weight": weight, "grad": grad}
    counts = []
    for cast in FP8_CASTS[recipe]:
        x = tensors[cast.tensor]
        for fmt in cast.formats:
            counts.append(fp8_counts(x, fp8_scale(x, fmt, cast.dim, cast.power_of_two), fmt))
    return torch.cat(counts)


class Diagnostics:
    """Per-step numerics gathered on the device, reported at each metrics flush."""

    def __init__(
        self,
        cfg: DictConfig,
        model: nn.Module,
        scaler: LossScaler,
        tracker: Tracker,
        precision: Precision | None = None,
        optimizer: torch.optim.Optimizer | None = None,
    ):
        self.every = cfg.grad_stats_every
        self.attribute = cfg.overflow_attribution
        self.max_names = cfg.max_names
        self.scaler, self.tracker = scaler, tracker

        self.params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        # a layer is the module that owns the parameter ("features.3.0.weight" -> "features.3.0")
        owners = [name.rpartition(".")[0] or name for name, _ in self.params]
        self.layers = list(dict.fromkeys(owners))
        device = scaler.device
        self._layer_of = torch.tensor([self.layers.index(o) for o in owners], device=device)
        self._numel = [0] * len(self.layers)
        for owner, (_, p) in zip(owners, self.params, strict=True):
            self._numel[self.layers.index(owner)] += p.numel()  # a DTensor's is the whole one's
        # parameters whose shard on this rank holds elements (under FSDP some may hold none)
        self._filled = [i for i, (_, p) in enumerate(self.params) if local_shard(p).numel()]
        self._filled_index = torch.tensor(self._filled, dtype=torch.long, device=device)

        # under FSDP, each rank's counts and flags are combined at the flush (one collective each)
        group = shard_group([p for _, p in self.params])
        sharded = group is not None
        self._stats = DeviceRows(partial(all_reduce, op="SUM", group=group) if sharded else None)
        self._steps = DeviceRows(partial(all_reduce, op="MAX", group=group) if sharded else None)
        self._flags: torch.Tensor | None = None

        # under fp8, the layers it converted (by the names recorded in `ran`), seen through DDP
        fp8 = precision.fp8 if precision is not None else None
        root = model.module if isinstance(model, DistributedDataParallel) else model
        self.fp8_layers = [(n, root.get_submodule(n)) for n in (fp8.converted if fp8 else ())]
        self.fp8_recipe = fp8.recipe if fp8 else None
        self._fp8 = DeviceRows()

        # attention layers that can measure their logits' growth on the steps inspected
        self.root = root
        self.precision = precision
        self.attention = [(n, m) for n, m in root.named_modules() if hasattr(m, "measure_logits")]
        self._logits = DeviceRows()

        # the update hooks' counts of lost updates, where the run has them; their parameters in
        # the optimizer's order, each to its layer
        self.updates = getattr(optimizer, "pure_updates", None)
        if self.updates is not None:
            pairs = zip(owners, self.params, strict=True)
            layer_of = {id(p): self.layers.index(owner) for owner, (_, p) in pairs}
            self._update_layer = torch.tensor(
                [layer_of[id(p)] for p in self.updates.params], device=device
            )
        self._lost = DeviceRows(partial(all_reduce, op="SUM", group=group) if sharded else None)

    def inspector(self, step: int) -> Callable[[], None] | None:
        """What to run on the step's unscaled gradients, or None when nothing is due."""
        stats = self.every > 0 and step % self.every == 0
        if not (stats or self.attribute):
            return None
        return partial(self._inspect, step, stats)

    @torch.no_grad()
    def measure_attention(self, step: int, micro_batches: Sequence[torch.Tensor]) -> None:
        """On a statistics step, before it: the attention layers' largest logits on its batch,
        from a forward pass of the plain model of its own (see the module's docstring), one
        micro-batch at a time as the step runs them: the whole batch at once would hold the
        activations and output of all of it (49 GB of logits for GPT-2 small's 480 windows)."""
        if not (self.attention and self.every > 0 and step % self.every == 0):
            return
        for _, layer in self.attention:
            layer.measure_logits = True
        training = self.root.training
        self.root.eval()
        autocast = self.precision.autocast() if self.precision else contextlib.nullcontext()
        try:
            with autocast, torch.no_grad():
                for inputs in micro_batches:  # each layer keeps the largest over them
                    self.root(inputs)
        finally:
            self.root.train(training)
            for _, layer in self.attention:
                layer.measure_logits = False
        self._logits.append(step, self._logit_absmax())

    def _inspect(self, step: int, stats: bool) -> None:
        grads = [
            local_shard(p.grad if p.grad is not None else torch.zeros_like(p))
            for _, p in self.params
        ]
        if self.attribute:
            self._flags = self._nonfinite(grads)
        if stats and self.fp8_layers:
            self._fp8.append(step, self._fp8_counts())
        elif stats:
            scale = self.scaler.scale_tensor()
            per_param = torch.stack([fp16_counts(g, scale) for g in grads])
            per_layer = torch.zeros(
                (len(self.layers), per_param.shape[1]), dtype=torch.int64, device=per_param.device
            )
            per_layer.index_add_(0, self._layer_of, per_param)
            self._stats.append(step, per_layer.flatten())

    def _logit_absmax(self) -> torch.Tensor:
        """Each attention layer's largest |logit| of the measuring pass."""
        values = []
        for _, layer in self.attention:
            values.append(layer.logit_absmax.float())
            layer.logit_absmax = None
        return torch.stack(values)

    def _fp8_counts(self) -> torch.Tensor:
        rows = []
        for _, layer in self.fp8_layers:
            weight = layer.weight
            grad = weight.grad if weight.grad is not None else torch.zeros_like(weight)
            rows.append(fp8_layer_counts(weight, grad, self.fp8_recipe))
        return torch.cat(rows)

    def _nonfinite(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """1.0 for each gradient holding an inf or NaN, else 0.0: one multi-tensor pass."""
        bad = torch.zeros(len(grads), device=self.scaler.device)
        if self._filled:
            peaks = torch._foreach_norm([grads[i] for i in self._filled], float("inf"))
            bad.index_put_((self._filled_index,), (~torch.isfinite(torch.stack(peaks))).float())
        return bad

    def after_update(self, step: int) -> None:
        """Record the step's non-finite flags, once the step is done."""
        if self.attribute and self._flags is not None:
            self._steps.append(step, self._flags)
            self._flags = None

    def flush(self, wait: bool = False, close_windows: bool = True) -> None:
        """Report what has been read back. `close_windows=False` (a stop's flush) leaves the
        lost updates counting in the optimizer, whose checkpoint keeps them."""
        if self.updates is not None and close_windows:
            self._take_lost()
        for step, counts in self._lost.flush(wait):
            if any(counts[1::2]):  # steps since the last flush that moved a weight
                self.tracker.log(self._lost_row(step, counts))
        for step, flags in self._steps.flush(wait):
            self._attribute(step, flags)
        for step, counts in self._stats.flush(wait):
            self.tracker.log(self._stats_row(step, counts))
        for step, counts in self._fp8.flush(wait):
            self.tracker.log(self._fp8_row(step, counts))
        for step, values in self._logits.flush(wait):
            names = [name for name, _ in self.attention]
            row = {f"diag/{n}/attn_logit_max": v for n, v in zip(names, values, strict=True)}
            self.tracker.log({"step": step, **row, "diag/total/attn_logit_max": max(values)})

    def _take_lost(self) -> None:
        """The lost-update counts since the last flush, per layer, on their way to the host."""
        counts = self.updates.lost.take()
        per_layer = counts.new_zeros((len(self.layers), 2))
        per_layer.index_add_(0, self._update_layer, counts)
        self._lost.append(self.tracker.step, per_layer.flatten())

    def _lost_row(self, step: int, counts: list[int]) -> dict:
        pairs = [counts[i : i + 2] for i in range(0, len(counts), 2)]
        lost, moved = (sum(column) for column in zip(*pairs, strict=True))
        row = {"step": step, "opt/updates_lost": lost / moved}
        for name, (layer_lost, layer_moved) in zip(self.layers, pairs, strict=True):
            row[f"diag/{name}/updates_lost"] = layer_lost / layer_moved if layer_moved else 0.0
        return row

    def _attribute(self, step: int, flags: list[float]) -> None:
        names = [name for (name, _), bad in zip(self.params, flags, strict=True) if bad]
        if not names:
            return
        text = ", ".join(names[: self.max_names])
        if len(names) > self.max_names:
            text += f" (+{len(names) - self.max_names} more)"
        log.info("Step %d: non-finite gradients in %s", step, text)
        self.tracker.log(
            {"step": step, "diag/nonfinite_params": text, "diag/nonfinite_param_count": len(names)}
        )

    def _fp8_row(self, step: int, counts: list[int]) -> dict:
        keys = fp8_count_keys(self.fp8_recipe)
        width = len(keys)
        per_layer = [counts[i * width : (i + 1) * width] for i in range(len(self.fp8_layers))]
        sizes = [layer.weight.numel() for _, layer in self.fp8_layers]
        total = [sum(column) for column in zip(*per_layer, strict=True)]
        row: dict = {"step": step}
        for name, numel, values in [
            *zip((n for n, _ in self.fp8_layers), sizes, per_layer, strict=True),
            ("total", sum(sizes), total),
        ]:
            for key, value in zip(keys, values, strict=True):
                row[f"diag/{name}/{key}"] = value / numel
        return row

    def _stats_row(self, step: int, counts: list[int]) -> dict:
        width = len(COUNTS) + HIST_BINS
        per_layer = [counts[i * width : (i + 1) * width] for i in range(len(self.layers))]
        total = [sum(column) for column in zip(*per_layer, strict=True)]
        row: dict = {"step": step}
        for name, numel, values in [
            *zip(self.layers, self._numel, per_layer, strict=True),
            ("total", sum(self._numel), total),
        ]:
            for i, key in enumerate(COUNTS):
                row[f"diag/{name}/{key}"] = values[i] / numel
            row[f"diag/{name}/log2_hist"] = Histogram(values[len(COUNTS) :], HIST_EDGES)
        return row
