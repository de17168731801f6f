"""Pure bf16's own update (mpexp/precision/pure_optimizers.py) against the hook-based one it
replaced (tests/pure_reference.py): the same numbers, half the bytes at the step's peak, and a
rounding that no diagnostic switch turns off."""

from __future__ import annotations

import copy
import logging
import os
import signal
import weakref

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from mpexp.checkpoints import files
from mpexp.checkpoints.checkpoint import checkpoint_files
from mpexp.errors import ConfigError
from mpexp.precision.pure_optimizers import PureAdam, PureSGD
from mpexp.run.runner import train
from mpexp.step.loop import Fit
from mpexp.stopping import Preempted
from mpexp.tracking.run_context import RunContext
from mpexp.validate import validate
from tests.conftest import CPU, TINY, make_cfg
from tests.pure_reference import PureUpdates
from tests.test_bf16_pure import PURE
from tests.test_distributed import GLOBAL
from tests.test_preemption import descendants, finish, torchrun
from tests.test_resume import assert_same_final_state, comparable, resume, wait_for
from tests.test_training import read_metrics

SHAPES = [(300, 70), (70,), (5, 3, 3, 3), (70_001,)]  # the last one spans two chunks


def bf16_params(shapes=SHAPES) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter((torch.randn(s, generator=g) * 0.1).bfloat16()) for s in shapes]


def set_grads(params, step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g) * 1e-2).bfloat16()


def stepped(optimizer, params, steps: int = 12) -> list[torch.Tensor]:
    for step in range(steps):
        set_grads(params, step)
        optimizer.step()
    return [p.detach().clone() for p in params]


def reference(kind: str, rounding: str, states: torch.dtype, fused: bool):
    """The earlier update: torch's optimizer on float32 copies, in hooks."""
    params = bf16_params()
    if kind == "sgd":
        optimizer = torch.optim.SGD(params, lr=1e-2, momentum=0.9, weight_decay=0.01, fused=fused)
        if fused:  # as mpexp builds torch's fused SGD (performance._zero_momentum)
            for p in params:
                optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)
    else:
        cls = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam
        optimizer = cls(params, lr=1e-3, weight_decay=0.01, fused=fused)
    PureUpdates(optimizer, rounding, states, 0, CPU)
    return optimizer, params


def ours(kind: str, rounding: str, states: torch.dtype, fused: bool, count_every: int = 1):
    params = bf16_params()
    pure = {"rounding": rounding, "states": states, "fused": fused, "chunk": 1 << 16}
    pure["count_every"] = count_every
    if kind == "sgd":
        return PureSGD(params, lr=1e-2, momentum=0.9, weight_decay=0.01, **pure), params
    return PureAdam(params, lr=1e-3, weight_decay=0.01, decoupled=kind == "adamw", **pure), params


@pytest.mark.parametrize("kind", ["adam", "adamw", "sgd"])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("rounding", ["nearest", "kahan"])
@pytest.mark.parametrize("states", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("count_every", [1, 5])
def test_the_chunked_update_is_the_earlier_update_bit_for_bit(
    kind, fused, rounding, states, count_every
):
    """Nearest and Kahan, both bit for bit (Kahan's 1 ulp allowance is not needed): each chunk
    runs the same float32 arithmetic (torch's fused kernel, or its single-tensor formula
    unfused) on the same values, and an elementwise update does not care where chunks end. The
    steps that do not count lost updates (4 in 5), under nearest with bf16 states and fused,
    run torch's fused kernel on the bf16 tensors whole: the same again."""
    optimizer, params = reference(kind, rounding, states, fused)
    before = stepped(optimizer, params)
    optimizer, params = ours(kind, rounding, states, fused, count_every)
    after = stepped(optimizer, params)
    for old, new in zip(before, after, strict=True):
        assert torch.equal(old, new)


@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW])
def test_nearest_with_bf16_states_is_torchs_fused_adam_on_bf16_weights(cls):
    """What is bit-identical to torch itself: its fused kernel run on the bf16 weights and
    states (float32 arithmetic inside, round-to-nearest on the way out). torch's unfused step
    on bf16 weights is not: it computes in bfloat16."""
    params = bf16_params()
    torchs = stepped(cls(params, lr=1e-3, weight_decay=0.01, fused=True), params)
    kind = "adamw" if cls is torch.optim.AdamW else "adam"
    optimizer, params = ours(kind, "nearest", torch.bfloat16, fused=True)
    for theirs, mine in zip(torchs, stepped(optimizer, params), strict=True):
        assert torch.equal(theirs, mine)


def test_stochastic_rounding_lands_where_the_earlier_one_does_on_average():
    """SGD's steps of a sixteenth of bfloat16's spacing at 1, 64 of them: nearest never moves,
    float32 arrives at 1 + 2^-6; each stochastic update arrives there in the mean over 65,536
    weights, the earlier and the chunked alike (standard error about 2^-14)."""
    ends = {}
    for name in ("reference", "ours"):
        weight = torch.nn.Parameter(torch.ones(1 << 16, dtype=torch.bfloat16))
        if name == "reference":
            optimizer = torch.optim.SGD([weight], lr=2**-12)
            PureUpdates(optimizer, "stochastic", torch.bfloat16, 0, CPU)
        else:
            optimizer = PureSGD([weight], lr=2**-12, rounding="stochastic", chunk=1 << 12)
        for _ in range(64):
            weight.grad = torch.full_like(weight, -1.0)
            optimizer.step()
        ends[name] = weight.detach().float()
    for name, end in ends.items():
        assert end.mean().item() == pytest.approx(1 + 2**-6, abs=4 * 2**-14), name
        assert end.std().item() == pytest.approx(ends["reference"].std().item(), rel=0.05)


class LiveBytes(TorchDispatchMode):
    """The bytes held by the storages that tensors made while it is active, at their peak:
    torch's own accounting of the CPU tensors a step allocates (views of a storage already
    `known` add nothing)."""

    def __init__(self, known: list[torch.Tensor]) -> None:
        super().__init__()
        self.known = {t.untyped_storage().data_ptr() for t in known}
        self.live = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
            if key in self.known or size == 0:
                continue
            self.known.add(key)
            self.live += size
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, key, size)
        return out

    def _free(self, key: int, size: int) -> None:
        self.known.discard(key)
        self.live -= size


def bytes_per_parameter(optimizer, params) -> tuple[float, float]:
    """(held between steps, at the step's peak), per parameter, over a second step (the
    first makes the states)."""
    for step in range(2):
        set_grads(params, step)
        if step == 0:
            optimizer.step()
    held = [*params, *(p.grad for p in params)]
    held += [v for s in optimizer.state.values() for v in s.values() if v.ndim]
    # each storage once: the states of several parameters may share one
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in held}
    held_bytes = sum(storages.values())
    with LiveBytes(held) as live:
        optimizer.step()
    count = sum(p.numel() for p in params)
    return held_bytes / count, (held_bytes + live.peak) / count


LAYERS = [(1024, 1024)] * 3 + [(1024,)] * 3  # 3.1 M parameters: a few chunks each


@pytest.mark.parametrize(
    ("rounding", "states", "held"),
    [
        ("nearest", torch.bfloat16, 8),
        ("stochastic", torch.bfloat16, 8),
        ("kahan", torch.bfloat16, 10),
        ("nearest", torch.float32, 12),
        ("kahan", torch.float32, 14),
    ],
)
def test_adams_step_adds_only_a_few_chunks_to_the_bytes_it_holds(rounding, states, held):
    """Weight, gradient and two moments at 2 bytes each, 2 more for Kahan's buffer (4 more for
    each moment in float32); the step itself adds a few float32 chunks whatever the model's
    size: 0.6 to 0.7 bytes a parameter here. The earlier update held
    float32 copies of everything at once: 24 to 30 bytes a parameter."""
    params = bf16_params(LAYERS)
    # chunks of 64 Ki elements (a CPU's default is 1 Mi): a few of them are a few MiB, small
    # against this model; counting every step, the chunked path's worst case
    optimizer = PureAdam(params, lr=1e-3, rounding=rounding, states=states, chunk=1 << 16)
    between, peak = bytes_per_parameter(optimizer, params)
    assert between == held
    count = sum(p.numel() for p in params)
    assert peak * count <= held * count + optimizer.step_temporary_bytes()  # what runs record

    params = bf16_params(LAYERS)
    earlier = torch.optim.Adam(params, lr=1e-3)
    PureUpdates(earlier, rounding, states, 0, CPU)
    assert bytes_per_parameter(earlier, params)[1] > held + 8  # what the test tells apart


def test_kahan_stays_on_when_the_lost_updates_are_not_counted(tmp_path):
    """`diagnostics.updates_lost=false` once installed no hooks, and the run trained plain bf16
    while recording update_rounding=kahan; now it only skips the count."""
    kahan = [*PURE, "precision=bf16_pure_kahan", "trainer.epochs=1"]
    counted = train(make_cfg(*kahan), RunContext(tmp_path / "counted"))
    uncounted = train(
        make_cfg(*kahan, "diagnostics.updates_lost=false"), RunContext(tmp_path / "uncounted")
    )
    nearest = train(make_cfg(*PURE, "trainer.epochs=1"), RunContext(tmp_path / "nearest"))

    assert uncounted["ran"]["update_rounding"] == "kahan"
    assert uncounted["val/loss"] == counted["val/loss"]
    assert nearest["val/loss"] != counted["val/loss"]


def test_bf16_states_rounded_to_nearest_warn_that_adams_second_moment_freezes(tmp_path, caplog):
    cfg = make_cfg(*PURE, "trainer.epochs=1")
    with caplog.at_level(logging.WARNING):
        train(cfg, RunContext(tmp_path / "nearest"))
    frozen = [r for r in caplog.records if "second moment stops moving" in r.getMessage()]
    assert len(frozen) == 1
    assert "beta2=0.999" in frozen[0].getMessage()

    caplog.clear()
    for quiet in ("precision=bf16_pure_stochastic", "precision.optimizer_states=float32"):
        with caplog.at_level(logging.WARNING):
            train(make_cfg(*PURE, quiet, "trainer.epochs=1"), RunContext(tmp_path / quiet))
    assert not [r for r in caplog.records if "second moment" in r.getMessage()]


def test_adams_second_moment_moves_under_stochastic_rounding_and_freezes_under_nearest():
    """A constant gradient of 1 for 1000 steps: float32's v reaches 1 - 0.999^1000 = 0.632;
    bfloat16 states rounded to nearest stop where 0.001 (1 - v) falls below half of v's
    spacing; stochastically rounded states follow float32's."""
    ends = {}
    for rounding, states in [
        ("nearest", torch.float32),
        ("nearest", torch.bfloat16),
        ("stochastic", torch.bfloat16),
    ]:
        weight = torch.nn.Parameter(torch.zeros(4096, dtype=torch.bfloat16))
        optimizer = PureAdam([weight], lr=1e-6, rounding=rounding, states=states)
        for _ in range(1000):
            weight.grad = torch.ones_like(weight)
            optimizer.step()
        ends[rounding, states] = optimizer.state[weight]["exp_avg_sq"].float().mean().item()
    assert ends["nearest", torch.float32] == pytest.approx(0.632, abs=1e-3)
    assert ends["nearest", torch.bfloat16] < 0.3
    assert ends["stochastic", torch.bfloat16] == pytest.approx(0.632, abs=0.01)


def test_an_optimizer_setting_the_pure_update_would_ignore_is_refused():
    sgd_with_betas = ["optimizer=adam", "optimizer._target_=torch.optim.SGD"]
    with pytest.raises(ConfigError, match=r"does not implement optimizer\.betas") as err:
        validate(make_cfg(*TINY, "precision=bf16_pure", *sgd_with_betas))
    assert "\n" not in str(err.value)


def test_a_stop_off_the_log_interval_leaves_the_lost_update_rows_as_they_were(
    tmp_path, monkeypatch, caplog
):
    """A stop at step 5 (log_every=4) once logged the count of step 5 alone, and the resumed run
    that of steps 6 to 8; the checkpoint now keeps the open window's counts."""
    args = [*PURE, "trainer.epochs=1", "trainer.deterministic=true"]
    whole = tmp_path / "whole"
    train(make_cfg(*args), RunContext(whole))

    stopped = tmp_path / "stopped"
    monkeypatch.setattr(Fit, "_stop_agreed", lambda fit: fit.tracker.step == 5)
    with pytest.raises(Preempted):
        train(make_cfg(*args), RunContext(stopped))
    monkeypatch.undo()
    resume(args, stopped, caplog)

    def lost_rows(run_dir):
        return [r for r in comparable(run_dir) if "opt/updates_lost" in r]

    assert [r["step"] for r in lost_rows(whole)] == [4, 8]
    assert lost_rows(stopped) == lost_rows(whole)
    assert_same_final_state(whole, stopped, ("model", "optimizer"))


@pytest.mark.slow  # torchrun twice and a kill, in emulated bf16: about a minute
def test_a_killed_fsdp_run_with_stochastic_rounding_resumes_exactly(tmp_path):
    """Each rank rounds its own shard from a generator of its own, seeded per rank; the sharded
    checkpoint keeps each rank's generator (with its open count window and step count) in that
    rank's file, so the resumed run draws what the killed one would have."""
    args = [
        "trainer.strategy=fsdp",
        *(o for o in PURE if not o.startswith("dataset.batch_size")),
        GLOBAL,  # the step's 64 over both ranks: 32 each
        "precision=bf16_pure_stochastic",
        "trainer.epochs=3",
        "trainer.checkpoint_every_steps=5",
    ]
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    finish(torchrun(*args, f"hydra.run.dir={whole}", cwd=tmp_path))
    proc = torchrun(*args, f"hydra.run.dir={killed}", cwd=tmp_path)
    wait_for(lambda: checkpoint_files(killed), proc)
    for pid in [proc.pid, *descendants(proc.pid)]:
        os.kill(pid, signal.SIGKILL)
    proc.wait()
    finish(torchrun(*args, f"trainer.resume={killed}", cwd=tmp_path))

    (rank_file,) = [f for f in checkpoint_files(killed)[-1].iterdir() if f.name == "rng-rank1.pt"]
    assert "update_rounding_generator" in torch.load(rank_file, weights_only=True)["optimizer"]
    (steps, epochs), (whole_steps, whole_epochs) = read_metrics(killed), read_metrics(whole)
    assert [r["step"] for r in steps] == [r["step"] for r in whole_steps]  # each step once
    # as test_preemption's FSDP resume: the losses of the uninterrupted run
    assert [r["train/loss"] for r in steps if "train/loss" in r] == pytest.approx(
        [r["train/loss"] for r in whole_steps if "train/loss" in r], rel=1e-6
    )
    assert epochs[-1]["val/loss"] == pytest.approx(whole_epochs[-1]["val/loss"], rel=1e-6)


@pytest.mark.parametrize("rounding", ["nearest", "kahan", "stochastic"])
def test_a_step_the_scaler_skips_changes_nothing_and_a_taken_one_is_the_plain_step(rounding):
    """GradScaler hands the fused update its overflow flag on the device: at 1 the weights, the
    states and Kahan's buffer stay as they were, and the step does not count; at 0 the step is
    the one taken without a flag."""
    runs = {}
    for flag in (None, 0.0, 1.0):
        optimizer, params = ours("adam", rounding, torch.bfloat16, fused=True)
        stepped(optimizer, params, steps=3)
        before = {k: v.clone() for k, v in optimizer.state[params[-1]].items()}
        weights = [p.detach().clone() for p in params]
        if flag is not None:
            optimizer.found_inf, optimizer.grad_scale = torch.tensor(flag), torch.tensor(1.0)
        set_grads(params, 3)
        optimizer.step()
        after = optimizer.state[params[-1]]
        runs[flag] = [p.detach().clone() for p in params]
        if flag == 1.0:
            assert all(torch.equal(a, b) for a, b in zip(weights, runs[flag], strict=True))
            assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(torch.equal(a, b) for a, b in zip(runs[None], runs[0.0], strict=True))


@pytest.mark.gpu
def test_a_captured_stochastic_step_draws_as_the_eager_one_does(tmp_path):
    """On CUDA the pure bf16 step is captured as a CUDA graph, its rounding generator registered
    with the graph: each replay advances the generator as an eager step does, so the two runs end
    with the same generator state (an unregistered one would stay where the capture left it)."""
    if not hasattr(torch.cuda.CUDAGraph, "register_generator_state"):
        pytest.skip(f"torch {torch.__version__} cannot register a generator with a CUDA graph")
    args = [
        *(o for o in PURE if not o.startswith("precision")),
        "precision=bf16_pure_stochastic",
        "trainer.device=cuda",
        "trainer.epochs=1",
    ]
    runs = {}
    for name, graph in (("captured", "true"), ("eager", "false")):
        summary = train(make_cfg(*args, f"trainer.cuda_graph={graph}"), RunContext(tmp_path / name))
        assert summary["ran"]["cuda_graph"] is (graph == "true")
        final = files.load(checkpoint_files(tmp_path / name)[-1])
        runs[name] = final["optimizer"]["update_rounding_generator"]
    assert torch.equal(runs["captured"], runs["eager"])


@pytest.mark.parametrize("rounding", ["nearest", "kahan", "stochastic"])
@pytest.mark.parametrize("states", [torch.bfloat16, torch.float32])
def test_a_checkpoint_of_the_earlier_update_resumes_where_it_left_off(rounding, states):
    """The optimizer state dict of torch's Adam under the earlier hooks (its states, Kahan's
    buffers, the generator's state) loads into the new update, which then steps as the earlier
    one would have: bit for bit under nearest and Kahan, from the same generator state under
    stochastic rounding."""
    earlier, params = reference("adam", rounding, states, fused=True)
    stepped(earlier, params, steps=4)
    saved = copy.deepcopy(earlier.state_dict())  # as from a file: no tensor shared
    resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ours_now = PureAdam(
        resumed_params, lr=1e-3, weight_decay=0.01, rounding=rounding, states=states
    )
    ours_now.load_state_dict(saved)

    assert ours_now.steps_taken == 4  # from Adam's own count: the lost updates' steps line up
    state = ours_now.state[resumed_params[0]]
    assert {state[k].dtype for k in ("exp_avg", "exp_avg_sq")} == {states}
    if rounding == "stochastic":
        assert torch.equal(ours_now.generator.get_state(), saved["update_rounding_generator"])
        return
    for step in range(4, 8):
        set_grads(params, step)
        earlier.step()
        set_grads(resumed_params, step)
        ours_now.step()
    for old, new in zip(params, resumed_params, strict=True):
        assert torch.equal(old, new)
