"""The base of every loss-scaling strategy (mpexp/precision/scaling.py): torch.amp.GradScaler
plus the scale it applied and whether the last step was skipped, as device tensors, so that the
loop keeps a complete scale history without a host-device synchronisation per step. Disabled, it
is the `none` strategy. It also skips a step whose loss is not finite, on every rank alike.
"""

from __future__ import annotations

import torch

from mpexp.shards import local_shard


def any_nonfinite(grads: list[torch.Tensor]) -> torch.Tensor:
    """1.0 if any element of `grads` (all on one device) is inf or NaN, else 0.0, on the device:
    one multi-tensor read of every gradient."""
    filled = [g for g in grads if g.numel()]
    if not filled:
        return torch.zeros((), device=grads[0].device)
    peaks = torch._foreach_norm(filled, float("inf"))
    return (~torch.isfinite(torch.stack(peaks))).any().float()


def optimizer_grads(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    params = (p for group in optimizer.param_groups for p in group["params"])
    return [p.grad for p in params if p.grad is not None]


class LossScaler(torch.amp.GradScaler):
    """GradScaler plus device-side views of the current scale and the last step's overflow.

    Enabled, it is the base of every strategy; disabled, it is the `none` strategy.
    """

    strategy = "none"
    min_scale = 0.0  # no floor

    def __init__(self, device: torch.device, **kwargs):
        super().__init__(device.type, **kwargs)
        self._found_inf = torch.zeros((), device=device)
        # as its tensors have it ("cuda" becomes "cuda:0"), so that comparing it with a
        # gradient's device tells whether a flag needs moving
        self.device = self._found_inf.device
        self._one = torch.ones((), device=device)
        self._sum_overflow_over_ranks = False
        # 1 when a loss of this step was not finite (int32: it takes part in arithmetic below).
        # Replaced, never changed in place, so one zero tensor serves every step's reset.
        self._all_finite = torch.zeros((), dtype=torch.int32, device=device)
        self._loss_bad = self._all_finite
        self._no_floor_hit = torch.zeros((), device=device)

    def scale_tensor(self) -> torch.Tensor:
        """The current scale as a device tensor (1.0 when disabled).

        It is the scaler's own tensor, which `update()` changes in place: copy it (the loop stacks
        it into its history) before calling `update()`.
        """
        if not self._enabled:
            return self._one
        if self._scale is None:
            self._lazy_init_scale_growth_tracker(self.device)
        return self._scale

    def found_inf(self) -> torch.Tensor:
        """1.0 if the last `step` was skipped (non-finite gradients or loss), else 0.0 (device)."""
        return self._found_inf

    def needs_true_units(self) -> bool:
        """Whether the scaler itself reads the gradients in true units before the step, so that
        `unscale_` must run before it (it need not otherwise: a fused optimizer unscales inside
        its own kernel)."""
        return False

    def skip_together(self) -> None:
        """Combine the overflow flags over all ranks (MAX) before each step is taken or skipped.

        Needed when each rank unscales different gradients (FSDP shards): one rank may find an
        inf that the others cannot see, and all must skip that step and back the scale off
        alike, as torch's ShardedGradScaler does. (Torch versions whose DTensor dispatch already
        combines the flag of a sharded unscale do not need it: see mpexp.distributed.)
        """
        self._sum_overflow_over_ranks = True

    def unscale_(self, optimizer) -> None:
        super().unscale_(optimizer)
        self._settle_flags(optimizer)

    def _check_inf_per_device(self, optimizer):
        # GradScaler.step's overflow check for a fused optimizer whose gradients are still scaled:
        # its kernel unscales them as it updates, writing each one back. GradScaler's own check
        # is an unscale by 1, which writes every gradient once more; on CUDA a multi-tensor
        # max-norm only reads them. (Torch's CPU max-norm is a slow path, and sharded FSDP
        # gradients need torch's check, which combines the ranks' flags.)
        grads = optimizer_grads(optimizer)
        if all(g.is_cuda and local_shard(g) is g for g in grads):
            devices = {g.device for g in grads}
            flags = {d: any_nonfinite([g for g in grads if g.device == d]) for d in devices}
            self._per_optimizer_states[id(optimizer)]["found_inf_per_device"] = flags
        else:
            flags = super()._check_inf_per_device(optimizer)
        self._settle_flags(optimizer)
        return flags

    def _settle_flags(self, optimizer) -> None:
        """Make the step's overflow flags final: the same on every rank, and set as well when a
        loss was not finite (such a step is skipped even if its gradients happen to be finite)."""
        if not self._enabled:
            return
        flags = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values()
        if self._sum_overflow_over_ranks:
            for found_inf in flags:
                # MAX, not SUM: fused optimizers skip a step only for a flag of exactly 1.0
                torch.distributed.all_reduce(found_inf, op=torch.distributed.ReduceOp.MAX)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            # every rank must skip (and keep its scale) alike, or the replicas drift apart
            self._loss_bad = self._loss_bad.clone()
            torch.distributed.all_reduce(self._loss_bad, op=torch.distributed.ReduceOp.MAX)
        for found in flags:
            torch.maximum(found, self._loss_bad.to(found.device), out=found)

    def floor_hit(self) -> torch.Tensor:
        """1.0 if the last `update` wanted to back off from a scale already at the floor."""
        return self._no_floor_hit

    @property
    def scales_loss(self) -> bool:
        """Whether it scales the loss (a skipped step is then an overflow, which the scale rule
        answers), as against guarding unscaled steps or doing nothing."""
        return self._enabled

    def continues_after_skip(self) -> bool:
        """Whether training goes on after a skipped step, which must then leave everything as
        it was (BatchNorm statistics, the learning-rate schedule's position)."""
        return self._enabled

    def capturable(self) -> bool:
        """Whether the next step can be captured in a CUDA graph and replayed: its device work
        must not depend on Python state that changes from step to step."""
        return True

    def reset_step(self) -> None:
        """Forget a step that was begun but not finished (a failed capture or compilation)."""
        if self._enabled:  # a disabled GradScaler keeps no per-step state
            self._per_optimizer_states.clear()
        self._loss_bad = self._all_finite

    def scale(self, outputs):
        if self._enabled and isinstance(outputs, torch.Tensor):
            self._mark_nonfinite_loss(outputs)
        return super().scale(outputs)

    def _mark_nonfinite_loss(self, outputs: torch.Tensor) -> None:
        """Every micro-batch's loss passes here: a non-finite one marks the whole step."""
        # x - x is exactly 0 for a finite x and NaN for inf or NaN: two operators (kernel
        # launches, on a GPU) where isfinite().all() takes five
        loss = outputs.detach()
        if loss.dim():  # not a loss but a batch of them
            bad = (loss - loss).ne(0).any().to(self._loss_bad.dtype)
        else:
            bad = torch.ne(loss - loss, 0, out=torch.empty_like(self._loss_bad))
        if self._loss_bad is not self._all_finite:  # a later micro-batch of the step
            bad = torch.maximum(self._loss_bad, bad)
        self._loss_bad = bad

    def step(self, optimizer, *args, **kwargs):
        # GradScaler.step unscales (or, for a fused optimizer, only checks) if unscale_ has not
        # run; either way the flags pass through _settle_flags first
        result = super().step(optimizer, *args, **kwargs)
        if self._enabled:
            flags = list(self._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values())
            if len(flags) == 1 and flags[0].device == self.device:
                self._found_inf = flags[0]  # a new tensor every step: no copy needed
            else:  # sum of per-device flags: stays on the device, read in the next flush
                self._found_inf = sum(v.to(self.device) for v in flags).clamp(max=1)
        return result

    def update(self, new_scale=None) -> None:
        super().update(new_scale)
        self._loss_bad = self._all_finite

    def _overflow(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(overflow, clean) for this step, as device booleans, over every optimizer stepped.

        A step skipped only for its loss is neither: the scale rule ignores it.
        """
        flags = [
            found.to(self.device)
            for state in self._per_optimizer_states.values()
            for found in state["found_inf_per_device"].values()
        ]
        if not flags:
            raise AssertionError("No inf checks were recorded prior to update.")
        skipped = torch.stack(flags).sum() > 0
        return skipped & (self._loss_bad == 0), ~skipped

    def describe(self) -> dict:
        """The scaler's settings for the run record."""
        return {"loss_scaling": self.strategy}

    def outcome(self) -> dict:
        """What the run settled on, for the summary (read at the end of training)."""
        return {}
