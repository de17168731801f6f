"""Pure bf16's compiled update (precision.update_compile; mpexp/precision/pure_compiled.py)
against the eager step it stands in for: the same weights, states and counts (SGD bit for bit,
Adam to an ulp, where the order of torch's fused kernel's operations differs), Kahan's buffer
kept (inductor would drop the rounding it is made of), stochastic rounding unbiased and resumed
exactly, the step's bytes within the recorded bound, when a run compiles it and what it records.

Each test compiles a few of the update's variants (seconds each on two cores); the file shares
them in one process (one xdist group a file)."""

from __future__ import annotations

import io
import logging
import re

import pytest
import torch
from torch._inductor import config as inductor_config
from torch._inductor.utils import run_and_get_code
from torch._subclasses.fake_tensor import FakeTensorMode

from mpexp.errors import ConfigError
from mpexp.precision import pure_compiled, pure_kernels
from mpexp.precision.pure_compiled import COUNT_TEMPORARY, compile_setting
from mpexp.precision.pure_kernels import Variant, adam_coefficients, can_compile, compiled
from mpexp.precision.pure_optimizers import PureAdam, PureSGD, build_pure
from mpexp.run.runner import train
from mpexp.tracking.run_context import RunContext
from mpexp.validate import validate
from tests.conftest import CPU, make_cfg
from tests.test_bf16_pure import PURE
from tests.test_pure_step import bf16_params, set_grads

pytestmark = pytest.mark.skipif(can_compile(CPU) is not None, reason="no C++ compiler")

CHUNK = 1 << 12  # several batches of one piece, a parameter cut along its memory, shared ones


def sgd(params, **pure):
    return PureSGD(params, lr=1e-2, momentum=0.9, weight_decay=0.01, nesterov=True, **pure)


def adam(params, **pure):
    return PureAdam(params, lr=1e-3, weight_decay=0.01, **pure)


def stepped(build, steps: int = 4, **pure):
    """The weights and the lost-update counts after `steps` steps, counting every other."""
    params = bf16_params()
    optimizer = build(params, chunk=CHUNK, count_every=2, **pure)
    for step in range(steps):
        set_grads(params, step)
        optimizer.step()
    return [p.detach().clone() for p in params], optimizer.lost.counts.clone(), optimizer


def watched_calls(monkeypatch, backend: str) -> list:
    """The update's calls through `backend` ("native", a CPU's C loop, or "compiled",
    torch.compile's), as (variant, elements), from here on."""
    calls = []
    real = getattr(pure_compiled, backend)

    def watched(variant):
        update = real(variant)

        def call(*args):
            calls.append((variant, args[0].numel()))
            return update(*args)

        return call

    monkeypatch.setattr(pure_compiled, backend, watched)
    return calls


@pytest.mark.parametrize("rounding", ["nearest", "kahan"])
def test_sgds_compiled_update_is_the_eager_one_bit_for_bit(rounding):
    """Weights and counts equal, through batches of one piece, parameters stepped whole in one
    call and batches of several small tensors gathered (Nesterov, weight decay, bf16 states;
    with dampening or float32 states torch's fused SGD rounds a multiply-add once where this
    loop rounds twice: an ulp apart, as Adam below)."""
    eager, eager_counts, _ = stepped(sgd, rounding=rounding, compiled=False)
    mine, counts, optimizer = stepped(sgd, rounding=rounding, compiled=True)
    assert optimizer.update_path == "compiled"
    for theirs, ours in zip(eager, mine, strict=True):
        assert torch.equal(theirs, ours)
    assert torch.equal(counts, eager_counts)
    assert counts[:, 1].sum() > 0  # the counting steps counted


def test_adams_compiled_update_is_the_eager_one_to_an_ulp():
    """Adam's float32 formula in another order than torch's fused kernel: after four steps a
    weight differs by one bfloat16 ulp at most, and at most one in a thousand differs."""
    eager, eager_counts, _ = stepped(adam, rounding="kahan", compiled=False)
    mine, counts, _ = stepped(adam, rounding="kahan", compiled=True)
    differ = total = 0
    for theirs, ours in zip(eager, mine, strict=True):
        ulp = torch.finfo(torch.bfloat16).eps * theirs.float().abs().clamp(min=2**-126)
        assert ((theirs.float() - ours.float()).abs() <= ulp).all()
        differ, total = differ + (theirs != ours).sum().item(), total + theirs.numel()
    assert differ <= total / 1000
    assert (counts - eager_counts).abs().sum() <= total / 1000


def test_a_gathered_batchs_count_never_writes_over_its_own_weights(monkeypatch):
    """A batch of one piece whose gradient is laid out otherwise (a transposed matrix) is
    gathered; torch.compile's counting loop (a GPU's) must not take the gathered weights'
    buffer as its output: the loop compiled for that aliasing, kept in inductor's cache on
    disk, wrote over the weights in later processes whose buffers did not alias."""
    monkeypatch.setattr(pure_compiled, "NATIVE_DEVICES", ())
    calls = []
    real = pure_compiled.compiled

    def watched(variant):
        update = real(variant)

        def checked(w, g, states, carried, coefficients, draws, masks, scaling):
            for out in masks or ():
                span = (out.data_ptr(), out.data_ptr() + out.numel() * out.element_size())
                start, end = w.data_ptr(), w.data_ptr() + w.numel() * w.element_size()
                calls.append(span[0] < end and start < span[1])
            return update(w, g, states, carried, coefficients, draws, masks, scaling)

        return checked

    monkeypatch.setattr(pure_compiled, "compiled", watched)
    params = bf16_params()
    optimizer = sgd(params, rounding="kahan", chunk=CHUNK, compiled=True)
    eager_params = bf16_params()
    eager = sgd(eager_params, rounding="kahan", chunk=CHUNK, compiled=False)
    for step in range(2):
        for ps, o in ((params, optimizer), (eager_params, eager)):
            set_grads(ps, step, transposed=True)
            o.step()
    assert calls and not any(calls)
    assert all(torch.equal(a, b) for a, b in zip(params, eager_params, strict=True))
    assert torch.equal(optimizer.lost.counts, eager.lost.counts)


@pytest.mark.parametrize("backend", ["native", "compiled"])
def test_a_models_small_tensors_share_a_call_and_each_large_one_takes_one(monkeypatch, backend):
    """A model keeps small tensors between its large ones (a normalisation's weight and bias
    between two convolutions): they are stepped together, in one gathered batch, and each
    tensor larger than a batch in one call where it lies, its last piece with it; the weights
    are the eager step's, bit for bit. (Batched in the model's order, each large tensor's last
    piece went with the small ones after it: six calls a step here, not four.) Through the C
    loop and through torch.compile's."""
    if backend == "compiled":
        monkeypatch.setattr(pure_compiled, "NATIVE_DEVICES", ())
    calls = watched_calls(monkeypatch, backend)
    shapes = [(16, 32, 3, 3), (16,), (16,), (32, 32, 3, 3), (32,), (32,), (10, 410), (10,)]
    results, last = [], []
    for compiles in (True, False):
        params = bf16_params(shapes)
        optimizer = sgd(params, rounding="kahan", chunk=CHUNK, compiled=compiles, count=False)
        for step in range(3):
            set_grads(params, step)
            calls.clear()
            optimizer.step()
            last = sorted(n for _, n in calls) if compiles else last
        results.append(params)
    assert last == [106, 4100, 4608, 9216]  # the last step's calls, by elements
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


@pytest.mark.parametrize("rounding", ["nearest", "kahan"])
def test_weights_out_of_the_splits_range_step_as_the_eager_ones_do(rounding):
    """Veltkamp's split (the rounding kept in the compiled loop on a CPU) overflowed from 2^112
    and made inf NaN: it now splits the value scaled by 2^-20, and round-to-nearest stores the
    cast. Weights, NaNs (Kahan's inf - inf, as the eager step's) and counts as the eager step's;
    under round-to-nearest an infinite weight stays infinite, also where a weight decay of 0 is
    not multiplied in."""
    values = [float("inf"), float("-inf"), 2.0**113, -(2.0**120), 2.0**-130, 1.0, 0.0]
    ends = []
    for how in (False, True):
        weight = torch.nn.Parameter(torch.tensor(values * 800, dtype=torch.bfloat16))
        optimizer = PureAdam([weight], lr=1e-3, rounding=rounding, compiled=how)
        for _ in range(3):
            weight.grad = torch.full_like(weight, 1e-3)
            optimizer.step()
        ends.append((weight.detach().clone(), optimizer.lost.counts.clone()))
    (eager, eager_counts), (mine, counts) = ends
    assert torch.equal(mine.isnan(), eager.isnan())
    assert torch.equal(mine.nan_to_num(), eager.nan_to_num())
    assert torch.equal(counts, eager_counts)
    if rounding == "nearest":
        assert not mine.isnan().any()


def test_adams_bias_corrections_are_had_in_float64_as_torchs_kernel_has_them():
    group = {"betas": (0.9, 0.9999), "lr": 1e-3, "weight_decay": 0.0, "eps": 1e-8}
    for step in (1, 10, 1000, 100_000):
        made = adam_coefficients(torch.tensor(float(step)), group, decoupled=True)
        root = (1 - 0.9999**step) ** 0.5
        size = 1e-3 / (1 - 0.9**step)
        assert made[3].item() == pytest.approx(root, rel=1e-7)
        assert made[5].item() == pytest.approx(size, rel=1e-7)


def test_kahans_buffer_keeps_the_updates_rounding_to_nearest_loses():
    """Steps of a third of bfloat16's half-spacing at 1: nearest never moves the weights;
    compiled Kahan lands on the float32 result within an ulp. Without the rounding kept inside
    the compiled loop (inductor drops a cast to bfloat16 and back), its buffer stays 0 and it
    is nearest."""
    ends = {}
    for rounding in ("nearest", "kahan"):
        weight = torch.nn.Parameter(torch.ones(5000, dtype=torch.bfloat16))
        optimizer = PureSGD([weight], lr=2**-11, momentum=0.9, nesterov=True,
                            rounding=rounding, compiled=True, count=False)  # fmt: skip
        reference = torch.ones(5000)
        buffer = torch.zeros(5000)
        for step in range(40):
            weight.grad = torch.full_like(weight, -0.1)
            optimizer.step()
            buffer = -0.1 * torch.ones(5000) if step == 0 else 0.9 * buffer - 0.1
            reference -= 2**-11 * (-0.1 + 0.9 * buffer)
        ends[rounding] = weight.detach().float()
    assert torch.equal(ends["nearest"], torch.ones(5000))
    assert reference[0] > 1 + 2**-7  # float32 went past the next bfloat16 value
    assert (ends["kahan"] - reference).abs().max() <= 2**-7


def test_compiled_stochastic_rounding_is_unbiased_and_resumes_exactly():
    """SGD's steps of a sixteenth of the spacing at 1: nearest would never move; each weight's
    stochastic rounding lands on the float32 result in the mean over 65,536 weights. A copy
    loaded from the state dict halfway continues with the same draws."""
    weight = torch.nn.Parameter(torch.ones(1 << 16, dtype=torch.bfloat16))
    optimizer = PureSGD([weight], lr=2**-12, rounding="stochastic", compiled=True, seed=3)
    twin = torch.nn.Parameter(weight.detach().clone())
    other = PureSGD([twin], lr=2**-12, rounding="stochastic", compiled=True, seed=99)
    for step in range(64):
        if step == 32:
            twin.data.copy_(weight.detach())
            other.load_state_dict(optimizer.state_dict())
        for p in (weight, twin):
            p.grad = torch.full_like(p, -1.0)
        optimizer.step()
        if step >= 32:
            other.step()
    end = weight.detach().float()
    assert end.mean().item() == pytest.approx(1 + 2**-6, abs=4 * 2**-14)
    assert end.std().item() > 2**-9  # rounded up or down at random, not all alike
    assert torch.equal(twin, weight)


@pytest.mark.parametrize("backend", ["native", "compiled"])
def test_a_counting_step_counts_a_large_parameter_in_few_calls(monkeypatch, backend):
    """A counting step takes a parameter stepped whole in one call of the C loop, which counts
    as it goes; torch.compile's loop (a GPU's), which holds a value per element of a call and
    writes its new weights into the workspace's float32 weight buffer as bf16, in calls of
    twice the workspace's elements at most, not a chunk a call: here 12,480 and 9,001 elements
    in calls of 8,192 at most. Weights and counts are the eager step's, bit for bit."""
    if backend == "compiled":
        monkeypatch.setattr(pure_compiled, "NATIVE_DEVICES", ())
    calls = watched_calls(monkeypatch, backend)
    eager, eager_counts, _ = stepped(sgd, steps=2, rounding="kahan", compiled=False)
    mine, counts, _ = stepped(sgd, steps=2, rounding="kahan", compiled=True)
    assert all(torch.equal(a, b) for a, b in zip(eager, mine, strict=True))
    assert torch.equal(counts, eager_counts) and counts[:, 1].sum() > 0
    summed = sorted(n for v, n in calls if v.count == "sums")  # SHAPES' three large ones
    if backend == "native":  # and the small ones gathered, counted by piece in their call
        assert summed == [71, 4608, 9001, 12480]
    else:  # 9,001 = 8,192 + 809; 12,480 = 8,192 + 4,288
        assert summed == [809, 4288, 4608, 8192, 8192]


def test_a_parameter_too_long_for_one_hash_is_stepped_in_calls_with_keys_of_their_own(
    monkeypatch,
):
    """The hash's index repeats past 2^32 elements of a call: the C loop steps a parameter of
    2^31 elements or more in calls below that, each drawing its own keys. Here the limit is
    4,096: SHAPES' large parameters take three, four and two calls, the weights and counts the
    eager step's bit for bit (Kahan), and stochastic rounding draws keys for every call."""
    calls, draws = watched_calls(monkeypatch, "native"), []
    draw = pure_compiled.draw_keys
    monkeypatch.setattr(pure_compiled, "INT32_INDEX_BELOW", 4096)
    monkeypatch.setattr(pure_compiled, "draw_keys", lambda *a: draws.append(1) or draw(*a))
    eager, eager_counts, _ = stepped(sgd, steps=2, rounding="kahan", compiled=False)
    mine, counts, _ = stepped(sgd, steps=2, rounding="kahan", compiled=True)
    assert all(torch.equal(a, b) for a, b in zip(eager, mine, strict=True))
    assert torch.equal(counts, eager_counts) and counts[:, 1].sum() > 0
    # each step: 4,608 = 4,096 + 512; 9,001 = 2 x 4,096 + 809; 12,480 = 3 x 4,096 + 192; the
    # small ones gathered (71)
    assert sorted(n for _, n in calls) == sorted([4096] * 12 + [512, 809, 192, 71] * 2)
    calls.clear()
    stepped(sgd, steps=1, rounding="stochastic", compiled=True)
    assert len(draws) == len(calls) > 0


@pytest.mark.parametrize(
    "build,begins",
    [(sgd, "experts"), (sgd, "halves"), (adam, "halves")],
    ids=["sgd-experts", "sgd-halves", "adam-halves"],
)
def test_a_resumed_run_whose_parameters_began_on_different_steps_continues_exactly(build, begins):
    """Parameters that begin training on different steps: a mixture of experts' (shared
    tensors from the first step, one expert's from the first, the other's from the second) or
    two halves of a model (one from the first step, the other from the second). Each batch
    must take the same path (compiled or eager, whose stochastic roundings are different
    streams) after a resume as before: the resumed run lays out the states as the steps that
    made them did, and knows each parameter's count of steps (SGD keeps no "step" state).
    Each case failed before: SGD's counts restarted at 0, and the states came back in one
    buffer."""
    shapes = [(64,), (32, 64), (64,), (64, 32)] * 4
    # the step each parameter begins on
    began = [0, 0, 0, 1] * 4 if begins == "experts" else [0] * 8 + [1] * 8

    def grads(params, step):
        g = torch.Generator().manual_seed(step)
        for i, p in enumerate(params):
            shared = begins == "experts" and i % 4 < 2
            on = shared or step >= 2 or began[i] == step
            p.grad = (torch.randn(p.shape, generator=g) * 1e-2).bfloat16() if on else None

    def run(params, optimizer, steps):
        for step in steps:
            grads(params, step)
            optimizer.step()

    pure = {"rounding": "stochastic", "chunk": CHUNK, "compiled": True, "count": False}
    params = bf16_params(shapes)
    optimizer = build(params, seed=1, **pure)
    run(params, optimizer, range(4))
    saved = io.BytesIO()
    torch.save(optimizer.state_dict(), saved)
    resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed = build(resumed_params, seed=1, **pure)
    saved.seek(0)
    resumed.load_state_dict(torch.load(saved, weights_only=True))
    run(params, optimizer, range(4, 8))
    run(resumed_params, resumed, range(4, 8))
    assert all(torch.equal(a, b) for a, b in zip(params, resumed_params, strict=True))


def test_the_stochastic_roundings_random_bits_are_a_bijection_of_the_index():
    """The hash behind compiled stochastic rounding maps distinct indices to distinct pairs of
    16-bit halves (a bijection: with uniform keys each half is uniform, so the rounding is
    unbiased), and the two halves a value and a state take, and neighbouring elements', are
    uncorrelated."""
    from mpexp.precision.pure_kernels import _noise

    keys = torch.tensor([0x1234, 0xBEEF], dtype=torch.int32)
    left, right = _noise(1 << 20, keys, CPU)
    assert int(left.min()) >= 0 and int(left.max()) < 1 << 16 and int(right.max()) < 1 << 16
    assert torch.unique(left.long() << 16 | right.long()).numel() == 1 << 20
    halves = torch.stack((left[:-1], right[:-1], left[1:])).double()
    correlation = torch.corrcoef(halves)
    assert (correlation - torch.eye(3)).abs().max() < 0.01


@pytest.mark.parametrize(
    "variant",
    [
        Variant("adam", "kahan"),
        Variant("adam", "kahan", count="sums"),
        Variant("adam", "kahan", count="masks"),
        Variant("sgd", "stochastic", momentum=True, nesterov=True),
        Variant("sgd", "nearest", count="sums", momentum=True),
    ],
    ids=lambda v: f"{v.algorithm}-{v.rounding}-{v.count or 'nocount'}",
)
def test_the_compiled_loops_hold_what_the_recorded_bound_says(variant):
    """A step that counts nothing steps a parameter whole in one call: its loop may allocate
    nothing per element. A counting one steps twice the workspace's elements at most, and may
    allocate COUNT_TEMPORARY bytes per element, which `ran.bytes_step_peak`'s bound counts.
    Read in the code inductor writes: a buffer sized by the batch's (symbolic) length."""
    n = 5000
    w, g = (torch.randn(n).bfloat16() for _ in "wg")
    states = [torch.zeros_like(w) for _ in range(variant.states)]
    coefficients = torch.full((7,), 0.1)
    carried = torch.zeros_like(w) if variant.rounding == "kahan" else None
    stochastic = variant.rounding == "stochastic"
    draws = torch.tensor([1, 2, 3, 4], dtype=torch.int32) if stochastic else None
    masks = {"": None, "sums": (torch.empty_like(w),)}.get(variant.count)
    if variant.count == "masks":
        masks = (torch.empty_like(w), torch.empty_like(w))
    fresh = compiled.__wrapped__(variant)  # not the cached one: inductor writes its code
    with inductor_config.patch(force_disable_caches=True):
        args = (w, g, states, carried, coefficients, draws, masks, None)
        _, codes = run_and_get_code(fresh, *args)
    per_element = 0
    for shape, dtype in re.findall(
        r"empty_strided_cpu\(\((\w+), \), \(1, \), torch\.(\w+)\)", codes[-1]
    ):
        if not shape.isdigit():
            per_element += getattr(torch, dtype).itemsize
    assert per_element <= (COUNT_TEMPORARY if variant.count else 0)


def test_when_a_run_compiles_the_update_on_its_own():
    """On a CPU, whatever the size and the rounding (the C loop: built in a tenth of a second,
    faster at every size measured); not the op-by-op formula; on a GPU only when asked;
    `true` refused where it cannot be."""
    cpu, cuda = CPU, torch.device("cuda")
    assert compile_setting(None, True, cpu) is None  # compiled, falling back loudly
    assert compile_setting(None, False, cpu) is False  # the formula
    assert compile_setting(None, True, cuda) is False
    assert compile_setting(None, True, cpu, "cuda") is False  # a plan for a GPU
    assert compile_setting(True, True, cpu) is True
    assert compile_setting(False, True, cpu) is False
    with pytest.raises(ConfigError, match=r"optimizer\.fused=false"):
        compile_setting(True, False, cpu)


def test_a_plan_for_a_gpu_bounds_the_step_a_gpu_run_takes():
    """A plan for CUDA builds pure bf16's optimizer on fake CPU tensors: `null` must leave its
    update eager there as a GPU run's is, so that the workspace the plan prints holds no
    compiled loop's buffers (GPT-2 small's plan said 60.5 MiB for a step that holds 44.4)."""
    cfg = make_cfg(*PURE, "precision=bf16_pure_kahan")
    with FakeTensorMode():
        params = [torch.nn.Parameter(torch.empty(1 << 22, dtype=torch.bfloat16))]
    steps = {}
    for setting in (None, False):
        cfg.precision.update_compile = setting
        optimizer = build_pure("torch.optim.AdamW", {"lr": 1e-3}, params, cfg, True, False, "cuda")
        steps[setting] = (optimizer.compiles, optimizer.step_temporary_bytes())
    assert steps[None] == steps[False] and steps[None][0] is False


@pytest.mark.parametrize("strategy", ["single", "ddp"])
def test_a_ddp_run_that_compiles_on_its_own_stops_where_a_compilation_fails(strategy):
    """`null` falls back to the eager step where a compilation fails; under DDP that would be
    one rank's fallback, rounding otherwise (stochastic rounding from another stream) than
    the replicas it must stay equal to, so there a failure stops the run as `true` does."""
    cfg = make_cfg(*PURE, "precision=bf16_pure_stochastic", f"trainer.strategy={strategy}")
    params = [torch.nn.Parameter(torch.zeros(4096, dtype=torch.bfloat16))]
    optimizer = build_pure("torch.optim.AdamW", {"lr": 1e-3}, params, cfg, True, False)
    assert optimizer.compiled_update.required is (strategy == "ddp")


def test_the_hash_takes_the_same_bits_from_an_int64_index_as_from_an_int32_one(monkeypatch):
    """A call of 2^31 elements or more (one tensor stepped whole) hashes an int64 index, which
    an int32 one would wrap negative; below, the int32 index gives the same bits."""
    keys = torch.tensor([0x1234, 0xBEEF, 7, 9], dtype=torch.int32)
    narrow = pure_kernels._noise(70_000, keys[:2], CPU)
    monkeypatch.setattr(pure_kernels, "INT32_INDEX_BELOW", 1000)
    wide = pure_kernels._noise(70_000, keys[:2], CPU)
    assert all(torch.equal(a, b) for a, b in zip(narrow, wide, strict=True))
    assert all(int(n.min()) >= 0 and int(n.max()) < 1 << 16 for n in narrow)


def test_a_failed_compilation_falls_back_loudly_or_stops_a_run_that_asked(monkeypatch, caplog):
    def broken(_variant):
        def update(*_):
            raise RuntimeError("no compiler today")

        return update

    monkeypatch.setattr(pure_compiled, "native", broken)  # a CPU's
    eager, _, _ = stepped(sgd, rounding="kahan", compiled=False)
    with caplog.at_level(logging.WARNING):
        mine, _, optimizer = stepped(sgd, rounding="kahan", compiled=None)
    assert optimizer.update_path == "eager"
    assert "failed to build or compile (RuntimeError: no compiler today)" in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(eager, mine, strict=True))
    with pytest.raises(RuntimeError, match=r"precision\.update_compile=false"):
        stepped(sgd, rounding="kahan", compiled=True)


@pytest.mark.parametrize("skipped", [False, True])
def test_a_loss_scalers_scale_and_overflow_flag_are_taken_in_the_loop(skipped):
    """mpexp's loss scaler hands every fused step its scale and overflow flag: the compiled
    loop divides the gradient by the scale, and a step with the flag set leaves the weights,
    states and Kahan's buffer as they were (counting nothing), as the eager step does."""
    ends = []
    for how in (False, True):
        params = bf16_params()
        optimizer = adam(params, rounding="kahan", chunk=CHUNK, compiled=how)
        for step in range(3):
            set_grads(params, step)
            optimizer.grad_scale = torch.tensor(4.0)
            optimizer.found_inf = torch.tensor(float(skipped and step == 2))
            optimizer.step()
        states = [v.clone() for s in optimizer.state.values() for v in s.values()]
        ends.append(([p.detach().clone() for p in params], states, optimizer.lost.counts))
    (eager, eager_states, eager_counts), (mine, states, counts) = ends
    for theirs, ours in zip(eager + eager_states, mine + states, strict=True):
        assert torch.allclose(theirs.float(), ours.float(), rtol=2**-7, atol=1e-6)
    assert (counts - eager_counts).abs().sum() <= 40


def test_a_cpu_run_steps_compiled_unless_told_not_to_and_records_so(tmp_path, monkeypatch):
    """A CPU run's steps go through the compiled loop by default (its loss scaler's flag and
    all), and the run record says so."""
    calls = []
    real = pure_compiled.native  # a CPU's

    def counted(variant):
        calls.append(variant)
        return real(variant)

    monkeypatch.setattr(pure_compiled, "native", counted)
    kahan = [*PURE, "precision=bf16_pure_kahan", "trainer.epochs=1"]
    compiled = train(make_cfg(*kahan), RunContext(tmp_path / "compiled"))  # null: a CPU's way
    assert calls and {v.rounding for v in calls} == {"kahan"}
    calls.clear()
    eager = train(
        make_cfg(*kahan, "precision.update_compile=false"), RunContext(tmp_path / "eager")
    )
    assert not calls
    assert compiled["ran"]["pure_update"] == "compiled"
    assert eager["ran"]["pure_update"] == "eager"
    assert compiled["val/loss"] == pytest.approx(eager["val/loss"], rel=0.02)


def test_update_compile_is_a_pure_bf16_key():
    with pytest.raises(ConfigError, match=r"precision\.update_compile=true applies to pure bf16"):
        validate(make_cfg(*PURE[:-1], "precision=bf16", "precision.update_compile=true"))


@pytest.mark.gpu
@pytest.mark.parametrize("rounding", ["nearest", "kahan"])
def test_a_gpus_compiled_update_is_the_eager_one(rounding):
    """On CUDA (Triton, the cast kept as a rounding): SGD's weights and counts as the eager
    step's."""
    results = []
    for how in (False, True):
        on_cpu = bf16_params()
        params = [torch.nn.Parameter(p.detach().cuda()) for p in on_cpu]
        optimizer = sgd(params, rounding=rounding, chunk=CHUNK, compiled=how)
        for step in range(4):
            set_grads(on_cpu, step)
            for p, q in zip(params, on_cpu, strict=True):
                p.grad = q.grad.cuda()
            optimizer.step()
        results.append(([p.detach().cpu() for p in params], optimizer.lost.counts.cpu()))
    (eager, eager_counts), (mine, counts) = results
    assert all(torch.equal(a, b) for a, b in zip(eager, mine, strict=True))
    assert torch.equal(counts, eager_counts)
