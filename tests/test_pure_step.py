"""Pure bf16's multi-tensor step: the bytes its step holds in every path (against the bound runs
record as `ran.bytes_step_peak`) and at real sizes on fake tensors, SGD's dampening as torch's,
and the warnings for states that bfloat16 stops moving."""

from __future__ import annotations

import logging

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from mpexp.plan.live_bytes import LiveBytes
from mpexp.precision.pure_layout import side_by_side
from mpexp.precision.pure_optimizers import PureAdam, PureSGD
from mpexp.precision.pure_step import CPU_CHUNK, CUDA_CHUNK
from mpexp.precision.pure_warnings import stall_point, warn_stalled_states
from tests.conftest import CPU
from tests.pure_reference import PureUpdates

# a matrix and a vector spanning several 4 Ki-element batches, tensors that share a batch, odd
# sizes (pieces that start and end inside the count's rows of 64), a convolution larger than a
# batch (channels-last: cut along its memory)
SHAPES = [(96, 130), (70,), (16, 32, 3, 3), (9_001,), (1,)]


def bf16_params(shapes=SHAPES, channels_last=False) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    params = []
    for s in shapes:
        t = (torch.randn(s, generator=g) * 0.1).bfloat16()
        if channels_last and t.dim() == 4:
            t = t.contiguous(memory_format=torch.channels_last)
        params.append(torch.nn.Parameter(t))
    return params


def set_grads(params, step: int, transposed: bool = False) -> None:
    """Gradients laid out as their weights, as autograd makes them (or, `transposed`, a
    matrix's laid out as its transpose)."""
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        grad = (torch.randn(p.shape, generator=g) * 1e-2).bfloat16()
        p.grad = grad.contiguous(memory_format=_format(p))
        if transposed and p.dim() == 2:
            p.grad = p.grad.t().contiguous().t()


def _format(p: torch.Tensor) -> torch.memory_format:
    channels_last = p.dim() == 4 and p.is_contiguous(memory_format=torch.channels_last)
    return torch.channels_last if channels_last else torch.contiguous_format


def build(kind: str, params, **pure):
    if kind == "sgd":
        return PureSGD(params, lr=1e-2, momentum=0.9, weight_decay=0.01, nesterov=True, **pure)
    decoupled = kind == "adamw"
    return PureAdam(params, lr=1e-3, weight_decay=0.01, decoupled=decoupled, **pure)


def step_bytes(optimizer, params, transposed: bool = False) -> tuple[int, int]:
    """(held between steps, the peak of a step) in bytes, each storage once: the second step,
    the first having made the states."""
    set_grads(params, 0, transposed)
    optimizer.step()
    set_grads(params, 1, transposed)
    return held_and_step_peak(optimizer, params)


def held_and_step_peak(optimizer, params) -> tuple[int, int]:
    """(the weights', gradients' and states' bytes, the peak of one step) of the next step."""
    held = [*params, *(p.grad for p in params)]
    held += [v for s in optimizer.state.values() for v in s.values()]  # the step counts too
    tracker = LiveBytes()
    with tracker:
        for t in held:
            tracker.adopt(t, "held")
        tracker.start("step")
        optimizer.step()
    return tracker.live_bytes(held), tracker.peaks["step"].nbytes


@pytest.mark.parametrize("count", [True, False])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("kind", ["adam", "adamw", "sgd"])
@pytest.mark.parametrize("rounding", ["nearest", "kahan", "stochastic"])
def test_every_path_holds_its_step_within_the_recorded_bound(rounding, kind, fused, count):
    """What `ran.bytes_step_peak` adds to the held bytes (`step_temporary_bytes`) bounds what
    the step allocates, in every path: each rounding, Adam's coupled and AdamW's decoupled
    weight decay, SGD's, fused or not, counting lost updates or not. (The earlier bound, 40
    bytes per chunk element, was exceeded by the unfused Kahan and stochastic steps with
    coupled weight decay.)"""
    params = bf16_params()
    optimizer = build(kind, params, rounding=rounding, fused=fused, count=count, chunk=1 << 12)
    held, peak = step_bytes(optimizer, params)
    assert peak - held <= optimizer.step_temporary_bytes()
    if not count and fused and rounding == "nearest":  # torch's fused kernel on the bf16 tensors
        assert peak == held


MLP = [(4096, 784), (4096,), (4096, 4096), (4096,), (4096, 4096), (4096,), (10, 4096), (10,)]
GPT2_SMALL = [
    (50_257, 768), (1024, 768),
    *[s for _ in range(12) for s in [(768,), (768,), (768, 2304), (2304,), (768, 768), (768,),
                                      (768,), (768,), (768, 3072), (3072,), (3072, 768), (768,)]],
    (768,), (768,),
]  # fmt: skip


def fake_adam(shapes, **pure) -> tuple[PureAdam, list[torch.nn.Parameter]]:
    """PureAdam over fake bf16 parameters of `shapes` (no memory), with its states made."""
    params = [torch.nn.Parameter(torch.empty(s, dtype=torch.bfloat16)) for s in shapes]
    optimizer = PureAdam(params, **pure)
    optimizer.init_states(params, optimizer.param_groups[0])
    return optimizer, params


@pytest.mark.parametrize(
    ("shapes", "device_type", "chunk"),
    [(MLP, "cpu", CPU_CHUNK), (GPT2_SMALL, "cuda", CUDA_CHUNK)],
    ids=["36.8M-cpu", "gpt2-small-cuda"],
)
@pytest.mark.parametrize(
    ("rounding", "most"), [("nearest", 8.5), ("kahan", 10.5), ("stochastic", 10.5)]
)
def test_the_step_peaks_near_the_held_bytes_at_real_size(
    shapes, device_type, chunk, rounding, most
):
    """Adam's step at 36.8 M parameters (a CPU's workspace) and at GPT-2 small's 124 M (a
    GPU's), on fake tensors, counting lost updates (its largest workspace): its bound (which
    every path keeps, above) at most half a byte a parameter above the 8 held (10 with Kahan's
    buffer). The chunked step of 4 Mi elements peaked at 13.4 bytes a parameter under Kahan
    at 36.8 M, and on a GPU would have held about 512 MiB of workspace."""
    with FakeTensorMode():
        optimizer, params = fake_adam(shapes, rounding=rounding, device_type=device_type)
        states = [v for state in optimizer.state.values() for v in state.values() if v.ndim]
        held = LiveBytes().live_bytes([*params, *states]) + sum(2 * p.numel() for p in params)
    assert optimizer.chunk == chunk
    count = sum(p.numel() for p in params)
    assert held / count == (10 if rounding == "kahan" else 8)
    assert (held + optimizer.step_temporary_bytes()) / count <= most


def test_a_step_on_fake_tensors_peaks_within_its_bound():
    """The step a plan rehearses: 36.8 M parameters on fake tensors in a GPU's batches (18 of
    them), stochastic rounding counting its lost updates, within the bound it records."""
    with FakeTensorMode():
        optimizer, params = fake_adam(MLP, rounding="stochastic", device_type="cuda")
        for p in params:
            p.grad = torch.empty_like(p)
        held, peak = held_and_step_peak(optimizer, params)
    added = peak - held
    assert 0 < added <= optimizer.step_temporary_bytes()


def sgd_pair(dampening: float, fused: bool):
    """torch's SGD on float32 copies (the hooks of the earlier update) and PureSGD, both with
    `dampening`, on the same bf16 weights."""
    runs = []
    for ours in (False, True):
        params = bf16_params()
        settings = {"lr": 1e-2, "momentum": 0.9, "dampening": dampening, "weight_decay": 0.01}
        if ours:
            optimizer = PureSGD(params, **settings, fused=fused, chunk=1 << 12)
        else:
            optimizer = torch.optim.SGD(params, **settings, fused=fused)
            PureUpdates(optimizer, "nearest", torch.bfloat16, 0, CPU)
        runs.append((optimizer, params))
    return runs


@pytest.mark.parametrize("fused", [True, False])
def test_sgd_with_dampening_starts_its_momentum_with_the_gradient_as_torch_does(fused):
    """torch's SGD stores the first gradient itself in the momentum buffer, whatever the
    dampening; the fused pure step stored (1 - dampening) times it, and 4,813 of 5,762 weights
    differed from torch's after 15 steps."""
    (theirs, their_params), (mine, my_params) = sgd_pair(0.5, fused)
    for step in range(15):
        for optimizer, params in ((theirs, their_params), (mine, my_params)):
            set_grads(params, step)
            optimizer.step()
    for a, b in zip(their_params, my_params, strict=True):
        assert torch.equal(a, b)


# tiny tensors, several of them inside one row of 64 of the count's sums, one a whole row, and
# batches of 128 that end inside a row, at a row's end, and in the middle of a cut tensor
TINY = [(3,), (5,), (64,), (1,), (2, 3), (63,), (7, 19), (1,)]


@pytest.mark.parametrize(("shapes", "chunk"), [(SHAPES, 1 << 12), (TINY, 128)], ids=["4Ki", "tiny"])
@pytest.mark.parametrize("rounding", ["nearest", "kahan"])
def test_the_lost_update_counts_are_the_earlier_updates_per_parameter(rounding, shapes, chunk):
    """Counted over a batch's stretch (masks summed by rows of 64, which pieces start and end
    inside), each parameter's counts of lost and nonzero updates are those the earlier update
    counted tensor by tensor, over steps that walk several batches."""
    params = bf16_params(shapes)
    earlier = torch.optim.Adam(params, lr=1e-3, weight_decay=0.01, fused=True)
    counted = PureUpdates(earlier, rounding, torch.bfloat16, 0, CPU)
    mine = bf16_params(shapes)
    optimizer = PureAdam(mine, lr=1e-3, weight_decay=0.01, rounding=rounding, chunk=chunk)
    for step in range(4):
        for each, ps in ((earlier, params), (optimizer, mine)):
            set_grads(ps, step)
            each.step()
    assert counted.lost.counts.sum() > 0
    assert torch.equal(counted.lost.counts, optimizer.lost.counts)


@pytest.mark.parametrize("rounding", ["nearest", "kahan", "stochastic"])
def test_a_gpus_step_lets_its_workspace_go_and_steps_as_a_cpus(rounding, monkeypatch):
    """A GPU's step lets its workspace go, so that the next forward and backward passes can use
    its memory: after the first step, a step leaves nothing it made behind, and makes no tensor
    from host values (a copy from the host, which a step would wait on: where the batches'
    pieces start is put on the device once). It ends with the weights and lost-update counts
    of a CPU's step, which keeps its workspace (here both on a CPU's tensors)."""
    from_host = []
    tensor = torch.tensor
    monkeypatch.setattr(torch, "tensor", lambda *a, **k: from_host.append(a) or tensor(*a, **k))
    runs = {}
    for device_type in ("cpu", "cuda"):
        params = bf16_params()
        optimizer = build("adam", params, rounding=rounding, chunk=1 << 12, device_type=device_type)
        made, left = [], []  # by each step after the first: at its peak, and after it
        for step in range(3):
            set_grads(params, step)
            held = [*params, *(p.grad for p in params), optimizer.lost.counts]
            held += [v for state in optimizer.state.values() for v in state.values()]
            tracker = LiveBytes()
            from_host.clear()
            with tracker:
                for t in held:
                    tracker.adopt(t, "held")
                tracker.start("step")
                optimizer.step()
            if step:
                made.append(tracker.peaks["step"].nbytes - tracker.live_bytes(held))
                left.append(tracker.now - tracker.live_bytes(held))
                assert from_host == []
        runs[device_type] = params, optimizer.lost.counts, made, left
    params, counts, made, left = runs["cuda"]
    assert left == [0, 0] and min(made) > 22 * (1 << 12)  # a workspace in every step
    assert min(runs["cpu"][3]) >= 16 * (1 << 12)  # a CPU's is held from step to step
    assert all(torch.equal(a, b) for a, b in zip(runs["cpu"][0], params, strict=True))
    assert torch.equal(runs["cpu"][1], counts) and counts.sum() > 0


@pytest.mark.gpu
@pytest.mark.parametrize("rounding", ["nearest", "kahan", "stochastic"])
def test_a_gpus_steps_never_wait_on_it(rounding):
    """On CUDA, after the first step (which puts where the batches' pieces start on the GPU),
    steps that count lost updates and let their workspace go never wait on the GPU (CUDA's
    sync-debug mode set to error)."""
    params = [torch.nn.Parameter(p.detach().cuda()) for p in bf16_params()]
    optimizer = build("adam", params, rounding=rounding, chunk=1 << 12)
    grads = [[torch.randn_like(p) * 1e-2 for p in params] for _ in range(6)]

    def steps(grads) -> None:
        for step_grads in grads:
            for p, g in zip(params, step_grads, strict=True):
                p.grad = g
            optimizer.step()
            assert optimizer.batches.workspace is None

    steps(grads[:3])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        steps(grads[3:])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert optimizer.lost.counts[:, 1].sum() > 0


@pytest.mark.parametrize("rounding", ["nearest", "kahan"])
def test_channels_last_weights_step_as_contiguous_ones(rounding):
    """A channels-last convolution's weight, gradient and states share one layout: stepped along
    its memory, it ends as the same weights as a contiguous one, bit for bit."""
    ends = []
    for channels_last in (False, True):
        params = bf16_params(channels_last=channels_last)
        optimizer = PureAdam(params, lr=1e-3, rounding=rounding, chunk=1 << 12)
        for step in range(3):
            set_grads(params, step)
            optimizer.step()
        ends.append([p.detach().contiguous() for p in params])
    assert all(torch.equal(a, b) for a, b in zip(*ends, strict=True))


@pytest.mark.parametrize("rounding", ["nearest", "kahan"])
def test_gradients_laid_out_otherwise_are_stepped_by_rows_as_contiguous_ones(rounding):
    """A weight larger than a batch whose gradient is laid out otherwise (a transpose) is cut
    along its first dimension, in pieces of whole rows, and a row larger than a batch is a
    piece of its own: it ends as the same weights as with gradients laid out as the weights,
    bit for bit, within its recorded bound. (A row piece's size was once counted in rows, so
    that pieces overlapped in the workspace.)"""
    shapes = [(3, 5_000), (40, 300), (70,)]
    ends = []
    for transposed in (False, True):
        params = bf16_params(shapes)
        optimizer = build("adam", params, rounding=rounding, chunk=1 << 12)
        held, peak = step_bytes(optimizer, params, transposed)
        assert peak - held <= optimizer.step_temporary_bytes()
        set_grads(params, 2, transposed)
        optimizer.step()
        ends.append([p.detach().clone() for p in params])
    assert all(torch.equal(a, b) for a, b in zip(*ends, strict=True))


@pytest.mark.parametrize(
    ("beta", "target", "stops_at"),
    [(0.999, 1.0, 0.25), (0.995, 1.0, 0.609), (0.99, 1.0, 0.805), (0.999, 1000.0, 256.0)],
)
def test_the_stall_point_is_where_bfloat16_stops_the_average(beta, target, stops_at):
    """The stall point computed from bfloat16's spacing, against the average itself stored in
    bfloat16 and rounded to nearest, under a constant input: Adam's second moment at beta2
    0.999 sticks at 0.25 and at 0.99 at 0.80 of its input (float32: 1); SGD's momentum 0.999
    at 256 of 1000."""
    x = torch.zeros(1, dtype=torch.bfloat16)
    for _ in range(round(10 / (1 - beta))):
        x = (x.float() * beta + (1 - beta) * target).bfloat16()
    assert stall_point(beta, target) == pytest.approx(stops_at, rel=2e-3)
    assert x.item() == pytest.approx(stops_at, rel=5e-3)


def stalled_warnings(caplog, rounding, states, averages) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        warn_stalled_states(rounding, states, averages)
    return [r.getMessage() for r in caplog.records]


def test_a_state_that_stops_short_is_warned_about_with_where_it_stops(caplog):
    adam = [
        ("Adam's first moment", "beta1", 0.9, 1.0),
        ("Adam's second moment", "beta2", 0.99, 1.0),
    ]
    (said,) = stalled_warnings(caplog, "nearest", "bfloat16", adam)
    assert "second moment (beta2=0.99)" in said and "about 0.80 of float32's value" in said
    assert "65% leave bfloat16's unchanged" in said
    sgd = [("SGD's momentum buffer", "momentum", 0.999, 1000.0)]
    (said,) = stalled_warnings(caplog, "kahan", "bfloat16", sgd)  # Kahan's states: nearest
    assert "momentum buffer (momentum=0.999)" in said and "about 0.26" in said
    quiet = [
        ("Adam's second moment", "beta2", 0.98, 1.0),
        ("SGD's momentum buffer", "momentum", 0.9, 10.0),
    ]
    assert stalled_warnings(caplog, "nearest", "bfloat16", quiet) == []
    for rounding, states in (("stochastic", "bfloat16"), ("nearest", "float32")):
        assert stalled_warnings(caplog, rounding, states, adam + sgd) == []


def test_the_step_counts_advance_in_one_operation_and_resume_so():
    """Adam's count of steps per parameter (torch's 0-dim "step") lies side by side in one
    tensor, made so and loaded back so: a step adds one to all of them in one operation (a
    foreach add over 160 small tensors' counts took a sixth of their step), and a step a loss
    scaler skips takes it back. The counts are right either way."""
    params = bf16_params([(8, 8), (8,)] * 20)
    optimizer = PureAdam(params, lr=1e-3, rounding="kahan", chunk=1 << 12)
    for step in range(3):
        set_grads(params, step)
        optimizer.step()
    counts = [optimizer.state[p]["step"] for p in params]
    assert side_by_side(counts) is not None
    assert all(c.item() == 3 for c in counts)
    resumed = PureAdam(bf16_params([(8, 8), (8,)] * 20), lr=1e-3, rounding="kahan")
    resumed.load_state_dict(optimizer.state_dict())
    loaded = [resumed.state[p]["step"] for p in resumed.params]
    assert side_by_side(loaded) is not None and all(c.item() == 3 for c in loaded)
    set_grads(resumed.params, 3)
    resumed.found_inf = torch.ones(())  # what GradScaler hands a fused step that overflowed
    resumed.step()
    assert all(c.item() == 3 for c in loaded)
