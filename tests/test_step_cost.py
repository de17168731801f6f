"""What mpexp's training step dispatches beyond a bare torch.amp loop, per precision.

Every operator dispatched is at least one kernel launch on a GPU, and a small model's step on a
fast GPU waits for its launches: on the H100 of docs/benchmarks.md the host took about 25 us per
kernel, and a 16-bit DeepCNN step under CUDA graphs took 3 ms. mpexp's step adds its history row
(one stack) and, under fp16, its loss scaler's extra rules (a non-finite loss skips the step
without backing off; a floor under the scale). Counted on the CPU, in every CI run: the counts do
not depend on the device.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from mpexp.models.simplecnn import SimpleCNN
from mpexp.precision.modes import setup_precision
from mpexp.precision.scaling import build_scaler
from mpexp.step import performance
from mpexp.step.diagnostics import Diagnostics
from mpexp.step.history import StepHistory
from mpexp.step.stepper import Stepper
from tests.conftest import CPU, make_cfg


class Dispatched(TorchDispatchMode):
    """Counts the operators that compute (a kernel launch each on a GPU); views (detach, view,
    select, t) only describe memory and launch nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


IMAGES, LABELS = torch.randn(8, 1, 28, 28), torch.randint(10, (8,))
AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def model() -> SimpleCNN:
    torch.manual_seed(0)
    return SimpleCNN(1, 10, (28, 28), width=4)


def bare_step_ops(precision: str) -> Counter[str]:
    """The loop as torch's AMP recipe writes it, with the fused Adam that CUDA runs take."""
    net = model()
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cpu", enabled=precision == "fp16")
    dtype = AUTOCAST[precision]

    def step() -> None:
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = F.cross_entropy(net(IMAGES), LABELS)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

    step()  # the first step creates the optimizer's state
    with Dispatched() as counted:
        step()
    return counted.ops


def mpexp_step_ops(precision: str) -> Counter[str]:
    cfg = make_cfg("model=simplecnn", f"precision={precision}", "optimizer.fused=true")
    net = model()
    mode = setup_precision(cfg.precision, CPU)
    scaler = build_scaler(cfg.loss_scaling, mode, CPU)
    optimizer = performance.build_optimizer(cfg, net, CPU, scaler)
    diagnostics = Diagnostics(cfg.diagnostics, net, scaler, None, mode)
    stepper = Stepper(net, optimizer, scaler, mode, StepHistory(), diagnostics)
    stepper.step(1, IMAGES, LABELS)
    with Dispatched() as counted:
        stepper.step(2, IMAGES, LABELS)
    return counted.ops


# fp32 and bf16: the history row (a stack, the loss's terms joined to it, train/z_loss beside the
# cross-entropy, and the copy into its ring row) and the non-finite guard, about 13 small kernels
# that make sure a step with inf/NaN gradients is never applied (the loss's check, the gradients'
# check, the fused step's skip flag); a bare loop applies it.
# fp16: the history row and the scaler's own rules (a non-finite loss skips without backing off;
# a floor under the scale), about 10; the whole rule (hysteresis) took about 45 more operators
# than torch's GradScaler before the `dynamic` default got its short path. On a GPU the default
# step is one CUDA graph, which launches none of them one by one (mpexp/step/step_graph.py).
@pytest.mark.parametrize(("precision", "at_most"), [("fp32", 15), ("bf16", 15), ("fp16", 17)])
def test_a_step_dispatches_few_operators_beyond_a_bare_amp_loop(precision, at_most):
    bare, ours = bare_step_ops(precision), mpexp_step_ops(precision)
    extra = ours.copy()
    extra.subtract(bare)
    said = {op: n for op, n in extra.items() if n}
    assert sum(ours.values()) - sum(bare.values()) <= at_most, said
