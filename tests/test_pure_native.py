"""Pure bf16's update as a C loop on a CPU (mpexp/precision/pure_native.py): the bits that
torch.compile's loop of the same function stores (which a GPU runs), over the variants that
differ in what they compute, with infinities, NaNs and subnormals among the values; its count by
piece; the same bits on several threads; a build kept and reused; a missing or failing compiler
said plainly."""

from __future__ import annotations

import pytest
import torch

from mpexp.errors import ConfigError
from mpexp.precision import pure_native
from mpexp.precision.pure_compiled import compile_setting
from mpexp.precision.pure_kernels import (
    Variant,
    adam_coefficients,
    can_compile,
    compiled,
    sgd_coefficients,
)
from mpexp.precision.pure_native import NativeUpdate, cannot_build, native
from tests.conftest import CPU

pytestmark = pytest.mark.skipif(cannot_build() is not None, reason="no C compiler")

N = 5000
EDGES = [0.0, -0.0, 1.0, 3e38, 1e-40, float("inf"), float("nan"), -1e-39]


def operands(v: Variant, n: int = N, seed: int = 1, skip: float = 0.0) -> list:
    """A call's arguments as torch.compile's `_update` takes them: random weights, gradients,
    states and Kahan's buffer, with edge values among the weights and gradients."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, generator=g).bfloat16()
    w[: len(EDGES)] = torch.tensor(EDGES)
    grad = (torch.randn(n, generator=g) * 1e-2).bfloat16()
    grad[8:12] = torch.tensor([0.0, float("inf"), 1e-38, -5e-3])
    dtype = torch.bfloat16 if v.sixteen else torch.float32
    states = [(torch.rand(n, generator=g) * 1e-3).to(dtype) for _ in range(v.states)]
    carried = (torch.randn(n, generator=g) * 1e-3).bfloat16() if v.rounding == "kahan" else None
    if v.algorithm == "adam":
        group = {"betas": (0.9, 0.999), "lr": 1e-3, "weight_decay": 0.1, "eps": 1e-8}
        c = adam_coefficients(torch.tensor(5.0), group, v.decoupled)
    else:
        group = {"lr": 0.01, "momentum": 0.9, "dampening": 0.1, "weight_decay": 0.1}
        c = sgd_coefficients(group, CPU, False)
    keys = torch.tensor([11, 2222, 333, 44444], dtype=torch.int32)
    keys = keys if v.rounding == "stochastic" else None
    scaling = torch.tensor([1024.0, skip]) if v.scaled else None
    return [w, grad, states, carried, c, keys, scaling]


def same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Equal bits (a zero's sign too), but for a NaN's payload (the vectorised and the scalar
    cast write different ones): NaN where the other is NaN."""
    if a is None or b is None:
        return a is b
    bits = {2: torch.int16, 4: torch.int32}[a.element_size()]
    both = a.isnan() & b.isnan()
    return torch.equal(a.view(bits)[~both], b.view(bits)[~both]) and torch.equal(
        a.isnan(), b.isnan()
    )


VARIANTS = [
    (Variant("adam", "stochastic", decoupled=True), 0.0),
    (Variant("adam", "kahan", count="masks", scaled=True), 0.0),
    (Variant("adam", "kahan", count="masks", scaled=True), 1.0),
    (Variant("adam", "nearest", count="masks"), 0.0),
    (Variant("sgd", "nearest", count="sums", momentum=True, nesterov=True, sixteen=False), 0.0),
    (Variant("sgd", "stochastic", momentum=True, decay=False, count="masks"), 0.0),
    (Variant("sgd", "kahan", count="sums"), 0.0),  # no momentum: no state
    (Variant("adam", "stochastic", count="sums", sixteen=False, scaled=True), 0.0),
]


@pytest.mark.skipif(can_compile(CPU) is not None, reason="no torch.compile here")
@pytest.mark.parametrize(
    "variant,skip",
    VARIANTS,
    ids=[f"{v.algorithm}-{v.rounding}-{v.count or 'nocount'}-{s:g}" for v, s in VARIANTS],
)
def test_the_c_loop_stores_the_bits_torch_compiles_loop_does(variant, skip):
    """Weights, states, Kahan's buffer and the counts of three pieces (a long one, one of one
    element, the rest) as torch.compile's loop of `_update` has them: the two run the same
    float32 operations in the same order. A loss scaler's overflow flag leaves everything."""
    theirs, mine = operands(variant, skip=skip), operands(variant, skip=skip)
    w, g, states, carried, c, keys, scaling = theirs
    masks = [torch.empty_like(w) for _ in range(2 if variant.count == "masks" else 1)]
    counted = compiled(variant)(w, g, states, carried, c, keys, masks, scaling)
    ends = [1000, 1001, N] if variant.count == "masks" else [N]
    counts = native(variant)(*mine, torch.tensor(ends))
    if variant.count == "sums":  # torch.compile's loop leaves the weights for its caller
        theirs[0] = masks[0]
        assert torch.equal(counts, counted.long()[None])
    elif variant.count == "masks":
        cuts = [slice(0, 1000), slice(1000, 1001), slice(1001, N)]
        by_piece = [[int(m[cut].float().sum()) for m in masks] for cut in cuts]
        assert counts.tolist() == by_piece
        # updates lost, some kept (a skipped step: only the NaN weight, which is unequal to itself)
        assert counts[:, 0].sum() > counts[:, 1].sum() > 0 if not skip else counts.sum() == 2
    else:
        assert counts is None
    for a, b in zip(theirs[:4], mine[:4], strict=True):
        for x, y in zip(*((a, b) if isinstance(a, list) else ([a], [b])), strict=True):
            assert same(x, y)
    if skip:
        assert same(mine[0], operands(variant)[0])


def test_a_long_call_stores_the_same_bits_on_two_threads_as_on_one():
    """A piece of 2^16 elements and more is cut into one stretch a thread: every element is
    stepped once, as on one thread, and each piece's counts add up (pieces long and short,
    one empty)."""
    variant = Variant("adam", "stochastic", count="sums")
    n = (1 << 18) + 3
    ends = torch.tensor([70_001, 70_002, 70_002, 200_000, n])
    runs = []
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            args = operands(variant, n=n)
            counts = native(variant)(*args, ends)
            runs.append((args, counts))
    finally:
        torch.set_num_threads(threads)
    (one, one_counts), (two, two_counts) = runs
    assert torch.equal(one_counts, two_counts) and one_counts[2].sum() == 0
    assert one_counts[0, 0] > 70_001 // 2 and one_counts[1, 0] == 1
    assert all(same(a, b) for a, b in zip([one[0], *one[2]], [two[0], *two[2]], strict=True))


def test_a_build_is_kept_for_the_next_process_and_written_whole(tmp_path, monkeypatch):
    """The first build writes one library into the kernel folder; a later process (here, the
    cache of this one cleared) loads it rather than building again."""
    monkeypatch.setenv("MPEXP_KERNEL_DIR", str(tmp_path))
    variant = Variant("sgd", "kahan", momentum=True)
    NativeUpdate(variant)
    built = list(tmp_path.iterdir())
    assert len(built) == 1 and built[0].name.startswith("pure_update_")
    assert built[0].stat().st_mode & 0o777 == 0o755  # a shared folder's other users load it

    def no_second_build(*_):
        raise AssertionError("built again")

    monkeypatch.setattr(pure_native, "_build", no_second_build)
    args = operands(variant)
    NativeUpdate(variant)(*args)
    assert list(tmp_path.iterdir()) == built


def test_a_kernel_folder_that_cannot_be_made_falls_back_to_the_processs_own(tmp_path, monkeypatch):
    blocked = tmp_path / "a file"
    blocked.write_text("")
    monkeypatch.setenv("MPEXP_KERNEL_DIR", str(blocked / "kernels"))
    NativeUpdate(Variant("sgd", "nearest", count="sums"))
    assert not (blocked / "kernels").exists()
    assert any(pure_native._kernel_dir().glob("pure_update_*.so"))


def test_a_missing_or_failing_compiler_is_said_plainly(tmp_path, monkeypatch):
    """No compiler: a run that asks for the compiled update stops with a message naming what is
    missing; `null` steps eagerly. A compiler that fails: the build's error names it."""
    monkeypatch.setenv("MPEXP_KERNEL_DIR", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert "no C compiler" in cannot_build()
    with pytest.raises(ConfigError, match="no C compiler"):
        compile_setting(True, True, CPU)
    assert compile_setting(None, True, CPU) is False
    failing = tmp_path / "cc"
    failing.write_text("#!/bin/sh\necho 'cc: broken on purpose' >&2\nexit 1\n")
    failing.chmod(0o755)
    with pytest.raises(RuntimeError, match="could not build pure bf16's native update"):
        NativeUpdate(Variant("adam", "nearest", count="masks", decay=False))
    assert not list(tmp_path.glob("*.so"))  # no half-written library left behind


def test_a_compiler_whose_float_arithmetic_is_not_ieees_is_refused(tmp_path, monkeypatch):
    """A compiler that defaults to fast math (reassociation, no NaNs) would break Kahan's
    split and the count without a word: each build's known answer catches it."""
    fast = tmp_path / "fastcc"
    fast.write_text(f'#!/bin/sh\nexec {pure_native.compiler()} "$@" -ffast-math\n')
    fast.chmod(0o755)
    monkeypatch.setenv("CC", str(fast))
    monkeypatch.setenv("MPEXP_KERNEL_DIR", str(tmp_path))
    with pytest.raises(RuntimeError, match="not IEEE's"):
        NativeUpdate(Variant("adam", "kahan"))
    assert not list(tmp_path.glob("*.so"))


def test_a_build_is_named_for_the_cpu_it_was_made_on():
    """-march=native: two ARM CPUs of different parts, or x86 CPUs of different flags, build
    apart; two cores of one CPU (their numbers and clocks differ) alike."""
    arm = "processor\t: {n}\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd {sve}\nCPU part\t: {part}\n"
    one = arm.format(n=0, sve="sve", part="0xd40") + "\n" + arm.format(n=1, sve="sve", part="0xd40")
    other = arm.format(n=0, sve="", part="0xd0c")
    assert pure_native.cpu_key(one) == pure_native.cpu_key(arm.format(n=7, sve="sve", part="0xd40"))
    assert pure_native.cpu_key(one) != pure_native.cpu_key(other)
    x86 = "processor\t: {n}\ncpu MHz\t: {mhz}\nflags\t: fpu sse2 {avx}\n"
    assert pure_native.cpu_key(x86.format(n=0, mhz=2400, avx="avx512f")) == pure_native.cpu_key(
        x86.format(n=1, mhz=3100, avx="avx512f")
    )
    assert pure_native.cpu_key(x86.format(n=0, mhz=1, avx="")) != pure_native.cpu_key(
        x86.format(n=0, mhz=1, avx="avx512f")
    )


def test_a_tensor_the_loop_cannot_take_is_refused_before_it_reads_memory():
    """The loop reads raw memory: a float32 gradient (twice as many bytes), a state shorter
    than the weights or a strided view would be read past its end or out of order."""
    variant = Variant("adam", "kahan")
    update = native(variant)
    for spoil in (
        lambda a: a.__setitem__(1, a[1].float()),
        lambda a: a[2].__setitem__(0, a[2][0][:-1]),
        lambda a: a.__setitem__(3, torch.zeros(2 * N, dtype=torch.bfloat16)[::2]),
        lambda a: a.append(torch.tensor([N + 64, N])),  # a piece's end past the weights
        lambda a: a.append(torch.tensor([-64, N])),
    ):
        args = operands(variant)
        spoil(args)
        with pytest.raises(ValueError, match="native update"):
            update(*args)


def test_the_loop_is_vectorised_a_step_about_as_long_as_torchs_fused_adamw():
    """What the C loop is for: stochastic rounding's AdamW step on 1 Mi elements in about the
    time of torch's fused AdamW on the same bf16 weights (measured 1.0x; a loop left scalar, as
    a flag that turned errno back on left it, took 7x). The fastest of several runs each, on
    this thread's clock, so that a loaded machine slows both alike."""
    import time

    variant = Variant("adam", "stochastic", decoupled=True)
    n = 1 << 20
    args = operands(variant, n=n)
    weight = torch.nn.Parameter(args[0].clone())
    weight.grad = args[1].clone()
    fused = torch.optim.AdamW([weight], lr=1e-3, fused=True)
    update = native(variant)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:

        def fastest(step) -> float:
            times = []
            for _ in range(7):
                began = time.thread_time()
                step()
                times.append(time.thread_time() - began)
            return min(times)

        fused.step()
        ratio = fastest(lambda: update(*args)) / fastest(fused.step)
    finally:
        torch.set_num_threads(threads)
    assert ratio < 3, f"the C loop took {ratio:.1f}x torch's fused AdamW"
